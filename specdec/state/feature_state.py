"""A feature draft's (EAGLE-style) per-position inputs: the target's features where known, zeros else. One per
session (`DraftSession.feats`), kept by the draft worker's `FeatureInputs` (specdec/workers/proposers/features.py).
Torch only."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.common.errors import InvalidRequestError


@dataclass
class TargetFeatures:
    """The target's final hidden states at positions start, start+1, ...: rows [n, D]. A feature draft reads
    them as its inputs (docs/design/feature_draft.md); they only steer the draft, never what is accepted."""
    start: int
    rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.rows.shape[0])


class FeatureState:
    """A feature draft's inputs by position: the target's features received so far, and whether each cached
    position was fed with the target's feature. Position p is fed with the feature of p - 1, or zeros where that
    is not known (p = 0, drafted tokens): the draft is trained for both. A cached position fed with zeros whose
    feature has arrived since is re-fed by the next call (`first_refeed`)."""

    def __init__(self, max_len: int, dim: int, dtype, device):
        self.true = torch.zeros((max_len, dim), dtype=dtype, device=device)
        self.known = torch.zeros(max_len, dtype=torch.bool, device=device)
        self.fed_true = torch.zeros(max_len, dtype=torch.bool, device=device)

    def add(self, f: TargetFeatures) -> None:
        n = len(f)
        if f.rows.ndim != 2 or f.rows.shape[1] != self.true.shape[1]:
            raise InvalidRequestError("features", f"rows must be [n, {self.true.shape[1]}], got {tuple(f.rows.shape)}")
        if f.start < 0 or f.start + n > self.true.shape[0]:
            raise InvalidRequestError("features", f"positions {f.start}..{f.start + n - 1} lie outside the context")
        self.true[f.start:f.start + n] = f.rows.to(self.true.dtype)
        self.known[f.start:f.start + n] = True

    def inputs(self, base: int, n: int) -> torch.Tensor:
        prev = torch.arange(base - 1, base + n - 1, device=self.true.device).clamp_min(0)
        rows = self.true[prev] * self.known[prev, None]
        if base == 0:
            rows[0] = 0
        return rows

    def fed(self, base: int, n: int) -> None:
        prev = torch.arange(base - 1, base + n - 1, device=self.true.device).clamp_min(0)
        self.fed_true[base:base + n] = self.known[prev]
        if base == 0:
            self.fed_true[0] = True

    def first_refeed(self, length: int) -> int:
        """The first cached position (< length) fed with zeros whose feature has arrived since, else length."""
        redo = ~self.fed_true[1:length] & self.known[:max(length - 1, 0)]
        hit = redo.nonzero()
        return int(hit[0, 0]) + 1 if hit.numel() else length
