"""Prefix-aware routing: send a request to the replica that already holds its prompt's prefix.

A replica reuses whole prefill chunks of a prompt that one of its slots holds (specdec/state/prefix_cache.py); that only
pays if requests sharing a prefix (a system prompt, a conversation's earlier turns) land on the same replica.
The coordinator remembers, per pool, which replica each chunk-aligned prefix was last sent to, keyed by a chained
hash of the prompt's whole chunks, and prefers that replica for a new session when its load is within `slack`
sessions of the least-loaded one (the trade SGLang's cache-aware router and vLLM's production-stack router make:
affinity, unless it would pile requests on one replica). Pure Python, no grpc/ray.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

MAX_KEYS = 200_000  # remembered prefixes per pool (~100 bytes each): the oldest are forgotten first


def prefix_keys(prompt_ids: list[int], chunk: int, salt: str = "") -> list[bytes]:
    """One key per whole chunk of the prompt's prefilled part (prompt_ids[:-1]), shortest prefix first; key i
    names the prefix prompt_ids[:(i + 1) * chunk] under the request's cache salt (which the replicas match too)."""
    if chunk <= 0:
        return []
    keys, h = [], hashlib.blake2b(hashlib.blake2b(salt.encode()).digest(), digest_size=16)  # a fixed-size salt
    fed = prompt_ids[:-1]
    for at in range(0, len(fed) - chunk + 1, chunk):
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in fed[at:at + chunk]))
        keys.append(h.copy().digest())
    return keys


class PrefixAffinity:
    """Which replica each prefix was last routed to, LRU-bounded."""

    def __init__(self, slack: int = 2, max_keys: int = MAX_KEYS):
        self.slack, self.max_keys = slack, max_keys
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def prefer(self, keys: list[bytes], load: dict[str, int]) -> str | None:
        """Among `load`'s replicas (the candidates with room, → sessions pinned), the one that was sent the
        longest of these prefixes and whose load is within `slack` of the least loaded; else None."""
        if not keys or not load:
            return None
        least = min(load.values())
        for key in reversed(keys):  # the longest prefix first
            ep = self._where.get(key)
            if ep is not None and ep in load and load[ep] <= least + self.slack:
                return ep
        return None

    def record(self, keys: list[bytes], endpoint: str) -> None:
        for key in keys:
            self._where[key] = endpoint
            self._where.move_to_end(key)
        while len(self._where) > self.max_keys:
            self._where.popitem(last=False)

    def forget(self, endpoint: str) -> None:
        """A replica left the pool or failed: its cache is gone."""
        for key in [k for k, ep in self._where.items() if ep == endpoint]:
            del self._where[key]
