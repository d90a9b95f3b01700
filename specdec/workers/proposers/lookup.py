"""Prompt lookup as a draft source: the token that followed the context's last n-gram where it occurred before
(specdec/decoding/lookup.py), proposed with certainty (q one-hot) where the session's grammar allows it."""
from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.decoding.lookup import PromptLookup
from specdec.workers.drafting import grammar_allows

if TYPE_CHECKING:
    from specdec.workers.base import DraftSession


class LookupTokens:
    """A `CertainProposer` over a `PromptLookup`: greedy sessions only unless `lookup.greedy_only` is off."""
    also_after_forward = True  # a feature draft, or a block mixing model and looked-up tokens, looks up after it

    def __init__(self, lookup: PromptLookup):
        self.lookup = lookup

    def applies(self, s: DraftSession) -> bool:
        return s.params.greedy or not self.lookup.greedy_only

    def propose(self, s: DraftSession, context: list[int]) -> int | None:
        looked = self.lookup.propose(context)
        return looked[0] if looked is not None and grammar_allows(s, context, looked[0]) else None
