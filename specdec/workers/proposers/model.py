"""The draft model as a draft source: its logits row at the call's position, processed as the target's are, then
the argmax or a keyed sample (steps 2-3 of specdec/workers/drafting.py)."""
from __future__ import annotations

import torch

from specdec.workers.drafting import Choice, DraftCall, choose_token, processes_logits


class ModelTokens:
    """The draft model's token from the logits row its forward computed; q is the exact (top-`q_top_k`)
    distribution it was drawn from (one-hot for a greedy session)."""

    def __init__(self, model, q_top_k: int = 64):
        self.model = model
        self.q_top_k = q_top_k  # proposal truncation: q is exactly sparse on the wire (still lossless)

    @property
    def subset(self) -> torch.Tensor | None:
        """A compact-head draft's vocabulary subset (its logits rows are compact); None for others."""
        return getattr(self.model, "vocab_subset", None)

    def choose(self, c: DraftCall, row: torch.Tensor) -> Choice:
        subset = self.subset
        expand = None if subset is None else self.model.expand_logits
        if row.device.type != "cpu" and not (c.s.params.greedy and not processes_logits(c.s)):
            # a GPU draft samples (keyed CPU generators) and processes logits on the host: one copy of its
            # full-vocabulary row per drafted token; a plain greedy step reads the argmax on the device
            return choose_token(c, (row if subset is None else expand(row)).cpu(), None, None, self.q_top_k)
        return choose_token(c, row, subset, expand, self.q_top_k)
