"""Microbenchmarks behind the per-host kernel plans (specdec/modeling/linear.py) and the decode attention
(specdec/modeling/attention.py).

    python experiments/kernel_micro.py                 # both tables, 1 thread
    python experiments/kernel_micro.py --only linear   # or: attention

Linear: one layer of each of the default target's shapes, bf16 (and the fp32 F.linear for reference), every
kernel `specdec.modeling.linear.Linear` / `specdec.modeling.quant.Int8Linear` can run, 1 / 4 / 8 rows. Attention: one
query and four queries against 40-2,000 cached keys, the fused SDPA kernel vs `specdec.modeling.attention`'s decode
path, with the max error of each against an fp32 reference. Median µs over interleaved repeats; weights stay cache-hot,
so these rank kernels, while `scripts/forward_cost.py` measures whole forwards.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from specdec.modeling.attention import attention
from specdec.modeling.linear import Linear
from specdec.modeling.quant import Int8Linear, int8_supported

SHAPES = [(576, 576, "q, o"), (192, 576, "k, v"), (1536, 576, "gate, up"), (576, 1536, "down"),
          (49152, 576, "target head"), (8192, 576, "draft head (compact)")]


def _median_us(fns: dict, reps: int) -> dict:
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def linear_table(reps: int) -> None:
    print("| shape (out × in) | layer | rows | " + " | ".join(("gemv", "gemm", "packed", "int8", "fp32 F.linear"))
          + " |\n|---|---|---|---|---|---|---|---|")
    for out_f, in_f, what in SHAPES:
        lin = Linear(in_f, out_f, bias=False).to(torch.bfloat16)
        lin.prepack()
        q8 = Int8Linear(nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)) \
            if int8_supported("cpu", torch.bfloat16) else None
        w32 = lin.weight.float()
        for rows in (1, 4, 8):
            x = torch.randn(rows, in_f).to(torch.bfloat16)
            x32 = x.float()
            fns = {k: (lambda k=k: lin.run_kernel(k, x)) for k in lin.kernels(rows)}
            if q8 is not None:
                fns["int8"] = lambda: q8.run_kernel("int8", x)
            fns["fp32"] = lambda: F.linear(x32, w32)
            with torch.inference_mode():
                us = _median_us(fns, reps)
            cells = [f"{us[k]:.1f}" if k in us else "–" for k in ("gemv", "gemm", "packed", "int8", "fp32")]
            print(f"| {out_f} × {in_f} | {what} | {rows} | " + " | ".join(cells) + " |")


def attention_table(reps: int, heads: int = 9, kv_heads: int = 3, head_dim: int = 64) -> None:
    print(f"\n{heads} query heads, {kv_heads} K/V heads, head dim {head_dim}, bf16\n")
    print("| keys | queries | fused SDPA µs | decode path µs | SDPA max err | decode max err |\n"
          "|---|---|---|---|---|---|")
    for n_keys in (40, 320, 1000, 2000):
        for n_q in (1, 4):
            q = torch.randn(1, heads, n_q, head_dim).to(torch.bfloat16)
            k, v = (torch.randn(1, kv_heads, n_keys, head_dim).to(torch.bfloat16) for _ in range(2))
            mask = None if n_q == 1 else (torch.arange(n_keys)[None] <= (n_keys - n_q + torch.arange(n_q))[:, None])
            mask = None if mask is None else mask[None, None]
            gqa = kv_heads != heads
            fused = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # noqa: E731
            ours = lambda: attention(q, k, v, mask)  # noqa: E731
            us = _median_us({"fused": fused, "ours": ours}, reps)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
            err = {name: float((f().float() - ref).abs().max()) for name, f in (("fused", fused), ("ours", ours))}
            note = "" if n_q == 1 else " (fused in both)"
            print(f"| {n_keys} | {n_q}{note} | {us['fused']:.1f} | {us['ours']:.1f} | {err['fused']:.5f} | "
                  f"{err['ours']:.5f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["linear", "attention"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.only in (None, "linear"):
        linear_table(args.repeats)
    if args.only in (None, "attention"):
        attention_table(args.repeats)


if __name__ == "__main__":
    main()
