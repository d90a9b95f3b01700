"""A pool's state, as `coordinator/routing/pool.py`'s PoolManager keeps it: its members (one per replica), the requests
waiting for room, and the sessions handed out."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from coordinator.routing.affinity import PrefixAffinity
from coordinator.routing.preemption import Holdings


@dataclass
class Member:
    endpoint: str
    healthy: bool = True
    sessions: int = 0
    last_pick: float = 0.0
    failures: int = 0
    last_error: str = ""
    capacity: int | None = None  # ModelInfo.max_sessions; 0: unknown (no limit); None: not asked yet
    max_context: int = 0  # positions a session holds (ModelInfo.max_position_embeddings); 0: unknown
    refused: str = ""  # why it counts as unhealthy though it serves (a model that does not fit the tokenizer)
    pair_refused: bool = False  # a draft refused because it does not share the target's tokenizer (pool.py)
    model: str = ""  # ModelInfo.model
    fingerprint: str = ""  # ModelInfo.tokenizer_fingerprint ('': no tokenizer, not compared)
    paired_with: str | None = None  # the target fingerprint a draft was last compared with
    vocab: int = 0  # its model's vocabulary size (ModelInfo.vocab_size); 0: unknown
    vocab_warned: bool = False  # a draft replica with fewer vocabulary rows than the target's was logged
    slow_checks: int = 0  # health checks in a row that timed out while it counted as healthy

    def has_room(self) -> bool:
        return not self.capacity or self.sessions < self.capacity


@dataclass
class Waiter:
    exclude: set[str]
    future: asyncio.Future  # set to the endpoint handed over by `release`
    keys: list[bytes] = field(default_factory=list)  # the prompt's prefix keys (prefix affinity)
    priority: int = 0  # lower is served first; equal priorities in arrival order
    holder: str = ""  # the token the room it gets is recorded under (preemption)
    victim: str | None = None  # the holding it marked for preemption, if any


@dataclass
class Pool:
    kind: str
    source: object  # discovery source: async resolve() -> list[str]
    members: dict[str, Member] = field(default_factory=dict)
    waiters: deque[Waiter] = field(default_factory=deque)  # requests waiting for room, in arrival order
    full_since: float | None = None  # when requests started to queue (for the log), None while none waits
    affinity: PrefixAffinity | None = None  # which replica each prompt prefix went to (None: least loaded only)
    holdings: Holdings = field(default_factory=Holdings)  # the sessions handed out, for preemption

    def routable(self) -> list[str]:
        return [ep for ep, m in self.members.items() if m.healthy]

    def any_routable(self, exclude: set[str]) -> bool:
        return any(m.healthy and ep not in exclude for ep, m in self.members.items())
