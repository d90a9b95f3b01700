"""Scaled dot-product attention of one sequence, with a path for decode steps and verify blocks on CPUs.

A few bf16/fp16 queries on a CPU (a decode step, or a verify block of 1 + γ rows) take two small fp32 matmuls,
the query heads that share a K/V head stacked into one matrix, and the mask applied to the scores. PyTorch's
fused CPU kernel costs 5-7× more for one query (default target shapes, 1 thread, 320 / 1,000 / 2,000 keys:
252 / 862 / 1,776 µs vs 53 / 125 / 251 µs, `experiments/kernel_micro.py`) and ~1.4× more for a 3-row verify block
(104 vs 71 µs at 300 keys; 9 rows: 154 vs 143 µs), and fp32 scores are at least as accurate as the fused kernel's
(docs/benchmarks.md, "Kernels per host and decode attention"). Longer blocks (a prefill) take the fused kernel.
The switch is `specdec.common.settings` `decode_attention` (SPECDEC_DECODE_ATTENTION).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.common import settings

SMALL_BLOCK_ROWS = 16  # query rows up to which the two-matmul path runs (a verify block is 1 + γ ≤ 9 rows)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [1, H, S, hd], k/v: [1, KV, L, hd] (GQA when KV < H), mask: [1, 1, S, L] bool or None → [1, H, S, hd].
    Every query must see at least one key."""
    H, KV, S, hd = q.shape[1], k.shape[1], q.shape[2], q.shape[-1]
    small = S <= SMALL_BLOCK_ROWS and q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
    if small and settings.get().decode_attention:
        G = H // KV  # query head h reads K/V head h // G: stack each K/V head's G query heads (rows g, s)
        qg = q.reshape(1, KV, G * S, hd).float()
        scores = torch.matmul(qg, k.float().transpose(-1, -2)) * (hd ** -0.5)  # [1, KV, G * S, L]
        if mask is not None:
            scores = scores.view(1, KV, G, S, -1).masked_fill(~mask.unsqueeze(2), float("-inf")).view(1, KV, G * S, -1)
        out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
        return out.view(1, H, S, hd).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=KV != H)
