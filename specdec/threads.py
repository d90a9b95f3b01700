"""Per-thread torch intra-op thread counts that stick.

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
