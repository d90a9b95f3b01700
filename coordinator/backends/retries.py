"""When a replica call that failed is tried again (coordinator/backends/clients.py): the statuses that move a
session, and the backoffs for a replica that is full."""
from __future__ import annotations

import asyncio
import random
import time

import grpc

MAX_FAILOVERS = 4  # replicas one request's backend moves to before its error stands
BUSY_WAIT_S = 30.0  # how long one round call is sent again after full replica queues (`waited_for_room`)
BUSY_FIRST_S, BUSY_MAX_S = 0.02, 0.5  # its backoff: 20 ms, doubling, at most 0.5 s a wait, jittered
FULL_WAITS = 6  # a session start asked again of a full replica, with no other (`clients._Pinned._next_replica`)


def retryable(e: BaseException) -> str | None:
    """"unavailable" (move the session to another replica), "lost" (rebuild it on this one) or None (not retried)."""
    if isinstance(e, grpc.aio.AioRpcError):
        # CANCELLED: the replica cancelled the call (a server that stops cancels the calls reaching it meanwhile);
        # the coordinator's own cancels end its calls with asyncio's CancelledError, or are handled before this
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            return "unavailable"
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return "lost"
    return None


class BusyWaits:
    """The waits of one round call refused by full replica queues. A full queue is backpressure, not a fault: the
    call is sent again after a jittered, doubling backoff (so that the sessions refused together do not come back
    together) for up to `BUSY_WAIT_S` in all, however many refusals that takes."""

    __slots__ = ("tries", "since")

    def __init__(self):
        self.tries, self.since = 0, None

    async def waited_for_room(self, e: grpc.aio.AioRpcError) -> bool:
        """`e` refused the call for a full queue (RESOURCE_EXHAUSTED; the replica applied nothing): back off and say
        to send it again. False: not that, or the call has waited `BUSY_WAIT_S` already."""
        if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since >= BUSY_WAIT_S:
            return False
        cap = min(BUSY_MAX_S, BUSY_FIRST_S * 2 ** min(self.tries, 16))
        self.tries += 1
        await asyncio.sleep(random.uniform(cap / 2, cap))
        return True
