"""Verify batcher: collects Verify calls of different sessions into one `TargetWorker.verify_batch` forward.

Policy
- Continuous batching: while a forward runs, arriving calls queue; when it ends, everything queued (up to
  `max_batch_size`, at most one call per session, FIFO) goes into the next forward.
- When the worker is idle, a call is dispatched at once (straight to the model thread, without waking this
  task) if its session is the only open one: single-stream latency pays nothing for batching. With several open sessions the batcher waits until every open session
  has a call queued or `batch_window_ms` has passed, whichever comes first.
- More than `max_queue` waiting calls → CapacityError (RESOURCE_EXHAUSTED): back off or use another replica.
The forward runs on the model thread; this loop only arranges calls. Results equal unbatched calls (the
worker pads and masks per row).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from specdec.errors import CapacityError


@dataclass
class _Item:
    args: object  # specdec.workers.VerifyArgs
    future: asyncio.Future
    t_enqueue: int = field(default_factory=time.perf_counter_ns)


class VerifyBatcher:
    def __init__(self, worker, runner, open_sessions, window_ms: float = 1.0, max_batch_size: int = 16,
                 max_queue: int = 256, metrics=None):
        """open_sessions(): number of sessions that may send a verify now (the batch is full at that many)."""
        self.worker, self.runner, self.open_sessions = worker, runner, open_sessions
        self.window_s, self.max_batch_size, self.max_queue = window_ms / 1000.0, max_batch_size, max_queue
        self.metrics = metrics
        self._queue: list[_Item] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._busy = False  # a forward dispatched by this batcher is running

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for it in self._queue:
            if not it.future.done():
                it.future.set_exception(CapacityError("the target replica is shutting down; retry on another"))
        self._queue.clear()

    async def submit(self, args):
        """Queue one VerifyArgs; returns (VerifyOutcome, queue_ns). Worker errors are raised here."""
        if len(self._queue) >= self.max_queue:
            raise CapacityError(f"verify queue is full ({self.max_queue} calls waiting); back off and retry, "
                                f"use another target replica, or raise max_queue")
        if not self._queue and not self._busy and self.open_sessions() <= 1:
            return await self._direct(args)  # nobody to batch with: skip the batcher task's wake-up
        item = _Item(args, asyncio.get_running_loop().create_future())
        self._queue.append(item)
        self._depth()
        self._arrived.set()
        out, queue_ns = await item.future
        if isinstance(out, BaseException):
            raise out
        return out, queue_ns

    async def _direct(self, args):
        self._busy = True
        try:
            out = (await self.runner.run(self.worker.verify_batch, [args]))[0]
        finally:
            self._busy = False
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

    def _distinct(self) -> int:
        return len({it.args.session_id for it in self._queue})

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
        loop = asyncio.get_running_loop()
        while True:
            idle = not self._queue  # calls that queued during a forward go out at once, with no window
            if idle:
                self._arrived.clear()
                await self._arrived.wait()
            want = min(self.max_batch_size, max(1, self.open_sessions()))
            if idle and self.window_s > 0 and self._distinct() < want:  # others may be about to call
                deadline = loop.time() + self.window_s
                while self._distinct() < want and (left := deadline - loop.time()) > 0:
                    self._arrived.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._arrived.wait(), left)
            batch = self._take()
            if not batch:
                continue
            t_start = time.perf_counter_ns()
            self._busy = True
            try:
                results = await self.runner.run(self.worker.verify_batch, [it.args for it in batch])
            except Exception as exc:  # noqa: BLE001 - an unexpected failure fails the whole batch
                results = [exc] * len(batch)
            finally:
                self._busy = False
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(batch))
            for it, res in zip(batch, results):
                if not it.future.done():
                    it.future.set_result((res, t_start - it.t_enqueue))
