"""gRPC backends of `specdec.scheduling.schedule` with session pinning, failover and network accounting.

`RemoteDraft` / `RemoteTarget` implement `DraftBackend` / `TargetBackend` for ONE request: each is pinned to one
replica (chosen by the pool) and mirrors what that replica has fed, so the session can be rebuilt anywhere:

- UNAVAILABLE or CANCELLED (replica gone, draining, stopping, crashed): report it, pin another replica, start a
  session there from the mirrored prefix, retry the call. The absolute-position protocol plus keyed randomness
  make the retried call return exactly what the lost one would have (a half-received draft stream is resumed by
  skipping the tokens already delivered), so failover never changes the output.
- RESOURCE_EXHAUSTED on a round call (the replica's call queue is full; nothing was applied): back off and resend.
- NOT_FOUND (the replica expired or evicted the session): rebuild on the same replica, retry.
- The replica left the pool (scale-in; `PoolView` says so): move the session before the next call.

Per-round calls (Draft, Verify) travel as messages on one open stream per session and replica
(`specdec_rpc/rounds.py`) unless `streams=False`; any trouble with a stream resends the call unary.

network_ns = wall time inside calls minus the compute (and queueing) the replicas report, per link: a request's
draft backend holds the coordinator <-> draft time, its target backend the coordinator <-> target time.

With a trace context (`metadata`: the W3C `traceparent` and `tracestate` of the request's span,
coordinator/tracing.py), every call carries it as gRPC metadata, so the replicas' spans join the request's trace;
without one, calls carry none.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

import grpc

from specdec.common.errors import SessionNotFoundError
from specdec.decoding.sampling import SamplingParams
from specdec_rpc.pb import draft_pb2, target_pb2
from specdec_rpc.decode import decode_q, draft_block, features_from_proto, logprobs_from_proto, verify_outcome
from specdec_rpc.encode import VERIFY_METHOD_PB, draft_request, features_to_proto, sampling_to_proto, verify_q
from specdec.decoding.stop import StopSpec
from specdec.decoding.verify import SparseDist
from specdec.state.feature_state import TargetFeatures
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import VerifyOutcome
from specdec_rpc.rounds import BusyWaits, RoundStream

from coordinator.channels import Channels
from coordinator.routing.pool import DraftContextError
from coordinator.routing.probes import end_session_request
from coordinator.backends.retries import FULL_WAITS, MAX_FAILOVERS, retryable
from coordinator.backends.moves import PoolView, end_in_background, end_later, replica_call, take_room

log = logging.getLogger(__name__)


class _Pinned:
    kind = ""

    def __init__(self, pool, channels: Channels, view: PoolView | None = None, timeout: float = 60.0,
                 streams: bool = True, frames: bool = True):
        self.pool, self.channels, self.view, self.timeout = pool, channels, view or PoolView(), timeout
        # (("traceparent", ...), ("tracestate", ...)) of a traced request: sent with every call
        self.metadata: tuple | None = None
        self.rounds = self._round_stream(streams)
        if frames:  # the replica's frame port, where it serves one (specdec_rpc/frames.py)
            self.rounds.frames = lambda ep: self.channels.frame_call(self.kind, ep, self.metadata, self.timeout)
        self.endpoint: str | None = None
        self.served: list[str] = []  # every replica this request used, in order
        self.failed: list[str] = []
        self.sid = ""
        self.params: SamplingParams | None = None
        self.fed: list[int] = []  # mirror of the tokens the pinned replica holds fed
        self.network_ns = 0
        self.peer_network_ns = 0  # the direct data plane: draft <-> target time the draft replica measured
        self.queued_ns = 0  # time spent waiting for room in the pool (admission)
        self.failovers = 0
        self.start_kw: dict = {}  # extra StartSession fields (return_features), kept for rebuilds
        self.prefix_keys: list[bytes] = []  # the prompt's prefix keys: the pool prefers the replica they went to
        self.priority = 0  # the request's: a full pool serves lower values first
        self.holder = uuid.uuid4().hex  # the request's (its backends share it): holdings are holder/kind/1, ...
        self.holding = ""  # the current one (preemption marks it)
        self.preemptions = 0
        self.sibling: _Pinned | None = None  # the request's backend in the other pool (it yields with this one)
        self.model = ""  # the pinned replica's model (its StartSession answer says)
        self.in_call = 0  # calls in flight (a yield waits for them: `give_up`)
        self.give_up = False  # yield the session when the call in flight ends
        self.closed = False  # `end()` ran: no session may start on a replica after it (`pin`)
        self.gave_up: asyncio.Future | None = None  # done once the last given-up session has ended and been released
        self.rebuild_due = False  # pinned again by its sibling (`moves.take_room`): rebuilt at the next call
        self.room_lock = asyncio.Lock()  # one re-pinning at a time

    def _round_stream(self, enabled: bool) -> RoundStream:
        raise NotImplementedError

    async def pin(self) -> None:
        t0 = time.perf_counter_ns()
        self.holding = f"{self.holder}/{self.kind}/{len(self.served) + 1}"
        endpoint = await self.pool.acquire(self.kind, self.failed, self.prefix_keys, self.priority, self.holding)
        self.queued_ns += time.perf_counter_ns() - t0
        if self.closed:  # its request ended meanwhile (a call of its still in flight): start nothing
            await self.release(endpoint)
            raise SessionNotFoundError(f"the request ended; {self.kind} session {self.sid} is not started again")
        self.endpoint = endpoint
        self.served.append(self.endpoint)

    async def release(self, endpoint: str) -> None:
        await self.pool.release(self.kind, endpoint, self.holding)

    async def _start_on(self, prompt_ids: list[int], **extra):
        stub = self._stub()
        req_cls = (draft_pb2.DraftServiceStartSessionRequest if self.kind == "draft"
                   else target_pb2.TargetServiceStartSessionRequest)
        t0 = time.perf_counter_ns()
        r = await stub.StartSession(req_cls(session_id=self.sid, prompt_ids=prompt_ids,
                                            params=sampling_to_proto(self.params), **self.start_kw, **extra),
                                    timeout=self.timeout, metadata=self.metadata)
        self.network_ns += time.perf_counter_ns() - t0 - r.prefill_ns
        self.model = r.model or self.model
        self.fed = list(prompt_ids[:-1])
        return r

    def _stub(self):
        return self.channels.draft(self.endpoint) if self.kind == "draft" else self.channels.target(self.endpoint)

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams, **extra):
        """Pin a replica (unless `probe` did) and start the session there; → the StartSession response."""
        self.sid, self.params = session_id, params
        async with replica_call(self):  # a sibling's preemption waits for the prefill (moves.py)
            if self.endpoint is None:
                await self.pin()
            full_waits = 0
            while True:
                try:
                    return await self._start_on(list(prompt_ids), **extra)
                except Exception as e:  # noqa: BLE001
                    if self.failovers >= MAX_FAILOVERS:
                        raise
                    if retryable(e) == "unavailable":
                        await self._failover(e)
                    elif isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        full_waits = await self._next_replica(e, full_waits)  # another replica, or this one later
                    elif self.kind == "draft" and isinstance(e, grpc.aio.AioRpcError) and \
                            e.code() == grpc.StatusCode.OUT_OF_RANGE:
                        raise DraftContextError(f"the draft replica cannot hold this request: {e.details()}") from None
                    else:
                        raise

    async def _next_replica(self, e: BaseException, waits: int) -> int:
        """The replica refused a session for want of room the pool did not count (another coordinator's sessions,
        or a crashed one's, which its LRU frees once idle `lru_min_idle_s`): pin another replica, or, with none,
        wait (0.1 s, doubling, ~6 s in all) and ask this one again. → the waits so far."""
        full = self.endpoint
        self.failed.append(full)
        await self.release(full)
        try:
            await self.pin()
            self.failovers += 1
            return waits
        except Exception:  # noqa: BLE001 - no other replica
            self.endpoint = None
            if waits >= FULL_WAITS:
                raise e from None
        self.failed.remove(full)
        await asyncio.sleep(0.1 * 2 ** waits)
        await self.pin()
        return waits + 1

    async def _failover(self, e: BaseException) -> None:
        """The pinned replica is unreachable: report it and pin another (no session started yet)."""
        self.failovers += 1
        bad, self.endpoint = self.endpoint, None  # released here, once: a failed re-pin leaves nothing to release
        self.failed.append(bad)
        log.warning("%s replica %s failed (%s); moving session %s", self.kind, bad,
                    getattr(e, "code", lambda: e)(), self.sid)
        await self.pool.report_failure(self.kind, bad, str(getattr(e, "details", lambda: e)()))
        await self.release(bad)
        if self.sid:  # a replica that failed one call may be up and hold the session: end it there, off this path
            end_later(self, bad)
        await self.pin()

    async def end_on(self, endpoint: str, session_id: str | None = None) -> None:
        """End the session (this backend's, or `session_id`) on `endpoint`; a replica that is gone is let be."""
        stub = self.channels.draft(endpoint) if self.kind == "draft" else self.channels.target(endpoint)
        try:
            await stub.EndSession(end_session_request(self.kind, session_id or self.sid), timeout=5.0,
                                  metadata=self.metadata)
        except grpc.aio.AioRpcError:
            pass

    async def end(self, session_id: str) -> None:
        self.closed = True
        if self.endpoint is None:
            return
        if self.in_call:  # a call still in flight (a rebuild's StartSession among them) gives it up as it ends
            self.give_up = True
            return
        ep, self.endpoint = self.endpoint, None
        try:
            await self.rounds.aclose()
        finally:
            try:
                # a cancel arriving now must not leave the session behind (a closing pipeline awaits it)
                await asyncio.shield(end_in_background(self.end_on(ep)))
            finally:
                await self.release(ep)

    async def replace_replica(self, e: BaseException) -> None:
        """The pinned replica failed in a call this backend did not make (the direct data plane's `Speculate`):
        report it and pin another."""
        await self._failover(e)

    async def unpin(self) -> None:
        """Give the pinned replica's room back without an EndSession: no session of this backend is there (the
        direct data plane's draft replica started and ended the request's sessions)."""
        self.closed = True
        ep, self.endpoint = self.endpoint, None
        if ep is not None:
            await self.release(ep)

    async def _with_failover(self, call, rebuild, compute):
        """One round call (`call()` makes it: a stream message, or a unary RPC) with failover: after a retryable
        error, `rebuild` the session and call again. Network time = wall time minus the `compute(response)` the
        replica reports."""
        busy = BusyWaits()
        while True:
            t0 = time.perf_counter_ns()
            try:
                r = await call()
            except grpc.aio.AioRpcError as e:
                self.network_ns += time.perf_counter_ns() - t0
                if await busy.waited_for_room(e):  # the replica's queue was full: nothing was applied
                    continue
                await self._recover(e)
                await rebuild()
                continue
            self.network_ns += max(0, time.perf_counter_ns() - t0 - compute(r))
            return r

    async def _recover(self, e: BaseException) -> None:
        """After a retryable error: pin elsewhere (UNAVAILABLE) or stay (NOT_FOUND); the caller rebuilds. A session
        given up meanwhile (preemption) takes room again."""
        if self.endpoint is None and self.sid:
            await take_room(self)
            return
        why = retryable(e)
        if why is None or self.failovers >= MAX_FAILOVERS:
            raise e
        if why == "unavailable":
            await self._failover(e)
        else:
            self.failovers += 1
            log.warning("%s replica %s lost session %s; rebuilding it", self.kind, self.endpoint, self.sid)


class RemoteDraft(_Pinned):
    kind = "draft"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False
        self.reads_features = False

    def _round_stream(self, enabled: bool) -> RoundStream:
        return RoundStream(lambda ep: self.channels.draft(ep).DraftRounds(metadata=self.metadata),
                           lambda req: draft_pb2.DraftRoundsRequest(draft=req), lambda m: m.draft,
                           self.timeout, enabled)

    def _unary_draft(self, req: draft_pb2.DraftRequest):
        return self._stub().Draft(req, timeout=self.timeout, metadata=self.metadata)

    async def probe(self) -> None:
        """Pin a replica now and learn whether it reads target features (the schedule asks before starting)."""
        if self.endpoint is None:
            await self.pin()
        try:  # before any session exists: a sibling's preemption cannot have given this one up yet
            self.reads_features = await self.channels.draft_feature_size(self.endpoint, self.timeout) > 0
        except grpc.aio.AioRpcError as e:  # unknown: treat as plain (a feature draft then drafts without them)
            log.warning("draft replica %s GetInfo failed (%s); sending no target features", self.endpoint, e.code())
            self.reads_features = False

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    features: list[TargetFeatures] | None = None) -> None:
        extra = {"features": [features_to_proto(f) for f in features]} if features else {}
        await super().start(session_id, prompt_ids, params, **extra)

    async def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int, stop: StopSpec,
                    block_size: int, features: list[TargetFeatures] | None = None) -> DraftBlock:
        """The unary Draft: one message back, and the replica may draft it on its event loop (no thread hop)."""
        req = draft_request(draft_pb2.DraftRequest, session_id, base_position, append, gamma_max, stop, block_size,
                            features)

        async def rebuild():
            await self._start_on(self.fed[:base_position] + append[:1])

        async with replica_call(self, rebuild):
            r = await self._with_failover(lambda: self.rounds.call(self.endpoint, req, self._unary_draft), rebuild,
                                          lambda r: r.draft_ns)
        blk = draft_block(r)
        self.fed = self.fed[:base_position] + list(append) + blk.tokens[:-1]
        return blk

    async def draft_stream(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                           stop: StopSpec, block_size: int,
                           features: list[TargetFeatures] | None = None) -> AsyncIterator[DraftBlock]:
        req = draft_request(draft_pb2.DraftStreamRequest, session_id, base_position, append, gamma_max, stop,
                            block_size, features)
        got: list[int] = []  # tokens delivered to the schedule
        self._cancelled = False
        busy = BusyWaits()

        async def rebuild():
            await self._start_on(self.fed[:base_position] + append[:1])

        async with replica_call(self, rebuild):
            try:
                while True:
                    t0, compute, skip = time.perf_counter_ns(), 0, len(got)
                    call = self._call = self._stub().DraftStream(req, timeout=self.timeout, metadata=self.metadata)
                    try:
                        async for r in call:
                            compute += r.draft_ns
                            toks, q = list(r.token_ids), None
                            if skip:  # a resumed stream re-drafts the same tokens: drop what was delivered
                                n = min(skip, len(toks))
                                skip -= n
                                toks = toks[n:]
                                if not toks:
                                    continue
                                q = decode_q(r.q, check=False)[n:]
                            got.extend(toks)
                            yield draft_block(r, toks, q)
                        return
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if self._cancelled and not (task is not None and task.cancelling()):
                            return  # our own cancel(): the stream simply ends
                        raise
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.CANCELLED and self._cancelled:
                            return
                        if not got and await busy.waited_for_room(e):  # refused before drafting anything
                            continue
                        await self._recover(e)
                        await rebuild()
                    finally:
                        self.network_ns += max(0, time.perf_counter_ns() - t0 - compute)
            finally:
                self._call = None
                # the replica holds base + append + every delivered token but the last (at least)
                self.fed = self.fed[:base_position] + list(append) + got[:-1]

    async def cancel(self, session_id: str) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()  # the replica stops drafting at its next token


class RemoteTarget(_Pinned):
    kind = "target"
    chain_window = 1  # through the coordinator one verify at a time (chained rounds: the direct data plane's)
    prompt_logprobs = None  # TokenLogprobs of the prompt, when the request asked (SamplingParams.prompt_logprobs)
    cached_tokens = 0  # prompt positions the replica reused from its prefix cache at the session's first start

    def _round_stream(self, enabled: bool) -> RoundStream:
        return RoundStream(lambda ep: self.channels.target(ep).VerifyRounds(metadata=self.metadata),
                           lambda req: target_pb2.VerifyRoundsRequest(verify=req), lambda m: m.verify,
                           self.timeout, enabled)

    def _unary_verify(self, req: target_pb2.VerifyRequest):
        return self._stub().Verify(req, timeout=self.timeout, metadata=self.metadata)

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    want_features: bool = False) -> TargetFeatures | None:
        if want_features:
            self.start_kw["return_features"] = True
        r = await super().start(session_id, prompt_ids, params)
        self.cached_tokens = r.cached_tokens
        if r.HasField("prompt_logprobs"):
            self.prompt_logprobs = logprobs_from_proto(r.prompt_logprobs)
            self.params = dataclasses.replace(params, prompt_logprobs=-1)  # a rebuild need not recompute them
        return features_from_proto([r.features])[0] if r.HasField("features") else None

    async def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
                     q: list[SparseDist] | None, method: str, feed_draft: bool = True,
                     sample_bonus: bool = True) -> VerifyOutcome:
        base, fd = base_position, list(feed)

        async def rebuild():
            nonlocal base, fd
            if fd:  # the session's prompt ends with this call's first token, fed again (as StartSession leaves it)
                await self._start_on(self.fed[:base] + fd[:1])
            elif base >= 1:  # a fresh session has no stored row: re-feed the last fed token with this call
                prefix = self.fed[:base]
                await self._start_on(prefix)
                base, fd = base - 1, [prefix[-1]] + list(feed)
            else:
                await self._start_on(fd[:1])

        q_bytes = verify_q(q, method)

        def call():  # built per try: a rebuild moves base and fd
            req = target_pb2.VerifyRequest(session_id=session_id, base_position=base, feed_ids=fd,
                                           draft_ids=draft, method=VERIFY_METHOD_PB[method], feed_draft=feed_draft,
                                           sample_bonus=sample_bonus, q=q_bytes)
            return self.rounds.call(self.endpoint, req, self._unary_verify)

        async with replica_call(self, rebuild):
            r = await self._with_failover(call, rebuild, lambda r: r.forward_ns + r.verify_ns + r.queue_ns)
        kept = base + len(fd) + (r.num_accepted if feed_draft else 0)
        self.fed = (self.fed[:base] + fd + (list(draft) if feed_draft else []))[:kept]
        return verify_outcome(r)
