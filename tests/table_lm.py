"""TableLM: a drop-in stand-in for `CausalLM` whose next-token logits are a fixed random function of the WHOLE
prefix (hash-seeded), for fast statistical tests that still run the real workers and schedules.

Because the logits depend on every earlier token, any KV bookkeeping mistake (a rejected token kept, a position
off by one) changes the distributions and fails the chi-square tests. A forward costs microseconds, so tens of
thousands of seeded runs fit in a CI budget.
"""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch


class _TokenSlots:
    def __init__(self, num_slots: int, max_len: int):
        self.buf = torch.full((num_slots, max_len), -1, dtype=torch.long)
        self.max_len = max_len


class TableLM(torch.nn.Module):
    def __init__(self, vocab_size: int = 8, seed: int = 0, scale: float = 2.0, hidden_size: int = 4,
                 max_position_embeddings: int = 64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                                      hidden_size=hidden_size, eos_token_id=[])
        self.seed, self.scale = seed, scale
        self._cache: dict[tuple, torch.Tensor] = {}
        self._w = torch.nn.Parameter(torch.zeros(1))  # gives the module a device and dtype

    device = property(lambda self: self._w.device)
    dtype = property(lambda self: torch.float32)

    def new_kv_slots(self, num_slots: int, max_len: int) -> _TokenSlots:
        return _TokenSlots(num_slots, max_len)

    def next_logits(self, prefix: tuple[int, ...]) -> torch.Tensor:
        hit = self._cache.get(prefix)
        if hit is None:
            digest = hashlib.blake2b(repr((self.seed, prefix)).encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            hit = self._cache[prefix] = torch.randn(self.config.vocab_size, generator=gen) * self.scale
        return hit

    def forward(self, tokens, positions, slots, kv: _TokenSlots, logits_rows: slice | None = None):
        B, S = tokens.shape
        logits = torch.empty(B, S, self.config.vocab_size)
        for b in range(B):
            s = int(slots[b])
            kv.buf[s, positions[b]] = tokens[b]
            for j in range(S):
                p = int(positions[b, j])
                logits[b, j] = self.next_logits(tuple(kv.buf[s, :p + 1].tolist()))
        hidden = logits[..., :4].clone()
        return (logits if logits_rows is None else logits[:, logits_rows]), hidden
