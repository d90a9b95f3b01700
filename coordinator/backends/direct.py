"""The direct data plane (`COORDINATOR_DATA_PLANE=direct`): a speculative request's rounds run on its draft replica.

The coordinator pins a draft and a target replica as for its own rounds, then calls the draft replica's
`Speculate` with the target's endpoint: the draft replica drafts locally and verifies on the target replica
directly (draft_service/speculate.py), streaming the committed tokens back. A round then pays one network round
trip (draft <-> target) instead of the two or more of the coordinator's rounds (coordinator <-> draft,
coordinator <-> target, PEARL's cancels), which is what matters where the pools run on different machines
(docs/operations/network.md).

The coordinator keeps what only it can do: placement (the pools' room and prefix affinity), the request's history
and the client's stream, cancellation, and failover. When the call fails the tokens it delivered stand (the target
verified them) and `DirectInterrupted` says which replica failed, if any; the pipeline then moves that replica's
backend and goes on from the delivered tokens with its own rounds (exact: the same schedule, keyed randomness).
"""
from __future__ import annotations

import asyncio
import time

import grpc

from specdec.scheduling.request import GenerationRequest, GenerationResult, GenerationStats
from specdec_rpc.aio import within
from specdec_rpc.decode import logprobs_rows_from_proto, stats_from_proto
from specdec_rpc.encode import FAILED_TARGET_KEY, speculate_request

from coordinator.backends.clients import RemoteDraft, RemoteTarget

# statuses after which the request goes on with the coordinator's own rounds (the replica's fault, or an older
# draft replica without `Speculate`); any other status is the request's answer
_RESUMABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL}
# of those, the ones that say the replica is gone (reported to the pool, the backend moves)
_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
         grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


# how often a draft replica sends the committed tokens of a request whose caller reads only the final answer (a
# unary Generate, a completion without `stream`): a message a round would cost the draft replica and this process a
# wake-up and a decode each round, for nothing the caller sees. The price: a failover redoes at most this much
# work (it resumes from the tokens delivered). Streamed requests, and those with stop strings, get every round's.
REPORT_INTERVAL_MS = 50


class DirectInterrupted(Exception):
    """The `Speculate` call ended before its last message. `failed`: "draft", "target" or "" (no replica is at fault:
    an older draft replica, a lost session, a preemption); `error`: the status it ended with; `preempted`: the
    coordinator ended it to yield the request's sessions to a waiter of higher priority."""

    def __init__(self, error: grpc.aio.AioRpcError, failed: str, preempted: bool = False):
        super().__init__(f"direct rounds interrupted: {error.code().name} ({failed or 'no replica at fault'})")
        self.error, self.failed, self.preempted = error, failed, preempted


def preempted(draft: RemoteDraft, target: RemoteTarget) -> bool:
    """Whether a waiter of higher priority marked one of the request's sessions (coordinator/routing/preemption.py;
    the pipeline's pool view, refreshed in the background)."""
    return any(b.view.preempts(b.kind, b.holding) for b in (target, draft))


async def run_direct(req: GenerationRequest, draft: RemoteDraft, target: RemoteTarget, tracking, timeout: float,
                     server_name: str = "", chain_window: int = 0, report_interval_ms: int = 0) -> GenerationResult:
    """Run `req` on its draft replica against its target replica; `tracking(new, logprobs)` gets the committed tokens
    as they arrive (True: stop the request). Both backends are pinned here (no session: the draft replica starts
    and ends both). `report_interval_ms`: the tokens come in batches gathered that long (0: every round's).
    → the result; DirectInterrupted after a resumable failure (the tokens delivered stand)."""
    await _pin(draft, target)
    msg = speculate_request(req, target_endpoint=target.endpoint,
                            reserve_positions=target.start_kw["reserve_positions"],
                            output_start=target.start_kw["output_start"], target_server_name=server_name,
                            chain_window=chain_window)
    msg.report_interval_ms = report_interval_ms
    t0 = time.perf_counter_ns()
    call = draft.channels.draft(draft.endpoint).Speculate(msg, metadata=draft.metadata)
    tokens: list[int] = []
    logprobs: list = []
    try:
        while True:
            r = await _next_message(call, draft, timeout)
            if r.done:
                break
            new = list(r.token_ids)
            rows = logprobs_rows_from_proto(r.logprobs) if r.HasField("logprobs") else None
            tokens += new
            logprobs += rows or []
            if tracking(new, rows):  # a stop string downstream: the request ends here
                call.cancel()
                return GenerationResult(tokens, "stop", GenerationStats(mode=req.mode, rounds=0),
                                        logprobs if req.params.logprobs >= 0 else None)
            if preempted(draft, target):  # yield: the pipeline goes on with its own rounds, which give way
                call.cancel()
                raise DirectInterrupted(grpc.aio.AioRpcError(
                    grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                    details="preempted by a request of higher priority"), "", preempted=True)
    except grpc.aio.AioRpcError as e:
        draft.network_ns += time.perf_counter_ns() - t0
        if e.code() not in _RESUMABLE:
            raise
        raise _interrupted(e) from None
    except BaseException:
        call.cancel()  # our cancel: the draft replica ends both sessions
        raise
    return _finished(req, r, draft, target, tokens, logprobs, t0)


async def _pin(draft: RemoteDraft, target: RemoteTarget) -> None:
    """Pin the request's target replica, then its draft replica, where not pinned yet."""
    if target.endpoint is None:
        await target.pin()
    if draft.endpoint is None:
        await draft.pin()


async def _next_message(call, draft: RemoteDraft, timeout: float):
    """The `Speculate` call's next message; a call silent for `timeout` s (cancelled here) or ended before its last
    message raises the status that amounts to."""
    try:
        r = await within(call.read(), timeout)
    except asyncio.TimeoutError:
        call.cancel()
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   details=f"draft replica {draft.endpoint} sent nothing for {timeout} s")
    if r is grpc.aio.EOF:
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                   details=f"draft replica {draft.endpoint} ended the call early")
    return r


def _interrupted(e: grpc.aio.AioRpcError) -> DirectInterrupted:
    """A resumable failure as `DirectInterrupted`, naming the replica at fault: the target where the draft replica's
    trailers say so, else the draft where the status says it is gone."""
    failed_target = dict(e.trailing_metadata() or ()).get(FAILED_TARGET_KEY)
    failed = "target" if failed_target else ("draft" if e.code() in _GONE else "")
    return DirectInterrupted(e, failed)


def _finished(req: GenerationRequest, r, draft: RemoteDraft, target: RemoteTarget, tokens: list[int],
              logprobs: list, t0: int) -> GenerationResult:
    """The result from the call's last message `r`. Its stats and the call's wall time (since `t0`) give the
    backends' network time; it names both replicas' models and the prompt tokens the target replica reused."""
    stats, extra = stats_from_proto(r, req.mode)
    # the coordinator <-> draft link: the call's wall time less the replica's own run of the request
    wall_ns = time.perf_counter_ns() - t0
    draft.network_ns += max(0, wall_ns - int(stats.wall_s * 1e9))
    stats.wall_s = wall_ns / 1e9  # the request's, as the coordinator saw it
    draft.peer_network_ns = int(extra.get("peer_network_s", 0.0) * 1e9)
    target.model, target.cached_tokens = r.target_model or target.model, int(r.cached_tokens)
    draft.model = r.draft_model or draft.model
    return GenerationResult(tokens, r.finish_reason or "length", stats,
                            logprobs if req.params.logprobs >= 0 else None)
