"""Per-token decode cost, side by side in one process (KV-cached single-token steps, median of repeats)."""
from __future__ import annotations

import statistics
import time

import torch


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


def cost_ratio(draft, target, threads: int = 1, rounds: int = 3, **kw) -> dict:
    """Interleave draft and target measurements (``rounds`` times) and report medians and their ratio."""
    torch.set_num_threads(threads)
    d, t = [], []
    for _ in range(rounds):
        t.append(per_token_decode_s(target, **kw))
        d.append(per_token_decode_s(draft, **kw))
    dm, tm = statistics.median(d), statistics.median(t)
    return {"draft_ms": dm * 1e3, "target_ms": tm * 1e3, "ratio": dm / tm, "threads": threads}
