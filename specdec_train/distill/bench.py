"""Per-token decode cost, side by side in one process (KV-cached single-token steps, median of repeats)."""
from __future__ import annotations

import statistics
import time

import torch

from specdec.modeling.quant import weight_quant


@torch.no_grad()
def per_token_decode_s(model, prompt_len: int = 64, steps: int = 32, repeats: int = 5, vocab: int | None = None,
                       seed: int = 0) -> float:
    """Median over ``repeats`` of the mean wall time of one KV-cached single-token forward (incl. the head)."""
    g = torch.Generator().manual_seed(seed)
    V = vocab or model.config.vocab_size
    prompt = torch.randint(0, V, (1, prompt_len), generator=g)
    times = []
    for _ in range(repeats):
        out = model(input_ids=prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def _interleaved_ratio(measure, draft, target, threads: int, rounds: int, **kw) -> dict:
    """`measure(model, **kw)` of target then draft, `rounds` times; medians (ms) and their ratio."""
    torch.set_num_threads(threads)
    d, t = [], []
    for _ in range(rounds):
        t.append(measure(target, **kw))
        d.append(measure(draft, **kw))
    dm, tm = statistics.median(d), statistics.median(t)
    return {"draft_ms": dm * 1e3, "target_ms": tm * 1e3, "ratio": dm / tm, "threads": threads}


def cost_ratio(draft, target, threads: int = 1, rounds: int = 3, **kw) -> dict:
    """Interleave draft and target measurements (``rounds`` times) and report medians and their ratio."""
    return _interleaved_ratio(per_token_decode_s, draft, target, threads, rounds, **kw)


@torch.no_grad()
def served_per_token_s(model, context: int = 300, steps: int = 16, seed: int = 0, compact: bool | None = None) -> float:
    """Mean wall time of one KV-cached single-token forward of specdec's own model (what the services run), after
    `context` cached positions; the cache is refilled per call, so repeated calls measure the same thing.

    `compact` (default: whether the model has a compact vocabulary head): return the head's own logits, as greedy
    drafting does, rather than the full-vocabulary row that sampling needs."""
    if compact is None:
        compact = getattr(model, "vocab_subset", None) is not None
    g = torch.Generator().manual_seed(seed)
    kv, slots = model.new_kv_slots(1, context + steps + 1), torch.tensor([0])
    V = min(1000, model.config.vocab_size)
    model(torch.randint(0, V, (1, context), generator=g), torch.arange(context)[None], slots, kv)
    tok = torch.tensor([[V // 2]])
    t0 = time.perf_counter()
    for i in range(steps):
        logits, _ = model(tok, torch.tensor([[context + i]]), slots, kv, compact_logits=compact)
        tok = logits[:, -1:].argmax(-1)  # a compact id is a valid (if different) input token too
    return (time.perf_counter() - t0) / steps


def served_cost_ratio(draft, target, threads: int = 1, rounds: int = 15, **kw) -> dict:
    """Draft/target per-token cost as served (specdec models, e.g. dtype auto + the draft's int8 weights),
    interleaved per round, medians."""
    return {**_interleaved_ratio(served_per_token_s, draft, target, threads, rounds, **kw),
            "draft_dtype": str(draft.dtype).removeprefix("torch."), "draft_weights": weight_quant(draft),
            "target_dtype": str(target.dtype).removeprefix("torch.")}
