"""Replica pools: membership (from discovery), health, least-loaded routing. A plain async class; the Ray actor
in `coordinator/actor.py` hosts one `PoolManager` per coordinator.

Routing policy
- A replica is routable when discovery lists it and its last health check said SERVING (a draining replica
  reports NOT_SERVING, so it stops receiving new sessions while its in-flight calls finish).
- New sessions go to the routable replica with the fewest sessions pinned by this coordinator (ties: the one
  used least recently, so a new replica fills up first).
- A call that fails with UNAVAILABLE reports the replica (`report_failure`): it is skipped until a health check
  passes again. If nothing is routable, `acquire` refreshes once before giving up with `ReplicaUnavailableError`
  naming the addresses it tried (→ UNAVAILABLE).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from specdec.errors import SpecDecError

log = logging.getLogger(__name__)
KINDS = ("draft", "target")
SERVICE_NAMES = {"draft": "specdec.v1.DraftService", "target": "specdec.v1.TargetService"}


class ReplicaUnavailableError(SpecDecError):
    """No replica of a pool could be reached (→ UNAVAILABLE). The message names the addresses tried."""


@dataclass
class Member:
    endpoint: str
    healthy: bool = True
    sessions: int = 0
    last_pick: float = 0.0
    failures: int = 0
    last_error: str = ""


@dataclass
class Pool:
    kind: str
    source: object  # discovery source: async resolve() -> list[str]
    members: dict[str, Member] = field(default_factory=dict)

    def routable(self) -> list[str]:
        return [ep for ep, m in self.members.items() if m.healthy]


async def grpc_health(endpoint: str, service: str, timeout: float, credentials=None) -> tuple[bool, str]:
    """(SERVING?, error text) of one replica via the standard health service."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.aio.secure_channel(endpoint, credentials) if credentials is not None
               else grpc.aio.insecure_channel(endpoint))
    try:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout)
        ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        return ok, "" if ok else "NOT_SERVING (draining)"
    except grpc.aio.AioRpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    finally:
        await channel.close()


class PoolManager:
    """Owns the draft and target pools. `health_check(endpoint, service)` is injectable (tests)."""

    def __init__(self, sources: dict, refresh_s: float = 5.0, health_timeout_s: float = 1.0,
                 health_check=None, credentials_factory=None):
        self.pools = {k: Pool(k, s) for k, s in sources.items() if s is not None}
        self.refresh_s = refresh_s
        self.health_timeout_s = health_timeout_s
        self._health = health_check
        self._credentials_factory = credentials_factory
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self.generation = 0  # bumped on every membership change

    # -- membership --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Refresh now, then every refresh_s in the background (idempotent)."""
        if self._task is None:
            await self.refresh()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self):
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a bad refresh must not stop the loop
                log.exception("pool refresh failed")

    async def _check(self, kind: str, endpoint: str) -> tuple[bool, str]:
        if self._health is not None:
            return await self._health(endpoint, SERVICE_NAMES[kind])
        creds = self._credentials_factory() if self._credentials_factory else None
        return await grpc_health(endpoint, SERVICE_NAMES[kind], self.health_timeout_s, creds)

    async def refresh(self) -> None:
        """Re-resolve every pool and health-check its members."""
        async with self._lock:
            for pool in self.pools.values():
                found = await pool.source.resolve()
                gone = [ep for ep in pool.members if ep not in found]
                for ep in gone:
                    log.info("%s replica %s left the pool (%d sessions pinned)", pool.kind, ep,
                             pool.members[ep].sessions)
                    del pool.members[ep]
                for ep in found:
                    if ep not in pool.members:
                        log.info("%s replica %s joined the pool", pool.kind, ep)
                        pool.members[ep] = Member(ep, healthy=False)
                checks = await asyncio.gather(*(self._check(pool.kind, ep) for ep in found))
                for ep, (ok, err) in zip(found, checks):
                    m = pool.members[ep]
                    if ok != m.healthy:
                        log.info("%s replica %s is %s%s", pool.kind, ep, "healthy" if ok else "unhealthy",
                                 f" ({err})" if err else "")
                    m.healthy, m.last_error = ok, err
                if gone or any(not m.healthy for m in pool.members.values()):
                    self.generation += 1
            self.generation += 1

    def members(self) -> dict[str, list[str]]:
        """Routable endpoints per pool (pipelines cache this to move sessions off removed replicas)."""
        return {k: p.routable() for k, p in self.pools.items()}

    def snapshot(self) -> dict:
        return {k: {ep: {"healthy": m.healthy, "sessions": m.sessions, "error": m.last_error}
                    for ep, m in p.members.items()} for k, p in self.pools.items()}

    # -- routing -----------------------------------------------------------------------------------------
    def _pool(self, kind: str) -> Pool:
        if kind not in self.pools:
            raise ReplicaUnavailableError(f"no {kind} pool is configured; set COORDINATOR_{kind.upper()}_DNS or "
                                          f"COORDINATOR_{kind.upper()}_ENDPOINTS")
        return self.pools[kind]

    def _pick(self, pool: Pool, exclude: set[str]) -> str | None:
        cands = [m for ep, m in pool.members.items() if m.healthy and ep not in exclude]
        if not cands:
            return None
        m = min(cands, key=lambda m: (m.sessions, m.last_pick))
        m.sessions += 1
        m.last_pick = time.monotonic()
        return m.endpoint

    async def acquire(self, kind: str, exclude: list[str] | tuple = ()) -> str:
        """Pin a new session to the least-loaded routable replica of `kind`."""
        pool = self._pool(kind)
        ep = self._pick(pool, set(exclude))
        if ep is None:
            await self.refresh()
            ep = self._pick(pool, set(exclude))
        if ep is None:
            tried = sorted(set(pool.members) | set(exclude))
            detail = "; ".join(f"{e} ({pool.members[e].last_error or 'excluded'})" if e in pool.members
                               else f"{e} (failed)" for e in tried)
            raise ReplicaUnavailableError(
                f"no {kind} replica reachable (pool {pool.source!r}; tried: {detail or 'none found'}); "
                f"start a {kind} service or fix COORDINATOR_{kind.upper()}_DNS/_ENDPOINTS")
        return ep

    def release(self, kind: str, endpoint: str) -> None:
        m = self.pools.get(kind, Pool(kind, None)).members.get(endpoint)
        if m is not None and m.sessions > 0:
            m.sessions -= 1

    def report_failure(self, kind: str, endpoint: str, error: str = "") -> None:
        m = self.pools.get(kind, Pool(kind, None)).members.get(endpoint)
        if m is not None:
            m.healthy = False
            m.failures += 1
            m.last_error = error or "call failed"
            self.generation += 1
