"""How much a second busy core slows a one-thread decode step on this host (the PEARL question: does drafting
beside a verify cost the verify?).

    python experiments/core_contention.py --repeats 9

Times the served target's decode step (1 thread, 300 cached positions) alone, then while another process decodes
with the draft (or the target: `--neighbour target`) on the other core without pause, alternating alone / beside
per repeat; medians. Memory bandwidth and a shared last-level cache are what two cores share.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics

import torch

from specdec.modeling.model import load_model
from specdec_train.distill.bench import served_per_token_s


def _neighbour(spec: str, role: str, ready, stop) -> None:
    torch.set_num_threads(1)
    m = load_model(spec, dtype="auto", role=role)
    ready.set()
    while not stop.is_set():
        served_per_token_s(m, steps=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--draft", default="default-draft")
    ap.add_argument("--neighbour", choices=["draft", "target"], default="draft")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()

    torch.set_num_threads(1)
    target = load_model(args.target, dtype="auto", role="target")
    spec = args.draft if args.neighbour == "draft" else args.target
    ctx = mp.get_context("spawn")
    alone, beside = [], []
    for _ in range(args.repeats):
        alone.append(served_per_token_s(target, steps=16))
        ready, stop = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_neighbour, args=(spec, args.neighbour, ready, stop), daemon=True)
        p.start()
        if not ready.wait(timeout=120):
            raise SystemExit("the neighbour process did not start")
        beside.append(served_per_token_s(target, steps=16))
        stop.set()
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
    a, b = statistics.median(alone) * 1e3, statistics.median(beside) * 1e3
    print(f"| target decode step, 1 thread | alone | beside a {args.neighbour} decoding on the other core | "
          f"slowdown |\n|---|---|---|---|\n| median of {args.repeats} × 16 tokens | {a:.2f} ms | {b:.2f} ms | "
          f"{b / a - 1:+.1%} |")


if __name__ == "__main__":
    main()
