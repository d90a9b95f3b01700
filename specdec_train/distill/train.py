"""Knowledge distillation of the draft on the target's top-k soft labels (hard next tokens where none yet).

Loss per completion position: cross-entropy of the draft's (compact-vocabulary) distribution against the target's
top-k distribution restricted to the subset and renormalised (= forward KL up to a constant); rows the teacher job
has not reached yet use the target's own sampled/greedy next token (an unbiased sample of the same target). The
soft-label pool is re-read from the teacher's shard directory every ``reload_every`` steps, so training can run
while the teacher job is still writing shards. Checkpoints (model, optimizer, step, RNG) every ``ckpt_every``
steps; a restarted run resumes from ``out_dir/ckpt.pt``.
"""
from __future__ import annotations

import json
import math
import pathlib
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm


class Pool:
    def __init__(self, rows, teacher_dir, to_compact, oov_compact):
        self.hard = [{"ids": torch.tensor(r["prompt_ids"] + r["completion_ids"], dtype=torch.long),
                      "start": len(r["prompt_ids"]), "key": (tuple(r["prompt_ids"]), tuple(r["completion_ids"]))}
                     for r in rows]
        self.teacher_dir = pathlib.Path(teacher_dir) if teacher_dir else None
        self.to_compact, self.oov = to_compact, oov_compact
        self.soft: dict = {}
        self.seen_shards: set = set()

    def reload(self):
        if self.teacher_dir is None or not self.teacher_dir.exists():
            return
        for p in sorted(self.teacher_dir.glob("shard_*.pt")):
            if p.name in self.seen_shards:
                continue
            for r in torch.load(p):
                ids = r["ids"].long()
                key = (tuple(ids[:r["start"]].tolist()), tuple(ids[r["start"]:].tolist()))
                self.soft[key] = r
            self.seen_shards.add(p.name)

    def n_soft(self):
        return sum(1 for h in self.hard if h["key"] in self.soft)


def make_batch(items, pool: Pool, k_soft: int):
    """-> compact input ids [B, L], target token ids [B, L] (-100 = ignore), soft idx/prob [B, L, k], soft mask."""
    B = len(items)
    L = max(len(it["ids"]) for it in items) - 1
    x = torch.zeros(B, L, dtype=torch.long)
    hard = torch.full((B, L), -100, dtype=torch.long)
    sidx = torch.zeros(B, L, k_soft, dtype=torch.long)
    sp = torch.zeros(B, L, k_soft)
    smask = torch.zeros(B, L, dtype=torch.bool)
    for b, it in enumerate(items):
        ids, P = it["ids"], it["start"]
        n = len(ids) - 1
        x[b, :n] = pool.to_compact[ids[:-1]]
        tgt_c = pool.to_compact[ids[P:]]
        in_sub = pool.to_compact[ids[P:]] != pool.oov if pool.oov is not None else torch.ones_like(tgt_c, dtype=torch.bool)
        in_sub |= ids[P:] == 0  # full id 0 is the oov row's own token
        hard[b, P - 1:n] = torch.where(in_sub, tgt_c, torch.full_like(tgt_c, -100))
        r = pool.soft.get(it["key"])
        if r is not None:
            idx = r["idx"][:, :k_soft].long()
            lp = r["logp"][:, :k_soft].float()
            cidx = pool.to_compact[idx]
            ok = (cidx != pool.oov) | (idx == 0)
            p = lp.exp() * ok
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
            C = idx.shape[0]
            sidx[b, P - 1:P - 1 + C] = cidx
            sp[b, P - 1:P - 1 + C] = p
            smask[b, P - 1:P - 1 + C] = True
    return x, hard, sidx, sp, smask


def kd_loss(logits, hard, sidx, sp, smask, top1_weight: float = 0.0):
    """Soft-label cross-entropy (+ `top1_weight` x cross-entropy on the target's top-1 token where it lies in the
    subset: greedy acceptance only needs the argmax right) on soft rows; hard next-token CE on the others."""
    logq = F.log_softmax(logits.float(), dim=-1)
    soft_l = -(logq.gather(-1, sidx) * sp).sum(-1)
    if top1_weight:
        # soft labels are sorted by the target's log-prob; column 0 is the top-1 (p = 0 there when it is outside)
        top1_l = -logq.gather(-1, sidx[..., :1]).squeeze(-1)
        soft_l = soft_l + top1_weight * top1_l * (sp[..., 0] > 0)
    hard_l = F.nll_loss(logq.transpose(1, 2), hard.clamp_min(0), reduction="none")
    hard_valid = (hard >= 0) & ~smask
    tot = (soft_l * smask).sum() + (hard_l * hard_valid).sum()
    n = smask.sum() + hard_valid.sum()
    return tot / n.clamp_min(1), int(smask.sum()), int(hard_valid.sum())


def warm_start(draft, state: dict) -> list[int]:
    """Load a checkpoint's weights into ``draft``, which may be deeper than the checkpoint's model: its extra
    decoder layers (appended after the checkpoint's) get zeroed attention and MLP output projections, so each is
    the identity on the residual stream and the grown draft starts out computing exactly the checkpoint's function.
    Returns the indices of the added layers."""
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"checkpoint has weights the draft lacks (is the draft shallower?): {unexpected[:4]}")
    grown = sorted({int(k.split(".")[2]) for k in missing if k.startswith("model.layers.")})
    other = [k for k in missing if not k.startswith("model.layers.")]
    if other:
        raise ValueError(f"checkpoint lacks non-layer weights: {other[:4]}")
    n_old = len(draft.model.layers) - len(grown)
    if grown != list(range(n_old, len(draft.model.layers))):
        raise ValueError(f"checkpoint is missing layers {grown}, not a tail of the draft's layers")
    with torch.no_grad():
        for i in grown:
            draft.model.layers[i].self_attn.o_proj.weight.zero_()
            draft.model.layers[i].mlp.down_proj.weight.zero_()
    return grown


def draft_optimizer(draft, lr: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9/0.98), weight decay 0.01 on matrices other than the embedding (fused on a GPU)."""
    decay = [p for n, p in draft.named_parameters() if p.ndim >= 2 and "embed" not in n]
    nodecay = [p for n, p in draft.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    fused = {"fused": True} if next(draft.parameters()).device.type == "cuda" else {}
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": nodecay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.98), **fused)


def warmup_cosine(step: int, warmup: int, steps: int) -> float:
    """LR factor: linear warm-up over `warmup` steps, then cosine from 1 to 0.1 at `steps`."""
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps)))


def resume(ck: pathlib.Path, model, opt, rng: random.Random, strict: bool = True):
    """Load a checkpoint written by `save_checkpoint` (model, optimizer, RNGs) → (step, history, wall_s), or None."""
    if not ck.exists():
        return None
    st = torch.load(ck, map_location=next(model.parameters()).device, weights_only=False)
    model.load_state_dict(st["model"], strict=strict)
    opt.load_state_dict(st["opt"])
    rng.setstate(st["rng"])
    torch.set_rng_state(st["torch_rng"].cpu())
    return st["step"], st["history"], st.get("wall_s", 0.0)


def save_checkpoint(ck: pathlib.Path, model, opt, rng: random.Random, step: int, history: list, wall: float) -> None:
    tmp = ck.with_name(ck.name + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "wall_s": wall}, tmp)
    tmp.replace(ck)


def train(draft, rows, teacher_dir, to_compact, oov_compact, out_dir, *, steps: int, batch_size: int = 8,
          lr: float = 1e-3, warmup: int = 20, k_soft: int = 32, seed: int = 0, threads: int = 1,
          ckpt_every: int = 100, reload_every: int = 25, bf16: bool = True, time_budget_s: float | None = None,
          top1_weight: float = 0.0, eval_fn=None, eval_every: int = 0, progress: bool = True, log=print):
    torch.set_num_threads(threads)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = draft_optimizer(draft, lr)
    step, history, wall0 = 0, [], 0.0
    ck = out_dir / "ckpt.pt"
    state = resume(ck, draft, opt, rng)
    if state is not None:
        step, history, wall0 = state
        log(f"resumed from step {step}")
    pool = Pool(rows, teacher_dir, to_compact, oov_compact)
    pool.reload()
    draft.train()
    t0 = time.time()
    bar = tqdm(total=steps, initial=step, desc="distill", disable=not progress, mininterval=10)
    ema = None
    while step < steps:
        if step % reload_every == 0:
            pool.reload()
        items = [pool.hard[rng.randrange(len(pool.hard))] for _ in range(batch_size)]
        x, hard, sidx, sp, smask = make_batch(items, pool, k_soft)
        for g in opt.param_groups:
            g["lr"] = lr * warmup_cosine(step, warmup, steps)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = draft(input_ids=x).logits
        loss, ns, nh = kd_loss(logits, hard, sidx, sp, smask, top1_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", soft=f"{ns}/{ns + nh}", rows_soft=len(pool.soft))
        wall = wall0 + time.time() - t0
        if eval_fn is not None and eval_every and step % eval_every == 0:
            draft.eval(); m = eval_fn(draft); draft.train()
            history.append({"step": step, "wall_s": round(wall, 1), "loss_ema": round(ema, 4), **m})
            log(json.dumps(history[-1]))
        if step % ckpt_every == 0 or step == steps or (time_budget_s and wall > time_budget_s):
            save_checkpoint(ck, draft, opt, rng, step, history, wall)
        if time_budget_s and wall > time_budget_s:
            log(f"time budget reached at step {step}")
            break
    draft.eval()
    return {"steps": step, "history": history, "wall_s": wall0 + time.time() - t0, "soft_rows": len(pool.soft)}
