"""Prompt lookup: propose the token that followed the context's last n-gram the last time it occurred.

Small targets repeat themselves: a doctest restates the signature, a list's items share their scaffolding, a
greedy continuation falls into a loop. Where the context's last `n` tokens occurred before, the token that
followed them then is a free guess at the next one (prompt lookup decoding; vLLM's `ngram` speculator).
`DraftWorker` uses it beside the draft model (specdec/workers/proposers/lookup.py): where the longest earlier match has
at least `min_ngram` tokens, the drafted token is the looked-up one, proposed with q = one-hot (exact, so verification
stays lossless at any temperature); elsewhere the draft model's own token. Measured on the shipped pair
(docs/benchmarks.md, "Prompt lookup beside the draft model"): greedy agreement with the target 0.714 → 0.743 on held-out
text and 0.567 → 0.680 on the benchmark's prompts, where the target's continuations repeat more. Pure numpy; no torch,
no grpc.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PromptLookup:
    """`min_ngram`: the shortest match that proposes (3 measured best: 1-2 token matches propose worse than
    the draft); `max_ngram`: matches are compared up to this length, the longest wins, the latest among equals;
    `window`: only the last `window` tokens of the context are searched (bounds the cost per drafted token);
    `accept_prob`: the measured share of looked-up tokens the target accepts (0.883 on held-out text, 0.885 on
    the benchmark's prompts, greedy, min_ngram 3: `experiments/lookup_agreement.py`), which PACER's stop rule takes as
    a looked-up block's predicted acceptance in place of the pre-verifier's (trained on the draft's own tokens);
    `greedy_only`: propose for greedy requests only. Sampled requests are exact with lookup too, but at T = 1.0
    it measured neutral on the default pair (tokens per target forward 1.65 vs 1.68 for sd γ = 2): the target
    seldom repeats itself when it samples."""
    min_ngram: int = 3
    max_ngram: int = 6
    window: int = 4096
    accept_prob: float = 0.88
    greedy_only: bool = True

    def __post_init__(self):
        if self.min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")
        if not 0.0 <= self.accept_prob <= 1.0:
            raise ValueError(f"accept_prob must lie in [0, 1], got {self.accept_prob}")
        if self.window <= self.max_ngram:
            raise ValueError(f"window ({self.window}) must exceed max_ngram ({self.max_ngram})")

    def propose(self, context: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
        """→ (token, match length) for the context's next position, or None where no earlier occurrence of its
        last `min_ngram` tokens exists."""
        a = np.asarray(context[-self.window:], dtype=np.int64)
        last = len(a) - 1
        if last < self.min_ngram:
            return None
        # candidates j < last whose token equals the last one: j + 1 followed an occurrence of a[last]
        cand = np.flatnonzero(a[:last] == a[last])
        if cand.size == 0:
            return None
        n = np.ones(cand.size, dtype=np.int64)  # match length of the suffixes ending at j and at last
        for k in range(1, self.max_ngram):
            back = cand - k
            grow = (n == k) & (back >= 0)
            grow[grow] = a[back[grow]] == a[last - k]
            if not grow.any():
                break
            n += grow
        best = int(n.max())
        if best < self.min_ngram:
            return None
        j = int(cand[np.flatnonzero(n == best)[-1]])
        return int(a[j + 1]), best


def prompt_lookup(min_ngram: int, max_ngram: int = PromptLookup.max_ngram) -> PromptLookup | None:
    """The lookup a `--prompt-lookup-min-ngram` setting asks for: None for 0 (off)."""
    return PromptLookup(min_ngram, max(max_ngram, min_ngram)) if min_ngram else None
