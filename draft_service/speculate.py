"""The direct data plane (`Speculate`): this draft replica runs one request's rounds itself.

With `COORDINATOR_DATA_PLANE=direct` the coordinator pins a draft and a target replica as always, then hands the
request to the draft replica, which runs `specdec.scheduling.schedule.generate` with two backends:

- `ReplicaDraft`: this replica's own drafting, through its batcher (concurrent sessions still share forwards), with
  no network between the schedule and the draft: a PEARL cut or a new block costs nothing on the wire;
- `PeerTarget`: the pinned target replica, called directly (its per-round stream, `specdec_rpc.rounds`).

So a round pays one network round trip (draft replica <-> target replica) where the coordinator's own rounds pay
two or more (coordinator <-> draft, coordinator <-> target, and PEARL's cancels). The committed tokens stream back
to the coordinator as they are verified; the coordinator keeps placement, the history and failover: if this call
fails, the tokens it sent stand (the target verified them) and the coordinator resumes from them. A failure of the
target replica ends the call with that replica's status and names it in the `specdec-failed-target` trailing
metadata, so the coordinator marks the right replica down.

The schedule is the same code as the coordinator's and the in-process engine's: every mode stays exactly lossless
here (tests/test_direct.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from typing import AsyncIterator, NamedTuple

import grpc

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stop import StopSpec, make_stop_rule
from specdec.decoding.verify import SparseDist
from specdec.scheduling.field_rules import validate_request
from specdec.scheduling.request import GenerationRequest
from specdec.scheduling.schedule import generate
from specdec.state.feature_state import TargetFeatures
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import VerifyOutcome
from specdec_rpc.channels import open_channel
from specdec_rpc.frames import FrameCall, FramePorts
from specdec_rpc.decode import features_from_proto, request_from_speculate, verify_outcome
from specdec_rpc.encode import (FAILED_TARGET_KEY, VERIFY_METHOD_PB, logprobs_rows_to_proto, sampling_to_proto,
                                stats_to_proto, verify_q)
from specdec_rpc.pb import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from specdec_rpc.rounds import BusyWaits, RoundStream
from specdec_rpc.tracing import TRACE_HEADERS, CallClock

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 60.0  # the longest one call to the target replica may take (the coordinator's rpc_timeout_s)


def parse_routes(spec: str) -> dict[str, str]:
    """`target_routes` ('endpoint=address,...') → {endpoint: address}; a malformed entry is a start-up error."""
    routes = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        endpoint, sep, address = item.partition("=")
        if not sep or not endpoint.strip() or not address.strip():
            raise ValueError(f"target_routes entry {item!r} is not 'endpoint=address'; e.g. "
                             f"'10.0.0.5:50052=127.0.0.1:7001'")
        routes[endpoint.strip()] = address.strip()
    return routes


class _Call(NamedTuple):
    """What a draft span names of its call (the Draft RPC's request has these fields)."""
    session_id: str
    base_position: int


class ReplicaDraft:
    """`DraftBackend` over this replica's worker and batcher: what the Draft/DraftStream RPCs do, without the wire.
    With traces exported, each prefill and draft is a span of the `Speculate` call's trace (`context`), as the RPCs'
    are of theirs."""

    def __init__(self, servicer, output_start: int, reserve: int, context=None):
        self.servicer, self.host, self.worker, self.batcher = (servicer, servicer.host, servicer.worker,
                                                               servicer.batcher)
        self.reads_features = self.worker.reads_features
        self.output_start, self.reserve = output_start, reserve
        self.context = context
        self.spans = servicer.spans if context is not None else None

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    features: list[TargetFeatures] | None = None) -> None:
        if self.reserve:
            self.worker.check_reserve(self.reserve, len(prompt_ids))
        clock = CallClock() if self.spans is not None else None
        _, ns, _, cached = await self.host.start_session(session_id, list(prompt_ids), params,
                                                         features=features if self.reads_features else None,
                                                         output_start=self.output_start)
        if clock is not None:
            self.spans.record("prefill", self.context, clock, {
                "specdec.session_id": session_id, "specdec.prompt_tokens": len(prompt_ids),
                "specdec.cached_tokens": cached, "specdec.prefill_ns": ns})

    def _args(self, session_id, base_position, append, gamma_max, stop: StopSpec, block_size, features):
        self.host.touch(session_id)
        return (session_id, base_position, list(append), gamma_max,
                make_stop_rule(stop, self.worker.preverifier), block_size,
                features if self.reads_features else None)

    async def draft_stream(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                           stop: StopSpec, block_size: int,
                           features: list[TargetFeatures] | None = None) -> AsyncIterator[DraftBlock]:
        entry = self.batcher.submit(*self._args(session_id, base_position, append, gamma_max, stop, block_size,
                                                features))
        self.servicer.metrics.num_drafts.inc()
        clock, sent = (CallClock() if self.spans is not None else None), []
        try:
            async for block in self.batcher.blocks(entry):
                self.servicer.count_blocks([block])
                sent.append(block)
                yield block
        finally:
            entry.abandoned = True
            if clock is not None:
                self.servicer.draft_span(self.context, clock, _Call(session_id, base_position), sent, entry)

    async def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int, stop: StopSpec,
                    block_size: int, features: list[TargetFeatures] | None = None) -> DraftBlock:
        args = self._args(session_id, base_position, append, gamma_max, stop, block_size, features)
        self.servicer.metrics.num_drafts.inc()
        clock = CallClock() if self.spans is not None else None
        blocks, entry = await self.batcher.draft_whole(*args)
        self.servicer.count_blocks(blocks)
        if clock is not None:
            self.servicer.draft_span(self.context, clock, _Call(session_id, base_position), blocks, entry)
        return DraftBlock(tokens=[t for b in blocks for t in b.tokens], q=[d for b in blocks for d in b.q],
                          stop_reason=blocks[-1].stop_reason, draft_ns=sum(b.draft_ns for b in blocks),
                          block_size=blocks[-1].block_size)

    async def cancel(self, session_id: str) -> None:
        self.worker.cancel(session_id)  # the drafting stops at its next token

    async def end(self, session_id: str) -> None:
        with contextlib.suppress(Exception):  # expired or evicted meanwhile: nothing to end
            await self.host.end_session(session_id)


class _Pipe:
    """A VerifyRounds stream with several requests in flight: `send` writes one and returns the future of its
    answer; a reader resolves the futures in order. Any trouble fails every waiting future with it (the request's
    Speculate call then ends, and the coordinator resumes the request)."""

    def __init__(self, call):
        self.call = call
        self.waiting: deque[asyncio.Future] = deque()
        self.lock = asyncio.Lock()
        self.reader = asyncio.ensure_future(self._read())
        self.error: BaseException | None = None

    async def send(self, message) -> asyncio.Future:
        if self.error is not None:
            raise self.error
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        async with self.lock:
            try:
                await self.call.write(message)
            except asyncio.InvalidStateError:  # the stream ended: its status (the reader's error) says why
                await asyncio.sleep(0)
                raise self.error or grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                                         details="the chained verifies' stream ended") from None
        return fut

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details="the target replica ended the "
                                               "chained verifies' stream")
                if not self.waiting:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, details="an answer nobody asked for")
                fut = self.waiting.popleft()
                if not fut.done():
                    fut.set_result(msg)
        except asyncio.CancelledError:
            self._fail(asyncio.CancelledError())
            raise
        except BaseException as e:  # noqa: BLE001 - every waiting verify fails with it
            self.error = e
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.cancel() if isinstance(e, asyncio.CancelledError) else fut.set_exception(e)

    async def close(self) -> None:
        if not self.call.done():
            self.call.cancel()
        self.reader.cancel()
        with contextlib.suppress(BaseException):
            await self.reader


class PeerTarget:
    """`TargetBackend` over the pinned target replica, dialed directly. No failover here: an error ends the request's
    `Speculate` call and the coordinator, which owns placement, moves it. A full call queue (RESOURCE_EXHAUSTED:
    nothing applied) is waited out as the coordinator would (`BusyWaits`).

    network_ns: wall time inside calls minus the compute and queueing the target reports (the draft <-> target
    link)."""

    def __init__(self, channel: grpc.aio.Channel, endpoint: str, timeout: float, metadata, reserve: int,
                 output_start: int, window: int = 0, link: LinkEstimate | None = None, frames=None):
        """`frames(endpoint, metadata, timeout)`: a call on the target's frame port, or None (`PeerChannels`)."""
        self.stub = target_pb2_grpc.TargetServiceStub(channel)
        self.endpoint, self.timeout, self.metadata = endpoint, timeout, metadata
        self.start_kw = {"reserve_positions": reserve, "output_start": output_start}
        self.rounds = RoundStream(lambda ep: self.stub.VerifyRounds(metadata=self.metadata),
                                  lambda req: target_pb2.VerifyRoundsRequest(verify=req), lambda m: m.verify,
                                  timeout, frames=(lambda ep: frames(ep, self.metadata, timeout)) if frames else None)
        self.network_ns = self.queue_ns = 0
        self.model, self.cached_tokens, self.started = "", 0, False
        self.window = window  # the caller's chained-rounds window (> 1: allowed)
        self.link = link or LinkEstimate()
        self.pipe: _Pipe | None = None  # the chained verifies' stream
        self._last_answer_ns = 0

    @property
    def chain_window(self) -> int:
        """Verifies a greedy PEARL request keeps in flight: the window where chained rounds pay on this link
        (`LinkEstimate.chains`), else 0 (PEARL's rounds)."""
        return self.window if self.window > 1 and self.link.chains() else 0

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    want_features: bool = False) -> TargetFeatures | None:
        t0 = time.perf_counter_ns()
        r = await self.stub.StartSession(target_pb2.TargetServiceStartSessionRequest(
            session_id=session_id, prompt_ids=prompt_ids, params=sampling_to_proto(params),
            return_features=want_features, **self.start_kw), timeout=self.timeout, metadata=self.metadata)
        rtt_ns = max(0, time.perf_counter_ns() - t0 - r.prefill_ns)
        self.network_ns += rtt_ns
        self.link.round_trip(rtt_ns / 1e9)
        self.model, self.cached_tokens, self.started = r.model, r.cached_tokens, True
        return features_from_proto([r.features])[0] if r.HasField("features") else None

    async def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
                     q: list[SparseDist] | None, method: str, feed_draft: bool = True,
                     sample_bonus: bool = True) -> VerifyOutcome:
        req = target_pb2.VerifyRequest(session_id=session_id, base_position=base_position, feed_ids=feed,
                                       draft_ids=draft, method=VERIFY_METHOD_PB[method], feed_draft=feed_draft,
                                       sample_bonus=sample_bonus, q=verify_q(q, method))
        busy = BusyWaits()
        while True:
            t0 = time.perf_counter_ns()
            try:
                r = await self.rounds.call(self.endpoint, req, self._unary)
            except grpc.aio.AioRpcError as e:
                self.network_ns += time.perf_counter_ns() - t0
                if await busy.waited_for_room(e):
                    continue
                raise
            rtt_ns = max(0, time.perf_counter_ns() - t0 - r.forward_ns - r.verify_ns - r.queue_ns)
            self.network_ns += rtt_ns
            self.queue_ns += r.queue_ns
            self.link.round_trip(rtt_ns / 1e9)
            self.link.forward(r.forward_ns / 1e9)
            return verify_outcome(r)

    async def verify_chained(self, session_id: str, base_position: int, assumed: list[int],
                             proposals: list[int]) -> asyncio.Future:
        """Send a chained verify (specdec/scheduling/chained.py) on the session's pipelined stream and return at once: →
        the future of its VerifyOutcome. Answers come in the order the verifies were sent."""
        if self.pipe is None:
            self.pipe = _Pipe(self.stub.VerifyRounds(metadata=self.metadata))
        req = target_pb2.VerifyRequest(session_id=session_id, base_position=base_position, feed_ids=assumed,
                                       draft_ids=proposals, method=common_pb2.VERIFY_METHOD_GREEDY, feed_draft=True,
                                       sample_bonus=False, chained=True)
        sent_ns = time.perf_counter_ns()
        fut = await self.pipe.send(target_pb2.VerifyRoundsRequest(verify=req))
        out: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(f: asyncio.Future) -> None:
            if out.cancelled():
                return
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                r = f.result().verify
                # verifies in flight overlap: a chained verify's link time is what is left of the wait from its send
                # (or the answer before it, if later) to its answer after the target's compute and queueing
                now = time.perf_counter_ns()
                self.network_ns += max(0, now - max(sent_ns, self._last_answer_ns) - r.forward_ns - r.verify_ns
                                       - r.queue_ns)
                self._last_answer_ns = now
                self.queue_ns += r.queue_ns
                self.link.forward(r.forward_ns / 1e9)
                o = verify_outcome(r)
                o.committed, o.committed_from, o.proposed = list(r.committed_ids), r.committed_from, r.proposed
                out.set_result(o)

        fut.add_done_callback(done)
        return out

    def _unary(self, req: target_pb2.VerifyRequest):
        return self.stub.Verify(req, timeout=self.timeout, metadata=self.metadata)

    async def end(self, session_id: str) -> None:
        await self.rounds.aclose()
        if self.pipe is not None:
            await self.pipe.close()
        if self.started:  # a target that failed may be gone: a short wait, and the coordinator ends it too
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.stub.EndSession(target_pb2.TargetServiceEndSessionRequest(session_id=session_id),
                                           timeout=5.0, metadata=self.metadata)


CHAIN_MIN_RTT = 0.5  # chained rounds where the link's round trip is at least this many target forwards


class LinkEstimate:
    """What this replica has measured of one target replica: the link's round trip (a call's wall time less the
    target's compute and queueing) and the target's forward time, each a moving average (weight 0.2).

    Chained rounds (specdec/scheduling/chained.py) pay where waiting for a verify's answer idles the target long enough:
    with the round trip at least `CHAIN_MIN_RTT` forwards. Below that, PEARL's rounds, one verify at a time, commit more
    per forward (on a 2-vCPU host, at round trip 0: 23.5 tokens/s chained against 24.1 with PEARL's rounds and
    26.9 for sd; at one forward: 21.8 chained against 15.2, docs/operations/network.md)."""

    def __init__(self):
        self.rtt_s: float | None = None
        self.forward_s: float | None = None

    @staticmethod
    def _mix(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def round_trip(self, seconds: float) -> None:
        self.rtt_s = self._mix(self.rtt_s, max(0.0, seconds))

    def forward(self, seconds: float) -> None:
        if seconds > 0:
            self.forward_s = self._mix(self.forward_s, seconds)

    def chains(self) -> bool:
        """Whether chained rounds pay on this link (False until both are measured)."""
        return self.rtt_s is not None and self.forward_s is not None and self.rtt_s >= CHAIN_MIN_RTT * self.forward_s


class PeerChannels:
    """One channel per target address this replica dials (shared by its requests), with `target_routes` applied
    and the replica's TLS settings as client credentials; and, with `frames`, per-round calls on a target's frame
    port where it serves one (specdec_rpc/frames.py; `ssl_context`: the same TLS). A routed endpoint (a proxy or
    relay between the pools, which carries gRPC) gets no frames."""

    def __init__(self, routes: dict[str, str], credentials: grpc.ChannelCredentials | None = None,
                 frames: bool = True, ssl_context=None, spin_s: float = 0.0):
        self.routes, self.credentials = routes, credentials
        self.frames = frames
        self.frame_ports = FramePorts(ssl_context, spin_s)
        self._ch: dict[tuple[str, str], grpc.aio.Channel] = {}
        self.links: dict[str, LinkEstimate] = {}  # target endpoint -> what was measured of it

    def link(self, endpoint: str) -> LinkEstimate:
        return self.links.setdefault(endpoint, LinkEstimate())

    def get(self, endpoint: str, server_name: str = "") -> grpc.aio.Channel:
        address = self.routes.get(endpoint, endpoint)
        key = (address, server_name)
        if key not in self._ch:
            self._ch[key] = open_channel(address, self.credentials, server_name)
        return self._ch[key]

    def frame_opener(self, server_name: str = ""):
        """PeerTarget's `frames` for targets dialed with `server_name` (None: this replica sends no frames)."""
        if not self.frames:
            return None

        async def open_call(endpoint: str, metadata, timeout: float) -> FrameCall | None:
            if endpoint in self.routes:
                return None
            stub = target_pb2_grpc.TargetServiceStub(self.get(endpoint, server_name))
            return await self.frame_ports.open(
                endpoint, "VerifyRounds", target_pb2.VerifyRoundsResponse,
                lambda: stub.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=timeout), metadata, server_name)
        return open_call

    async def close(self) -> None:
        chans, self._ch = list(self._ch.values()), {}
        for ch in chans:
            await ch.close()


class _Reports:
    """The committed tokens on their way to the coordinator, gathered over `interval` seconds (0: each round's alone).
    The first round's go at once, and whatever is gathered goes when the request ends; a message costs the two
    processes a wake-up each and the coordinator a decode, so a client that reads only the final answer is sent one
    every `interval` instead of one a round."""

    def __init__(self, interval: float):
        self.interval, self.last = interval, -math.inf
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.ready = asyncio.Event()
        self.closed = False
        self.timer: asyncio.TimerHandle | None = None

    def add(self, new: list[int], logprobs: list | None = None) -> bool:
        """`generate`'s on_tokens: gather; False (the coordinator stops a request by cancelling the call)."""
        self.tokens += new
        if logprobs:
            self.logprobs += logprobs
        due = self.last + self.interval - time.monotonic()
        if due <= 0:
            self.ready.set()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(due, self.ready.set)
        return False

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def next(self) -> tuple[list[int], list] | None:
        """The tokens gathered since the last message (and their logprobs), once due; None after the last."""
        while not self.tokens:
            if self.closed:
                return None
            self.ready.clear()
            await self.ready.wait()
        if not self.closed and self.interval > 0 and time.monotonic() < self.last + self.interval:
            self.ready.clear()
            await self.ready.wait()  # the timer, or the request's end
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch = (self.tokens, self.logprobs)
        self.tokens, self.logprobs, self.last = [], [], time.monotonic()
        return batch


async def speculate(servicer, peers: PeerChannels, request: draft_pb2.SpeculateRequest, context,
                    timeout: float) -> AsyncIterator[draft_pb2.SpeculateResponse]:
    """The `Speculate` RPC: run the request's schedule here, stream its committed tokens (module docstring)."""
    req: GenerationRequest = validate_request(request_from_speculate(request))
    if req.mode == "ar":
        raise InvalidRequestError("speculation.draft_stop" if request.HasField("speculation") else "mode",
                                  "Speculate runs speculative modes; an 'ar' request goes to the target")
    if not request.target_endpoint:
        raise InvalidRequestError("target_endpoint", "name the target replica to verify on (host:port)")
    if req.params.prompt_logprobs >= 0:
        raise InvalidRequestError("params.prompt_logprobs", "Speculate returns no prompt logprobs; ask the "
                                  "coordinator's own rounds for them")
    metadata = tuple((k, v) for k, v in context.invocation_metadata() if k in TRACE_HEADERS) or None
    draft = ReplicaDraft(servicer, int(request.output_start), int(request.reserve_positions), context)
    target = PeerTarget(peers.get(request.target_endpoint, request.target_server_name), request.target_endpoint,
                        timeout, metadata, int(request.reserve_positions), int(request.output_start),
                        int(request.chain_window), peers.link(request.target_endpoint),
                        peers.frame_opener(request.target_server_name) if req.sequential_calls else None)
    report = _Reports(request.report_interval_ms / 1000.0)
    task = asyncio.ensure_future(generate(req, draft, target, report.add))
    task.add_done_callback(lambda t: report.close())
    try:
        while (batch := await report.next()) is not None:
            new, logprobs = batch
            msg = draft_pb2.SpeculateResponse(token_ids=new)
            if logprobs:
                msg.logprobs.CopyFrom(logprobs_rows_to_proto(logprobs, new))
            yield msg
        try:
            res = task.result()
        except grpc.aio.AioRpcError as e:  # the target replica's status: pass it on, and say whose it is
            context.set_trailing_metadata(((FAILED_TARGET_KEY, request.target_endpoint),))
            await context.abort(e.code(), f"target replica {request.target_endpoint}: {e.details() or e.code().name}")
        done = draft_pb2.SpeculateResponse(done=True, finish_reason=res.finish_reason, target_model=target.model,
                                           cached_tokens=target.cached_tokens, draft_model=servicer.host.info.model)
        stats_to_proto(res.stats, done, peer_network_s=target.network_ns / 1e9, target_queued_s=target.queue_ns / 1e9)
        yield done
    finally:
        if not task.done():  # the coordinator cancelled (its client went away, a stop string, a deadline)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
