"""Adaptive overlap for the PEARL modes: run a request's rounds overlapped (PEARL) or sequentially (sd/PACER),
whichever has committed more tokens per second so far. Pure Python; no torch, no grpc.

PEARL hides the draft behind the target's verify, which pays where the two compute on separate hardware. Where
they share a host's cores and memory bandwidth, a draft decoding beside the verify slows it (+40 % per target
step on a 2-vCPU host, `experiments/core_contention.py`), and the shadow drafting costs more than it hides.
Which case holds is a property of the deployment, and it can change with load, so each PEARL request measures
it: it starts overlapped, tries sequential rounds, then keeps the faster kind and re-tries the other every
`explore_every` decisions. Both kinds are exact, so the choice changes speed, never the output distribution.
Sampled requests adapt too: their rounds already depend on timing (where PEARL's shadow stream is cut, when the
target's load switches speculation off), so a seed fixes each draw, not the whole text of a separate request
(docs/api/grpc.md, "Seeds and reproducibility").

Sequential rounds are tried `explore_rounds` at a time. One round's rate is mostly the luck of its content (a
round of 8 looked-up tokens against one rejected at its first token), while an overlapped stretch spans several
rounds; deciding on a single sequential round kept some requests overlapped where overlap lost 25-45 %
(docs/benchmarks.md, "Adaptive overlap").
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OverlapChoice:
    explore_every: int = 8  # every n-th decision takes the kind that is behind (it may have become faster)
    explore_rounds: int = 4  # sequential rounds are tried this many in a row
    tokens: list[int] = field(default_factory=lambda: [0, 0])  # [sequential, overlapped]
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    decisions: int = 0
    streak: int = 0  # sequential rounds still to run in the current try

    def rate(self, overlapped: bool) -> float:
        return self.tokens[overlapped] / self.seconds[overlapped] if self.seconds[overlapped] > 0 else 0.0

    def next_overlapped(self) -> bool:
        """Whether the next round (at a point where no block is pending) runs overlapped."""
        self.decisions += 1
        if self.streak > 0:
            self.streak -= 1
            return False
        if self.seconds[True] == 0:
            return True  # the mode's own schedule first
        best = self.seconds[False] > 0 and self.rate(True) >= self.rate(False)
        pick = (not best) if self.decisions % self.explore_every == 0 else best
        if not pick and (self.seconds[False] == 0 or best):  # trying sequential: a few rounds in a row
            self.streak = self.explore_rounds - 1
        return pick

    def record(self, overlapped: bool, tokens: int, seconds: float) -> None:
        self.tokens[overlapped] += tokens
        self.seconds[overlapped] += seconds
