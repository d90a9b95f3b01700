"""Greedy headroom of token trees for a draft, teacher-forced on the target's own greedy continuations.

    python experiments/tree_headroom.py specdec/assets/default_draft --shapes 1 1,1,1 2,1,1 4,2,1

For a tree whose depth-d nodes are the draft's top-k_d tokens after each depth-(d-1) node, greedy verification
accepts depth d exactly when the target's greedy token there is among the draft's top-k_d *given the target's own
prefix* (every accepted path is the target's text). So one teacher-forced draft forward over each held-out greedy
continuation gives the exact tokens per verify round (accepted + the target's bonus token) of every tree shape, and
the verify rows it needs (sum over depths of prod k). A chain (1,1,1) is sd with γ = 3. This measures what trees
could gain; it does not time them.
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from specdec_train.distill.data import load_samples, split
from specdec_train.distill.draft_model import load_draft

SETS = {"gen7": ".cache-distill/gen/gen7.jsonl", "code1": ".cache-distill/gen/code1.jsonl"}


@torch.no_grad()
def target_ranks(draft, rows) -> list[torch.Tensor]:
    """Per greedy row: the rank of the target's token in the draft's distribution at each completion position."""
    out = []
    for r in rows:
        if r["temperature"] != 0:
            continue
        ids = torch.tensor(r["prompt_ids"] + r["completion_ids"])
        P, C = len(r["prompt_ids"]), len(r["completion_ids"])
        logits = draft(input_ids=ids[None]).logits[0, P - 1:P - 1 + C].float()
        out.append((logits > logits.gather(-1, ids[P:, None])).sum(-1))
    return out


def tokens_per_round(ranks: list[torch.Tensor], shape: tuple[int, ...]) -> float:
    """Mean (accepted + 1) over rounds starting at every completion position."""
    tot = n = 0
    for rk in ranks:
        hit = torch.stack([torch.cat((rk[d:] < k, torch.zeros(d, dtype=torch.bool))) for d, k in enumerate(shape)])
        run = hit.long().cumprod(0).sum(0)  # consecutive accepted depths from each start
        tot += int(run.sum()) + len(rk)
        n += len(rk)
    return tot / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("draft")
    ap.add_argument("--shapes", nargs="+", default=["1", "1,1", "1,1,1", "1,1,1,1", "2,1,1", "3,1,1", "2,2,1",
                                                     "4,1,1", "4,2,1", "2,2,2", "4,2,2,1"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft = load_draft(args.draft)
    ranks = []
    for path in SETS.values():
        ranks += target_ranks(draft, split(load_samples([path]), 0.05)[1])
    allr = torch.cat(ranks)
    print(json.dumps({"positions": len(allr), "top_k_coverage": {k: round(float((allr < k).float().mean()), 4)
                                                                for k in (1, 2, 3, 4, 8)}}))
    print("| tree (top-k per depth) | verify rows | tokens per round |\n|---|---|---|")
    for s in args.shapes:
        shape = tuple(int(x) for x in s.split(","))
        rows = sum(math.prod(shape[:d + 1]) for d in range(len(shape)))
        print(f"| {s} | {rows} | {tokens_per_round(ranks, shape):.3f} |")


if __name__ == "__main__":
    main()
