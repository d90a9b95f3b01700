"""The session table: sessions by explicit id, an idle TTL, and a bound on their number.

Policy (docs/api/grpc.md, "DraftService and TargetService"):
- every call that names a session refreshes its last-use time (`touch`); a session idle longer than `ttl_s` has
  expired: calls on it are refused (NOT_FOUND) whether or not it was reaped yet;
- `max_sessions` bounds the sessions (hence KV memory). Making room for a new one first drops the expired ones,
  then evicts the least-recently-used session if it has been idle at least `lru_min_idle_s` (None: never);
  otherwise the start is refused (all sessions are busy: evicting one would break a live request).

A worker keeps its sessions (KV slot, tokens) in one, on its model thread; a replica keeps another on its event
loop for the admission policy, and frees the worker's slot of every id that one drops. Pure Python.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from types import MappingProxyType
from typing import Generic, Iterator, Mapping, TypeVar

from specdec.common.errors import CapacityError, InvalidRequestError, SessionNotFoundError

MAX_SESSION_ID_LEN = 128

V = TypeVar("V")


class SessionTable(Generic[V]):
    """{session id: value}, least recently used first. Reads (`get`, `[]`, `in`, iteration) change nothing;
    `touch` is a call's use of a session."""

    def __init__(self, max_sessions: int, ttl_s: float, lru_min_idle_s: float | None = 0.0, clock=time.monotonic):
        self.max_sessions, self.ttl_s, self.lru_min_idle_s = max_sessions, ttl_s, lru_min_idle_s
        self._clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()  # oldest use first
        self._values: dict[str, V] = {}

    # ---- reads ------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, sid: object) -> bool:
        return sid in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._last))

    def __getitem__(self, sid: str) -> V:
        return self._values[sid]

    def get(self, sid: str, default=None):
        return self._values.get(sid, default)

    def values(self) -> list[V]:
        return [self._values[s] for s in self._last]

    def items(self) -> list[tuple[str, V]]:
        return [(s, self._values[s]) for s in self._last]

    def last_used(self) -> Mapping[str, float]:
        """Read-only {session id: monotonic time of its last call}."""
        return MappingProxyType(self._last)

    @staticmethod
    def check_id(sid: str) -> None:
        if not sid:
            raise InvalidRequestError("session_id", "is empty; pass a unique id per request (e.g. a UUID)")
        if len(sid) > MAX_SESSION_ID_LEN:
            raise InvalidRequestError("session_id", f"is longer than {MAX_SESSION_ID_LEN} characters; use a shorter id")

    # ---- use ----------------------------------------------------------------------------------------------------
    def touch(self, sid: str) -> V:
        """A call's use of sid: its value, its last use now. NOT_FOUND if unknown or expired (the caller must
        start the session again)."""
        self.check_id(sid)
        now = self._clock()
        last = self._last.get(sid)
        if last is None:
            raise SessionNotFoundError(f"session {sid!r} is unknown on this replica (never started, ended, expired "
                                       "or evicted); call StartSession again with the full token history")
        if now - last > self.ttl_s:
            raise SessionNotFoundError(f"session {sid!r} expired after {self.ttl_s:g}s idle; call StartSession "
                                       "again with the full token history")
        self._last[sid] = now
        self._last.move_to_end(sid)
        return self._values[sid]

    def make_room(self, sid: str) -> list[tuple[str, V]]:
        """Drop what must go for sid to be added: the expired sessions, then (when full) the least recently used
        one if it idled long enough. → the (id, value) pairs dropped; CapacityError when none may go. Re-starting
        an id in the table reuses its place."""
        self.check_id(sid)
        now = self._clock()
        gone = [(e, self._drop(e)) for e in self.expired(now)]
        if sid not in self._last and len(self._last) >= self.max_sessions:
            lru, last = next(iter(self._last.items()))
            if self.lru_min_idle_s is None or now - last < self.lru_min_idle_s:
                raise self._full()
            gone.append((lru, self._drop(lru)))
        return gone

    def add(self, sid: str, value: V) -> None:
        """Hold sid (after `make_room`), used now."""
        self._last[sid] = self._clock()
        self._last.move_to_end(sid)
        self._values[sid] = value

    def admit(self, sid: str, value: V = None) -> list[str]:
        """Make room for sid and hold it. → the ids dropped to make room, whose resources the caller frees."""
        gone = self.make_room(sid)
        self.add(sid, value)
        return [e for e, _ in gone]

    def check_room(self, sid: str) -> None:
        """Raise CapacityError where `admit(sid)` would, changing nothing: before work an admission may waste (a
        grammar's compile; a refused start would compile it and push a cached one out)."""
        self.check_id(sid)
        now = self._clock()
        if sid in self._last or len(self._last) < self.max_sessions:
            return
        if any(now - t > self.ttl_s for t in self._last.values()):
            return
        if self.lru_min_idle_s is None or now - next(iter(self._last.values())) < self.lru_min_idle_s:
            raise self._full()

    def _full(self) -> CapacityError:
        return CapacityError(f"all {len(self._last)} session slots are busy (max_sessions={self.max_sessions}); end "
                             "finished sessions, retry later or on another replica, or raise max_sessions")

    def remove(self, sid: str) -> V | None:
        """Forget sid. → its value (None if it was not held)."""
        if sid not in self._last:
            return None
        return self._drop(sid)

    def _drop(self, sid: str) -> V:
        del self._last[sid]
        return self._values.pop(sid)

    def expired(self, now: float | None = None) -> list[str]:
        now = self._clock() if now is None else now
        return [s for s, t in self._last.items() if now - t > self.ttl_s]

    def reap(self) -> list[str]:
        """Drop and return the expired ids (called periodically)."""
        gone = self.expired()
        for s in gone:
            self._drop(s)
        return gone
