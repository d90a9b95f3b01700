"""Held-out greedy agreement of one or more drafts, per data set (each set's own 5 % split by prompt).

    python experiments/heldout_agreement.py DRAFT_DIR specdec/assets/default_draft
    python experiments/heldout_agreement.py specdec/assets/default_draft --served none int8   # as the service runs it
    python experiments/heldout_agreement.py DRAFT --set online=specdec_train/data/distill_heldout.jsonl.gz --max-rows 300

Sets: the shared data's held-out split, and the online held-out set (`specdec_train/data/distill_heldout.jsonl.gz`: the
target's greedy continuations of the held-out prompts met while generating the shipped draft's training text,
chat templates, self-instructed user turns and code; never trained on). Rows that name their `source` are also
reported per source.

Default: the HF model in float32, all completion positions in one forward. `--served QUANT...`: specdec's own
model as the draft service loads it (dtype auto, the given weight quantization), decoding the completion one token
per forward after a prefill of the prompt: the exact kernels a draft step runs.

Agreement = the draft's top-1 equals the target's greedy token, teacher-forced over the target's own greedy
continuations of the held-out prompts (`specdec_train.distill.evaluate.greedy_agreement`).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from specdec.modeling.model import load_model
from specdec_train.distill.data import load_samples, split
from specdec_train.distill.draft_model import load_draft
from specdec_train.distill.evaluate import greedy_agreement

SETS = {"online": str(Path(__file__).resolve().parents[1] / "specdec_train" / "data" / "distill_heldout.jsonl.gz")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafts", nargs="+")
    ap.add_argument("--set", action="append", help="NAME=PATH (repeatable; default: online)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--served", nargs="+", metavar="QUANT", help="measure specdec's served model per quant mode")
    ap.add_argument("--max-rows", type=int, default=0, help="a seeded sample of at most this many rows per set")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sets = dict(s.split("=", 1) for s in args.set) if args.set else SETS
    variants = [(d, q) for d in args.drafts for q in (args.served or [None])]
    for d, q in variants:
        m = load_draft(d) if q is None else load_model(d, dtype="auto", role="draft", quant=q)
        out = {}
        for name, path in sets.items():
            _, held = split(load_samples([path]), 0.05)
            held = [r for r in held if r["temperature"] == 0]
            if args.max_rows and len(held) > args.max_rows:
                held = random.Random(0).sample(held, args.max_rows)
            measure = (lambda rows: greedy_agreement(m, rows, None, None)) if q is None else \
                (lambda rows: served_agreement(m, rows))
            sources = sorted({r["source"] for r in held if "source" in r})
            if sources:  # each row measured once: per source, then pooled by positions
                per = {src: measure([r for r in held if r.get("source") == src]) for src in sources}
                n = sum(a["positions"] for a in per.values())
                pooled = {"agreement": sum(a["agreement"] * a["positions"] for a in per.values()) / max(n, 1),
                          "positions": n, "rows": sum(a["rows"] for a in per.values())}
                groups = {name: pooled, **{f"{name}/{src}": a for src, a in per.items()}}
            else:
                groups = {name: measure(held)}
            for g, a in groups.items():
                out[g] = {"agreement": round(a["agreement"], 4), "positions": a["positions"], "rows": a["rows"]}
        print(d, f"served quant={q}" if q else "hf fp32", json.dumps(out), flush=True)


def served_agreement(model, rows) -> dict:
    """Greedy agreement with specdec's model: prefill the prompt, then one completion token per forward."""
    rows = [r for r in rows if r["temperature"] == 0]
    hit = n = 0
    slots = torch.tensor([0])
    for r in rows:
        P, comp = len(r["prompt_ids"]), r["completion_ids"]
        kv = model.new_kv_slots(1, P + len(comp) + 1)
        logits, _ = model(torch.tensor([r["prompt_ids"]]), torch.arange(P)[None], slots, kv,
                          logits_rows=slice(-1, None))
        for i, tok in enumerate(comp):
            hit += int(logits[0, -1].argmax()) == tok
            logits, _ = model(torch.tensor([[tok]]), torch.tensor([[P + i]]), slots, kv)
        n += len(comp)
    return {"agreement": hit / max(n, 1), "positions": n, "rows": len(rows)}


if __name__ == "__main__":
    main()
