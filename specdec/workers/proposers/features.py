"""A feature draft's (EAGLE-style) inputs: the target's features by position, which steer the draft model's
forwards (docs/design/feature_draft.md); what is accepted never depends on them. Torch only."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.state.feature_state import FeatureState
from specdec.state.feature_state import TargetFeatures
from specdec.workers.base import feature_size

if TYPE_CHECKING:
    from specdec.workers.base import DraftSession


class FeatureInputs:
    """The inputs of a draft whose model reads the target's features (`config.feature_size` > 0): each of its
    sessions keeps a `FeatureState` (`DraftSession.feats`), the features received so far by position. A cached
    position fed before its feature arrived is re-fed by the next call (`begin`)."""

    def __init__(self, model, max_len: int):
        self.model, self.max_len = model, max_len

    def open(self, s: DraftSession, features: list[TargetFeatures] | None) -> None:
        """A new session's state, holding the features sent with its start."""
        m = self.model
        s.feats = FeatureState(self.max_len, feature_size(m), m.dtype, m.device)
        for f in features or []:
            s.feats.add(f)

    @staticmethod
    def begin(s: DraftSession, features: list[TargetFeatures] | None, feed: list[int],
              base: int) -> tuple[list[int], int]:
        """Store a call's `features`; → (feed, base) of its first forward, which re-feeds the cached positions
        they improve (the call's first forward truncates to the new base: `DraftWorker.advance`)."""
        for f in features or []:
            s.feats.add(f)
        redo = s.feats.first_refeed(base)
        if redo < base:
            return s.tokens[redo:] + feed, redo
        return feed, base

    @staticmethod
    def inputs(s: DraftSession, base: int, n: int) -> torch.Tensor:
        return s.feats.inputs(base, n)

    @staticmethod
    def fed(s: DraftSession, base: int, hidden: torch.Tensor) -> None:
        s.feats.fed(base, hidden.shape[0])
