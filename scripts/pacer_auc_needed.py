"""How good would a PACER stop rule have to be? (docs/pacer.md, "Session 15")

    python scripts/pacer_auc_needed.py --data .cache-pacer/bench_diag/rounds_bench_w0.pt

Replays greedy decoding exactly (label files from `python -m specdec_train.preverifier collect --walk-gamma 0`) with
synthetic stop rules: per token, score = sigmoid(a * (2 * label - 1) + N(0, 1)), so `a` sets how much the rule
knows. Each pays `--call-ms` per call; θ is the best on the same rounds (the most favourable case). Prints the
AUC on reached blocks and the gain over the best fixed γ for each a, next to the free perfect rule's.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from specdec_train.preverifier import data as D
from specdec_train.preverifier import train as T


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", required=True, help="label files collected with --walk-gamma 0")
    ap.add_argument("--split", default="all", choices=["all", "train", "dev", "test"])
    ap.add_argument("--knowledge", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0], help="values of a")
    ap.add_argument("--draft-ms", type=float, default=1.27)
    ap.add_argument("--verify-ms", type=float, default=17.26, help="target verify forward, base")
    ap.add_argument("--verify-row-ms", type=float, default=0.71, help="target verify, per drafted row")
    ap.add_argument("--call-ms", type=float, default=0.40, help="one pre-verifier call in the drafting loop")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    rounds, _ = D.load_rounds(args.data)
    rounds = [r for r in rounds if r["temperature"] == 0 and args.split in ("all", r.get("split"))]
    lab = torch.stack([r["label"].float() for r in rounds])
    greedy = torch.ones(len(rounds), dtype=torch.bool)
    base = T.attach_starts(T.RoundTable(torch.zeros_like(lab), lab, greedy), rounds)
    if not base.exact:
        raise SystemExit("these rounds are not at every position of their texts: collect them with --walk-gamma 0")
    costs = T.Costs(args.draft_ms / 1e3, args.verify_ms / 1e3, args.verify_row_ms / 1e3, args.call_ms / 1e3)
    fixed = max(T.simulate(base, costs, None, None, g)["tokens_per_s"] for g in (1, 2, 3, 4, 6, 8))
    oracle = T.replay(base, costs, None, None, lab.shape[1], oracle=True)["tokens_per_s"]
    print(f"{len(rounds)} rounds; the free perfect rule: x{oracle / fixed:.3f} the best fixed gamma")
    print("| a | AUC (reached blocks) | best θ | x best fixed γ |\n|---|---|---|---|")
    for a in args.knowledge:
        z = a * (2 * lab - 1) + torch.randn_like(lab)
        tab = T.RoundTable(F.logsigmoid(z), lab, greedy, base.starts)
        score, label, reached = T.block_scores(tab, 1)
        theta, best = T.tune_threshold(tab, costs, 1, lab.shape[1], "block")
        print(f"| {a:g} | {T.weighted_auc(score, label, reached):.3f} | {theta:.2f} | "
              f"{best['tokens_per_s'] / fixed:.3f} |")


if __name__ == "__main__":
    main()
