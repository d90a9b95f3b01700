"""One dedicated thread per model: every model call runs there, never on the event loop.

torch releases the GIL inside kernels, so the loop keeps serving health checks and queueing RPCs while
a forward runs. One thread (not a pool) serialises access to the model and its KV slots.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor


class ModelThread:
    def __init__(self, name: str, threads: int = 0):
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                        initializer=self._init_thread)

    def _init_thread(self):
        if self._threads:
            from specdec.threads import set_thread_count

            set_thread_count(self._threads)

    async def run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

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
