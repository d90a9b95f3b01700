"""`nn.Linear` with a faster kernel for one-row calls (a decode step) in bf16 on a CPU.

A decode step multiplies one activation row by every weight matrix, so its time is the time to stream the
weights. On a CPU, `F.linear(x, W)` with one bf16 row runs oneDNN's GEMM, which streams them slowly; `torch.mv(W,
x)` computes the same dot products (bf16 inputs, fp32 accumulation: identical logits on the default target) with a
GEMV kernel that streams faster. Measured on the default target (docs/benchmarks.md, "One-row bf16 kernel"). Calls
with more rows keep `F.linear`: taking them as `W @ x^T` was faster for some matrices in isolation, but not in the
model's forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GEMV_ONE_ROW = True  # False: always F.linear (for A/B measurements: scripts/forward_cost.py --kernels)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if GEMV_ONE_ROW and x.dtype is torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1]:
            y = torch.mv(self.weight, x.reshape(-1))
            if self.bias is not None:
                y = y + self.bias
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)
