"""Stop rules for drafting: how many tokens the draft proposes before the target verifies.

The draft asks its stop rule after every block of `block_size` tokens. A stop rule only chooses the draft length,
so it can never change the output distribution (the target's verification is what makes decoding lossless).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from specdec.common.errors import InvalidRequestError


@dataclass
class DraftFeatures:
    """What the draft knows about the tokens it drafted this round (one row per drafted token). Host tensors where
    the drafting loop builds them, whatever the draft's device (specdec/workers/drafting.py, `CallFeatures.block`)."""

    hidden: torch.Tensor  # [n, D] draft hidden state that produced q_t (fp32); [n, 0] for rules without needs_hidden
    tokens: torch.Tensor  # [n] drafted token ids
    logq: torch.Tensor  # [n] log q_t(x_t)
    entropy: torch.Tensor  # [n] entropy of q_t (nats)
    block_start: int  # index of the first token of the block just finished
    # [n] top-1 minus top-2 log-prob of the draft's untempered distribution at each row, filled only for stop rules
    # that ask for it (`needs_margin`): the draft's confidence beyond log q, from logits it already has
    margin: torch.Tensor | None = None

    def on_host(self) -> DraftFeatures:
        """These features with every tensor on the host (itself where they are: the drafting loop's are)."""
        tensors = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor) and v.device.type != "cpu"}
        return replace(self, **{k: v.cpu() for k, v in tensors.items()}) if tensors else self


class StopRule(ABC):
    """What a drafting call asks of its stop rule. Every rule has every attribute; these are the defaults."""

    needs_features: bool = True  # False: the rule never reads them and the draft skips computing them (None is passed)
    needs_hidden: bool = True  # of the features: the draft's hidden rows (False: an empty [n, 0] tensor)
    needs_margin: bool = False  # of the features: the top-1 - top-2 margin (DraftFeatures.margin)
    block_size: int = 0  # the block size the rule was tuned for, taken where a call sets none (0: one block)
    # a block prompt lookup proposed is not scored by the rule: its predicted acceptance is lookup's measured
    # precision, and drafting stops when that falls below `threshold`
    threshold: float = 0.0
    skip_below: float = 0.0  # the first block of a greedy call scoring below this: draft nothing (StopSpec)
    last_score: float | None = None  # the score behind the latest `should_stop` (None: the rule scores nothing)

    def reset(self) -> None:
        """A new drafting round (`DraftWorker.begin`): per-round state starts over."""

    @abstractmethod
    def should_stop(self, features: DraftFeatures | None) -> bool:
        """After each block: stop drafting here?"""


@dataclass(frozen=True)
class StopSpec:
    """A serialisable request for a stop rule: `fixed` (draft up to gamma_max) or `pacer` (pre-verifier)."""

    kind: str = "fixed"
    threshold: float | None = None  # pacer: stop when P(block accepted) < threshold (None: the shipped default)
    # pacer: when the *first* block scores below this, send nothing (draft length 0: the round is an `ar` step,
    # a one-row target forward, cheaper than verifying a block that will likely be rejected). None/0: never
    skip_below: float | None = None


class FixedLength(StopRule):
    """Never stops early: the draft length is gamma_max (standard speculative decoding)."""

    needs_features = False

    def should_stop(self, features: DraftFeatures | None) -> bool:
        return False


class PreverifierModel(Protocol):
    """What the stop rule reads of a pre-verifier (`specdec.decoding.preverifier.Preverifier`, or a benchmark's oracle).
    """

    block_size: int  # the B it was trained for (0: the caller's)
    threshold: float  # its θ, where the request sets none
    use_hidden: bool  # reads the draft's hidden rows
    use_head: bool  # reads the draft's output head
    use_margin: bool  # reads the draft's top-1 − top-2 margin

    def block_accept_prob(self, features: DraftFeatures) -> float: ...

    def round_scorer(self) -> Any:
        """A scorer of one round's tokens, each scored once (`specdec.decoding.round_scorer.RoundScorer`), or None:
        every block is scored whole by `block_accept_prob`."""


class PreverifierStop(StopRule):
    """PACER: stop when the pre-verifier's P(every token of this block is accepted) falls below `threshold`."""

    needs_features = True

    def __init__(self, preverifier: PreverifierModel, threshold: float, skip_below: float = 0.0):
        self.preverifier = preverifier
        self.threshold = threshold
        self.skip_below = skip_below  # first block below this: draft nothing (see StopSpec.skip_below)
        self.block_size = int(preverifier.block_size or 0)  # the B it was tuned for
        self.needs_margin = bool(preverifier.use_margin)
        # a pre-verifier that reads neither the hidden state nor the draft head: the draft keeps no hidden rows
        self.needs_hidden = bool(preverifier.use_hidden or preverifier.use_head)
        self.last_score: float | None = None
        # one round's scorer (each drafted token scored once; specdec.decoding.round_scorer.RoundScorer) where offered
        self._scorer = preverifier.round_scorer()

    def reset(self) -> None:
        """A new drafting round (`DraftWorker.begin`): the round scorer's per-token scores start over."""
        if self._scorer is not None:
            self._scorer.reset()

    def should_stop(self, features: DraftFeatures) -> bool:
        self.last_score = float(self._scorer.score(features) if self._scorer is not None
                                else self.preverifier.block_accept_prob(features))
        return self.last_score < self.threshold


def make_stop_rule(spec: StopSpec, preverifier: PreverifierModel | None) -> StopRule:
    """Map a wire-level stop spec to a stop rule of a draft with this pre-verifier (None: it has none)."""
    if spec.kind == "fixed":
        return FixedLength()
    if spec.kind == "pacer":
        if preverifier is None:
            raise InvalidRequestError("mode", "this draft has no pre-verifier loaded; use mode sd/pearl or start the "
                                              "draft with --preverifier")
        threshold = spec.threshold if spec.threshold is not None else preverifier.threshold
        return PreverifierStop(preverifier, threshold, spec.skip_below or 0.0)
    raise InvalidRequestError("stop", f"unknown stop rule {spec.kind!r}; use fixed or pacer")
