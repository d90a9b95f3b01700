"""Forward cost of a model vs the number of rows it is fed, per dtype, KV-cached, side by side in one process.

    python scripts/forward_cost.py --model default-target --dtypes float32 bfloat16 --rows 1 2 4 8 16
    python scripts/forward_cost.py --dtypes bfloat16 --kernels gemm gemv gemv+packed packed tuned --rows 1 2 4 8 300
    python scripts/forward_cost.py --dtypes bfloat16 --attention native torch --sessions 1 8 --rows 1 4
    SPECDEC_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python scripts/forward_cost.py --dtypes float32 bfloat16 \
        --kernels gemm tuned --bandwidth     # an AVX2-only host emulated; against the memory-bandwidth bound

Why it matters: a verify forwards 1 + (drafted tokens) rows. If that cost grows with the rows, long drafts are
expensive and the best draft length shrinks. Dtypes and row counts are interleaved per repeat (machine drift hits
all alike); medians are printed as a markdown table.

`--bandwidth` also times a STREAM-style copy once per repeat (interleaved with the forwards, so it sees the same
machine load) and prints the bound it sets: the bytes a one-row step must read (every linear weight once, the KV
cache up to the context) over the copy bandwidth, against the measured one-row step and the part of it spent in the
linears' kernels (timed around each `Linear.run_kernel` call: the weights' share of the bytes, without the
attention, norms and per-op dispatch between them).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.common import settings
from specdec.modeling.linear import Linear, padding, set_plan
from specdec.modeling.model import load_model

PLANS = {"gemm": ("gemm",) * 4, "gemv": ("gemv", "gemm", "gemm", "gemm"),
         "gemv+packed": ("gemv", "packed", "packed", "packed"), "packed": ("packed",) * 4,
         "stream": ("stream",) * 4}
COPY_BYTES = 1 << 29  # per array of the copy: well past any cache


def step_bytes(model, context: int) -> int:
    """Bytes a one-row decode step reads at least: every linear weight once (a weight shared by two layers, as a
    tied head, once) and the cached keys and values of `context` positions; the embedding row and norms are noise."""
    weights = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Linear)}
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * context * model.dtype.itemsize
    return sum(weights.values()) + kv


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default-target")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=300, help="KV positions already cached")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", nargs="+", default=["tuned"], choices=list(PLANS) + ["tuned", "tuned-unpadded"],
                    help="bf16 linears (specdec/modeling/linear.py): gemm = F.linear always; gemv = torch.mv for one "
                         "row, F.linear for more; gemv+packed = gemv, prepacked oneDNN weights for more rows (the "
                         "untuned default); packed = prepacked for every row count; tuned = measured on this host, with "
                         "its row padding; tuned-unpadded = the same kernels without row padding")
    ap.add_argument("--attention", nargs="+", default=["native"], choices=["native", "native-ops", "torch"],
                    help="native = specdec/modeling/csrc's decode attention where it runs, and whole decoder layers as "
                         "one native call where every linear streams (the default: `native_layers`); native-ops = the "
                         "same kernels layer by layer between torch ops (`native_layers` off); torch = the torch path "
                         "(specdec/modeling/attention.py, row by row in a batch)")
    ap.add_argument("--sessions", nargs="+", type=int, default=[1],
                    help="sessions per forward (a batched step: each session's rows, contexts 8 positions apart)")
    ap.add_argument("--bandwidth", action="store_true",
                    help="time a STREAM-style copy per repeat and print the bandwidth bound of a one-row step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {dt: load_model(args.model, dtype=dt) for dt in args.dtypes}
    tuned = {dt: {m: (m.plan, m.pad_to) for m in models[dt].modules() if isinstance(m, Linear)} for dt in args.dtypes}
    n_slots = max(args.sessions)
    kvs = {dt: m.new_kv_slots(n_slots, args.context + 8 * n_slots + max(args.rows) + 1) for dt, m in models.items()}
    # fp32 linears run a plan only where tuning gave them one (hosts without native bf16 GEMMs: the streaming kernel)
    fp32_plans = any(p for p, _ in tuned.get("float32", {}).values())
    variants = [(dt, k, a) for dt in args.dtypes
                for k in (args.kernels if dt == "bfloat16" or fp32_plans else ["gemm"]) for a in args.attention]
    shapes = [(b, n) for b in args.sessions for n in args.rows]

    in_linears = [0.0]
    if args.bandwidth:  # time spent in the linears' kernels, per forward
        run_kernel = Linear.run_kernel

        def timed(self, kernel, x2):
            t = time.perf_counter()
            y = run_kernel(self, kernel, x2)
            in_linears[0] += time.perf_counter() - t
            return y

        Linear.run_kernel = timed
    linear_times: dict[tuple, list[float]] = {}

    def once(variant: tuple[str, str, str], shape: tuple[int, int]) -> float:
        dt, kernel, attention = variant
        b, n = shape
        for m, (plan, pad) in tuned[dt].items():
            m.plan, m.pad_to = plan, pad if kernel == "tuned" else None
        if kernel in PLANS and (dt == "bfloat16" or fp32_plans):  # an unplanned fp32 model runs F.linear as served
            set_plan(models[dt], PLANS[kernel])
        toks = torch.randint(0, 1000, (b, n))
        pos = torch.stack([torch.arange(args.context + 8 * i, args.context + 8 * i + n) for i in range(b)])
        with settings.override(native=attention != "torch", native_layers=attention == "native"):
            in_linears[0] = 0.0
            t = time.perf_counter()
            models[dt](toks, pos, torch.arange(b), kvs[dt])
            elapsed = time.perf_counter() - t
            linear_times.setdefault((variant, shape), []).append(in_linears[0])
            return elapsed

    for dt in args.dtypes:  # fills the cache positions the timed forwards attend to
        for i in range(n_slots):
            ctx = args.context + 8 * i
            models[dt](torch.randint(0, 1000, (1, ctx)), torch.arange(ctx)[None], torch.tensor([i]), kvs[dt])
    for v in variants:  # warm-up
        for shape in shapes:
            once(v, shape)
    times = {(v, shape): [] for v in variants for shape in shapes}
    src = torch.ones(COPY_BYTES // 4) if args.bandwidth else None
    dst = torch.empty_like(src) if args.bandwidth else None
    copies = []
    for _ in range(args.repeats):
        if args.bandwidth:
            t = time.perf_counter()
            dst.copy_(src)
            copies.append(2 * COPY_BYTES / (time.perf_counter() - t))  # STREAM counts a copy's read and write
        for v in variants:
            for shape in shapes:
                times[(v, shape)].append(once(v, shape))
    for dt, plans in tuned.items():
        if any(p for p, _ in plans.values()):
            print(f"{dt} tuned plans (kernel for 1 / 4 / 8 / more rows): {sorted({p for p, _ in plans.values() if p})}")
            print(f"{dt} tuned row padding ((out, in) features: rows 1..8 run as): {padding(models[dt])}\n")
    print(f"model {args.model}, {args.threads} thread(s), context {args.context}, median (min) of {args.repeats} "
          f"(ms)\n")
    print("| dtype | kernels | attention | sessions | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in args.rows)
          + " | cost(8)/cost(1) | cost(16)/cost(1) |")
    print("|---|---|---|---|" + "---|" * (len(args.rows) + 2))
    for v in variants:
        for b in args.sessions:
            med = {n: statistics.median(times[(v, (b, n))]) * 1e3 for n in args.rows}
            low = {n: min(times[(v, (b, n))]) * 1e3 for n in args.rows}
            ratio = " | ".join(f"{med[n] / med[1]:.2f}" if n in med and 1 in med else "-" for n in (8, 16))
            print(f"| {v[0]} | {v[1]} | {v[2]} | {b} | " + " | ".join(f"{med[n]:.1f} ({low[n]:.1f})" for n in args.rows)
                  + f" | {ratio} |")
    if args.bandwidth:
        bw = statistics.median(copies)
        print(f"\ncopy bandwidth ({args.threads} thread(s), {COPY_BYTES >> 20} MiB arrays, median (max) of "
              f"{len(copies)}): {bw / 1e9:.1f} ({max(copies) / 1e9:.1f}) GB/s\n")
        print("| dtype | kernels | bytes per one-row step | best one-row time | measured one row | measured / best "
              "| in the linears | their bytes / bandwidth | linears / their best |")
        print("|---|---|---|---|---|---|---|---|---|")
        for v in variants:
            if 1 in args.rows and 1 in args.sessions and v[2] == args.attention[0]:
                need = step_bytes(models[v[0]], args.context)
                weights = step_bytes(models[v[0]], 0)
                one = statistics.median(times[(v, (1, 1))])
                lin = statistics.median(linear_times[(v, (1, 1))][-args.repeats:])
                with settings.override(native=v[2] != "torch", native_layers=v[2] == "native"):
                    once(v, (1, 1))  # the variant's plans, then: do its layers run as native calls?
                    whole = v[2] == "native" and models[v[0]]._native_layers(1, models[v[0]].dtype) is not None
                # native layers run their linears inside one C call per layer: only the head is timed apart
                lin_cells = "- | - | -" if whole else \
                    f"{lin * 1e3:.1f} ms | {weights / bw * 1e3:.1f} ms | {lin / (weights / bw):.2f}"
                print(f"| {v[0]} | {v[1]}{' (native layers)' if whole else ''} | {need / 1e6:.0f} MB | "
                      f"{need / bw * 1e3:.1f} ms | {one * 1e3:.1f} ms | {one / (need / bw):.2f} | {lin_cells} |")


if __name__ == "__main__":
    main()
