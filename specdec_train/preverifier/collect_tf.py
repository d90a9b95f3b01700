"""Fast label collection by teacher forcing (the default for training; `collect.py` drives the real workers).

Why it is exact for greedy decoding: in a greedy SD round every accepted prefix is the target's own greedy
continuation, so the draft's state at any drafted token whose predecessors were accepted is the draft's state on the
target's greedy text. One teacher-forced draft forward over (prompt + the target's greedy continuation) therefore
gives, at every position j, exactly the features the DraftWorker computes when it drafts position j after an
accepted prefix (same model code, same hidden row; at T=0, log q and entropy come from the untempered softmax,
as in the worker), and the conditional
label is `argmax q_j == the target's token j`. Rounds are then laid out the way `mode=sd` walks the text (start,
accepted prefix, next start = start + accepted + 1). The only approximation is for the tokens *after* the first
rejection of a round, which are read on the target's text rather than on the draft's own wrong continuation: they
never count as accepted and only matter for how long a pacer keeps drafting past a failure in the θ simulation.

Sampled (T=1): the continuation is a target sample (the distribution of accepted prefixes under exact speculative
sampling), the draft token is drawn from the worker's q (temperature, top-k truncation) with a seeded generator,
and the soft label is min(1, p/q) with p from one teacher-forced target forward.
"""
from __future__ import annotations

import statistics
import time

import torch

from specdec.decoding.preverifier import head_stats
from specdec.decoding.sampling import SamplingParams, logits_to_probs, truncate_top_k
from specdec.decoding.stop import FixedLength, PreverifierStop
from specdec.workers.draft import DraftWorker


@torch.inference_mode()
def _tf_forward(model, ids: list[int]):
    kv = model.new_kv_slots(1, len(ids) + 1)
    x = torch.tensor([ids])
    logits, hidden = model(x, torch.arange(len(ids))[None], torch.tensor([0]), kv)
    return logits[0], hidden[0]


@torch.inference_mode()
def collect_tf(draft_model, rows: list[dict], gamma_max: int = 12, target_model=None, q_top_k: int = 64,
               seed: int = 0, time_budget_s: float | None = None, greedy_labels_from: str = "file",
               rounds_per_token: float = 0.3, progress=None, walk_gamma: int | None = None) -> list[dict]:
    """rows: {prompt_ids, completion_ids, temperature, prompt} → round dicts (see collect.Round).

    Each round records `gamma_max` tokens; the next round starts where `mode=sd` with γ = `walk_gamma` (default
    gamma_max) would start it: after min(accepted, walk_gamma) tokens and the target's one. Where rounds start
    matters: acceptance runs are correlated, so a long-γ walk starts most rounds right after a rejection, where
    the draft does worse than where short drafts (the best fixed γ, a pacer) start theirs. walk_gamma=0 records
    a round at every position (no subsampling either): what `train.replay` needs to walk any policy exactly."""
    out = []
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    for n, row in enumerate(rows):
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
        P, comp = len(row["prompt_ids"]), list(row["completion_ids"])
        C = len(comp)
        if C < gamma_max + 1:
            continue
        ids = list(row["prompt_ids"]) + comp
        dl, dh = _tf_forward(draft_model, ids)
        dl, dh = dl[P - 1:P - 1 + C], dh[P - 1:P - 1 + C]  # row j predicts comp[j]
        temp = float(row["temperature"])
        params = SamplingParams(temperature=temp)
        if temp == 0.0:
            x = dl.argmax(-1)
            if greedy_labels_from == "target" and target_model is not None:
                tl, _ = _tf_forward(target_model, ids)
                tgt = tl[P - 1:P - 1 + C].argmax(-1)
            else:
                tgt = torch.tensor(comp)
            label = (x == tgt).float()
            lp = torch.log_softmax(dl.float(), -1)  # the DraftWorker's greedy features: untempered softmax
            logq = lp.gather(1, x[:, None])[:, 0]
            ent = torch.special.entr(lp.exp()).sum(-1)
        else:
            if target_model is None:
                raise ValueError("sampled rows need the target model (soft labels min(1, p/q))")
            q = truncate_top_k(logits_to_probs(dl, params), q_top_k)
            x = torch.multinomial(q, 1, generator=gen)[:, 0]
            qx = q.gather(1, x[:, None])[:, 0].clamp_min(1e-30)
            tl, _ = _tf_forward(target_model, ids)
            p = logits_to_probs(tl[P - 1:P - 1 + C], params)
            px = p.gather(1, x[:, None])[:, 0]
            label = (px / qx).clamp(max=1.0)
            logq = qx.log()
            ent = torch.where(q > 0, -q * q.clamp_min(1e-30).log(), torch.zeros(())).sum(-1)
        aux = head_stats(dl, x)
        s = 0
        seq_rounds = []
        while s + gamma_max <= C:
            sl = slice(s, s + gamma_max)
            lab = label[sl]
            if temp == 0.0:
                acc = int(torch.cumprod(lab, 0).sum())
            else:
                acc = int(torch.cumprod((torch.rand(gamma_max, generator=gen) < lab).float(), 0).sum())
            seq_rounds.append({"hidden": dh[sl].half().clone(), "tokens": x[sl].int().clone(), "logq": logq[sl].float().clone(),
                        "entropy": ent[sl].float().clone(), "aux": aux[sl].float().clone(),
                        "label": lab.float().clone(), "temperature": temp,
                        "prompt": row.get("prompt", n), "start": s, "num_accepted": acc, "draft_ns": 0,
                        "forward_ns": 0,
                        "split": row.get("split", "train")})
            s += 1 if walk_gamma == 0 else min(acc, walk_gamma or gamma_max) + 1
        cap = max(1, int(rounds_per_token * C))
        if len(seq_rounds) > cap and walk_gamma != 0:  # bound the memory: a uniform subsample of the rounds
            keep = sorted(torch.randperm(len(seq_rounds), generator=gen)[:cap].tolist())
            seq_rounds = [seq_rounds[i] for i in keep]
        out.extend(seq_rounds)
        if progress is not None:
            progress(n + 1, len(rows), len(out), time.perf_counter() - t0)
    return out


@torch.inference_mode()
def measure_costs(draft_model, target_model, gamma_max: int = 12, ctx: int = 64, reps: int = 7,
                  preverifier=None, loop_tokens: int = 8, loop_reps: int = 15) -> dict:
    """Median KV-cached costs at 1 thread, interleaved: one draft token, one target verify of n+1 tokens (n=1, γ).

    The draft's cost per token is read in the DraftWorker's own drafting loop (greedy rounds of `loop_tokens`,
    no stop rule: `draft_token_s`, the worker's bookkeeping included; the bare forward is `draft_forward_s`).
    With `preverifier`, also `preverifier_s`: what a call adds per block there (B = 1, θ = 0, so both ways draft
    the same tokens). An isolated call understates it 2-4× (docs/design/pacer.md, "Pre-verifier cost"), which biases θ
    high."""
    def step(model, S):
        kv = model.new_kv_slots(1, ctx + 64)
        vocab = min(100, model.config.vocab_size)
        model(torch.randint(0, vocab, (1, ctx)), torch.arange(ctx)[None], torch.tensor([0]), kv)
        t = time.perf_counter()
        model(torch.randint(0, vocab, (1, S)), torch.arange(ctx, ctx + S)[None], torch.tensor([0]), kv)
        return time.perf_counter() - t

    d, t1, tg = [], [], []
    for _ in range(reps):
        d.append(step(draft_model, 1))
        t1.append(step(target_model, 2))
        tg.append(step(target_model, gamma_max + 1))
    m = statistics.median
    out = {"draft_token_s": m(d), "target_2_s": m(t1), f"target_{gamma_max + 1}_s": m(tg),
           "target_base_s": m(t1) - (m(tg) - m(t1)) / max(gamma_max - 1, 1),
           "target_per_token_s": max((m(tg) - m(t1)) / max(gamma_max - 1, 1), 0.0)}
    out["draft_forward_s"] = out["draft_token_s"]
    out.update(_loop_costs(draft_model, preverifier, ctx, loop_tokens, loop_reps))
    return out


def _loop_costs(draft_model, preverifier, ctx: int, n: int, reps: int) -> dict:
    worker = DraftWorker(draft_model, preverifier=preverifier, max_sessions=1, max_context=ctx + 2 * n + 8)
    prompt = torch.randint(0, min(1000, draft_model.config.vocab_size), (ctx,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    worker.start_session("cost", prompt, SamplingParams(temperature=0.0))
    plain, pv = [], []
    for rep in range(reps + 2):
        ways = [(FixedLength(), plain)] + ([(PreverifierStop(preverifier, 0.0), pv)] if preverifier is not None else [])
        for rule, acc in ways:
            t = time.perf_counter()
            blk = worker.draft("cost", ctx - 1, [prompt[-1]], n, rule, block_size=1)
            if rep >= 2:  # warm-up
                acc.append((time.perf_counter() - t) / len(blk.tokens))
    worker.end_session("cost")
    out = {"draft_token_s": statistics.median(plain), "loop_tokens": n}
    if pv:  # B = 1 and θ = 0: one call per drafted token but the last (gamma_max closes the round unasked)
        out["preverifier_s"] = max(statistics.median(pv) - out["draft_token_s"], 0.0) * n / max(n - 1, 1)
    return out
