"""Greedy agreement with the target of the draft model alone, of prompt lookup beside it, and of their union.

    python experiments/lookup_agreement.py --set online --rows 200            # held-out text (never trained on)
    python experiments/lookup_agreement.py --set bench --humaneval 16 --chat 16  # the benchmark's own prompts

Teacher-forced over the target's greedy continuations: `online` reads them from the shipped held-out set
(`specdec_train/data/distill_heldout.jsonl.gz`); `bench` decodes them here with the target as served (bf16, 128 new
tokens). At each position: the draft's greedy token as served (int8, one token per forward) and the prompt-lookup
proposal with the length of its match. Prints, per source, the agreement of the draft, of "lookup where its
match has >= N tokens, else the draft" for N = 1..6, and of the oracle union.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from specdec.decoding.lookup import PromptLookup
from specdec.modeling.hub import resolve_model
from specdec.modeling.model import load_model
from specdec.text.tokenizer import load_tokenizer
from specdec_bench.prompts import load_prompt_sets
from specdec_train.distill.data import load_samples

HELDOUT = Path(__file__).resolve().parents[1] / "specdec_train" / "data" / "distill_heldout.jsonl.gz"


def decode(model, ids: list[int], n: int, force: list[int] | None = None) -> tuple[list[int], list[int]]:
    """→ (tokens, the model's greedy token at each position); `force` teacher-forces the tokens."""
    P = len(ids)
    steps = len(force) if force is not None else n
    kv = model.new_kv_slots(1, P + steps + 1)
    slots = torch.tensor([0])
    logits, _ = model(torch.tensor([ids]), torch.arange(P)[None], slots, kv, logits_rows=slice(-1, None))
    out, greedy = [], []
    for i in range(steps):
        g = int(logits[0, -1].argmax())
        greedy.append(g)
        t = g if force is None else force[i]
        out.append(t)
        if force is None and t in (2,):  # the default target's EOS
            break
        logits, _ = model(torch.tensor([[t]]), torch.tensor([[P + i]]), slots, kv)
    return out, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("online", "bench"), default="online")
    ap.add_argument("--rows", type=int, default=200, help="online: a seeded sample of this many greedy rows")
    ap.add_argument("--humaneval", type=int, default=16)
    ap.add_argument("--chat", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    draft = load_model("default-draft", dtype="auto", role="draft", quant="auto")
    rows = []  # (source, prompt ids, completion ids)
    if args.set == "online":
        held = [r for r in load_samples([str(HELDOUT)]) if r["temperature"] == 0]
        for r in random.Random(1).sample(held, min(args.rows, len(held))):
            rows.append((r.get("source", "all"), r["prompt_ids"], r["completion_ids"]))
    else:
        target = load_model("default-target", dtype="auto", role="target")
        tok = load_tokenizer(resolve_model("default-target"))
        for name, n in (("humaneval", args.humaneval), ("chat", args.chat)):
            for p in load_prompt_sets(tok, [name], n) if n else []:
                rows.append((name, p.ids, decode(target, p.ids, 128)[0]))
    lookup = PromptLookup(min_ngram=1, max_ngram=6)
    recs = []  # (source, truth, draft token, lookup token or None, match length)
    for src, ids, comp in rows:
        _, greedy = decode(draft, ids, 0, force=comp)
        for i, t in enumerate(comp):
            got = lookup.propose(ids + comp[:i])
            recs.append((src, t, greedy[i], *(got if got else (None, 0))))
    sources = sorted({r[0] for r in recs})
    rules = {"draft": lambda r: r[2]}
    for k in range(1, 7):
        rules[f"lookup n >= {k}, else draft"] = lambda r, k=k: r[3] if r[4] >= k else r[2]
    rules["union (oracle)"] = lambda r: r[1] if r[1] in (r[2], r[3]) else r[2]
    print(f"| rule | all ({len(recs)} positions) | " + " | ".join(sources) + " |")
    print("|---|---|" + "---|" * len(sources))
    for name, f in rules.items():
        cells = [sum(f(r) == r[1] for r in sub) / len(sub) for sub in
                 [recs] + [[r for r in recs if r[0] == s] for s in sources]]
        print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
