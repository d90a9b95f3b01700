"""Scaled dot-product attention of one sequence, with a decode path for CPUs.

One unmasked bf16/fp16 query on a CPU (a decode step) takes two small fp32 matmuls: PyTorch's fused CPU kernel
costs 5-7× more for it (default target shapes, 1 thread, 320 / 1,000 / 2,000 keys: 252 / 862 / 1,776 µs vs
53 / 125 / 251 µs, `scripts/kernel_micro.py`), and fp32 scores are at least as accurate as the fused kernel's
(docs/benchmarks.md, "Kernels per host and decode attention"). Everything else, several queries included, where
the fused kernel is as fast, takes it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DECODE_ATTENTION = True  # False: every call takes the fused SDPA kernel (A/B: scripts/kernel_ab.py --attention)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [1, H, S, hd], k/v: [1, KV, L, hd] (GQA when KV < H), mask: [1, 1, S, L] bool or None → [1, H, S, hd]."""
    H, KV = q.shape[1], k.shape[1]
    decode = q.shape[2] == 1 and mask is None and q.device.type == "cpu"
    if DECODE_ATTENTION and decode and q.dtype in (torch.bfloat16, torch.float16):
        qg = q.reshape(1, KV, H // KV, q.shape[-1]).float()  # the H // KV query heads that share each K/V head
        scores = torch.matmul(qg, k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5)
        out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
        return out.view(1, H, 1, q.shape[-1]).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=KV != H)
