"""A pinned session's moves between replica calls (functions of coordinator/backends/clients.py's `_Pinned`):
scale-in (its replica left the pool) and preemption by priority (coordinator/routing/preemption.py). Each happens
before a call, where the session holds nothing in flight, and ends with the session rebuilt from what it verified,
as after a failover.

A preempted request gives up its sessions in both pools, not just the one a waiter wants: while it waits for room
in one pool it makes no calls, so a session it kept in the other would sit idle where another request may need it
(and, with both pools full, the waiter and the victim could each wait for what the other holds). The backend a
call is in flight on (PEARL's shadow draft stream) gives its session up when that call ends. Each backend takes
room again at its own next call, the draft before the target (the order a new request takes them in).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from specdec.common.errors import CapacityError

log = logging.getLogger(__name__)


_ENDING: set[asyncio.Task] = set()  # EndSessions on their way, awaited by nobody (kept from the GC)


def end_in_background(coro) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)
    return task


async def ending(timeout: float) -> None:
    """Wait (at most `timeout`) for the EndSessions on their way: a closing pipeline lets them arrive."""
    if _ENDING:
        await asyncio.wait(list(_ENDING), timeout=timeout)


class PoolView:
    """A pipeline's cached copy of routable pool members (refreshed in the background, never per round): what
    tells a session to move (`gone`) or to yield (`preempts`)."""

    def __init__(self):
        self.members: dict[str, list[str]] = {}
        self.preempt: dict[str, list[str]] = {}  # holdings marked for preemption (coordinator/routing/preemption.py)

    def gone(self, kind: str, endpoint: str) -> bool:
        live = self.members.get(kind)
        return bool(live) and endpoint not in live  # an empty view (blip, startup) moves nothing

    def preempts(self, kind: str, holding: str) -> bool:
        return bool(holding) and holding in self.preempt.get(kind, ())


# The moves, as functions of a pinned backend `b` (clients.py's `_Pinned`): its session's state (`endpoint`, `sid`,
# `holding`, `in_call`, `give_up`, `gave_up`, `rebuild_due`, `sibling`, `room_lock`) and its replica calls (`pin`,
# `release`, `end_on`). `rebuild` (a coroutine function) builds the session again on the pinned replica.

@contextlib.asynccontextmanager
async def replica_call(b, rebuild=None):
    """One replica call of `b`, in flight for the `async with` block. Before it (`rebuild`: how the call's session
    is started again where it was given up): take room again after a preemption, yield to a waiter of higher
    priority, or move off a replica that left the pool; a session's start (no `rebuild`) only counts as in flight.
    A sibling's preemption must not end a session while a call of it is in flight (a rebuilding StartSession would
    fail NOT_FOUND; found by scripts/soak.py): it leaves `give_up` for the call's end, which gives the session up
    then."""
    b.in_call += 1
    try:
        if rebuild is not None:
            await _before_call(b, rebuild)
        yield
    finally:
        b.in_call -= 1
        if b.give_up and not b.in_call:
            await give_up_session(b)


async def _before_call(b, rebuild) -> None:
    if b.endpoint is None and b.sid:  # given up with its sibling's preemption
        await take_room(b, rebuild)
    elif b.rebuild_due:
        b.rebuild_due = False
        await rebuild()
    elif (b.endpoint is not None and b.view.preempts(b.kind, b.holding)
          and await b.pool.marked(b.kind, b.holding)):  # the view may be a refresh old
        await _yield_session(b, rebuild)
    elif b.endpoint is not None and b.view.gone(b.kind, b.endpoint):
        old = b.endpoint
        log.info("%s replica %s left the pool; moving session %s", b.kind, old, b.sid)
        await b.release(old)
        b.failed.append(old)
        await b.pin()
        await rebuild()
        end_later(b, old)  # best effort: free its slot if it is still up


def end_later(b, endpoint: str) -> None:
    """End `b`'s session on a replica it moved off, in the background (the move does not wait for it)."""
    end_in_background(b.end_on(endpoint))


async def _yield_session(b, rebuild) -> None:
    """Preempted: give up this session and the sibling's, wait for room with this request's own priority, and
    rebuild the session from what it verified (exact)."""
    log.info("%s session %s (priority %d) preempted on %s: it waits for room, then resumes", b.kind, b.sid,
             b.priority, b.endpoint)
    b.preemptions += 1
    await give_up_session(b)
    sib = b.sibling
    if sib is not None and sib.endpoint is not None:
        if sib.in_call:
            sib.give_up = True  # when its call in flight ends
        else:
            await give_up_session(sib)
    await take_room(b, rebuild)


async def yield_direct(draft, target, session_id: str) -> None:
    """A direct request preempted (coordinator/backends/direct.py): the coordinator cancelled its rounds, and its draft
    replica ends both sessions. Make sure the target's is gone, give both rooms back (the waiter of higher priority
    takes them), then take room again with the request's own priority, draft first as a new request does, for the
    coordinator's rounds to resume on."""
    marked = target if target.view.preempts(target.kind, target.holding) else draft
    log.info("%s session %s (priority %d) preempted on %s: it waits for room, then resumes", marked.kind, session_id,
             marked.priority, marked.endpoint)
    marked.preemptions += 1
    if target.endpoint is not None:
        await asyncio.shield(target.end_on(target.endpoint, session_id))
    for b in (target, draft):
        endpoint, token, b.endpoint = b.endpoint, b.holding, None
        if endpoint is not None:
            await b.pool.release(b.kind, endpoint, token)
    for b in (draft, target):
        await _pin_waiting(b, session_id)


async def give_up_session(b) -> None:
    """End the session and give its room back (a waiter of higher priority takes it). The backend is free the
    moment this starts (`endpoint` None); taking room again waits until the replica has ended the session, so
    that a rebuilt session of the same id is never ended by this."""
    b.give_up = False
    ep, token, b.endpoint = b.endpoint, b.holding, None
    if ep is None:
        return
    b.rounds.close()
    done = b.gave_up = asyncio.get_running_loop().create_future()
    try:
        try:  # shielded: a request cancelled meanwhile (deadline, client gone) must not leave the session behind
            await asyncio.shield(b.end_on(ep))
        finally:
            await b.pool.release(b.kind, ep, token)
    finally:
        done.set_result(None)


async def take_room(b, rebuild=None) -> None:
    """Pin again after giving the session up, and rebuild it (`rebuild` None: the caller does). A preempted
    request keeps its place in line: it waits out full queues rather than fail with output already verified.
    Calls that find the backend given up at once take room once: the first one pins and rebuilds."""
    async with b.room_lock:
        if b.endpoint is not None:
            return
        sib = b.sibling
        if b.kind == "target" and sib is not None and sib.sid and not sib.closed:
            # draft room before target room, the order a new request takes them in (its probe pins the draft
            # first): else this request could hold the target and wait for a draft that a new request holds
            # while it waits for the target, both until queue_wait_s (found by a chaos test)
            while sib.endpoint is not None and sib.give_up:  # its call in flight gives it up as it ends
                await asyncio.sleep(0.005)
            if sib.endpoint is None and not sib.closed:
                await take_room(sib)
                sib.rebuild_due = True
        if b.gave_up is not None:
            await asyncio.shield(b.gave_up)
        await _pin_waiting(b, b.sid)
        if rebuild is not None:
            await rebuild()


async def _pin_waiting(b, session_id: str) -> None:
    """Pin `b` again after a preemption, waiting out full queues: a preempted request keeps its place in line
    rather than fail with output already verified."""
    while True:
        try:
            await b.pin()
            return
        except CapacityError as e:
            log.info("preempted session %s still waits for room (%s)", session_id, e)
            await asyncio.sleep(1.0)
