"""OpenAI's and vLLM's logits adjustments on the target: logit_bias, then the repetition, frequency and presence
penalties, before temperature / top-k / top-p (specdec/sampling.py).

Lossless by construction: they change only p, the distribution the output must follow. Verification accepts a
draft token against the adjusted p of its own position (that position's history: the output so far plus the
draft tokens before it), and the draft keeps proposing from its own q, which is all the speculative-sampling proof
asks of it (ALGORITHMS.md). The draft could apply them too, to be accepted more often; it does not, so a penalty
costs acceptance where it bites (repeats), never exactness.

Definitions (vLLM's):
- logit_bias: logit[t] += bias[t];
- repetition_penalty r: for every token in the prompt or the output so far, logit /= r if positive, else *= r;
- frequency_penalty f, presence_penalty e: logit[t] -= f * count[t] + e * (count[t] > 0), count over the output
  so far (not the prompt).
"""
from __future__ import annotations

import torch

from specdec.sampling import SamplingParams


def adjusts(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 \
        or params.presence_penalty != 0.0


def adjust_logits(rows: torch.Tensor, history: list[int], output_start: int, appended: list[int],
                  params: SamplingParams) -> torch.Tensor:
    """rows [n, V]: row i predicts the token after `history` + appended[:i] (history: every token before row 0's
    position; the output begins at `output_start`). → the adjusted rows, fp32 (the input is left as it is)."""
    out = rows.float().clone()
    if not adjusts(params) or out.shape[0] == 0:
        return out
    vocab = out.shape[-1]
    counts = torch.bincount(torch.tensor(history[output_start:], dtype=torch.long), minlength=vocab)[:vocab]
    counts = counts.to(out.dtype)
    seen = torch.zeros(vocab, dtype=torch.bool)
    if params.repetition_penalty != 1.0 and history:
        seen[torch.tensor(history, dtype=torch.long)] = True
    bias = None
    if params.logit_bias:
        bias = torch.zeros(vocab, dtype=out.dtype)
        ids, values = zip(*params.logit_bias)
        bias[torch.tensor(ids, dtype=torch.long)] = torch.tensor(values, dtype=out.dtype)
    for i in range(out.shape[0]):
        if i > 0:
            counts[appended[i - 1]] += 1
            seen[appended[i - 1]] = True
        row = out[i]
        if bias is not None:
            row += bias
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            row[seen] = torch.where(row[seen] > 0, row[seen] / r, row[seen] * r)
        if params.frequency_penalty != 0.0:
            row -= params.frequency_penalty * counts
        if params.presence_penalty != 0.0:
            row -= params.presence_penalty * (counts > 0).to(out.dtype)
    return out
