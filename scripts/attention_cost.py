"""The native decode attention's cost per query-row count: one sequence of the default target's attention shape
(9 query heads sharing 3 K/V heads of 64, bf16), 300 cached positions, one call per layer for 30 layers, as a
forward of that many rows pays it (the ctypes call included).

    python scripts/attention_cost.py                      # this host's build
    SPECDEC_ISA=avx2 python scripts/attention_cost.py     # as built for an AVX2-only host

docs/benchmarks.md, "Native decode attention"."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.modeling import native


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args(argv)
    if not native.available():
        raise SystemExit("the native kernels do not run here (no C compiler, or SPECDEC_NATIVE=0)")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    max_len = args.context + max(args.rows) + 8
    k = torch.randn(1, max_len, 3, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, max_len, 3, 64, generator=gen).to(torch.bfloat16)
    slots = torch.zeros(1, dtype=torch.long)
    calls = {}
    for rows in args.rows:
        q = torch.randn(1, rows, 9, 64, generator=gen).to(torch.bfloat16)
        calls[rows] = (q, torch.arange(args.context + 1, args.context + 1 + rows)[None].contiguous())
    times: dict[int, list[float]] = {rows: [] for rows in args.rows}
    for _ in range(args.repeats):  # row counts interleaved per repeat, so drift hits them alike
        for rows, (q, visible) in calls.items():
            t = time.perf_counter()
            for _layer in range(30):
                native.decode_attention(q, k, v, slots, visible)
            times[rows].append(time.perf_counter() - t)
    print(f"| rows | 30 layers' attention, {args.context} cached positions: median (min) ms |")
    print("|---|---|")
    for rows, ts in times.items():
        print(f"| {rows} | {statistics.median(ts) * 1e3:.2f} ({min(ts) * 1e3:.2f}) |")


if __name__ == "__main__":
    main()
