"""Verify batcher: collects Verify calls of different sessions into one `TargetWorker.verify_batch` forward.

Policy
- Continuous batching: while a forward runs, arriving calls queue; when it ends, the queued calls (up to
  `max_batch_size`, at most one call per session, FIFO) go into the next forward.
- Phase locking. Sessions that verify in turn would otherwise alternate for ever: A verifies while B drafts,
  then B while A drafts, and every forward holds one session, so the target serialises them. Before a forward
  the batcher therefore waits for the open sessions that are expected back soon: a session's next call is due
  at its last result + its usual gap between a result and its next call (an average it keeps per session). It
  waits until they are all queued or the latest is overdue, and never longer than `batch_window_ms` (a wait
  pays off when it is shorter than the forward it saves). A session not seen yet (a new request) is expected
  within the window; a session idle for more than `idle_s` is not waited for. Once two sessions share a
  forward they get their results at the same time, draft at the same time (the draft replica batches them too)
  and come back together.
- When the worker is idle and only one session is open, a call is dispatched at once, without waking this
  task: single-stream latency pays nothing for batching. With one torch thread per process it runs on the
  event loop's own thread (`ModelThread.can_run_here`): no hand-off to the model thread and back, 0.2-0.6 ms
  a verify on a loaded 2-vCPU host. The loop is busy for that forward; a call that arrives meanwhile queues
  and joins the next forward, as it would have anyway.
- More than `max_queue` waiting calls → CapacityError (RESOURCE_EXHAUSTED): back off or use another replica.
Batched forwards run on the model thread; this loop only arranges calls. Results equal unbatched calls (the
worker pads and masks per row).
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass, field

from specdec.common.errors import CapacityError
from specdec_rpc.aio import within
from specdec_rpc.aio import cancel_and_wait
from specdec_rpc.interceptor import ServiceDraining


@dataclass
class _Item:
    args: object  # specdec.workers.target.VerifyArgs
    future: asyncio.Future
    t_enqueue: int = field(default_factory=time.perf_counter_ns)


class VerifyBatcher:
    def __init__(self, worker, runner, open_sessions, window_ms: float = 100.0, max_batch_size: int = 16,
                 max_queue: int = 256, metrics=None, idle_s: float = 1.0):
        """open_sessions(): {session id: time.monotonic() of its last call} of the sessions that may verify."""
        self.worker, self.runner, self.open_sessions = worker, runner, open_sessions
        self.window_s, self.max_batch_size, self.max_queue = window_ms / 1000.0, max_batch_size, max_queue
        self.metrics, self.idle_s = metrics, idle_s
        self._returned: dict[str, float] = {}  # session id -> when its last result was handed back
        self._gap: dict[str, float] = {}  # session id -> average seconds from a result to its next call
        self._running: set[str] = set()  # sessions in the forward that runs now (empty: the worker is idle)
        self._queue: list[_Item] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for it in self._queue:
            if not it.future.done():
                it.future.set_exception(ServiceDraining("the target replica is shutting down; retry on another"))
        self._queue.clear()

    async def submit(self, args):
        """Queue one VerifyArgs; returns (VerifyOutcome, queue_ns). Worker errors are raised here."""
        if len(self._queue) >= self.max_queue:
            raise CapacityError(f"verify queue is full ({self.max_queue} calls waiting); back off and retry, "
                                f"use another target replica, or raise max_queue")
        self._arrival(args.session_id)
        if not self._queue and not self._running and len(self.open_sessions()) <= 1:
            return await self._direct(args)  # nobody to batch with: skip the batcher task's wake-up
        item = _Item(args, asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._depth()
        self._arrived.set()
        out, queue_ns = await item.future
        if isinstance(out, BaseException):
            raise out
        return out, queue_ns

    def forget(self, session_id: str) -> None:
        """The session ended: never wait for it again."""
        self._returned.pop(session_id, None)
        self._gap.pop(session_id, None)

    def _arrival(self, sid: str) -> None:
        t_out = self._returned.get(sid)
        if t_out is not None:
            gap = time.monotonic() - t_out
            self._gap[sid] = gap if sid not in self._gap else 0.5 * (self._gap[sid] + gap)

    def _expected_until(self, now: float) -> float | None:
        """The latest time an open session with no call queued or running is expected to call (None: none is)."""
        queued = {it.args.session_id for it in self._queue}
        latest = None
        open_sessions = self.open_sessions()
        for sid, last_call in open_sessions.items():
            if sid in queued or sid in self._running:
                continue
            t_out = self._returned.get(sid)
            if now - max(last_call, t_out or 0.0) > self.idle_s:
                continue  # idle: not waited for
            due = math.inf if t_out is None else t_out + 1.25 * self._gap.get(sid, self.window_s) + 0.002
            latest = due if latest is None else max(latest, due)
        return latest

    async def _gather(self) -> None:
        """Wait for sessions expected back soon, at most window_s from now (the moment a forward could start)."""
        if self.window_s <= 0 or not self._queue:
            return
        close = time.monotonic() + self.window_s
        while len(self._queue) < self.max_batch_size:
            now = time.monotonic()
            due = self._expected_until(now)
            left = (min(due, close) - now) if due is not None else 0.0
            if left <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._arrived.wait(), left)

    def _done(self, sids) -> None:
        now = time.monotonic()
        for sid in sids:
            self._returned[sid] = now
        self._running = set()
        open_sessions = self.open_sessions()
        if len(self._returned) > 2 * max(8, len(open_sessions)):  # forget sessions ended elsewhere (TTL, LRU)
            self._returned = {k: v for k, v in self._returned.items() if k in open_sessions}
            self._gap = {k: v for k, v in self._gap.items() if k in open_sessions}

    async def _direct(self, args):
        self._running = {args.session_id}
        try:
            if self.runner.can_run_here():  # no hand-off to the model thread and back (specdec/common/threads.py)
                out = self.worker.verify_batch([args])[0]
            else:
                out = (await self.runner.run(self.worker.verify_batch, [args]))[0]
        finally:
            self._done([args.session_id])
            if self._queue:
                self._arrived.set()
        if self.metrics is not None:
            self.metrics.batch_size.observe(1)
        if isinstance(out, BaseException):
            raise out
        return out, 0

    def _depth(self):
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))

    def _take(self) -> list[_Item]:
        batch, seen, rest = [], set(), []
        for it in self._queue:
            sid = it.args.session_id
            if it.future.cancelled():  # the client went away before its turn
                continue
            if sid in seen or len(batch) >= self.max_batch_size:
                rest.append(it)  # a second call of the same session waits for the next forward
            else:
                seen.add(sid)
                batch.append(it)
        self._queue = rest
        self._depth()
        return batch

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._gather()
            batch = self._take()
            if not batch:
                continue
            t_start = time.perf_counter_ns()
            self._running = {it.args.session_id for it in batch}
            try:
                results = await self.runner.run(self.worker.verify_batch, [it.args for it in batch])
            except Exception as exc:  # noqa: BLE001 - an unexpected failure fails the whole batch
                results = [exc] * len(batch)
            finally:
                self._done(it.args.session_id for it in batch)
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(batch))
            for it, res in zip(batch, results):
                if not it.future.done():
                    it.future.set_result((res, t_start - it.t_enqueue))
