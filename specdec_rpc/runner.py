"""One dedicated thread per model: model calls run there, so the event loop keeps serving.

torch releases the GIL inside kernels, so the loop keeps serving health checks and queueing RPCs while
a forward runs. One thread (not a pool) serialises access to the model and its KV slots.

The one exception (`can_run_here`): a single-stream call may run on the event loop's own thread while the model
thread has nothing queued or running. A hand-off to a sleeping thread and back costs 0.2-0.6 ms on a loaded
2-vCPU host; a single stream has nothing to overlap with it. Only the loop
submits work, and it is busy for the whole call, so the model is never driven from two threads at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from concurrent.futures import Future, ThreadPoolExecutor


class ModelThread:
    def __init__(self, name: str, threads: int = 0):
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                        initializer=self._init_thread)
        self._last: Future | None = None  # the latest submission (the one thread runs them in order)

    def _init_thread(self):
        if self._threads:
            from specdec.threads import set_thread_count

            set_thread_count(self._threads)

    async def run(self, fn, *args, **kwargs):
        self._last = self._pool.submit(functools.partial(fn, *args, **kwargs))
        return await asyncio.wrap_future(self._last)

    def can_run_here(self) -> bool:
        """The calling thread may run a model call now: the model thread is idle (nothing queued or still
        running, also after a cancelled await) and both compute with one torch thread (a second OpenMP team in
        the process would cost every parallel region a wake-up; specdec/threads.py)."""
        import torch

        return (self._threads == 1 and (self._last is None or self._last.done())
                and torch.get_num_threads() == 1)

    def post(self, fn, *args, **kwargs) -> None:
        """Queue a call and do not wait for it (clean-up from a cancelled coroutine)."""
        self._last = self._pool.submit(fn, *args, **kwargs)

    def submit(self, fn, *args, **kwargs):
        """Blocking call from a synchronous context (startup, tests)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task (a batcher's loop, the session reaper) and wait until it has stopped."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
