"""When a replica call that failed is tried again (coordinator/backends/clients.py): the statuses that move a
session, and the backoff for a replica that is full (`specdec_rpc.rounds.BusyWaits`)."""
from __future__ import annotations

import grpc

MAX_FAILOVERS = 4  # replicas one request's backend moves to before its error stands
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
