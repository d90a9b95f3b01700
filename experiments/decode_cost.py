"""Per-token decode cost of the draft vs the target, as the services run them: specdec's own model, one KV-cached
single-token forward (head included) after `--context` cached positions, 1 thread, side by side in one process.

    python experiments/decode_cost.py --dtypes auto float32 --repeats 15
    python experiments/decode_cost.py --dtypes auto --draft-quants none int8 --repeats 15   # int8 draft weights
    python experiments/decode_cost.py --dtypes auto --draft default-draft DRAFT_DIR --repeats 15  # several drafts

A feature draft (`specdec_feature_size` in its config, docs/design/feature_draft.md) is timed as it drafts inside a
block: each step's input feature is a zero row, sent as the wire sends features (bf16); its `fc` runs as for any
feature, so the cost is the same as with the target's features.

A draft with a compact vocabulary head is timed twice: returning its head's logits (what greedy drafting runs) and
the full-vocabulary row (what sampled drafting runs).

Draft and target and the dtypes are interleaved per repeat (machine drift hits all alike); each repeat times
`--steps` consecutive tokens; medians over repeats and the draft/target ratio per dtype are printed as markdown.
`auto` is what `--dtype auto` serves on this machine (specdec.modeling.dtypes.auto_dtype).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from specdec.modeling.dtypes import resolve_dtype
from specdec.modeling.model import load_model
from specdec.modeling.quant import weight_quant
from specdec_train.distill.bench import served_per_token_s


class FeatureFed:
    """A feature draft whose forwards get a zero feature row per input token unless given features."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, tokens, *args, **kw):
        if kw.get("features") is None:
            kw["features"] = torch.zeros(*tokens.shape, self.model.config.feature_size, dtype=torch.bfloat16)
        return self.model(tokens, *args, **kw)


def served(model):
    return FeatureFed(model) if getattr(model.config, "feature_size", 0) else model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--draft", nargs="+", default=["default-draft"])
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-quants", nargs="+", default=["auto"],
                    help="draft weight quantization(s) to compare (auto: what the draft service serves)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {("target", "", dt, "none"): load_model(args.target, dtype=resolve_dtype(dt, "cpu", "target"),
                                                     role="target", quant="none") for dt in args.dtypes}
    for name in args.draft:
        for dt in args.dtypes:
            for qu in args.draft_quants:
                ddt = resolve_dtype(dt, "cpu", "draft")
                if qu == "int8" and ddt != torch.bfloat16:
                    continue  # int8 weights need bf16 activations (specdec.modeling.quant)
                models[("draft", name, dt, qu)] = served(load_model(name, dtype=ddt, role="draft", quant=qu))
    runs = [(k, False) for k in models] + [(k, True) for k, m in models.items()
                                           if getattr(m, "vocab_subset", None) is not None]
    times = {r: [] for r in runs}
    for _ in range(args.repeats):
        for k, compact in runs:
            times[(k, compact)].append(served_per_token_s(models[k], context=args.context, steps=args.steps,
                                                          compact=compact))
    print(f"| draft | dtype (served as) | draft weights | logits | draft ms/token | target ms/token | draft / target |  "
          f"({args.threads} thread, {args.context} cached positions, median of {args.repeats} × {args.steps} tokens)")
    print("|---|---|---|---|---|---|---|")
    for (k, compact) in runs:
        role, name, dt, qu = k
        if role != "draft":
            continue
        d = statistics.median(times[(k, compact)]) * 1e3
        if getattr(models[k].config, "feature_size", 0):
            name = f"{name} (feature draft, {models[k].config.num_hidden_layers} layer)"
        t = statistics.median(times[(("target", "", dt, "none"), False)]) * 1e3
        shown = f"{dt} ({str(models[('target', '', dt, 'none')].dtype).removeprefix('torch.')})"
        logits = "compact head (greedy drafting)" if compact else "full row"
        print(f"| {name} | {shown} | {qu}: {weight_quant(models[k])} | {logits} | {d:.2f} | {t:.2f} | {d / t:.3f} |")


if __name__ == "__main__":
    main()
