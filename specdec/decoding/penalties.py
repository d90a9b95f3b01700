"""OpenAI's and vLLM's logits adjustments: logit_bias, then the repetition, frequency and presence penalties,
before temperature / top-k / top-p (specdec/decoding/sampling.py).

Lossless by construction: p, the distribution the output must follow, is the adjusted target. Verification
accepts a draft token against the adjusted p of its own position (that position's history: the output so far plus
the draft tokens before it), and q is whatever the draft sampled from, which is all the speculative-sampling proof
asks of q (docs/design/algorithms.md, "Logits adjustments"). The draft applies the same adjustments to its
proposals (DraftWorker._draft_token) only to be accepted more often: with draft == target every draft token is
accepted (tests/test_penalties.py).

Definitions (vLLM's):
- logit_bias: logit[t] += bias[t];
- repetition_penalty r: for every token in the prompt or the output so far, logit /= r if positive, else *= r;
- frequency_penalty f, presence_penalty e: logit[t] -= f * count[t] + e * (count[t] > 0), count over the output
  so far (not the prompt);
- min_tokens m: a row deciding one of the first m output tokens gets -inf at `stop_ids` (EOS and stop token ids);
- allowed_token_ids: every other token gets -inf;
- bad_words (token sequences w): a row whose context (prompt and output) ends with w[:-1] gets -inf at w[-1], so
  no output ends with w (vLLM's rule; a one-token w is never generated).
"""
from __future__ import annotations

import functools

import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams


def adjusts(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 \
        or params.presence_penalty != 0.0 or bool(params.min_tokens and params.stop_ids) \
        or bool(params.allowed_token_ids) or bool(params.bad_words)


def live_rows(rows: torch.Tensor, draft: list[int], output_index: int) -> torch.Tensor:
    """Adjusted and masked rows [n, V] (row i decides output token output_index + i). A row that allows no token
    is the request's own contradiction (allowed_token_ids, bad_words, min_tokens and a grammar that leave nothing):
    InvalidRequestError if verification can reach it (each draft token before it has p > 0), else zeros (a row
    never read; it must not turn the verify's arithmetic into NaN)."""
    dead = torch.isneginf(rows).all(-1)
    if not bool(dead.any()):
        return rows
    for i in dead.nonzero()[:, 0].tolist():
        if all(float(rows[j, draft[j]]) > float("-inf") for j in range(i)):
            raise InvalidRequestError("constraints", f"allowed_token_ids, bad_words, min_tokens and structured output "
                                                     f"together leave no token for output token {output_index + i}; "
                                                     f"loosen them")
    rows = rows.clone()
    rows[dead] = 0.0
    return rows


@functools.lru_cache(maxsize=256)
def _bad_word_index(bad_words: tuple[tuple[int, ...], ...]) -> dict[int, dict[tuple[int, ...], list[int]]]:
    """{len(w) - 1: {w[:-1]: [w[-1], ...]}}: a row looks up its context's tail once per prefix length, not every
    word (a request's words are the same on every verify and draft step: cached)."""
    index: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for w in bad_words:
        index.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])
    return index


def adjust_logits(rows: torch.Tensor, history: list[int], output_start: int, appended: list[int],
                  params: SamplingParams) -> torch.Tensor:
    """rows [n, V]: row i predicts the token after `history` + appended[:i] (history: every token before row 0's
    position; the output begins at `output_start`). → the adjusted rows, fp32 (the input is left as it is).

    Only the tokens the history, the appended tokens and the bias name can change: those K columns are gathered,
    adjusted for every row at once ([n, K]), and scattered back (a full-vocabulary pass per row cost 0.4 ms)."""
    out = rows.float().clone()
    if not adjusts(params) or out.shape[0] == 0:
        return out
    n = out.shape[0]
    held = params.min_tokens - (len(history) - output_start)  # rows [0, held) decide output tokens < min_tokens
    if held > 0 and params.stop_ids:
        out[:held, torch.tensor(params.stop_ids)] = float("-inf")
    if params.allowed_token_ids:
        _mask_disallowed(out, params.allowed_token_ids)
    if params.bad_words:
        _mask_bad_words(out, history, appended, params.bad_words)
    bias = dict(params.logit_bias)
    ids = sorted(set(history) | set(appended[:n - 1]) | set(bias))
    if not ids:
        return out
    counts, seen = _counts_and_seen(ids, history, output_start, appended[:n - 1], n, out.dtype)
    index = torch.tensor(ids, dtype=torch.long)
    out[:, index] = _penalized(out[:, index], ids, bias, counts, seen, params)
    return out


def _mask_disallowed(out: torch.Tensor, allowed_token_ids) -> None:
    """allowed_token_ids: -inf, in place, at every other token of every row."""
    keep = torch.zeros(out.shape[-1], dtype=torch.bool)
    keep[torch.tensor(allowed_token_ids)] = True
    out[:, ~keep] = float("-inf")


def _mask_bad_words(out: torch.Tensor, history: list[int], appended: list[int], bad_words) -> None:
    """bad_words: -inf, in place, at w[-1] in each row i whose context (history + appended[:i]) ends with w[:-1]."""
    index = _bad_word_index(bad_words)
    longest = max(index)
    for i in range(out.shape[0]):  # row i's context: history + appended[:i]; only its last `longest` tokens matter
        tail = tuple(history[max(len(history) - longest, 0):]) + tuple(appended[:i]) if longest else ()
        for k, words in index.items():
            last = words.get(tail[len(tail) - k:]) if k <= len(tail) else None
            if last:
                out[i, last] = float("-inf")


def _counts_and_seen(ids: list[int], history: list[int], output_start: int, appended: list[int], n: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and column of `ids` ([n, K] each): how often the token occurs in the output before the row (from
    `output_start` of the history, then appended[:i]: row i sees appended[:i]), and whether it occurs anywhere in
    its context (prompt included), for the repetition penalty."""
    col = {t: j for j, t in enumerate(ids)}
    k = len(ids)
    counts = torch.zeros((n, k), dtype=dtype)
    seen = torch.zeros((n, k), dtype=torch.bool)
    if output_start < len(history):
        counts += torch.bincount(torch.tensor([col[t] for t in history[output_start:]]), minlength=k).to(dtype)
    if history:
        seen[:, torch.tensor(sorted({col[t] for t in history}))] = True
    for i, t in enumerate(appended):  # row i sees appended[:i]
        counts[i + 1:, col[t]] += 1
        seen[i + 1:, col[t]] = True
    return counts, seen


def _penalized(vals: torch.Tensor, ids: list[int], bias: dict, counts: torch.Tensor, seen: torch.Tensor,
               params: SamplingParams) -> torch.Tensor:
    """The gathered columns `vals` [n, K] (tokens `ids`) after logit_bias, then the repetition, frequency and
    presence penalties, in that order."""
    if bias:
        vals += torch.tensor([bias.get(t, 0.0) for t in ids], dtype=vals.dtype)
    if params.repetition_penalty != 1.0:
        r = params.repetition_penalty
        vals = torch.where(seen, torch.where(vals > 0, vals / r, vals * r), vals)
    if params.frequency_penalty != 0.0:
        vals -= params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        vals -= params.presence_penalty * (counts > 0).to(vals.dtype)
    return vals
