"""Preemption by priority: a request that waits for room in a full pool may take the session of a running request
of lower priority (a larger `priority` value), as vLLM's priority scheduling preempts. Pure bookkeeping; the pool
(coordinator/routing/pool.py) decides when, and the preempted request (coordinator/backends/clients.py) yields its session.

- Every session the pool hands out is a *holding*: a token the request chose (`<request>/<pool>/<n>`, one per
  pinning), its replica, its priority and the order it was handed out in.
- A waiter of priority p marks at most one victim: among the holdings of priority > p on healthy replicas the
  waiter may use, not marked yet, the one of the largest priority value, and of those the one handed out last
  (the least work lost). A waiter that gives up unmarks its victim if that has not yielded yet.
- A request that waits for room in one pool cannot give up its session in another (it makes no calls while it
  waits): its holdings are never chosen while it waits, and a waiter that had marked one of them when it started
  waiting chooses again. Without this, a draft pool and a target pool that are both full deadlock a preemption:
  the victim waits for a draft session while the waiter waits for the victim's target session.
- The pipelines learn the marked tokens with their pool view (every `view_refresh_s`). A marked request ends its
  session at its next replica call, gives the room back (the waiter of highest priority gets it), and waits
  for room again itself, with its own priority. It then rebuilds its session from its history (prompt and the
  tokens verified so far), as after a failover: the output stays exact, only time is lost (a re-prefill).
- Equal priorities never preempt each other, so with every request at the default priority nothing is preempted.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass
class Holding:
    endpoint: str
    priority: int
    order: int
    marked: bool = False


class Holdings:
    """The sessions one pool handed out, by token."""

    def __init__(self):
        self.by_token: dict[str, Holding] = {}
        self._order = itertools.count()

    def record(self, token: str, endpoint: str, priority: int) -> None:
        if token:
            self.by_token[token] = Holding(endpoint, priority, next(self._order))

    def drop(self, token: str) -> None:
        self.by_token.pop(token, None)

    def mark_victim(self, priority: int, usable) -> str | None:
        """Mark the holding a waiter of `priority` preempts (`usable(token, holding)`: it may be preempted for this
        waiter); → its token, or None when no usable holding has a lower priority."""
        cands = [(h.priority, h.order, t) for t, h in self.by_token.items()
                 if not h.marked and h.priority > priority and usable(t, h)]
        if not cands:
            return None
        _, _, token = max(cands)
        self.by_token[token].marked = True
        return token

    def unmark(self, token: str | None) -> None:
        if token is not None and (h := self.by_token.get(token)) is not None:
            h.marked = False

    def marked(self) -> list[str]:
        return [t for t, h in self.by_token.items() if h.marked]


def request_of(token: str) -> str:
    return token.split("/", 1)[0]


def mark_for(pools, pool, waiter) -> None:
    """Choose `waiter`'s victim in `pool` (module docstring): lower priority, a healthy replica it may use, and a
    request that is not itself waiting anywhere. `pools`: every pool of the manager, `pool` among them."""
    blocked = {request_of(w.holder) for p in pools for w in p.waiters if w.holder}

    def usable(token: str, h: Holding) -> bool:
        m = pool.members.get(h.endpoint)
        return request_of(token) not in blocked and h.endpoint not in waiter.exclude and m is not None and m.healthy

    waiter.victim = pool.holdings.mark_victim(waiter.priority, usable)


def on_wait(pools, pool, waiter) -> None:
    """`waiter` (already queued in `pool`) starts waiting: waiters that marked its request's holdings elsewhere
    choose again, then it marks its own victim."""
    mine = request_of(waiter.holder)
    for other in pools:
        for w in list(other.waiters):
            if w is not waiter and w.victim and mine and request_of(w.victim) == mine:
                other.holdings.unmark(w.victim)
                mark_for(pools, other, w)
    mark_for(pools, pool, waiter)
