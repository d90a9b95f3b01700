"""The draft worker's proposal sources, one per module; `DraftWorker` (specdec/workers/draft.py) composes them, one
drafted token at a time (the step itself: specdec/workers/drafting.py). Torch only.

- forced.py: `ForcedTokens`, the token a session's grammar forces (structured output, specdec/text/grammar.py);
- lookup.py: `LookupTokens`, prompt lookup's token (specdec/decoding/lookup.py);
- model.py: `ModelTokens`, the draft model's token, from the logits row its forward computed;
- features.py: `FeatureInputs`, a feature draft's inputs (the target's features by position), which steer the
  draft model's forwards.

The first two are `CertainProposer`s: they propose from the context alone, with q one-hot, so where one knows the
call's next token before the step's forward, that token is drafted without one (the next forward feeds it). The
worker asks them in order, before the forward; where none proposes there, the forward runs, the ones that
`also_after_forward` are asked once it fed the position (where they were not asked before it), and else the draft
model proposes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from specdec.workers.proposers.features import FeatureInputs
from specdec.workers.proposers.forced import ForcedTokens
from specdec.workers.proposers.lookup import LookupTokens
from specdec.workers.proposers.model import ModelTokens

if TYPE_CHECKING:
    from specdec.workers.base import DraftSession


class CertainProposer(Protocol):
    """A source of tokens proposed with certainty (q one-hot: exact at any temperature), read off the context."""
    # also asked after the step's forward, where it was not asked before it (a feature draft; a block that mixes
    # model and proposed tokens, whose features are needed at once)
    also_after_forward: bool

    def applies(self, s: DraftSession) -> bool:
        """Whether it may propose for this session at all (no context read)."""

    def propose(self, s: DraftSession, context: list[int]) -> int | None:
        """Its token after `context` (the session's tokens, then those the call feeds next), or None."""


__all__ = ["CertainProposer", "FeatureInputs", "ForcedTokens", "LookupTokens", "ModelTokens"]
