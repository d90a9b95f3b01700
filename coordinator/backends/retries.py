"""When a replica call that failed is tried again (coordinator/backends/clients.py): the statuses that move a
session, and the backoffs for a replica that is full."""
from __future__ import annotations

import asyncio

import grpc

MAX_FAILOVERS = 4  # replicas one request's backend moves to before its error stands
BUSY_TRIES = 7  # a round call sent again after a full replica queue (`waited_for_room`)
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


async def waited_for_room(e: grpc.aio.AioRpcError, tries: int) -> bool:
    """A round call refused because the replica's call queue is full (RESOURCE_EXHAUSTED; it applied nothing): back
    off (20 ms, doubling, ~2.5 s in all) and say to send it again. False: not that, or no tries left."""
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or tries >= BUSY_TRIES:
        return False
    await asyncio.sleep(0.02 * 2 ** tries)
    return True
