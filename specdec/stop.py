"""Stop rules for drafting: how many tokens the draft proposes before the target verifies.

The draft asks its stop rule after every block of `block_size` tokens. A stop rule only chooses the draft length,
so it can never change the output distribution (the target's verification is what makes decoding lossless).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class DraftFeatures:
    """What the draft knows about the tokens it drafted this round (one row per drafted token)."""

    hidden: torch.Tensor  # [n, D] draft hidden state that produced q_t (fp32); [n, 0] for rules without needs_hidden
    tokens: torch.Tensor  # [n] drafted token ids
    logq: torch.Tensor  # [n] log q_t(x_t)
    entropy: torch.Tensor  # [n] entropy of q_t (nats)
    block_start: int  # index of the first token of the block just finished
    # [n] top-1 minus top-2 log-prob of the draft's untempered distribution at each row, filled only for stop rules
    # that ask for it (`needs_margin`): the draft's confidence beyond log q, from logits it already has
    margin: torch.Tensor | None = None


class StopRule(Protocol):
    needs_features: bool  # False: the rule never reads them and the draft skips computing them (None is passed)

    def should_stop(self, features: DraftFeatures | None) -> bool: ...


@dataclass(frozen=True)
class StopSpec:
    """A serialisable request for a stop rule: `fixed` (draft up to gamma_max) or `pacer` (pre-verifier)."""

    kind: str = "fixed"
    threshold: float | None = None  # pacer: stop when P(block accepted) < threshold (None: the shipped default)
    # pacer: when the *first* block scores below this, send nothing (draft length 0: the round is an `ar` step,
    # a one-row target forward, cheaper than verifying a block that will likely be rejected). None/0: never
    skip_below: float | None = None


class FixedLength:
    """Never stops early: the draft length is gamma_max (standard speculative decoding)."""

    needs_features = False

    def should_stop(self, features: DraftFeatures | None) -> bool:
        return False


class PreverifierStop:
    """PACER: stop when the pre-verifier's P(every token of this block is accepted) falls below `threshold`."""

    needs_features = True
    needs_margin = False
    needs_hidden = True

    def __init__(self, preverifier, threshold: float, skip_below: float = 0.0):
        self.preverifier = preverifier
        self.threshold = threshold
        self.skip_below = skip_below  # first block below this: draft nothing (see StopSpec.skip_below)
        self.block_size = int(getattr(preverifier, "block_size", 0) or 0)  # the B it was tuned for
        self.needs_margin = bool(getattr(preverifier, "use_margin", False))
        # a pre-verifier that reads neither the hidden state nor the draft head: the draft keeps no hidden rows
        self.needs_hidden = bool(getattr(preverifier, "use_hidden", True) or getattr(preverifier, "use_head", False))
        self.last_score: float | None = None
        # one round's scorer (each drafted token scored once; specdec.round_scorer.RoundScorer) where offered
        self._scorer = preverifier.round_scorer() if hasattr(preverifier, "round_scorer") else None

    def reset(self) -> None:
        """A new drafting round (`DraftWorker.begin`): the round scorer's per-token scores start over."""
        if self._scorer is not None:
            self._scorer.reset()

    def should_stop(self, features: DraftFeatures) -> bool:
        self.last_score = float(self._scorer.score(features) if self._scorer is not None
                                else self.preverifier.block_accept_prob(features))
        return self.last_score < self.threshold
