"""Session bookkeeping of a replica: explicit ids, idle TTL, and an LRU bound on the session count.

Policy (documented in docs/services.md):
- every call that names a session refreshes its last-use time; a session idle longer than `ttl_s`
  is expired (its KV slot freed) and later calls get NOT_FOUND;
- `max_sessions` bounds the sessions (hence KV memory). Starting a session when full first reaps
  expired ones, then evicts the least-recently-used session if it has been idle at least
  `lru_min_idle_s`; otherwise the start is refused with RESOURCE_EXHAUSTED (all sessions are busy,
  evicting one would break a live request).
Pure Python; the servicer frees the worker's slot for every id this table evicts.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from types import MappingProxyType

from specdec.errors import CapacityError, InvalidRequestError, SessionNotFoundError

MAX_SESSION_ID_LEN = 128


class SessionTable:
    def __init__(self, max_sessions: int, ttl_s: float, lru_min_idle_s: float = 0.0, clock=time.monotonic):
        self.max_sessions, self.ttl_s, self.lru_min_idle_s = max_sessions, ttl_s, lru_min_idle_s
        self._clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, sid: str) -> bool:
        return sid in self._last

    def last_used(self):
        """Read-only {session id: monotonic time of its last call}."""
        return MappingProxyType(self._last)

    @staticmethod
    def check_id(sid: str) -> None:
        if not sid:
            raise InvalidRequestError("session_id", "is empty; pass a unique id per request (e.g. a UUID)")
        if len(sid) > MAX_SESSION_ID_LEN:
            raise InvalidRequestError("session_id", f"is longer than {MAX_SESSION_ID_LEN} characters; use a shorter id")

    def touch(self, sid: str) -> None:
        """Mark sid used now; NOT_FOUND if unknown or expired (the caller must restart the session)."""
        self.check_id(sid)
        now = self._clock()
        last = self._last.get(sid)
        if last is None:
            raise SessionNotFoundError(f"session {sid!r} not found on this replica (never started, ended, "
                                       "expired or evicted); call StartSession again with the full token history")
        if now - last > self.ttl_s:
            raise SessionNotFoundError(f"session {sid!r} expired after {self.ttl_s:g}s idle; call StartSession "
                                       "again with the full token history")
        self._last[sid] = now
        self._last.move_to_end(sid)

    def admit(self, sid: str) -> list[str]:
        """Reserve a slot for sid (re-starting an existing id reuses its slot). Returns ids to free."""
        self.check_id(sid)
        now = self._clock()
        evict = self.expired(now)
        for e in evict:
            del self._last[e]
        if sid not in self._last and len(self._last) >= self.max_sessions:
            lru, last = next(iter(self._last.items()))
            if now - last < self.lru_min_idle_s:
                raise self._full()
            del self._last[lru]
            evict.append(lru)
        self._last[sid] = now
        self._last.move_to_end(sid)
        return evict

    def check_room(self, sid: str) -> None:
        """Raise CapacityError where `admit(sid)` would, changing nothing: before work an admission may waste (a
        grammar's compile; a refused start would compile it and push a cached one out)."""
        self.check_id(sid)
        now = self._clock()
        if sid in self._last or len(self._last) < self.max_sessions:
            return
        if any(now - t > self.ttl_s for t in self._last.values()):
            return
        if now - next(iter(self._last.values())) < self.lru_min_idle_s:
            raise self._full()

    def _full(self) -> CapacityError:
        return CapacityError(f"replica holds {len(self._last)} active sessions (max_sessions={self.max_sessions}); "
                             "end finished sessions, retry on another replica, or raise max_sessions")

    def remove(self, sid: str) -> bool:
        return self._last.pop(sid, None) is not None

    def expired(self, now: float | None = None) -> list[str]:
        now = self._clock() if now is None else now
        return [s for s, t in self._last.items() if now - t > self.ttl_s]

    def reap(self) -> list[str]:
        """Drop and return expired ids (called periodically)."""
        gone = self.expired()
        for s in gone:
            del self._last[s]
        return gone
