"""Top-k soft labels from the target's logits, written as resumable shards.

Shard ``teacher/shard_00012.pt`` holds, for each of its rows (a fixed, seeded permutation of the training rows),
``ids`` (prompt+completion token ids, int32), ``start`` (index of the first completion token) and, for every
completion position j (predicting ``ids[start + j]``), the target's top-k log-probabilities ``logp`` [C, k]
(float16) and token ids ``idx`` [C, k] (int32). Existing shards are skipped, so a killed job resumes.
"""
from __future__ import annotations

import os
import pathlib
import random
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from specdec.modeling.dtypes import resolve_dtype


def shard_rows(rows: list[dict], seed: int, shard_size: int) -> list[list[dict]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    rows = [rows[i] for i in order]
    return [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)]


@torch.no_grad()
def teacher_topk(model, rows: list[dict], k: int, batch_size: int = 8, pad_id: int = 0) -> list[dict]:
    out = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]) + len(rows[i]["completion_ids"]))
    for b in range(0, len(order), batch_size):
        idxs = order[b:b + batch_size]
        seqs = [rows[i]["prompt_ids"] + rows[i]["completion_ids"] for i in idxs]
        L = max(len(s) for s in seqs)
        x = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        for j, s in enumerate(seqs):
            x[j, :len(s)] = torch.tensor(s)
        # right padding + causal attention: real positions never see the padding
        h = model.model(input_ids=x).last_hidden_state
        for j, i in enumerate(idxs):
            P, C = len(rows[i]["prompt_ids"]), len(rows[i]["completion_ids"])
            hs = h[j, P - 1:P - 1 + C]
            logp = torch.log_softmax(model.lm_head(hs).float(), dim=-1)
            v, ix = logp.topk(k, dim=-1)
            out[i] = {"ids": torch.tensor(seqs[j], dtype=torch.int32), "start": P,
                      "logp": v.half(), "idx": ix.int()}
    return out


def run_teacher(target_dir, rows: list[dict], out_dir, k: int = 32, seed: int = 0, shard_size: int = 64,
                threads: int = 1, progress: bool = True, max_shards: int | None = None, dtype: str = "auto") -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = shard_rows(rows, seed, shard_size)
    if max_shards is not None:
        shards = shards[:max_shards]
    # label the distribution that is served: `auto` resolves like the target service (bf16 on CPUs with native
    # bf16 GEMMs, where it is also ~3x faster for these long sequences)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=resolve_dtype(dtype, "cpu", "target")).eval()
    todo = [i for i in range(len(shards)) if not (out_dir / f"shard_{i:05d}.pt").exists()]
    t0, ntok = time.time(), 0
    bar = tqdm(todo, desc="teacher top-k", disable=not progress, mininterval=5)
    for i in bar:
        res = teacher_topk(model, shards[i], k)
        tmp = out_dir / f".shard_{i:05d}.pt.tmp"
        torch.save(res, tmp)
        os.replace(tmp, out_dir / f"shard_{i:05d}.pt")
        ntok += sum(len(r["completion_ids"]) for r in shards[i])
        bar.set_postfix(tok_s=f"{ntok / (time.time() - t0):.0f}")


def load_shards(out_dir) -> list[dict]:
    rows = []
    for p in sorted(pathlib.Path(out_dir).glob("shard_*.pt")):
        rows.extend(torch.load(p))
    return rows
