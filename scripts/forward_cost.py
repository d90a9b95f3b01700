"""Forward cost of a model vs the number of rows it is fed, per dtype, KV-cached, side by side in one process.

    python scripts/forward_cost.py --model default-target --dtypes float32 bfloat16 --rows 1 2 4 8 16

Why it matters: a verify forwards 1 + (drafted tokens) rows. If that cost grows with the rows, long drafts are
expensive and the best draft length shrinks. Dtypes and row counts are interleaved per repeat (machine drift hits
all alike); medians are printed as a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.model import load_model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default-target")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=300, help="KV positions already cached")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {dt: load_model(args.model, dtype=dt) for dt in args.dtypes}
    kvs = {dt: m.new_kv_slots(1, args.context + max(args.rows) + 1) for dt, m in models.items()}
    slots = torch.tensor([0])

    def once(dt: str, n: int) -> float:
        toks = torch.randint(0, 1000, (1, n))
        pos = torch.arange(args.context, args.context + n)[None]
        t = time.perf_counter()
        models[dt](toks, pos, slots, kvs[dt])
        return time.perf_counter() - t

    for dt in args.dtypes:  # warm-up (also fills the cache positions the timed forwards attend to)
        models[dt](torch.randint(0, 1000, (1, args.context)), torch.arange(args.context)[None], slots, kvs[dt])
        for n in args.rows:
            once(dt, n)
    times = {(dt, n): [] for dt in args.dtypes for n in args.rows}
    for _ in range(args.repeats):
        for dt in args.dtypes:
            for n in args.rows:
                times[(dt, n)].append(once(dt, n))
    print(f"model {args.model}, {args.threads} thread(s), context {args.context}, median of {args.repeats} (ms)\n")
    print("| dtype | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in args.rows) + " | cost(8)/cost(1) |")
    print("|---|" + "---|" * (len(args.rows) + 1))
    for dt in args.dtypes:
        med = {n: statistics.median(times[(dt, n)]) * 1e3 for n in args.rows}
        ratio = f"{med[8] / med[1]:.2f}" if 8 in med and 1 in med else "-"
        print(f"| {dt} | " + " | ".join(f"{med[n]:.1f}" for n in args.rows) + f" | {ratio} |")


if __name__ == "__main__":
    main()
