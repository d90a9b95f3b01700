"""A pinned session's per-round calls as messages on one open bidirectional stream (`VerifyRounds`, `DraftRounds`).

A sequential round (sd, pacer) makes two replica calls, a Draft and a Verify. As unary RPCs each pays a call's
set-up and tear-down on both ends; on an open stream it is one message each way (measured on a 2-vCPU host
against a server that computes 20 ms per call: 1.13 ms over the compute for a unary call, 0.55 ms for a message
on an open stream; docs/operations/failures.md, "Per-round streams").

The stream is only a faster wire for the same unary call, never a different protocol:

- Any trouble with it (the replica ended it with a status, it is draining, it does not know the method, the
  connection broke) closes it, and the request is sent again as the unary RPC, whose answer or status is the
  authoritative one. Positions are absolute and randomness is keyed, so a request the replica already applied is
  not applied twice and returns the same result.
- UNAVAILABLE, UNIMPLEMENTED, a broken stream or an early end turn streams off for that replica for the rest of
  the request (an older replica, a draining one, a dead one); the unary call then takes the usual failover path.
- Where the replica serves a frame port (specdec_rpc/frames.py) and `frames` opens a call there, the messages go
  on it instead of the gRPC stream, by the same rules, except that where a gRPC stream would be turned off, frames
  are (the request's later calls to that replica take its gRPC stream).
- One call at a time per stream: a call made while another is in flight goes unary.
- No deadline on the stream itself (it lives as long as the request); each message waits at most `timeout`
  seconds, then the stream is closed and the call fails with DEADLINE_EXCEEDED, as a unary call would.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Awaitable, Callable

import grpc


BUSY_WAIT_S = 30.0  # how long one round call is sent again after full replica queues (`BusyWaits`)
BUSY_FIRST_S, BUSY_MAX_S = 0.02, 0.5  # its backoff: 20 ms, doubling, at most 0.5 s a wait, jittered

# statuses after which this request stops using streams to that replica (the unary call decides what next)
_STREAMS_OFF = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class RoundStream:
    """`call(endpoint, request, unary)`: the replica's answer to `request`, over the open stream when possible.

    open_stream(endpoint) -> a grpc.aio StreamStreamCall; wrap(request) -> the stream's request message;
    unwrap(message) -> the unary response."""

    def __init__(self, open_stream: Callable[[str], grpc.aio.StreamStreamCall], wrap: Callable, unwrap: Callable,
                 timeout: float, enabled: bool = True, frames: Callable[[str], Awaitable] | None = None):
        """`frames(endpoint)`: a `FrameCall` on the replica's frame port, or None where it serves none."""
        self._open, self._wrap, self._unwrap, self.frames = open_stream, wrap, unwrap, frames
        self.timeout, self.enabled = timeout, enabled
        self._call: grpc.aio.StreamStreamCall | None = None
        self._endpoint: str | None = None
        self._busy = False
        self.off: set[str] = set()  # replicas this request no longer streams to
        self.frames_off: set[str] = set()  # replicas whose frame port failed this request (gRPC streams instead)
        self.on_frames = False  # the open stream is a frame call
        self.messages = 0  # calls answered over a stream
        self.fallbacks = 0  # calls resent unary after stream trouble

    async def call(self, endpoint: str, request, unary: Callable[[object], Awaitable]):
        if not self.enabled or self._busy or endpoint in self.off:
            return await unary(request)
        if self._endpoint != endpoint:
            self.close()
            frame_call = None
            if self.frames is not None and endpoint not in self.frames_off:
                frame_call = await self.frames(endpoint)
            self._call, self._endpoint = frame_call or self._open(endpoint), endpoint
            self.on_frames = frame_call is not None
        self._busy = True
        try:
            try:
                # the message is written before this coroutine first yields (no task in between): what else is ready
                # on the loop (a token message to the coordinator) runs while the replica computes, not before
                async with asyncio.timeout(self.timeout):
                    msg = await self._exchange(request)
            except TimeoutError:
                self.close()
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details=(
                    f"{endpoint} did not answer within {self.timeout} s (per-round stream); raise the coordinator's "
                    f"rpc_timeout_s if the replica is just slow")) from None
            except asyncio.CancelledError:
                self.close()  # a reply may still be on its way: this stream is out of step now
                raise
            except Exception as e:  # noqa: BLE001 - the unary call below gives the authoritative answer
                if not isinstance(e, grpc.aio.AioRpcError) or e.code() in _STREAMS_OFF:
                    (self.frames_off if self.on_frames else self.off).add(endpoint)
                self.close()
                self.fallbacks += 1
                return await unary(request)
            if msg is grpc.aio.EOF:  # the replica ended the stream without a status for this request
                (self.frames_off if self.on_frames else self.off).add(endpoint)
                self.close()
                self.fallbacks += 1
                return await unary(request)
            self.messages += 1
            return self._unwrap(msg)
        finally:
            self._busy = False

    async def _exchange(self, request):
        await self._call.write(self._wrap(request))
        return await self._call.read()

    def close(self) -> None:
        """Drop the stream (the replica's handler sees a cancel and ends; its session is untouched)."""
        call, self._call, self._endpoint, self.on_frames = self._call, None, None, False
        if call is not None and not call.done():
            call.cancel()

    async def aclose(self) -> None:
        """End the stream cleanly (half-close: the replica's handler returns OK)."""
        call, self._call, self._endpoint, self.on_frames = self._call, None, None, False
        if call is not None and not call.done():
            with contextlib.suppress(Exception):
                await call.done_writing()


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
