"""What a thread hand-off costs on this machine: an asyncio event loop hands a job to a worker thread
(`run_in_executor`, what `specdec.engine` and the model servers do for every model call) and waits for it.

    python scripts/handoff_latency.py --repeats 50

The job spins for a fixed time (0, 2 and 20 ms: nothing, a draft token, a target forward) so the measured
overhead is the round trip alone: waking the worker, and waking the loop when the job is done. Between jobs
both threads sleep 2 ms, as they do between a round's calls. Prints the median and 90th percentile per job
length. On a virtualised CPU a thread that slept long wakes slowly: that is what running `ar` / `sd` / `pacer`
calls inline saves (docs/benchmarks.md, "Thread hand-offs").
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time


def spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


async def measure(job_ms: float, repeats: int, pool) -> list[float]:
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await loop.run_in_executor(pool, spin, job_ms / 1e3)
        out.append((time.perf_counter() - t0) * 1e3 - job_ms)
        time.sleep(0.002)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--job-ms", type=float, nargs="+", default=[0.0, 2.0, 20.0])
    args = ap.parse_args(argv)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    print("| job | hand-off overhead, median | 90th percentile |\n|---|---|---|")
    for ms in args.job_ms:
        lat = sorted(asyncio.run(measure(ms, args.repeats, pool)))
        print(f"| {ms:g} ms | {statistics.median(lat) * 1e3:.0f} µs | {lat[int(0.9 * len(lat))] * 1e3:.0f} µs |")
    pool.shutdown()


if __name__ == "__main__":
    main()
