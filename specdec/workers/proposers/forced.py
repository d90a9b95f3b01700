"""Grammar-forced tokens: where a session's grammar admits one continuation only (a JSON key, `": "`), the draft
proposes its token with certainty (q one-hot) and without a forward (specdec/text/grammar.py, `GrammarState.forced`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.workers.base import DraftSession


class ForcedTokens:
    """A `CertainProposer`: the token the session's grammar forces after the context, if it forces one."""
    also_after_forward = False  # asked before the forward only

    @staticmethod
    def applies(s: DraftSession) -> bool:
        return s.grammar is not None

    @staticmethod
    def propose(s: DraftSession, context: list[int]) -> int | None:
        forced = s.grammar.forced(context[s.output_start:], 1)
        return forced[0] if forced else None
