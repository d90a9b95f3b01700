"""Per-thread torch intra-op thread counts that stick.

`torch.set_num_threads(n)` sets the calling thread's OpenMP team size and a process-wide default. A thread's
*first* parallel op (or `torch.get_num_threads()`) lazily initialises it from that process-wide default, which by
then may be another thread's later setting: a worker thread told "1" that starts computing after another thread
asked for "2" silently runs with 2 (and vice versa). Measured: an `Engine(threads_per_model=1)` created before an
`Engine(threads_per_model=2)` ran its forwards with 2 threads. Forcing the lazy initialisation first makes the
setting stick for that thread.
"""
from __future__ import annotations

import torch


def set_thread_count(n: int) -> None:
    """Pin this thread's torch intra-op thread count to n (n <= 0: leave it as it is)."""
    if n and n > 0:
        torch.get_num_threads()  # the lazy per-thread init, before our setting rather than after it
        torch.set_num_threads(n)
