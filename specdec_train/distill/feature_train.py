"""Distilling a feature draft (EAGLE-style): one decoder layer that reads the target's own final hidden states.

The draft's input at position t is ``fc([embed(x_t); f_{t-1}])`` where ``f_{t-1}`` is the target's final (post-norm)
hidden state at t-1 (the feature that predicted x_t), or zeros where it is not known: at t = 0, and inside a
drafted block, whose tokens the target has not seen yet. The rest is a plain draft (its decoder layers, norm and
head); it is warm-started from the shipped plain draft with the feature columns of ``fc`` at zero, so training
starts from the plain draft's agreement. Loss per position: cross-entropy against the target's own distribution
``softmax(W_target f_t)`` on the draft's vocabulary subset (exact, computed from the stored feature: no top-k).
Features are withheld (zeroed) at random positions in training (``drop``), as they are inside drafted blocks.

Data: ``features`` shards (``run_features``) of ``{ids, start, feat}`` rows: the target's features at every
position of prompt + completion, bf16.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.modeling.model import CausalLM, ModelConfig, rope_tables, rotate_half
from specdec_train.distill.train import resume, save_checkpoint, warmup_cosine


# ---- data ----------------------------------------------------------------------------------------------------

@torch.inference_mode()
def target_features(target: CausalLM, ids: list[int]) -> torch.Tensor:
    """The target's final hidden state at every position of ``ids`` → [len, D] (one prefill)."""
    kv = target.new_kv_slots(1, len(ids))
    dev = target.device
    _, h = target(torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None],
                  torch.tensor([0], device=dev), kv, logits_rows=slice(0, 0))
    return h[0]


def run_features(target: CausalLM, rows: list[dict], out_dir, shard_size: int = 128, progress: bool = True) -> None:
    """Write ``out_dir/shard_NNNNN.pt`` (rows in input order); existing shards are skipped (resumable)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)]
    todo = [i for i in range(len(shards)) if not (out_dir / f"shard_{i:05d}.pt").exists()]
    bar = tqdm(total=sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for i in todo for r in shards[i]),
               desc="target features", unit="tok", disable=not progress, mininterval=5)
    for i in todo:
        res = []
        for r in shards[i]:
            ids = r["prompt_ids"] + r["completion_ids"]
            res.append({"ids": torch.tensor(ids, dtype=torch.int32), "start": len(r["prompt_ids"]),
                        "feat": target_features(target, ids).to(torch.bfloat16).clone(),
                        "temperature": float(r.get("temperature", 0.0))})
            bar.update(len(ids))
        tmp = out_dir / f".shard_{i:05d}.pt.tmp"
        torch.save(res, tmp)
        os.replace(tmp, out_dir / f"shard_{i:05d}.pt")


def load_features(feat_dir) -> list[dict]:
    rows = []
    for p in sorted(pathlib.Path(feat_dir).glob("shard_*.pt")):
        rows.extend(torch.load(p))
    return rows


# ---- model ----------------------------------------------------------------------------------------------------

def build_feature_draft(plain: CausalLM, feature_size: int, feature_scale: float = 1.0) -> CausalLM:
    """A feature draft warm-started from a plain (compact-vocabulary) draft: the same layers, embeddings, norm and
    head, plus ``fc`` = [I | 0], so that at initialisation ``fc([e; f]) = e`` and it drafts exactly like
    ``plain``; training then teaches it to read the target's features."""
    cfg = ModelConfig(**{**plain.config.__dict__, "feature_size": feature_size, "feature_scale": feature_scale,
                         "eos_token_id": list(plain.config.eos_token_id)})
    oov = int(plain.to_compact[0]) if plain.to_compact is not None else 0
    draft = CausalLM(cfg, vocab_subset=plain.vocab_subset, oov_compact_id=oov)
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in plain.state_dict().items()},
                                                strict=False)
    assert set(missing) == {"fc.weight", "fc.bias"} and not unexpected, (missing, unexpected)
    D = cfg.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :D].copy_(torch.eye(D))
        draft.fc.bias.zero_()
    return draft.float()


def train_forward(m: CausalLM, tokens_c: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Teacher-forced causal forward over whole sequences (no KV cache, differentiable) → f̂ [B, L, D].
    tokens_c: compact ids [B, L]; feats: the input features f_{t-1} [B, L, D]."""
    cfg = m.config
    B, L = tokens_c.shape
    cos, sin = rope_tables(cfg, L, tokens_c.device)
    x = m.fc(torch.cat((m.model.embed_tokens(tokens_c), feats * cfg.feature_scale), dim=-1))
    H, KV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer in m.model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(B, L, H, hd).transpose(1, 2)
        k = a.k_proj(h).view(B, L, KV, hd).transpose(1, 2)
        v = a.v_proj(h).view(B, L, KV, hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, L, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.model.norm(x)


# ---- training ------------------------------------------------------------------------------------------------

def make_batch(items: list[dict], to_compact: torch.Tensor, max_len: int, drop: float = 0.0):
    """→ compact tokens [B, L], input features [B, L, D] (shifted by one, zeros at 0 and, with probability
    ``drop`` each, where the feature is withheld: inside a drafted block the target's features are not known
    yet and the draft is fed zeros there), target features, mask."""
    L = min(max_len, max(len(it["ids"]) for it in items))
    D = items[0]["feat"].shape[-1]
    B = len(items)
    tok = torch.zeros(B, L, dtype=torch.long)
    fin = torch.zeros(B, L, D)
    fout = torch.zeros(B, L, D)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, it in enumerate(items):
        n = len(it["ids"])
        s = random.randrange(0, n - L + 1) if n > L else 0  # a random window of long rows
        ids, f = it["ids"][s:s + L].long(), it["feat"][s:s + L].float()
        m = len(ids)
        tok[b, :m] = to_compact[ids]
        fout[b, :m] = f
        fin[b, 1:m] = f[:m - 1]
        if s > 0:
            fin[b, 0] = it["feat"][s - 1].float()
        mask[b, :m] = True
    if drop > 0:
        fin = fin * (torch.rand(B, L, 1) >= drop)
    return tok, fin, fout, mask


def feature_loss(m: CausalLM, teacher_head: torch.Tensor, f_hat, f_true, mask):
    """Cross-entropy of the draft's distribution against the target's own, ``softmax(teacher_head @ f)`` on the
    vocabulary subset (the target's full distribution restricted and renormalised), over the masked positions."""
    with torch.no_grad():
        p = torch.softmax((f_true.to(teacher_head.dtype) @ teacher_head.T).float(), dim=-1)
    logq = torch.log_softmax(m.lm_head(f_hat).float(), dim=-1)
    ce = -(p * logq).sum(-1)
    return (ce * mask).sum() / mask.sum().clamp_min(1)


@torch.no_grad()
def feature_agreement(m: CausalLM, rows: list[dict], to_compact: torch.Tensor, subset: torch.Tensor,
                      batch_size: int = 8, withhold: bool = False) -> dict:
    """Teacher-forced on the target's tokens and features: the fraction of completion positions of greedy rows
    where the draft's top-1 equals the target's next token. All features known: every position is like the first
    token of a drafted block. ``withhold``: the completion's features are zeroed (the prompt's kept), like tokens
    deep inside a block."""
    rows = sorted((r for r in rows if r.get("temperature", 0.0) == 0.0), key=lambda r: len(r["ids"]))
    hit = n = 0
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        tok, fin, _, _ = make_batch(chunk, to_compact, max_len=1 << 30)
        if withhold:
            for j, r in enumerate(chunk):
                fin[j, r["start"]:] = 0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f_hat = train_forward(m, tok, fin)
        pred = subset[m.lm_head(f_hat).float().argmax(-1)]
        for j, r in enumerate(chunk):
            P, Lr = r["start"], len(r["ids"])
            hit += int((pred[j, P - 1:Lr - 1] == r["ids"][P:Lr].long()).sum())
            n += Lr - P
    return {"agreement": hit / max(n, 1), "positions": n, "rows": len(rows)}


def train_feature_draft(m: CausalLM, teacher_head: torch.Tensor, rows: list[dict], out_dir, *, steps: int,
                        batch_size: int = 8, max_len: int = 384, lr: float = 5e-4, warmup: int = 20,
                        drop: float = 0.5, seed: int = 0, threads: int = 1, ckpt_every: int = 50,
                        eval_fn=None, eval_every: int = 0, time_budget_s: float | None = None,
                        train_only: tuple[str, ...] = (), progress: bool = True, log=print) -> dict:
    """AdamW on everything but the input embeddings; bf16 autocast; resumable from ``out_dir/ckpt.pt``.
    ``teacher_head``: the target's output-head rows of the draft's vocabulary subset [V_s, D]."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    random.seed(seed)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m.model.embed_tokens.weight.requires_grad_(False)
    if train_only:  # e.g. ("fc.",): only the feature projection learns
        for n, p in m.named_parameters():
            p.requires_grad_(any(n.startswith(t) for t in train_only))
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    step, history, wall0 = 0, [], 0.0
    ck = out_dir / "ckpt.pt"
    state = resume(ck, m, opt, rng, strict=False)
    if state is not None:
        step, history, wall0 = state
        log(f"resumed from step {step}")
    elif eval_fn is not None:
        history.append({"step": 0, "wall_s": 0.0, **eval_fn(m)})
        log(json.dumps(history[-1]))
    m.train()
    t0, ema = time.time(), None
    bar = tqdm(total=steps, initial=step, desc="feature draft", disable=not progress, mininterval=10)
    while step < steps:
        items = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
        tok, fin, fout, mask = make_batch(items, m.to_compact, max_len, drop)
        for g in opt.param_groups:
            g["lr"] = lr * warmup_cosine(step, warmup, steps)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = feature_loss(m, teacher_head, train_forward(m, tok, fin), fout, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.update(1)
        bar.set_postfix(ce=f"{ema:.3f}")
        wall = wall0 + time.time() - t0
        if eval_fn is not None and eval_every and step % eval_every == 0:
            m.eval()
            history.append({"step": step, "wall_s": round(wall, 1), "ce_ema": round(ema, 4), **eval_fn(m)})
            m.train()
            log(json.dumps(history[-1]))
        over = time_budget_s is not None and wall > time_budget_s
        if step % ckpt_every == 0 or step == steps or over:
            save_checkpoint(ck, m, opt, rng, step, history, wall)
        if over:
            log(f"time budget reached at step {step}")
            break
    m.eval()
    return {"steps": step, "history": history, "wall_s": wall0 + time.time() - t0}
