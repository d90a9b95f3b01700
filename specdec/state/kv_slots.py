"""The KV cache of a model's sessions: one slot per session, written by absolute position (specdec/modeling/model.py).
"""
from __future__ import annotations

import torch


class KVSlots:
    """Per-layer K/V buffers `[num_slots, max_len, kv_heads, head_dim]`, written by absolute position."""

    def __init__(self, cfg, num_slots: int, max_len: int, device, dtype):
        shape = (num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim)
        # zeros, not empty: a batched forward reads every row up to the longest row, and masked-out garbage that
        # happens to be NaN would still poison the attention output (0 * NaN = NaN)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.num_slots, self.max_len = num_slots, max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the K/V of positions [0, n) of slot `src` into slot `dst`, every layer (a reused prompt prefix)."""
        for t in self.k + self.v:
            t[dst, :n] = t[src, :n]
