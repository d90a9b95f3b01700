"""`nn.Linear` with faster bf16 CPU kernels for the two shapes inference runs: one row and a few rows.

- **One row (a decode step).** Its time is the time to stream the weights. `F.linear(x, W)` with one bf16 row runs
  oneDNN's GEMM, which streams them slowly; `torch.mv(W, x)` computes the same dot products (bf16 inputs, fp32
  accumulation: identical logits on the default target) with a GEMV kernel that streams faster.
- **A few rows (a verify: 1 + drafted tokens).** `F.linear` re-lays the bf16 weight out for oneDNN on every call.
  `prepack()` does that once (`torch.ops.mkldnn._reorder_linear_weight`) and multi-row calls then run
  `mkldnn._linear_pointwise` on the packed copy: bit-identical outputs, and a 2-8-row forward of the default target
  costs about what a one-row forward does instead of ~1.2-1.3× (docs/benchmarks.md, "Multi-row bf16 kernel").
  The price is a second copy of the weights in memory, so only inference models are packed (`prepack_linears`).

Both kernels are measured against `F.linear` by `scripts/forward_cost.py --kernels`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_ONE_ROW = True  # False: one-row calls take F.linear (A/B measurements: scripts/forward_cost.py --kernels)
PACKED_MULTI_ROW = True  # False: multi-row calls take F.linear even where a packed weight exists (A/B)


def packing_supported() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear(nn.Linear):
    _packed: tuple[int, int, torch.Tensor] | None = None  # (weight data_ptr, weight version, packed weight)

    def prepack(self, rows_hint: int = 4) -> bool:
        """Lay a bf16 CPU weight out for oneDNN once; returns whether it did. The packed copy is used only while the
        weight is the same tensor at the same version (an in-place update or a `.to()` makes it stale: ignored)."""
        w = self.weight
        if w.dtype is not torch.bfloat16 or w.device.type != "cpu" or not packing_supported():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows_hint)
        except RuntimeError:  # a oneDNN build without bf16 support on this CPU: keep F.linear
            return False
        self._packed = (w.data_ptr(), w._version, packed)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16 and x.device.type == "cpu":
            if GEMV_ONE_ROW and x.numel() == x.shape[-1]:
                y = torch.mv(self.weight, x.reshape(-1))
                if self.bias is not None:
                    y = y + self.bias
                return y.view(*x.shape[:-1], self.out_features)
            p = self._packed
            if PACKED_MULTI_ROW and p is not None and p[0] == self.weight.data_ptr() and p[1] == self.weight._version:
                y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), p[2], self.bias, "none", [], "")
                return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def prepack_linears(model: nn.Module, rows_hint: int = 4) -> int:
    """`prepack` every `Linear` of an inference model; returns how many were packed (0 off a bf16 CPU)."""
    return sum(m.prepack(rows_hint) for m in model.modules() if isinstance(m, Linear))
