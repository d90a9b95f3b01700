"""Request pipelines: run `specdec.scheduling.schedule.generate` for one request against pinned gRPC replicas.

A plain async class (no Ray, no tokenizer): token ids in, events out. `coordinator/actor.py` hosts it in an async
Ray actor; with `--no-ray` the front server uses it directly. Ray is never on the per-round path: the only Ray
calls are pinning (one per request and per failover), unpinning, and a pool-membership refresh every
`view_refresh_s`.

Events (coordinator/events.py, dataclasses that pickle across Ray): a `TokensEvent` per batch of newly verified
tokens, in order (a `ServedEvent` where the caller reads only the last event and the replicas changed), then a
`DoneEvent` with the answer and its `RequestStats`, or an `ErrorEvent` on failure.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

import grpc

from specdec.common.errors import (CapacityError, ContextOverflowError, InvalidRequestError, SessionNotFoundError,
                            SpecDecError, StalePositionError)
from specdec.scheduling.request import GenerationRequest, GenerationResult, GenerationStats, PipelineRequest
from specdec.scheduling.schedule import generate
from specdec.workers.base import PREFILL_CHUNK
from specdec_rpc.logs import bind
from specdec_rpc.tracing import TRACE_HEADERS

from coordinator.routing.affinity import prefix_keys
from coordinator.channels import Channels
from coordinator.backends.clients import RemoteDraft, RemoteTarget
from coordinator.routing.pool import DraftContextError, ReplicaUnavailableError
from coordinator.backends.direct import REPORT_INTERVAL_MS, DirectInterrupted, run_direct
from coordinator.backends.moves import PoolView, end_in_background, ending, yield_direct
from coordinator.events import DoneEvent, ErrorEvent, Event, RequestStats, Served, ServedEvent, TokensEvent

log = logging.getLogger(__name__)

_CODES = [(InvalidRequestError, "INVALID_ARGUMENT"), (ReplicaUnavailableError, "UNAVAILABLE"),
          (SessionNotFoundError, "NOT_FOUND"), (StalePositionError, "FAILED_PRECONDITION"),
          (ContextOverflowError, "OUT_OF_RANGE"), (CapacityError, "RESOURCE_EXHAUSTED"),
          (SpecDecError, "FAILED_PRECONDITION")]


def error_event(e: BaseException) -> ErrorEvent:
    """The last event of a request that failed with `e`: its gRPC status name and message."""
    if isinstance(e, grpc.aio.AioRpcError):  # a replica's answer: pass its status through
        return ErrorEvent(e.code().name, e.details() or str(e.code()))
    for cls, code in _CODES:
        if isinstance(e, cls):
            return ErrorEvent(code, str(e))
    return ErrorEvent("INTERNAL", f"{type(e).__name__}: {e}")


def _log_timings(stats: RequestStats) -> dict[str, float]:
    """The seconds a request's JSON log lines carry once it ends (their `timings` field)."""
    return {name: round(v, 6) for name, v in (
        ("wall_s", stats.wall_s), ("queued_s", stats.queued_s), ("draft_busy_s", stats.draft_busy_s),
        ("target_busy_s", stats.target_busy_s), ("draft_network_s", stats.draft_network_s),
        ("target_network_s", stats.target_network_s), ("peer_network_s", stats.peer_network_s),
        ("draft_idle_s", stats.draft_idle_s), ("target_idle_s", stats.target_idle_s))}


async def go_on(req: GenerationRequest, head: list[int], head_logprobs: list, session_id: str, run,
                **changes) -> GenerationResult:
    """A request interrupted after the tokens `head` (verified and delivered) goes on from them: `run(rest)`
    generates the rest, a request whose prompt ends with the head (`changes` applied), in a session of its own
    (`session_id`: the interrupted one has ended). Nothing is left where the head holds an EOS or the whole length.
    → the whole request's result."""
    ended = any(t in req.eos_token_ids for t in head)
    if ended or len(head) >= req.max_new_tokens:
        return GenerationResult(head, "stop" if ended else "length", GenerationStats(mode=req.mode),
                                head_logprobs if req.params.logprobs >= 0 else None)
    rest = dataclasses.replace(req, prompt_ids=req.prompt_ids + head, max_new_tokens=req.max_new_tokens - len(head),
                               session_id=session_id, **changes)
    res = await run(rest)
    return GenerationResult(head + res.token_ids, res.finish_reason, res.stats,
                            head_logprobs + res.logprobs if res.logprobs is not None else None)


@dataclasses.dataclass(eq=False)
class _RequestReplicas:
    """One request's backends and delivered tokens. `first_target` / `first_draft`: the backends it started with;
    `target` / `draft`: the ones it runs on now (a target-only continuation moves to backends of its own; a draft
    found unreachable at the start leaves `draft` None). `fallback`: why it went target-only, "unreachable" (no
    draft replica) or "context" (past the draft's context), '' where it did not."""
    first_target: RemoteTarget
    first_draft: RemoteDraft | None
    target: RemoteTarget
    draft: RemoteDraft | None
    n_prompt: int
    on_tokens: Callable
    committed: list[int] = dataclasses.field(default_factory=list)
    seen_logprobs: list = dataclasses.field(default_factory=list)
    told: Served | None = None  # the replicas last passed to `on_tokens`
    fallback: str = ""
    final_only: bool = False  # the caller reads only the last event (a unary client): tokens may come in batches

    def tracking(self, new: list[int], logprobs: list | None = None) -> bool:
        """The schedule's token callback: records the delivered tokens and passes them on, with the replicas the
        request holds where they changed since the last call."""
        self.committed.extend(new)
        self.seen_logprobs.extend(logprobs or ())
        first_target, first_draft = self.first_target, self.first_draft
        targets = dict.fromkeys((first_target, self.target))
        served = Served(prompt_tokens=self.n_prompt, cached_prompt_tokens=first_target.cached_tokens,
                        target_replica=",".join(ep for b in targets for ep in b.served),
                        draft_replica=",".join(first_draft.served) if first_draft is not None else "")
        if served == self.told:
            return self.on_tokens(new, logprobs)
        self.told = served
        return self.on_tokens(new, logprobs, served)

    def targets(self) -> list[RemoteTarget]:
        return [self.first_target] + ([self.target] if self.target is not self.first_target else [])

    def drafts(self) -> list[RemoteDraft]:
        return [self.first_draft] if self.first_draft is not None else []

    def stats(self, res: GenerationResult) -> RequestStats:
        """The finished request's stats: the schedule's, with what the coordinator measured of its replicas (each
        link's network time, queueing, cached prompt positions, the replicas and models, fallback, preemptions)."""
        targets, drafts = self.targets(), self.drafts()
        draft_net = sum(b.network_ns for b in drafts) / 1e9
        target_net = sum(b.network_ns for b in targets) / 1e9
        peer_net = sum(b.peer_network_ns for b in drafts) / 1e9
        return RequestStats.of(
            res.stats, draft_network_s=draft_net, target_network_s=target_net, peer_network_s=peer_net,
            network_s=draft_net + target_net + peer_net,
            draft_model=self.first_draft.model if self.first_draft is not None else "",
            target_model=self.target.model or self.first_target.model,
            queued_s=sum(b.queued_ns for b in targets + drafts) / 1e9,
            prompt_tokens=self.n_prompt, cached_prompt_tokens=self.first_target.cached_tokens,
            completion_tokens=len(res.token_ids),
            draft_replica=",".join(ep for b in drafts for ep in b.served),
            target_replica=",".join(ep for b in targets for ep in b.served),
            draft_unavailable=bool(self.fallback), draft_fallback=self.fallback,
            preemptions=sum(b.preemptions for b in targets + drafts))

    async def end_left(self, session_id: str) -> None:
        """End the sessions still pinned: what a failure before `generate` left (the draft's probe, a cancel during
        it); ending an ended backend does nothing."""
        left = [b for b in (self.first_draft, self.first_target, self.target)
                if b is not None and b.endpoint is not None]
        if left:
            await asyncio.shield(asyncio.gather(*(b.end(session_id) for b in left), return_exceptions=True))


class AsyncPool:
    """Awaitable facade over an in-process PoolManager (the Ray facade lives in actor.py)."""

    def __init__(self, manager):
        self.manager = manager

    async def acquire(self, kind, exclude=(), keys=(), priority=0, holder=""):
        return await self.manager.acquire(kind, list(exclude), list(keys), priority, holder)

    async def release(self, kind, endpoint, holder=""):
        self.manager.release(kind, endpoint, holder)

    async def report_failure(self, kind, endpoint, error=""):
        self.manager.report_failure(kind, endpoint, error)

    async def members(self):
        return self.manager.members()

    async def view(self):
        return self.manager.view()

    async def marked(self, kind, holder):
        return self.manager.marked(kind, holder)


class Pipeline:
    def __init__(self, pool, dialer=None, rpc_timeout_s: float = 60.0, view_refresh_s: float = 0.5,
                 replica_streams: bool = True, affinity_chunk: int = PREFILL_CHUNK, tag: str = "",
                 data_plane: str = "coordinator", chain_window: int = 0, replica_frames: bool = True):
        self.pool = pool  # async acquire/release/report_failure/members (AsyncPool or the Ray facade)
        # the prefix of its requests' holder tokens (a Ray pipeline actor's: coordinator/routing/router.py)
        self.tag = tag
        self.channels = Channels(dialer)  # how replicas are dialed (coordinator/channels.py)
        self.view = PoolView()
        self.rpc_timeout_s, self.view_refresh_s = rpc_timeout_s, view_refresh_s
        self.replica_streams = replica_streams  # per-round calls as stream messages (specdec_rpc/rounds.py)
        self.replica_frames = replica_frames  # ... on the replicas' frame ports where they serve one (frames.py)
        self.affinity_chunk = affinity_chunk  # positions per prefix key: the replicas' prefill chunk (0: no keys)
        self.data_plane = data_plane  # direct / auto: who runs a request's rounds (`_runs_direct`, backends/direct.py)
        # direct, greedy PEARL modes: verifies in flight (specdec/scheduling/chained.py)
        self.chain_window = chain_window
        self._tasks: dict[str, asyncio.Task] = {}
        self._stop: set[str] = set()
        self._cancelled: set[str] = set()  # cancelled requests: the next round's tokens cancel them again
        self._view_task: asyncio.Task | None = None
        self._fallback_warned = float("-inf")

    def _runs_direct(self, req: GenerationRequest) -> bool:
        """Whether the draft replica runs `req`'s rounds (`data_plane`: direct, or auto and a sequential mode): a
        speculative mode without prompt logprobs (those come with the target's session start, which the draft
        replica does not pass on)."""
        wanted = self.data_plane == "direct" or (self.data_plane == "auto" and req.sequential_calls)
        return wanted and req.mode != "ar" and req.params.prompt_logprobs < 0

    async def _refresh_view(self):
        while True:
            with contextlib.suppress(Exception):
                state = await self.pool.view()
                self.view.members, self.view.preempt = state["members"], state["preempt"]
            await asyncio.sleep(self.view_refresh_s)

    def _ensure_view(self):
        if self._view_task is None:
            self._view_task = asyncio.get_running_loop().create_task(self._refresh_view())

    async def stream(self, request: PipelineRequest) -> AsyncIterator[Event]:
        """Run one request (a front door's, typed: specdec.scheduling.request.PipelineRequest); yield events as tokens
        are verified (see module docstring)."""
        self._ensure_view()
        queue: asyncio.Queue = asyncio.Queue()
        # the pipeline's own copy: its unset gamma is filled here (`resolve_defaults`), the caller's stays as sent
        req = dataclasses.replace(request.generation)
        rid = req.session_id
        incremental = not request.final_only  # False: the caller reads only the last event
        # this request's log lines (JSON logs, specdec_rpc/logs.py) name it; its end adds replicas and timings
        log_fields = bind(request_id=rid, session_id=rid)
        # the request span's W3C headers (coordinator/tracing.py); an untraced request has none
        headers = request.trace_headers
        trace = tuple((k, headers[k]) for k in TRACE_HEADERS if headers.get(k)) if headers.get("traceparent") else None

        def on_tokens(new: list[int], logprobs: list | None = None, served: Served | None = None) -> bool:
            """`served`: the replicas the request holds, when they changed (a request that ends without its last
            event, a client's abort, is logged with them)."""
            if rid in self._cancelled:  # a cancel the request's task lost (a callee that swallowed it)
                raise asyncio.CancelledError
            if incremental:
                queue.put_nowait(TokensEvent(list(new), logprobs, served))
            elif served is not None:
                queue.put_nowait(ServedEvent(served))
            return rid in self._stop

        task = asyncio.ensure_future(self._run(req, on_tokens, request.draft_fallback, trace, log_fields,
                                               final_only=not incremental))
        self._tasks[rid] = task
        task.add_done_callback(lambda t: queue.put_nowait(None))
        try:
            while True:
                ev = await queue.get()
                if ev is None:
                    break
                yield ev
            yield ErrorEvent("CANCELLED", "the request was cancelled") if task.cancelled() else task.result()
        finally:
            if not task.done():  # the consumer went away (client cancel / deadline): end both sessions
                self._cancel(rid, task)
                with contextlib.suppress(BaseException):
                    await task
            self._tasks.pop(rid, None)
            self._stop.discard(rid)
            self._cancelled.discard(rid)

    def _backends(self, req: GenerationRequest, output_start: int, reserve: int, with_draft: bool, trace=None):
        """(RemoteTarget, RemoteDraft or None) for `req`, routed by its prompt's prefix
        (coordinator/routing/affinity.py). A replica whose context is too small refuses before any work (`reserve`); a
        session rebuilt from the history holds output too, and the penalties, min_tokens and a grammar count only the
        output (`output_start`). `trace`: the request span's W3C trace headers, sent with every replica call."""
        kw = dict(view=self.view, timeout=self.rpc_timeout_s, streams=self.replica_streams,
                  frames=self.replica_frames and req.sequential_calls)
        target = RemoteTarget(self.pool, self.channels, **kw)
        draft = RemoteDraft(self.pool, self.channels, **kw) if with_draft else None
        keys = prefix_keys(req.prompt_ids, self.affinity_chunk, req.params.cache_salt)
        # one per request: the pools see its two sessions as one request's, and can end them if this pipeline dies
        holder = self.tag + req.session_id
        for backend in (target, draft):
            if backend is not None:
                backend.start_kw.update(reserve_positions=reserve, output_start=output_start)
                backend.prefix_keys, backend.priority, backend.holder = keys, req.priority, holder
                backend.metadata = trace
        if draft is not None:  # preempted, a request gives up both sessions (coordinator/backends/moves.py)
            target.sibling, draft.sibling = draft, target
        return target, draft

    async def _run(self, req: GenerationRequest, on_tokens, draft_fallback: bool = False, trace=None,
                   log_fields: dict | None = None, final_only: bool = False) -> DoneEvent | ErrorEvent:
        """`draft_fallback`: with no draft replica reachable, at the start or mid-request, go on target-only
        instead of failing. `trace`: W3C trace headers for the replica calls; `log_fields`: the request's log
        fields, completed with its replicas and timings when it ends."""
        n_prompt, reserve = len(req.prompt_ids), len(req.prompt_ids) + req.max_new_tokens
        target, draft = self._backends(req, n_prompt, reserve, req.mode != "ar", trace)
        run = _RequestReplicas(target, draft, target, draft, n_prompt, on_tokens, final_only=final_only)
        try:
            res = await self._generate(req, run, draft_fallback, reserve, trace)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to the client as a status
            if not isinstance(e, (SpecDecError, grpc.aio.AioRpcError)):
                log.exception("request %s failed", req.session_id)
            return error_event(e)
        finally:  # generate ends the sessions it started; this releases what a failure before it left pinned
            await run.end_left(req.session_id)
        stats = run.stats(res)
        finish = "stop" if res.finish_reason == "stop" else res.finish_reason
        if log_fields is not None:
            log_fields.update(draft_replica=stats.draft_replica, target_replica=stats.target_replica,
                              timings=_log_timings(stats))
        pl = run.first_target.prompt_logprobs
        return DoneEvent(res.token_ids, finish, stats, res.logprobs,
                         list(zip(pl.logprobs, pl.top_ids, pl.top_logprobs)) if pl is not None else None)

    async def _generate(self, req: GenerationRequest, run: _RequestReplicas, draft_fallback: bool, reserve: int,
                        trace) -> GenerationResult:
        """Validate and generate `req` on `run`'s backends: with its draft replica (on the draft replica's own rounds
        where `_runs_direct`), or target-only where the draft pool is unreachable or too short for it and
        `draft_fallback` allows it (`run.fallback` says why)."""
        req.resolve_defaults()  # its fields were checked at the front door (coordinator/grpc_api/service.py)
        if run.draft is not None:
            req = await self._probe_draft(req, run, draft_fallback)
        draft, target = run.draft, run.target
        try:
            if draft is not None and self._runs_direct(req):
                return await self._direct(req, draft, target, run)
            return await generate(req, draft, target, run.tracking)
        except (ReplicaUnavailableError, DraftContextError) as e:  # the draft pool is gone, or too short for it
            if not (draft_fallback and draft is not None and getattr(e, "kind", "") == "draft"):
                raise
            # the draft pool went away mid-request: the committed tokens stand (the target verified them);
            # a target-only request goes on from them, in a session of its own (the failed one has ended)
            self._warn_fallback(e, req.session_id)
            run.fallback = "context" if isinstance(e, DraftContextError) else "unreachable"

            async def target_only(rest: GenerationRequest) -> GenerationResult:
                run.target, run.draft = self._backends(rest, run.n_prompt, reserve, False, trace)
                return await generate(rest, None, run.target, run.tracking)

            return await go_on(req, list(run.committed), list(run.seen_logprobs), f"{req.session_id}-ar",
                               target_only, mode="ar")

    async def _probe_draft(self, req: GenerationRequest, run: _RequestReplicas,
                           draft_fallback: bool) -> GenerationRequest:
        """Pin `run`'s draft replica before any work. With none reachable and `draft_fallback`, the request goes on
        target-only (ar) from the start. → the request to run."""
        try:
            await run.draft.probe()
        except ReplicaUnavailableError as e:
            if not draft_fallback:
                raise
            self._warn_fallback(e, req.session_id)
            run.draft, run.fallback = None, "unreachable"
            return dataclasses.replace(req, mode="ar")
        return req

    async def _direct(self, req: GenerationRequest, draft: RemoteDraft, target: RemoteTarget,
                      run: _RequestReplicas) -> GenerationResult:
        """The request's rounds on its draft replica (coordinator/backends/direct.py). Interrupted, it goes on from
        the tokens delivered (`run.committed`) with the coordinator's own rounds, on another replica where one
        failed. A caller that reads only the final answer gets the tokens in batches (`REPORT_INTERVAL_MS`)."""
        sid, tracking, committed, seen_logprobs = req.session_id, run.tracking, run.committed, run.seen_logprobs
        try:
            res = await run_direct(req, draft, target, tracking, self.rpc_timeout_s,
                                   self.channels.dialer.server_names.get("target", ""), self.chain_window,
                                   REPORT_INTERVAL_MS if run.final_only else 0)
        except DirectInterrupted as e:
            (log.info if e.preempted else log.warning)(
                "request %s: direct rounds on %s ended (%s: %s); going on from %d tokens with the coordinator's "
                "rounds", sid, draft.endpoint, e.error.code().name, e.error.details(), len(committed))
            if e.preempted:
                await yield_direct(draft, target, sid)
            else:  # the draft replica's target session, if it is left: ended off this path (a gone one is let be)
                end_in_background(target.end_on(target.endpoint, sid))
            if e.failed:
                await (target if e.failed == "target" else draft).replace_replica(e.error)
            return await go_on(req, list(committed), list(seen_logprobs), f"{sid}-resumed",
                               lambda rest: generate(rest, draft, target, tracking))
        await asyncio.gather(draft.unpin(), target.unpin())  # the draft replica ended both sessions
        return res

    def _warn_fallback(self, e: Exception, rid: str) -> None:
        """One warning per 30 s while the draft pool is down (every request would log it)."""
        now = time.monotonic()
        if now - self._fallback_warned >= 30.0:
            self._fallback_warned = now
            if isinstance(e, DraftContextError):  # this request's length, not the pool's health
                log.warning("request %s: %s; it runs target-only (ar) where the target replica holds it "
                            "(COORDINATOR_DRAFT_FALLBACK)", rid, e)
            else:
                log.warning("%s: serving requests target-only (ar) until a draft replica is back "
                            "(COORDINATOR_DRAFT_FALLBACK)", e)

    def stop(self, rid: str) -> None:
        """Finish the request after its current round (a stop string was seen downstream)."""
        if rid in self._tasks:
            self._stop.add(rid)

    def _cancel(self, rid: str, task: asyncio.Task) -> None:
        self._cancelled.add(rid)
        task.cancel()

    def cancel(self, rid: str) -> bool:
        task = self._tasks.get(rid)
        if task is not None and not task.done():
            self._cancel(rid, task)
            return True
        return False

    def active(self) -> int:
        return len(self._tasks)

    async def close(self, wait_s: float = 5.0):
        """Cancel the requests in flight, wait (at most `wait_s`) for them to end their replica sessions, then close
        the channels (closed first, the EndSessions failed and the sessions stayed until their TTL)."""
        tasks = list(self._tasks.values())
        for rid, t in list(self._tasks.items()):
            self._cancel(rid, t)
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)
        await ending(wait_s)
        if self._view_task is not None:
            self._view_task.cancel()
        await self.channels.close()
