"""Replica pools: membership (from discovery), health, least-loaded routing. A plain async class; the Ray actor
in `coordinator/actor.py` hosts one `PoolManager` per coordinator.

Routing policy
- A replica is routable when discovery lists it and its last health check said SERVING (a draining replica
  reports NOT_SERVING, so it stops receiving new sessions while its in-flight calls finish). A check that times
  out counts only at the `SLOW_CHECKS`-th in a row: on a busy host one slow answer made the only replica of a pool
  unroutable, and every request failed UNAVAILABLE at once.
- New sessions go to the routable replica with the fewest sessions pinned by this coordinator (ties: the one
  used least recently, so a new replica fills up first), unless prefix affinity prefers another: the replica the
  longest whole-chunk prefix of the prompt was last sent to, while it holds at most `affinity_slack` sessions more
  than the least loaded (coordinator/routing/affinity.py; its prefix cache then reuses that prefix).
- A call that fails with UNAVAILABLE reports the replica (`report_failure`): it is skipped until a health check
  passes again. If nothing is routable, `acquire` refreshes once before giving up with `ReplicaUnavailableError`
  naming the addresses it tried (→ UNAVAILABLE).

Admission (a pool at capacity queues, it does not fail)
- Each replica's capacity is its `ModelInfo.max_sessions`, read with `GetInfo` when it turns healthy (0 when
  unknown: no limit here, the replica's own RESOURCE_EXHAUSTED still applies).
- The same read checks a replica's vocabulary against the coordinator's tokenizer: one that cannot be that
  tokenizer's counts as unhealthy until it goes away (`replica_probes.vocabulary_mismatch`).
- Pairing: each draft replica's tokenizer fingerprint (`ModelInfo.tokenizer_fingerprint`, specdec/text/pairing.py) is
  compared with the target replicas' on the ids both have (of different sizes: the larger side's fingerprint of
  its first ids, from a second `GetInfo`). A draft of another tokenizer is refused like a wrong vocabulary: unusable
  until it goes away, with an ERROR naming both models and the first difference. A request that needs a draft
  while every draft replica is refused so fails with `DraftPairError` (→ FAILED_PRECONDITION) instead of going
  target-only (`draft_fallback` covers unreachable drafts, not wrong ones): the operator's mistake is reported,
  not hidden as a slow target-only service. A replica without a tokenizer (fingerprint '') is not compared.
- When every routable replica holds as many sessions pinned by this coordinator as its capacity, `acquire` waits
  for one to be released, first come first served within a request's `priority` (lower first), at most
  `wait_s`; then, or when `max_waiting` requests already wait, it fails with `CapacityError`
  (→ RESOURCE_EXHAUSTED) saying how many wait and what to change.
- A waiter may preempt a running request of lower priority (coordinator/routing/preemption.py; `preempt`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from coordinator.routing.affinity import PrefixAffinity
from coordinator.routing.members import Member, Pool, Waiter
from coordinator.routing.preemption import on_wait
from coordinator.routing.probes import (ReplicaInfo, end_session, grpc_capacity, grpc_health, grpc_tokenizer_prefix,
                                        vocabulary_mismatch)
from specdec.common.errors import CapacityError, ContextOverflowError, SpecDecError
from specdec.text.pairing import PairError, TokenizerFingerprint, fingerprint_difference, mismatch_message

log = logging.getLogger(__name__)
KINDS = ("draft", "target")
SERVICE_NAMES = {"draft": "specdec.v1.DraftService", "target": "specdec.v1.TargetService"}
SLOW_CHECKS = 3  # health checks in a row that time out before a healthy replica counts as unhealthy


class ReplicaUnavailableError(SpecDecError):
    """No replica of a pool could be reached (→ UNAVAILABLE). The message names the addresses tried; `kind` the
    pool ("draft", "target")."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # crosses Ray with its kind
        return type(self), (str(self), self.kind)


class DraftPairError(PairError):
    """Every draft replica is refused: none shares the target's tokenizer (→ FAILED_PRECONDITION). The message is
    the refusal of one of them, naming both models and the first difference."""
    kind = "draft"


class DraftContextError(ContextOverflowError):
    """The draft replicas' context is shorter than the request: it goes on target-only (COORDINATOR_DRAFT_FALLBACK)."""
    kind = "draft"


class PoolManager:
    """Owns the draft and target pools. `health_check(endpoint, service)`, `capacity_check(kind, endpoint)` and
    `prefix_check(kind, endpoint, prefix)` (a tokenizer fingerprint of the first ids) are injectable (tests); with an
    injected health check and no capacity check, capacities are unknown."""

    def __init__(self, sources: dict, refresh_s: float = 5.0, health_timeout_s: float = 1.0,
                 health_check=None, dialer=None, capacity_check=None, wait_s: float = 60.0,
                 max_waiting: int = 256, affinity_slack: int | None = 2, preempt: bool = True,
                 tokenizer_size: int = 0, prefix_check=None):
        """`affinity_slack`: sessions a replica may hold beyond the least loaded one and still get the requests
        whose prefixes it was sent (None: no prefix affinity). `preempt`: waiters take the sessions of running
        requests of lower priority (coordinator/routing/preemption.py)."""
        self.pools = {k: Pool(k, s, affinity=None if affinity_slack is None else PrefixAffinity(affinity_slack))
                      for k, s in sources.items() if s is not None}
        self.refresh_s = refresh_s
        self.health_timeout_s = health_timeout_s
        self.wait_s, self.max_waiting = wait_s, max_waiting
        self.preempt = preempt
        self.tokenizer_size = tokenizer_size  # the coordinator's tokens (0: no tokenizer): target vocabularies fit it
        self._health = health_check
        self._capacity = capacity_check
        self._prefix = prefix_check
        self._dialer = dialer  # coordinator/channels.py: plaintext unless set
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
        return await grpc_health(kind, endpoint, SERVICE_NAMES[kind], self.health_timeout_s, self._dialer)

    async def _check_capacity(self, kind: str, endpoint: str) -> ReplicaInfo:
        """A replica's `ReplicaInfo` (0 / '': unknown). An injected check may answer max_sessions alone, or a tuple
        (max_sessions, max_context, vocab_size, model, tokenizer fingerprint) cut anywhere after the first."""
        if self._capacity is not None:
            got = await self._capacity(kind, endpoint)
            return ReplicaInfo(got) if isinstance(got, int) else ReplicaInfo(*got)
        if self._health is not None:
            return ReplicaInfo()
        return await grpc_capacity(kind, endpoint, self.health_timeout_s, self._dialer)

    async def _tokenizer_prefix(self, kind: str, endpoint: str, prefix: int) -> TokenizerFingerprint | None:
        if self._prefix is not None:
            got = await self._prefix(kind, endpoint, prefix)
        elif self._health is not None:
            return None
        else:
            got = await grpc_tokenizer_prefix(kind, endpoint, prefix, self.health_timeout_s, self._dialer)
        return TokenizerFingerprint.parse(got)

    async def refresh(self) -> None:
        """Re-resolve every pool, health-check its members, learn new members' capacity, serve waiters."""
        async with self._lock:
            for pool in self.pools.values():
                await self._refresh_pool(pool)
            if await self._check_pairs():
                self._serve_waiters(self.pools["draft"])  # a waiter for a refused pool fails now
            self._warn_short_drafts()
            self.generation += 1

    async def _refresh_pool(self, pool: Pool) -> None:
        """One pool's part of `refresh` (under its lock): membership, health, capacities, then its waiters."""
        found = await pool.source.resolve()
        gone = self._update_members(pool, found)
        checks = await asyncio.gather(*(self._check(pool.kind, ep) for ep in found))
        for ep, (ok, err) in zip(found, checks):
            self._apply_check(pool, ep, ok, err)
        await self._learn_capacities(pool)
        if gone or any(not m.healthy for m in pool.members.values()):
            self.generation += 1
        self._serve_waiters(pool)

    def _update_members(self, pool: Pool, found: list[str]) -> list[str]:
        """Drop the members discovery no longer lists, add the new ones (unhealthy until checked) → those dropped."""
        gone = [ep for ep in pool.members if ep not in found]
        for ep in gone:
            log.info("%s replica %s left the pool (%d sessions pinned)", pool.kind, ep,
                     pool.members[ep].sessions)
            del pool.members[ep]
            if pool.affinity is not None:
                pool.affinity.forget(ep)
        for ep in found:
            if ep not in pool.members:
                log.info("%s replica %s joined the pool", pool.kind, ep)
                pool.members[ep] = Member(ep, healthy=False)
        return gone

    def _apply_check(self, pool: Pool, ep: str, ok: bool, err: str) -> None:
        """A member's health check: its health, unless it is refused (wrong vocabulary or tokenizer) or the check
        only timed out on a healthy member fewer than `SLOW_CHECKS` times in a row."""
        m = pool.members[ep]
        if self._slow_check_tolerated(pool, ep, m, ok, err):
            return
        if not ok:
            # checked anew when it is back (a restarted replica may serve another model)
            m.refused, m.pair_refused = "", False
        elif m.refused:
            ok, err = False, m.refused
        if ok != m.healthy and not m.refused:
            (log.info if ok else log.warning)("%s replica %s is %s%s", pool.kind, ep,
                                              "healthy" if ok else "unhealthy", f" ({err})" if err else "")
        m.healthy, m.last_error = ok, err
        if not ok:
            m.capacity = None  # ask again when it is back (a restarted replica may hold more or fewer)

    @staticmethod
    def _slow_check_tolerated(pool: Pool, ep: str, m: Member, ok: bool, err: str) -> bool:
        """Count a check that timed out; → whether it leaves the member as it was (a healthy one, fewer than
        `SLOW_CHECKS` in a row)."""
        slow = not ok and err.startswith("DEADLINE_EXCEEDED")
        m.slow_checks = m.slow_checks + 1 if slow else 0
        if slow and m.healthy and m.slow_checks < SLOW_CHECKS:
            # a busy host, more likely than a dead replica (that one refuses connections): a request
            # finding its only replica unroutable fails at once, so one slow answer must not do that
            log.info("%s replica %s: health check timed out (%d in a row; unhealthy at %d)", pool.kind,
                     ep, m.slow_checks, SLOW_CHECKS)
            return True
        return False

    async def _learn_capacities(self, pool: Pool) -> None:
        """Read the capacity, context, vocabulary, model and tokenizer of the healthy members not read yet; one whose
        vocabulary cannot be the coordinator tokenizer's is refused."""
        ask = [m for m in pool.members.values() if m.healthy and m.capacity is None]
        caps = await asyncio.gather(*(self._check_capacity(pool.kind, m.endpoint) for m in ask))
        for m, info in zip(ask, caps):
            m.capacity, m.max_context, m.vocab, m.vocab_warned = (info.max_sessions, info.max_context,
                                                                  info.vocab, False)
            m.model, m.fingerprint, m.paired_with = info.model, info.tokenizer_fingerprint, None
            m.refused = vocabulary_mismatch(self.tokenizer_size, info.vocab, pool.kind)
            m.pair_refused = bool(m.refused) and pool.kind == "draft"
            if m.refused:
                log.error("%s replica %s gets no requests: %s", pool.kind, m.endpoint, m.refused)
                m.healthy, m.last_error = False, m.refused

    async def _check_pairs(self) -> bool:
        """Compare each healthy draft replica's tokenizer with the target replicas' (module docstring, "Pairing"),
        once per target tokenizer it meets; → whether one was refused."""
        if "draft" not in self.pools or "target" not in self.pools:
            return False
        targets = [m for m in self.pools["target"].members.values() if m.healthy and m.fingerprint]
        if not targets:
            return False  # nothing to compare with yet: checked when a target replica reports its tokenizer
        common = Counter(m.fingerprint for m in targets).most_common(1)[0][0]
        target = next(m for m in targets if m.fingerprint == common)
        refused = False
        for m in self.pools["draft"].members.values():
            if not (m.healthy and m.fingerprint) or m.paired_with == common:
                continue
            why = await self._pair_difference(m, target)
            if why is None:  # a fingerprint could not be read: ask again at the next refresh
                continue
            m.paired_with = common
            if why:
                m.refused = mismatch_message(m.model or m.endpoint, target.model or target.endpoint, why)
                m.pair_refused, refused = True, True
                log.error("draft replica %s gets no requests: %s", m.endpoint, m.refused)
                m.healthy, m.last_error, m.capacity = False, m.refused, None
                self.generation += 1
        return refused

    async def _pair_difference(self, draft: Member, target: Member) -> str | None:
        """The first difference of two replicas' tokenizers on the ids both have ('' none; None: not readable)."""
        d, t = TokenizerFingerprint.parse(draft.fingerprint), TokenizerFingerprint.parse(target.fingerprint)
        if d is None or t is None:
            return ""  # a fingerprint of another format: not comparable here (the vocabulary check still applies)
        why = fingerprint_difference(d, t)
        if why is None:  # different sizes: the larger side's fingerprint of the ids both have
            if d.size > t.size:
                d = await self._tokenizer_prefix("draft", draft.endpoint, t.size)
            else:
                t = await self._tokenizer_prefix("target", target.endpoint, d.size)
            if d is None or t is None:
                return None
            why = fingerprint_difference(d, t)
        return why

    def _warn_short_drafts(self) -> None:
        """A draft replica whose model has fewer vocabulary rows than the target's (Qwen2.5-0.5B's for Qwen2.5-7B)
        refuses every prompt or bias holding an id past them (INVALID_ARGUMENT), unless it was started with the
        target's size (specdec/text/vocab.py); say so once per replica."""
        targets = [m.vocab for m in self.pools["target"].members.values() if m.vocab] if "target" in self.pools else []
        drafts = self.pools["draft"].members.values() if "draft" in self.pools else ()
        for m in drafts:
            if targets and 0 < m.vocab < max(targets) and not m.vocab_warned:
                m.vocab_warned = True
                log.warning("draft replica %s has %d vocabulary rows, the target %d: start it with "
                            "DRAFT_TARGET_VOCAB_SIZE=%d, or requests holding the target's last ids fail", m.endpoint,
                            m.vocab, max(targets), max(targets))

    def members(self) -> dict[str, list[str]]:
        """Routable endpoints per pool (pipelines cache this to move sessions off removed replicas)."""
        return {k: p.routable() for k, p in self.pools.items()}

    def marked(self, kind: str, holder: str) -> bool:
        """Whether this holding is still marked for preemption (a pipeline's view may be up to a refresh old)."""
        pool = self.pools.get(kind)
        h = pool.holdings.by_token.get(holder) if pool is not None else None
        return h is not None and h.marked

    def view(self) -> dict:
        """What pipelines cache: routable endpoints and the holdings marked for preemption, per pool."""
        return {"members": self.members(), "preempt": {k: p.holdings.marked() for k, p in self.pools.items()}}

    def snapshot(self) -> dict:
        return {k: {ep: {"healthy": m.healthy, "sessions": m.sessions, "capacity": m.capacity or 0,
                         "max_context": m.max_context, "error": m.last_error} for ep, m in p.members.items()}
                for k, p in self.pools.items()}

    def max_model_len(self) -> int:
        """The longest prompt + output every healthy target replica holds (vLLM's max_model_len; 0: unknown)."""
        known = [m.max_context for m in self.pools["target"].members.values() if m.healthy and m.max_context] \
            if "target" in self.pools else []
        return min(known, default=0)

    def waiting(self) -> dict[str, int]:
        """Requests waiting for room, per pool."""
        return {k: len(p.waiters) for k, p in self.pools.items()}

    # -- routing -----------------------------------------------------------------------------------------
    def _pool(self, kind: str) -> Pool:
        if kind not in self.pools:
            raise ReplicaUnavailableError(f"no {kind} pool is configured; set COORDINATOR_{kind.upper()}_DNS or "
                                          f"COORDINATOR_{kind.upper()}_ENDPOINTS", kind)
        return self.pools[kind]

    def _pick(self, pool: Pool, exclude: set[str], keys: list[bytes] = ()) -> str | None:
        cands = {ep: m for ep, m in pool.members.items() if m.healthy and ep not in exclude and m.has_room()}
        if not cands:
            return None
        ep = pool.affinity.prefer(keys, {e: m.sessions for e, m in cands.items()}) if pool.affinity else None
        m = cands[ep] if ep is not None else min(cands.values(), key=lambda m: (m.sessions, m.last_pick))
        m.sessions += 1
        m.last_pick = time.monotonic()
        if pool.affinity is not None:
            pool.affinity.record(keys, m.endpoint)
        return m.endpoint

    async def acquire(self, kind: str, exclude: list[str] | tuple = (), keys: list[bytes] = (),
                      priority: int = 0, holder: str = "") -> str:
        """Pin a new session to a routable replica of `kind` with room (the least loaded, or the one its prompt's
        prefix `keys` went to: module docstring); wait for room if all are full ("Admission"), served before
        waiters of a larger `priority`. `holder`: the request's token for this session (preemption; release
        it with the same)."""
        pool, exclude, keys = self._pool(kind), set(exclude), list(keys)
        # room is handed to waiters the moment it frees up, so room found here is room no waiter can use
        ep = self._pick(pool, exclude, keys)
        if ep is None and not pool.any_routable(exclude):
            await self.refresh()  # nothing routable: look again once
            ep = self._pick(pool, exclude, keys)
        if ep is not None:
            pool.holdings.record(holder, ep, priority)
            return ep
        if not pool.any_routable(exclude):
            raise self._unavailable(pool, exclude)
        return await self._wait(pool, exclude, keys, priority, holder)

    def _unavailable(self, pool: Pool, exclude: set[str]) -> ReplicaUnavailableError | DraftPairError:
        refused = [m for ep, m in pool.members.items() if m.pair_refused and ep not in exclude]
        if refused and not pool.any_routable(exclude):
            return DraftPairError(f"no draft replica can serve this target: {refused[0].refused}"
                                  + (f" ({len(refused)} draft replicas refused so)" if len(refused) > 1 else ""))
        tried = sorted(set(pool.members) | exclude)
        detail = "; ".join(f"{e} ({pool.members[e].last_error or 'excluded'})" if e in pool.members
                           else f"{e} (failed)" for e in tried)
        return ReplicaUnavailableError(
            f"no {pool.kind} replica reachable (pool {pool.source!r}; tried: {detail or 'none found'}); "
            f"start a {pool.kind} service or fix COORDINATOR_{pool.kind.upper()}_DNS/_ENDPOINTS", pool.kind)

    def _full(self, pool: Pool, what: str) -> CapacityError:
        cap = sum(m.capacity or 0 for m in pool.members.values() if m.healthy)
        return CapacityError(
            f"{what}: every routable {pool.kind} replica holds its max_sessions ({cap} sessions in all) and "
            f"{len(pool.waiters)} request(s) wait; retry later, add {pool.kind} replicas or raise their "
            f"--max-sessions (the wait is COORDINATOR_QUEUE_WAIT_S, the queue COORDINATOR_MAX_WAITING)")

    async def _wait(self, pool: Pool, exclude: set[str], keys: list[bytes], priority: int, holder: str) -> str:
        if len(pool.waiters) >= self.max_waiting:
            raise self._full(pool, f"the coordinator's queue is full ({self.max_waiting} waiting)")
        w = Waiter(exclude, asyncio.get_running_loop().create_future(), keys, priority, holder)
        pool.waiters.append(w)
        if self.preempt:
            on_wait(self.pools.values(), pool, w)
            if w.victim is not None:
                log.info("%s pool full: a request of priority %d preempts a session of priority %d", pool.kind,
                         priority, pool.holdings.by_token[w.victim].priority)
        if pool.full_since is None:
            pool.full_since = time.monotonic()
            log.warning("%s pool at capacity (%d sessions): new requests wait for a free session", pool.kind,
                        sum(m.capacity or 0 for m in pool.members.values() if m.healthy))
        try:
            done, _ = await asyncio.wait({w.future}, timeout=self.wait_s)
        except asyncio.CancelledError:  # the request went away while waiting
            self._forget(pool, w)
            raise
        if not done:
            self._forget(pool, w)
            raise self._full(pool, f"no {pool.kind} session became free within {self.wait_s:g} s")
        return w.future.result()  # the endpoint, or ReplicaUnavailableError if the pool emptied meanwhile

    def _forget(self, pool: Pool, w: Waiter) -> None:
        """A waiter gives up: leave the queue; a slot handed over at the same moment goes to the next one."""
        with contextlib.suppress(ValueError):
            pool.waiters.remove(w)
        pool.holdings.unmark(w.victim)  # no longer wanted, if it has not yielded yet
        handed = w.future.done() and not w.future.cancelled() and w.future.exception() is None
        if handed:
            self.release(pool.kind, w.future.result(), w.holder)  # serves the next waiter
        w.future.cancel()
        if not handed:
            self._serve_waiters(pool)  # the queue may be empty now (the drain log)

    def _serve_waiters(self, pool: Pool) -> None:
        """Hand free room to waiters in arrival order. A waiter that cannot use it (it excludes that replica
        after a failover) keeps its place, and the room goes to the next one."""
        self._serve(pool)
        if not pool.waiters and pool.full_since is not None:
            log.info("%s pool: the queue drained after %.1f s", pool.kind, time.monotonic() - pool.full_since)
            pool.full_since = None

    def _serve(self, pool: Pool) -> None:
        for w in sorted(pool.waiters, key=lambda w: w.priority):  # stable: arrival order within a priority
            if not any(m.healthy and m.has_room() for m in pool.members.values()) and pool.any_routable(w.exclude):
                return  # no room anywhere: everyone keeps waiting
            if w.future.done():
                pool.waiters.remove(w)
            elif not pool.any_routable(w.exclude):
                pool.waiters.remove(w)
                w.future.set_exception(self._unavailable(pool, w.exclude))
            elif (ep := self._pick(pool, w.exclude, w.keys)) is not None:
                pool.waiters.remove(w)
                pool.holdings.record(w.holder, ep, w.priority)
                pool.holdings.unmark(w.victim)  # room came: its victim, if it has not yielded yet, may stay
                w.future.set_result(ep)

    def release(self, kind: str, endpoint: str, holder: str = "") -> None:
        pool = self.pools.get(kind)
        if pool is None:
            return
        pool.holdings.drop(holder)
        m = pool.members.get(endpoint)
        if m is not None and m.sessions > 0:
            m.sessions -= 1
        self._serve_waiters(pool)

    def holds(self, kind: str, holder: str) -> bool:
        """Whether the token `holder` holds room in the `kind` pool, or waits for it."""
        pool = self.pools.get(kind)
        return pool is not None and bool(holder) and (holder in pool.holdings.by_token
                                                       or any(w.holder == holder for w in pool.waiters))

    def withdraw(self, kind: str, holder: str) -> None:
        """The request behind `holder` (a token) went away while it acquired: give back the room it was handed, or
        leave the queue. For a caller that cannot see the acquire's result (a cancelled Ray call)."""
        pool = self.pools.get(kind)
        if pool is None or not holder:
            return
        if (h := pool.holdings.by_token.get(holder)) is not None:
            self.release(kind, h.endpoint, holder)
        for w in [w for w in pool.waiters if w.holder == holder]:
            self._forget(pool, w)

    async def release_holders(self, prefix: str) -> int:
        """Give back everything held or awaited by tokens starting with `prefix` (a pipeline that died with its
        requests), and end those sessions on their replicas (a token is `prefix + session id + /kind/n`: best
        effort); → how many sessions were released."""
        held = []
        for kind, pool in self.pools.items():
            for token, h in list(pool.holdings.by_token.items()):
                if token.startswith(prefix):
                    self.release(kind, h.endpoint, token)
                    held.append((kind, h.endpoint, token[len(prefix):].split("/", 1)[0]))
            for w in [w for w in pool.waiters if w.holder.startswith(prefix)]:
                self._forget(pool, w)
        await asyncio.gather(*(end_session(kind, ep, sid, self.health_timeout_s, self._dialer)
                               for kind, ep, sid in held))
        return len(held)

    def report_failure(self, kind: str, endpoint: str, error: str = "") -> None:
        m = self.pools.get(kind, Pool(kind, None)).members.get(endpoint)
        if m is not None:
            m.healthy = False
            m.failures += 1
            m.last_error = error or "call failed"
            m.capacity = None
            pool = self.pools[kind]
            if pool.affinity is not None:  # a restarted replica's prefix cache is empty
                pool.affinity.forget(endpoint)
            self.generation += 1
            self._serve_waiters(pool)
