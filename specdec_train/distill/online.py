"""Online distillation: the target writes its own training text and teaches the draft in the same step.

Built for a GPU, where the target's forward costs little next to the draft's backward; it runs on a CPU too,
slowly. Everything lives in ``WORK/online/RUN/`` and a rerun resumes:

1. **Prompts.** Three sources, mixed per batch:
   - template x topic chat prompts (`generate.make_prompts`);
   - *self-instructed* user turns: the target samples a user message after the chat template's
     ``<|im_start|>user`` header, so the prompts follow the target's own idea of a request;
   - raw Python stubs (`code_prompts`; no HumanEval prompt or entry point).
2. **Text.** The target's continuations of those prompts (greedy, T=0.7, T=1 in turn), appended to
   ``data.jsonl`` in the rows `generate` writes. Any row whose prompt falls in the held-out split
   (`data.is_heldout`) or is a benchmark prompt is dropped, so held-out measurements stay held out.
3. **Distillation.** Each step runs the target on a batch of rows and trains the draft on the target's *whole*
   distribution restricted to the draft's vocabulary subset (forward KL), over the completion positions. No
   labels are stored: the teacher is recomputed every step.

The draft is written as a model directory (`draft_model.save_draft`) that the services load.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import random
import time

import torch
from safetensors.torch import load_file

from specdec_train.distill.code_prompts import code_prompts
from specdec_train.distill.data import is_heldout
from specdec_train.distill.generate import chat_text, complete, make_prompts, self_instruct
from specdec_train.distill.train import draft_optimizer, resume, save_checkpoint, warmup_cosine


@torch.no_grad()
def make_texts(model, tok, rng: random.Random, n: int, mix: dict[str, float], banned_code: set[str]):
    """n prompts of one source drawn by `mix` -> (source, texts ready for the target)."""
    src = rng.choices(list(mix), weights=list(mix.values()))[0]
    if src == "code":
        return src, code_prompts(rng, n, banned_code)
    users = make_prompts(rng, n) if src == "template" else self_instruct(model, tok, n)
    return src, [chat_text(tok, u) for u in users]


def generate_rows(model, tok, data_path: pathlib.Path, *, seconds: float, batch_size: int, max_new_tokens: int,
                  seed: int, mix: dict[str, float], temperatures: tuple[float, ...], banned_prompts: set,
                  banned_code: set[str], heldout_path: pathlib.Path | None = None, log=print) -> int:
    """Append target continuations to `data_path` for `seconds`; returns the tokens written. Greedy rows whose
    prompt falls in the held-out split go to `heldout_path` (a held-out set of the same text), if given."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t0, n_tok, kept, dropped, i = time.time(), 0, 0, 0, 0
    with open(data_path, "a") as out, (open(heldout_path, "a") if heldout_path else contextlib.nullcontext()) as held:
        while time.time() - t0 < seconds:
            temp = temperatures[i % len(temperatures)]
            i += 1
            src, texts = make_texts(model, tok, rng, batch_size, mix, banned_code)
            if not texts:
                continue
            for row in complete(model, tok, texts, temp, max_new_tokens):
                if tuple(row["prompt_ids"]) in banned_prompts or not row["completion_ids"]:
                    dropped += 1
                    continue
                row["source"] = src
                if is_heldout(row):
                    dropped += 1
                    if held is not None and temp == 0:
                        held.write(json.dumps(row) + "\n")
                    continue
                out.write(json.dumps(row) + "\n")
                kept += 1
                n_tok += len(row["completion_ids"])
            for f in (out, held):
                if f is not None:
                    f.flush()
            if i % 10 == 0:
                log(f"generate: {kept} rows, {n_tok} tokens, {dropped} dropped, {time.time() - t0:.0f} s")
    log(f"generate: done, {kept} rows, {n_tok} tokens, {dropped} dropped (held-out or benchmark prompts)")
    return n_tok


def load_draft_weights(draft, model_dir, layers: tuple[int, ...] | None = None) -> None:
    """Warm start: copy a saved draft directory's weights (`save_draft` format) into `draft`, which must have the
    same width and subset size; a tied head is stored once and stays tied. `layers` picks the saved draft's layers
    that become `draft`'s layers 0, 1, ... (default: all, same depth), e.g. (0, 1, 2) for a shallower draft."""
    state = {k: v.float() for k, v in load_file(str(pathlib.Path(model_dir) / "model.safetensors")).items()}
    if layers is not None:
        src = {f"model.layers.{s}.": f"model.layers.{i}." for i, s in enumerate(layers)}
        picked = {}
        for k, v in state.items():
            if not k.startswith("model.layers."):
                picked[k] = v
                continue
            head = ".".join(k.split(".")[:3]) + "."
            if head in src:
                picked[src[head] + k[len(head):]] = v
        state = picked
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and draft.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{model_dir} does not fit this draft (depth, width or tying differ): "
                         f"missing={missing[:4]} unexpected={unexpected[:4]}")


def batch_tensors(rows, to_compact, device):
    """Right-padded full ids [B, L] and the mask of positions whose next token is a completion token."""
    L = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.bool)
    for b, r in enumerate(rows):
        s = r["prompt_ids"] + r["completion_ids"]
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, len(r["prompt_ids"]) - 1:len(s) - 1] = True
    ids = ids.to(device)
    return ids, to_compact.to(device)[ids], mask.to(device)


def distill_step(draft, target, opt, batch, to_compact, subset, amp: dict, dev, lr: float):
    """One optimizer step of the draft on `batch`: the target's logits recomputed (no grad), the subset KL, clipped
    gradients at learning rate `lr`. → (loss, top-1 agreement), as tensors."""
    ids, cids, mask = batch_tensors(batch, to_compact, dev)
    with torch.no_grad(), torch.autocast(**amp):
        tl = target(input_ids=ids).logits
    with torch.autocast(**amp):
        dl = draft(input_ids=cids).logits
    loss, agree = subset_kl(dl, tl, subset, mask)
    del tl
    optimizer_step(opt, loss, draft, lr)
    return loss, agree


def optimizer_step(opt, loss, model, lr: float) -> None:
    """One step of `opt` on `loss` at learning rate `lr`, gradients clipped to norm 1."""
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def subset_kl(draft_logits, target_logits, subset, mask):
    """Mean over masked positions of KL(p_S || q), p_S = the target's distribution restricted to the subset S and
    renormalised, q = the draft's (which lives on S). Also returns top-1 agreement on those positions (with the
    target's argmax over the *full* vocabulary, as greedy verification uses it)."""
    tl = target_logits[mask].float()
    logp = tl[:, subset].log_softmax(-1)
    logq = draft_logits[mask].float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    agree = (subset[logq.argmax(-1)] == tl.argmax(-1)).float().mean()
    return kl, agree


def distill(target, draft, subset, to_compact, rows, run_dir: pathlib.Path, *, steps: int, batch_size: int,
            lr: float, warmup: int, seed: int, time_budget_s: float | None, eval_fn=None, eval_every: int = 0,
            ckpt_every: int = 200, log=print) -> dict:
    """Forward-KL distillation with the target recomputed every step; checkpoints to `run_dir/ckpt.pt`."""
    dev = next(draft.parameters()).device
    amp = dict(device_type=dev.type, dtype=torch.bfloat16)
    opt = draft_optimizer(draft, lr)
    ck = run_dir / "ckpt.pt"
    step, history, wall0 = 0, [], 0.0
    rng = random.Random(seed)
    state = resume(ck, draft, opt, rng)
    if state is not None:
        step, history, wall0 = state
        log(f"distill: resumed at step {step}")
    subset_d, to_compact_d = subset.to(dev), to_compact.to(dev)  # once, not per step
    t0, ema = time.time(), None
    draft.train()
    while step < steps:
        batch = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        loss, agree = distill_step(draft, target, opt, batch, to_compact_d, subset_d, amp, dev,
                                   lr * warmup_cosine(step, warmup, steps))
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        wall = wall0 + time.time() - t0
        if step % 50 == 0:
            log(f"distill: step {step} kl(ema) {ema:.4f} batch top-1 {agree.item():.3f} {wall:.0f} s")
        if eval_fn is not None and eval_every and (step % eval_every == 0 or step == steps):
            draft.eval()
            m = eval_fn(draft)
            draft.train()
            history.append({"step": step, "wall_s": round(wall, 1), "kl_ema": round(ema, 4), **m})
            log("distill: " + json.dumps(history[-1]))
        if step % ckpt_every == 0 or step == steps or (time_budget_s and wall > time_budget_s):
            save_checkpoint(ck, draft, opt, rng, step, history, wall)
        if time_budget_s and wall > time_budget_s:
            log(f"distill: time budget reached at step {step}")
            break
    draft.eval()
    return {"steps": step, "history": history, "wall_s": round(wall0 + time.time() - t0, 1)}
