"""Model threads, and per-thread torch intra-op thread counts that stick.

`ModelThread`: the one thread a model computes on (the replicas and the in-process engine alike).

`torch.set_num_threads(n)` sets the calling thread's OpenMP team size and a process-wide default. A thread's
*first* parallel op (or `torch.get_num_threads()`) lazily initialises it from that process-wide default, which by
then may be another thread's later setting: a worker thread told "1" that starts computing after another thread
asked for "2" silently runs with 2 (and vice versa). Measured: an `Engine(threads_per_model=1)` created before an
`Engine(threads_per_model=2)` ran its forwards with 2 threads. Forcing the lazy initialisation first makes the
setting stick for that thread.

**One multi-threaded team per process.** Every thread that runs a parallel op with n > 1 threads gets its own
OpenMP team of n - 1 workers, and they stay. When a process's OpenMP threads outnumber the cores, libgomp stops
spinning between parallel regions and every region pays a wake-up. Measured on the 2-core AMD host: a 2-thread
`ar` ran at 34-40 tok/s alone and at 13-16 tok/s once a second (idle) 2-thread team existed in the process
(docs/benchmarks.md, "One OpenMP team per process"). So threads that only orchestrate pin themselves to 1
(`orchestrator_threads`), and a process runs its multi-threaded compute on one thread where it can.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools

import torch


def set_thread_count(n: int) -> None:
    """Pin this thread's torch intra-op thread count to n (n <= 0: leave it as it is)."""
    if n and n > 0:
        torch.get_num_threads()  # the lazy per-thread init, before our setting rather than after it
        torch.set_num_threads(n)


def orchestrator_threads() -> None:
    """Pin the calling thread (an event loop, a main thread that only dispatches to model threads) to 1 torch
    thread, so that it never creates an OpenMP team of its own (see the module docstring)."""
    set_thread_count(1)


class ModelThread:
    """One dedicated thread for a model: its calls run there in order, so an event loop keeps serving while a
    forward runs (torch releases the GIL inside kernels), and one thread, not a pool, serialises access to the
    model and its KV slots. `threads`: the torch intra-op thread count it computes with (0: left as it is).

    A caller may run a call on its own thread instead (no hand-off to a sleeping thread and back, 0.2-0.6 ms on
    a loaded 2-vCPU host) while the model thread is `idle`: nothing queued or running, also after a cancelled
    await. Only one thread (an event loop) submits work, and it is busy for the whole of such a call, so the
    model is never driven from two threads at once."""

    def __init__(self, name: str, threads: int = 0):
        self.threads = threads or 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                                           initializer=set_thread_count, initargs=(self.threads,))
        self._last: concurrent.futures.Future | None = None  # the latest submission (the thread runs them in order)

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one-thread executor, for work that must share this thread's OpenMP team (the benchmark's HF baseline
        on a 2-thread engine's thread); calls submitted here bypass `idle`."""
        return self._pool

    def idle(self) -> bool:
        """Nothing queued or running on the model thread."""
        return self._last is None or self._last.done()

    def can_run_here(self) -> bool:
        """The calling thread may run a model call now: the model thread is idle and both compute with one torch
        thread (a second OpenMP team in the process would cost every parallel region a wake-up; module
        docstring)."""
        return self.threads == 1 and self.idle() and torch.get_num_threads() == 1

    def post(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Queue a call and do not wait for it (a producer feeding a queue; clean-up from a cancelled coroutine)."""
        self._last = self._pool.submit(fn, *args, **kwargs)
        return self._last

    async def run(self, fn, *args, **kwargs):
        """A call on the model thread, awaited."""
        return await asyncio.wrap_future(self.post(functools.partial(fn, *args, **kwargs)))

    def submit(self, fn, *args, **kwargs):
        """A call on the model thread, waited for from a synchronous context (startup, tests)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self, wait: bool = True) -> None:
        """Stop the thread; `wait`: until its running call ends (queued ones are dropped either way)."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
