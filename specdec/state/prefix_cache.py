"""Prefix caching over per-session KV slots: a new session starts from the longest prefix of its prompt that a
slot already holds, and prefills only the rest.

A slot's K/V at position i depends only on the tokens at positions 0..i (a feature draft's also on the target's
features, so it does not take part). So the tokens a slot holds name what its cache holds: those of a live
session, and, after a session ends, those it held last. A free slot keeps them until it is handed to another
session. `SlotPrefixes` tracks the free slots' contents and picks, for a new prompt, where to reuse from:

- the longest match over every slot, live or free (a shared system prompt, a multi-turn chat's history, a
  request sent twice);
- a free slot that holds the match and nothing more is taken as it is (no copy); any other match is copied into a
  fresh slot, so the source keeps what it holds beyond the match;
- a fresh slot is the free one released longest ago, so the recently ended conversations stay reusable longest.

Exact, bitwise: a prefill runs in chunks of `prefill_chunk` positions aligned to absolute positions (0, C, 2C,
...), and only whole chunks that a prefill computed are reused. A warm prefill then runs the very same forwards,
on the same inputs, as the tail of a cold one, so it writes the same bits whatever the kernels' blocking (a
prefill's rows do round differently with the call's row count: a split prefill is not a whole one;
docs/guide/features.md, "Prefix caching"). Positions written by decode steps or verify blocks are never reused. Pure
Python; the worker copies the K/V (KVSlots.copy_prefix)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of `a` and `b` (at most `limit`), by bisection over slice
    comparisons, which run in C: O(n log n) element compares, no Python loop per token."""
    hi = min(len(a), len(b), len(a) if limit is None else limit)
    if hi == 0 or a[0] != b[0]:
        return 0
    if a[:hi] == b[:hi]:
        return hi
    lo = 1  # a[:lo] == b[:lo] holds; a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Reuse:
    """Where a new session's K/V comes from: `tokens` positions from `source` (a slot), into `slot`."""
    slot: int
    source: int | None  # None: nothing reused; == slot: the free slot held them, no copy
    tokens: int

    @property
    def copy(self) -> bool:
        return self.source is not None and self.source != self.slot and self.tokens > 0


class SlotPrefixes:
    """The free slots, oldest released first, each with the tokens whose K/V it still holds."""

    def __init__(self, num_slots: int):
        # slot -> (cache salt, tokens): a prefix is reused only by a session with the same salt
        self._free: OrderedDict[int, tuple[str, list[int]]] = OrderedDict((slot, ("", [])) for slot in range(num_slots))

    def __len__(self) -> int:
        return len(self._free)

    def release(self, slot: int, tokens: list[int], salt: str = "") -> None:
        """A session ended: its slot is free and still holds the K/V of `tokens` (its session's cache salt)."""
        self._free[slot] = (salt, list(tokens))

    def held(self, slot: int) -> list[int]:
        return self._free.get(slot, ("", []))[1]

    def take(self, want: list[int] | None, live: dict[int, tuple[str, list[int]]], align: int = 1,
             salt: str = "") -> Reuse:
        """Hand out a free slot for a session whose prefill is `want` (None: reuse nothing), reusing the longest
        prefix of it, in whole multiples of `align` positions, that a slot of a session with the same `salt`
        holds; `live` maps the live sessions' slots to their (salt, reusable tokens). Raises IndexError when no
        slot is free."""
        if not self._free:
            raise IndexError("no free slot")
        best, best_len = None, 0
        if want:
            for slot, (their_salt, held) in list(self._free.items()) + list(live.items()):
                if their_salt != salt:
                    continue
                n = common_prefix_len(want, held) // align * align
                # on a tie a free slot wins (no copy); among free ones the most recently released
                if n > best_len or (n == best_len and n and slot in self._free):
                    best, best_len = slot, n
        if best is None or best_len == 0:
            return Reuse(self._pop_oldest(), None, 0)
        if best in self._free and (best_len == len(self._free[best][1]) or len(self._free) == 1):
            del self._free[best]  # it holds nothing beyond the match, or nothing else is free: take it as it is
            return Reuse(best, best, best_len)
        # copy, so that what the source holds beyond the match stays reusable (a copy costs ~1 % of a prefill)
        return Reuse(self._pop_oldest(keep=best), best, best_len)

    def _pop_oldest(self, keep: int | None = None) -> int:
        slot = next(s for s in self._free if s != keep)
        del self._free[slot]
        return slot
