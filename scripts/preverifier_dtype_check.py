"""Shipped pre-verifier scores with the draft served in fp32, bf16 and bf16 with int8 weights (specdec.quant),
against bf16 (what its labels were collected with), on the same 180 contexts of fresh greedy target text
(.cache-pacer/fresh/gen_g.jsonl, made by `distill generate --exclude-samples`).

    python scripts/preverifier_dtype_check.py
"""
import json, random, torch
torch.set_num_threads(1)
from specdec.model import load_model
from specdec.preverifier import load_preverifier
from specdec.engine import make_stop_rule
from specdec.stop import StopSpec
from specdec.workers import DraftWorker
from specdec.sampling import SamplingParams
rows = [json.loads(l) for l in open(".cache-pacer/fresh/gen_g.jsonl")]
rng = random.Random(0)
ctxs = []
for r in rng.sample(rows, 60):
    full = r["prompt_ids"] + r["completion_ids"]
    for _ in range(3):
        cut = rng.randrange(len(r["prompt_ids"]) + 1, len(full))
        ctxs.append(full[:cut])
scores = {}
VARIANTS = {"fp32": (torch.float32, "none"), "bf16": (torch.bfloat16, "none"), "bf16+int8": (torch.bfloat16, "int8")}
for name, (dt, quant) in VARIANTS.items():
    m = load_model("default-draft", dtype=dt, role="draft", quant=quant)
    pv = load_preverifier(None, draft_model=m)
    w = DraftWorker(m, preverifier=pv, max_sessions=1, max_context=2048)
    out = []
    for i, c in enumerate(ctxs):
        w.start_session("s", c, SamplingParams())
        stop = make_stop_rule(StopSpec("pacer", None), pv)
        b = list(w.draft_blocks("s", len(c) - 1, c[-1:], 2, stop, 1))
        out.append((b[0].tokens[0], b[0].score))
        w.end_session("s")
    scores[name] = out
th = pv.threshold
for name in ("fp32", "bf16+int8"):
    a, b = scores[name], scores["bf16"]
    same_tok = sum(x[0] == y[0] for x, y in zip(a, b))
    pairs = [(x[1], y[1]) for x, y in zip(a, b) if x[0] == y[0] and x[1] is not None]
    dec = sum((x < th) == (y < th) for x, y in pairs)
    diff = sorted(abs(x - y) for x, y in pairs)
    print(f"{name} vs bf16: contexts {len(ctxs)}, same first token {same_tok}, same stop decision (theta {th:.2f}) "
          f"{dec}/{len(pairs)}, |score diff| median {diff[len(diff)//2]:.4f} max {diff[-1]:.4f}")
