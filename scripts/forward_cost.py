"""Forward cost of a model vs the number of rows it is fed, per dtype, KV-cached, side by side in one process.

    python scripts/forward_cost.py --model default-target --dtypes float32 bfloat16 --rows 1 2 4 8 16
    python scripts/forward_cost.py --dtypes bfloat16 --kernels gemm gemv gemv+packed packed tuned --rows 1 2 4 8 300
    python scripts/forward_cost.py --dtypes bfloat16 --attention native torch --sessions 1 8 --rows 1 4

Why it matters: a verify forwards 1 + (drafted tokens) rows. If that cost grows with the rows, long drafts are
expensive and the best draft length shrinks. Dtypes and row counts are interleaved per repeat (machine drift hits
all alike); medians are printed as a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import settings
from specdec.linear import Linear, padding, set_plan
from specdec.model import load_model

PLANS = {"gemm": ("gemm",) * 4, "gemv": ("gemv", "gemm", "gemm", "gemm"),
         "gemv+packed": ("gemv", "packed", "packed", "packed"), "packed": ("packed",) * 4}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default-target")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=300, help="KV positions already cached")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", nargs="+", default=["tuned"], choices=list(PLANS) + ["tuned", "tuned-unpadded"],
                    help="bf16 linears (specdec/linear.py): gemm = F.linear always; gemv = torch.mv for one row, "
                         "F.linear for more; gemv+packed = gemv, prepacked oneDNN weights for more rows (the "
                         "untuned default); packed = prepacked for every row count; tuned = measured on this host, "
                         "with its row padding; tuned-unpadded = the same kernels without row padding")
    ap.add_argument("--attention", nargs="+", default=["native"], choices=["native", "torch"],
                    help="native = specdec/csrc's decode attention where it runs (the default); torch = the torch "
                         "path (specdec/attention.py, row by row in a batch)")
    ap.add_argument("--sessions", nargs="+", type=int, default=[1],
                    help="sessions per forward (a batched step: each session's rows, contexts 8 positions apart)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {dt: load_model(args.model, dtype=dt) for dt in args.dtypes}
    tuned = {dt: {m: (m.plan, m.pad_to) for m in models[dt].modules() if isinstance(m, Linear)} for dt in args.dtypes}
    n_slots = max(args.sessions)
    kvs = {dt: m.new_kv_slots(n_slots, args.context + 8 * n_slots + max(args.rows) + 1) for dt, m in models.items()}
    variants = [(dt, k, a) for dt in args.dtypes for k in (args.kernels if dt == "bfloat16" else ["gemm"])
                for a in args.attention]
    shapes = [(b, n) for b in args.sessions for n in args.rows]

    def once(variant: tuple[str, str, str], shape: tuple[int, int]) -> float:
        dt, kernel, attention = variant
        b, n = shape
        for m, (plan, pad) in tuned[dt].items():
            m.plan, m.pad_to = plan, pad if kernel == "tuned" else None
        if kernel in PLANS:
            set_plan(models[dt], PLANS[kernel])
        toks = torch.randint(0, 1000, (b, n))
        pos = torch.stack([torch.arange(args.context + 8 * i, args.context + 8 * i + n) for i in range(b)])
        with settings.override(native=attention == "native"):
            t = time.perf_counter()
            models[dt](toks, pos, torch.arange(b), kvs[dt])
            return time.perf_counter() - t

    for dt in args.dtypes:  # fills the cache positions the timed forwards attend to
        for i in range(n_slots):
            ctx = args.context + 8 * i
            models[dt](torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], torch.tensor([i]), kvs[dt])
    for v in variants:  # warm-up
        for shape in shapes:
            once(v, shape)
    times = {(v, shape): [] for v in variants for shape in shapes}
    for _ in range(args.repeats):
        for v in variants:
            for shape in shapes:
                times[(v, shape)].append(once(v, shape))
    for dt, plans in tuned.items():
        if dt == "bfloat16":
            print(f"tuned plans (kernel for 1 / 4 / 8 / more rows): {sorted({p for p, _ in plans.values() if p})}")
            print(f"tuned row padding ((out, in) features: rows 1..8 run as): {padding(models[dt])}\n")
    print(f"model {args.model}, {args.threads} thread(s), context {args.context}, median (min) of {args.repeats} "
          f"(ms)\n")
    print("| dtype | kernels | attention | sessions | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in args.rows)
          + " | cost(8)/cost(1) |")
    print("|---|---|---|---|" + "---|" * (len(args.rows) + 1))
    for v in variants:
        for b in args.sessions:
            med = {n: statistics.median(times[(v, (b, n))]) * 1e3 for n in args.rows}
            low = {n: min(times[(v, (b, n))]) * 1e3 for n in args.rows}
            ratio = f"{med[8] / med[1]:.2f}" if 8 in med and 1 in med else "-"
            print(f"| {v[0]} | {v[1]} | {v[2]} | {b} | " + " | ".join(f"{med[n]:.1f} ({low[n]:.1f})" for n in args.rows)
                  + f" | {ratio} |")


if __name__ == "__main__":
    main()
