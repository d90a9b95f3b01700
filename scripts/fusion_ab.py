"""Fused projections (specdec/fusion.py) on vs off: per-token decode cost and verify-forward cost of the served
target and draft, 1 thread, interleaved per repeat, medians.

    python scripts/fusion_ab.py --repeats 11

"off" loads the checkpoint's layout (as SPECDEC_FUSE=0 does); both copies get this host's tuned kernel plans.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec.fusion
from specdec_train.distill.bench import served_per_token_s
from specdec.model import load_model


@torch.inference_mode()
def forward_s(model, rows: int, context: int = 300, reps: int = 8) -> float:
    """Mean wall time of one `rows`-token forward after `context` cached positions (a verify of rows-1 drafts)."""
    kv, slots = model.new_kv_slots(1, context + rows + 1), torch.tensor([0])
    model(torch.randint(0, 1000, (1, context)), torch.arange(context)[None], slots, kv)
    x, pos = torch.randint(0, 1000, (1, rows)), torch.arange(context, context + rows)[None]
    t0 = time.perf_counter()
    for _ in range(reps):
        model(x, pos, slots, kv)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fuse = specdec.fusion.fuse_projections_
    models = {}
    for role, spec in (("target", args.target), ("draft", args.draft)):
        for on in (True, False):
            if not on:
                specdec.fusion.fuse_projections_ = lambda m: 0
            models[(role, on)] = load_model(spec, dtype="auto", role=role)
            specdec.fusion.fuse_projections_ = fuse
    cases = [("decode", 1)] + [("forward", r) for r in (4, 8)]
    t = {(k, c): [] for k in models for c in cases}
    for _ in range(args.repeats):
        for k, m in models.items():
            for c in cases:
                t[(k, c)].append(served_per_token_s(m) if c[0] == "decode" else forward_s(m, c[1]))
    print(f"| model | case | fused ms | split ms | fused / split |  ({args.threads} thread, median of {args.repeats})")
    print("|---|---|---|---|---|")
    for role in ("target", "draft"):
        for c in cases:
            on, off = (statistics.median(t[((role, f), c)]) * 1e3 for f in (True, False))
            print(f"| {role} | {c[0]} {c[1]} row{'s' if c[1] > 1 else ''} | {on:.2f} | {off:.2f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
