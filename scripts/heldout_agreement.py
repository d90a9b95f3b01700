"""Held-out greedy agreement of one or more drafts, per data set (each set's own 5 % split by prompt).

    python scripts/heldout_agreement.py /tmp/r4 specdec/assets/default_draft

Agreement = the draft's top-1 equals the target's greedy token, teacher-forced over the target's own greedy
continuations of the held-out prompts (`specdec.distill.evaluate.greedy_agreement`).
"""
from __future__ import annotations

import argparse
import json

import torch

from specdec.distill.data import SHARED_SAMPLES, load_samples, split
from specdec.distill.draft_model import load_draft
from specdec.distill.evaluate import greedy_agreement

SETS = {"shared": str(SHARED_SAMPLES), "gen7": ".cache-distill/gen/gen7.jsonl",
        "code1": ".cache-distill/gen/code1.jsonl"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+")
    ap.add_argument("--set", action="append", help="NAME=PATH (repeatable; default: shared, gen7, code1)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sets = dict(s.split("=", 1) for s in args.set) if args.set else SETS
    for d in args.drafts:
        m = load_draft(d)
        out = {}
        for name, path in sets.items():
            _, held = split(load_samples([path]), 0.05)
            a = greedy_agreement(m, held, None, None)
            out[name] = {"agreement": round(a["agreement"], 4), "positions": a["positions"], "rows": a["rows"]}
        print(d, json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
