"""``python -m specdec_train.distill {features,train-features,export-features}``: the feature draft pipeline.

1. ``features``: the target's final hidden states at every position of the training data (sharded, resumable).
2. ``train-features --run NAME``: warm-start a feature draft from a plain draft and distill it on them.
3. ``export-features --run NAME --out DIR``: a model directory the services load (``load_model_dir``).
See docs/design/feature_draft.md.
"""
from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import sys

import torch
from safetensors.torch import save_file

from specdec.modeling.hub import resolve_model
from specdec.modeling.model import load_model
from specdec_train.distill.data import is_heldout, load_samples, require_samples
from specdec_train.distill.export import TOKENIZER_FILES
from specdec_train.distill.feature_train import (build_feature_draft, feature_agreement, load_features, run_features,
                                                 train_feature_draft)


def _rows_split(feat_dir):
    train, held = [], []
    for r in load_features(feat_dir):
        (held if is_heldout({"prompt_ids": r["ids"][:r["start"]].tolist()}) else train).append(r)
    return train, held


def cmd_features(args):
    torch.set_num_threads(args.threads)
    rows = load_samples(require_samples(args.samples, "--samples"))
    target = load_model(args.target, dtype=args.dtype, role="target")
    run_features(target, rows, pathlib.Path(args.work) / "features")


def _plain_and_head(args):
    target = load_model(args.target, dtype="float32")
    plain = load_model(args.init_draft, dtype="float32")
    if args.init_ckpt:
        plain.load_state_dict(torch.load(args.init_ckpt, weights_only=False)["model"], strict=False)
    if plain.vocab_subset is None:
        raise SystemExit("--init-draft must be a compact-vocabulary draft (docs/design/distillation.md)")
    head = target.lm_head.weight[plain.vocab_subset].detach().to(torch.bfloat16).clone()
    return target, plain, head


def cmd_train_features(args):
    torch.set_num_threads(args.threads)
    target, plain, head = _plain_and_head(args)
    train, held = _rows_split(pathlib.Path(args.work) / "features")
    m = build_feature_draft(plain, target.config.hidden_size, args.feature_scale)
    del target
    run_dir = pathlib.Path(args.work) / "runs" / args.run
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text("python -m specdec_train.distill " + " ".join(map(shlex.quote, sys.argv[1:])) + "\n")
    logf = run_dir / "log.jsonl"

    def log(msg):
        print(msg, flush=True)
        with open(logf, "a") as f:
            f.write(msg + "\n")

    def ev(model):
        a = feature_agreement(model, held, model.to_compact, model.vocab_subset)
        b = feature_agreement(model, held, model.to_compact, model.vocab_subset, withhold=True)
        return {"agreement": round(a["agreement"], 4), "agreement_withheld": round(b["agreement"], 4),
                "positions": a["positions"]}

    res = train_feature_draft(m, head, train, run_dir, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                              drop=args.drop, seed=args.seed, threads=args.threads, eval_fn=ev,
                              eval_every=args.eval_every, time_budget_s=args.time_budget, log=log)
    summary = {"run": args.run, "steps": res["steps"], "train_wall_s": round(res["wall_s"], 1),
               "train_rows": len(train), "heldout_rows": len(held), "heldout": ev(m), "args": vars(args)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log(json.dumps({k: summary[k] for k in ("run", "steps", "train_wall_s", "heldout")}))


def cmd_export_features(args):
    run_dir = pathlib.Path(args.work) / "runs" / args.run
    summary = json.loads((run_dir / "summary.json").read_text())
    for k in ("init_draft", "init_ckpt", "feature_scale"):
        setattr(args, k, summary["args"][k])
    target, plain, _ = _plain_and_head(args)
    m = build_feature_draft(plain, target.config.hidden_size, args.feature_scale)
    m.load_state_dict(torch.load(run_dir / "ckpt.pt", weights_only=False)["model"], strict=False)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = pathlib.Path(resolve_model(args.init_draft))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update({"specdec_feature_size": m.config.feature_size, "specdec_feature_scale": m.config.feature_scale,
                "specdec_weights_dtype": "float16"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file({k: v.detach().half().contiguous() for k, v in m.state_dict().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / cfg["specdec_vocab_subset"], out / cfg["specdec_vocab_subset"])
    tdir = pathlib.Path(resolve_model(args.target))
    for f in TOKENIZER_FILES:
        if (tdir / f).exists():
            shutil.copy(tdir / f, out / f)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"wrote {out}")


def add_parsers(sub) -> None:
    f = sub.add_parser("features", help="the target's hidden states over the training data (sharded, resumable)")
    f.add_argument("--dtype", default="auto", help="the target's dtype; auto = what the target service serves")
    f.set_defaults(fn=cmd_features)

    t = sub.add_parser("train-features", help="distill a feature draft, warm-started from a plain draft")
    t.add_argument("--run", default="feature")
    t.add_argument("--init-draft", default="default-draft", help="the plain compact-vocabulary draft to start from")
    t.add_argument("--init-ckpt", default=None, help="a `train` checkpoint of that draft to load instead")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--drop", type=float, default=0.5, help="probability of withholding a position's feature")
    t.add_argument("--feature-scale", type=float, default=0.0625,
                   help="features are multiplied by this (their rms is ~2, the embeddings' ~0.125)")
    t.add_argument("--time-budget", type=float, default=None)
    t.add_argument("--eval-every", type=int, default=50)
    t.set_defaults(fn=cmd_train_features)

    x = sub.add_parser("export-features", help="write a feature draft directory from a run")
    x.add_argument("--run", default="feature")
    x.add_argument("--out", required=True)
    x.set_defaults(fn=cmd_export_features)
