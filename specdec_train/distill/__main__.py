"""``python -m specdec_train.distill {generate,teacher,train,evaluate,export,all}`` (plain drafts,
docs/design/distillation.md) and ``{features,train-features,export-features}`` (feature drafts,
docs/design/feature_draft.md)."""
from __future__ import annotations

import argparse
import json
import pathlib
import shlex
import sys

import torch
from transformers import AutoModelForCausalLM

from specdec.modeling.hub import resolve_model
from specdec.modeling.model import load_model
from specdec_train.distill.bench import cost_ratio, served_cost_ratio
from specdec_train.distill.data import load_samples, require_samples
from specdec_train.distill.draft_model import load_draft
from specdec_train.distill.evaluate import greedy_agreement
from specdec_train.distill.export import export
from specdec_train.distill.feature_cli import add_parsers
from specdec_train.distill.generate import generate
from specdec_train.distill.online_cli import add_parser as add_online
from specdec_train.distill.setup import load_split, log_line, setup_draft
from specdec_train.distill.teacher import run_teacher
from specdec_train.distill.train import train, warm_start

DEFAULT_WORK = pathlib.Path(".cache-distill")


def _target(args):
    d = resolve_model(args.target)
    return d, AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def cmd_generate(args):
    torch.set_num_threads(args.threads)

    exclude = None
    if args.exclude_samples:
        exclude = {tuple(r["prompt_ids"]) for r in load_samples(args.exclude_samples)}
    generate(resolve_model(args.target), args.out, seconds=args.seconds, seed=args.seed,
             batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
             exclude_prompt_ids=exclude, temperatures=tuple(float(t) for t in args.temperatures.split(",")),
             style=args.style)


def cmd_teacher(args):
    train_rows, _ = load_split(args)
    run_teacher(resolve_model(args.target), train_rows, pathlib.Path(args.work) / "teacher", k=args.k,
                seed=args.seed, threads=args.threads, max_shards=args.max_shards, dtype=args.dtype)


def cmd_train(args):
    torch.set_num_threads(args.threads)
    train_rows, held = load_split(args)
    tdir, target = _target(args)
    draft, subset, oov, to_compact = setup_draft(args, train_rows, target)
    del target
    run_dir = pathlib.Path(args.work) / "runs" / args.run
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.init_from and not (run_dir / "ckpt.pt").exists():  # warm start (weights only; fresh optimizer)
        grown = warm_start(draft, torch.load(args.init_from, weights_only=False)["model"])
        log_line(f"initialised from {args.init_from}" + (f"; new identity layers {grown}" if grown else ""),
                 run_dir / "log.jsonl")
    logf = run_dir / "log.jsonl"
    (run_dir / "command.txt").write_text("python -m specdec_train.distill " + " ".join(map(shlex.quote, sys.argv[1:])) + "\n")
    eval_fn = lambda m: greedy_agreement(m, held, subset, to_compact)
    res = train(draft, train_rows, pathlib.Path(args.work) / "teacher" if not args.hard_only else None,
                to_compact, oov, run_dir, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                k_soft=args.k, seed=args.seed, threads=args.threads, bf16=not args.fp32,
                time_budget_s=args.time_budget, top1_weight=args.top1_weight, eval_fn=eval_fn,
                eval_every=args.eval_every,
                log=lambda m: log_line(m, logf))
    final = greedy_agreement(draft, held, subset, to_compact)
    summary = {"run": args.run, "steps": res["steps"], "train_wall_s": round(res["wall_s"], 1),
               "soft_label_rows": res["soft_rows"], "train_rows": len(train_rows), "heldout": final,
               "args": vars(args)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    log_line(json.dumps({k: summary[k] for k in ("run", "steps", "train_wall_s", "heldout")}), logf)


def cmd_evaluate(args):
    _, held = load_split(args)
    _, target = _target(args)
    draft = load_draft(args.draft)
    agree = greedy_agreement(draft, held, None, None)
    cost = cost_ratio(draft, target, threads=1, rounds=args.rounds, repeats=args.repeats, steps=args.decode_steps)
    del target
    # the same pair as the services run it: specdec's models, dtype auto, the draft's int8 weights where they pay

    served = served_cost_ratio(load_model(args.draft, dtype="auto", role="draft"),
                               load_model(resolve_model(args.target), dtype="auto", role="target"),
                               rounds=args.rounds * args.repeats)
    out = {"agreement": agree, "cost": cost, "served_cost": served}
    print(json.dumps(out, indent=2))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=2))


def cmd_export(args):
    export(args)


def cmd_all(args):
    """The whole plain-draft pipeline in one command (each step is the documented subcommand; finished steps are
    skipped on a rerun): fresh chat and raw-code text, the teacher's soft labels, training from the target's
    layers, then the model directory and its measured card."""
    work = pathlib.Path(args.work)
    glob = ["--target", args.target, "--work", args.work, "--threads", str(args.threads), "--seed", str(args.seed)]
    samples = require_samples(args.samples, "--samples") if args.samples else []
    for style, seconds in (("chat", args.gen_seconds), ("code", args.code_seconds)):
        path = work / "gen" / f"{style}.jsonl"
        if seconds > 0 and not path.exists():
            main(glob + ["generate", "--style", style, "--out", str(path), "--seconds", str(seconds)])
        if path.exists():
            samples.append(str(path))
    if not samples:
        raise SystemExit("no training data: pass --samples or let `all` generate some (--gen-seconds > 0)")
    data = [x for f in samples for x in ("--samples", f)]
    main(glob + data + ["teacher"])
    run = work / "runs" / args.run
    if not (run / "summary.json").exists():
        main(glob + data + ["train", "--run", args.run, "--steps", str(args.steps), "--eval-every", "200"])
    metrics = run / "metrics.json"
    main(glob + data + ["export", "--run", args.run, "--out", args.out])
    main(glob + data + ["evaluate", "--draft", args.out, "--out", str(metrics)])
    main(glob + data + ["export", "--run", args.run, "--out", args.out, "--metrics", str(metrics)])  # card + metrics


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m specdec_train.distill", description=__doc__)
    ap.add_argument("--target", default="default-target")
    ap.add_argument("--samples", action="append", help="JSONL(.gz) of target continuations (repeatable); "
                    "no default: `all` can generate its own")
    ap.add_argument("--work", default=str(DEFAULT_WORK))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heldout-frac", type=float, default=0.05)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="write target continuations for the built-in prompt set")
    g.add_argument("--out", required=True)
    g.add_argument("--seconds", type=float, default=600)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--max-new-tokens", type=int, default=192)
    g.add_argument("--dtype", default="auto", help="the target's dtype; auto = what the target service serves")
    g.add_argument("--exclude-samples", action="append", default=[],
                   help="JSONL(.gz) whose prompts are skipped (repeatable): fresh text for pre-verifier labels")
    g.add_argument("--temperatures", default="0,0.7,1", help="cycled per batch")
    g.add_argument("--style", choices=["chat", "self", "code", "chatcode"], default="chat",
                   help="chat: chat-templated templates x topics; self: user turns sampled from the target; "
                   "code: raw Python stubs (no HumanEval prompt); chatcode: the same stubs asked for in a chat turn")
    g.set_defaults(fn=cmd_generate)

    t = sub.add_parser("teacher", help="top-k soft labels (sharded, resumable)")
    t.add_argument("--k", type=int, default=32)
    t.add_argument("--max-shards", type=int, default=None)
    t.add_argument("--dtype", default="auto",
                   help="the target's dtype; auto = what the target service serves (bf16 on CPUs with native bf16)")
    t.set_defaults(fn=cmd_teacher)

    tr = sub.add_parser("train", help="distill the draft (resumable)")
    tr.add_argument("--run", default="default")
    tr.add_argument("--steps", type=int, default=280)
    tr.add_argument("--batch-size", type=int, default=8)
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--k", type=int, default=32)
    tr.add_argument("--vocab-subset", type=int, default=8192)
    tr.add_argument("--init-layers", default="0,1", help="target layers copied into the draft (its depth); with --init-from a deeper draft keeps the "
                         "checkpoint's layers and adds the rest as identity layers (zeroed output projections)")
    tr.add_argument("--no-copy-layers", action="store_true")
    tr.add_argument("--final-norm-scale", type=float, default=0.1, help="multiply the copied final norm weight")
    tr.add_argument("--random-init", action="store_true", help="ablation: no initialisation from the target")
    tr.add_argument("--hard-only", action="store_true", help="ablation: ignore soft labels")
    tr.add_argument("--fp32", action="store_true")
    tr.add_argument("--top1-weight", type=float, default=0.0,
                    help="add this x cross-entropy on the target's top-1 token (greedy acceptance needs the argmax)")
    tr.add_argument("--time-budget", type=float, default=None, help="stop after this many training seconds")
    tr.add_argument("--eval-every", type=int, default=50)
    tr.add_argument("--init-from", default=None, help="warm start from this checkpoint's weights (e.g. "
                    "runs/r4/ckpt.pt); pair it with --subset-samples so the vocabulary subset matches")
    tr.add_argument("--subset-samples", action="append", default=None,
                    help="compute the frequency-ranked vocabulary subset from these samples only (repeatable)")
    tr.set_defaults(fn=cmd_train)

    e = sub.add_parser("evaluate", help="held-out agreement + per-token cost ratio at 1 thread")
    e.add_argument("--draft", required=True)
    e.add_argument("--rounds", type=int, default=3, help="interleaved draft/target rounds")
    e.add_argument("--repeats", type=int, default=5, help="repeats per round (median)")
    e.add_argument("--decode-steps", type=int, default=32, help="KV-cached single-token steps per repeat")
    e.add_argument("--out")
    e.set_defaults(fn=cmd_evaluate)

    x = sub.add_parser("export", help="write the HF draft dir + model card from a run")
    x.add_argument("--run", default="default")
    x.add_argument("--out", required=True)
    x.add_argument("--metrics", help="JSON written by `evaluate`")
    x.set_defaults(fn=cmd_export)

    al = sub.add_parser("all", help="generate -> teacher -> train -> export + evaluate, resumable")
    al.add_argument("--run", default="all")
    al.add_argument("--steps", type=int, default=3000)
    al.add_argument("--gen-seconds", type=float, default=1800, help="fresh chat text (0: none)")
    al.add_argument("--code-seconds", type=float, default=900, help="raw code completions (0: none)")
    al.add_argument("--out", default=str(DEFAULT_WORK / "draft"), help="e.g. specdec/assets/default_draft")
    al.set_defaults(fn=cmd_all)

    add_parsers(sub)
    add_online(sub)
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
