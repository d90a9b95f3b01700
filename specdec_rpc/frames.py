"""Per-round messages on a plain TCP connection: the data plane's fast wire (the replicas' frame port).

A speculative round makes one Draft and one Verify call (or one Verify on the direct data plane). Over gRPC's
per-round streams (`specdec_rpc/rounds.py`) each message still crosses gRPC's own threads on both ends: its
event-engine thread and the poller thread that hands completions to the event loop, so a round trip wakes about
three threads per process and costs about 0.23 ms of gRPC machinery even on an idle loopback (against about
0.09 ms for the same bytes on an asyncio socket; docs/benchmarks.md, "The round trip"). Here the event loop reads
the socket itself: a message wakes one thread.

The frames carry exactly the per-round streams' messages, `VerifyRoundsRequest` / `DraftRoundsRequest` in,
`VerifyRoundsResponse` / `DraftRoundsResponse` out, and each request is answered by the unary handler (`Verify`,
`Draft`) through the replica's error interceptor: the same results, status codes and messages, metrics and log
binding as the unary call. One request at a time per connection, handled as it is read (no read-ahead task
between the socket and the handler: the stream's read-ahead serves chained verifies, which frames do not carry).
So this is a faster wire for the same call, never a different protocol: the client side is a drop-in for the gRPC
stream that `RoundStream` opens, and any trouble sends the call again as the unary RPC, whose answer or status is
the authoritative one.

The wire, one connection per request and replica:

- a frame is a 4-byte little-endian length, then that many bytes (at most `MAX_FRAME`);
- the client's first frame is the hello: UTF-8 JSON `{"method": "VerifyRounds" | "DraftRounds", "metadata":
  [[key, value], ...]}` (the call's gRPC metadata: the trace context);
- then each client frame is one request message (protobuf), answered in order by one server frame: a status byte
  (0: OK, followed by the response message; otherwise the gRPC status code's value, followed by its UTF-8 details,
  after which the server closes the connection);
- the client ends the call by closing the connection.

Order: the calls of one session on one gRPC connection reach the replica in the order they were made, a cancel
included; a frame connection is a second connection, so a call on it can overtake a cancel or a call sent
on gRPC just before. Callers therefore use frames only for requests whose calls are sequential: each answered
before the next is made, none cancelled mid-flight (`GenerationRequest.sequential_calls`: ar, sd, pacer); the
PEARL modes, which overlap a draft stream with verifies and cancel what a rejection makes moot, stay on gRPC.
A request the replica has in hand when its client closes the connection runs to its end (a sequential request
closes only when it ends, or to resend the call unary, which names the same positions).

TLS: where the replica serves gRPC over TLS, the frame port serves TLS with the same certificate, key and client
certificate rule (mTLS), and clients dial it with the same trust roots and identity.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import ssl
import struct
import time
from typing import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

MAX_FRAME = 16 * 1024 * 1024  # the gRPC message limit of the replicas' channels (specdec_rpc/channels.py)
HELLO_TIMEOUT_S = 10.0  # a connection that names no method within this is closed
CONNECT_TIMEOUT_S = 2.0  # a frame port that does not accept within this (a firewall that drops) counts as down
DOWN_S = 30.0  # ... and is not dialed again for this long: the calls take gRPC meanwhile
_LEN = struct.Struct("<I")
_OK = 0


class FrameError(ConnectionError):
    """The peer broke the frame protocol (a frame over `MAX_FRAME`, a hello that is not one)."""


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise FrameError(f"a frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    return await reader.readexactly(n)


def _spin(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seconds: float) -> None:
    """Wait up to `seconds` awake for the connection's next bytes, where neither the reader's buffer nor this loop
    has anything else to do. A thread that sleeps in the event loop's poll is woken by the kernel when the bytes come,
    which on a VM costs the sender an inter-processor interrupt and the sleeper a cold core, often more than a short
    wait; one that polls the socket takes the bytes as they land. The loop runs nothing else meanwhile, hence the
    bound and the check that nothing is ready (`_ready`: the callbacks the loop would run next)."""
    if seconds <= 0 or reader._buffer or getattr(asyncio.get_running_loop(), "_ready", True):
        return
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    end = time.perf_counter() + seconds
    while not poller.poll(0) and time.perf_counter() < end:
        pass


def _frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise FrameError(f"a frame of {len(payload)} bytes is over the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(payload)) + payload


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ---------------------------------------------------------------------------------------------------------------
# the replica's side


class FrameContext:
    """What a per-round handler and the error interceptor use of a gRPC servicer context, for one connection."""

    def __init__(self, metadata: tuple, peer: str):
        self._metadata, self._peer = metadata, peer
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._done = False

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata) -> None:
        pass  # the per-round handlers send none

    def done(self) -> bool:
        return self._done


class FrameServer:
    """The replica's frame port. `methods`: {"VerifyRounds": (behavior, wrap), ...}: `behavior(request bytes,
    context)` the unary handler as the error interceptor wraps it (its deserializer takes the per-round request's
    bytes to the unary request), `wrap(response)` the per-round response message."""

    def __init__(self, methods: dict[str, Callable], ssl_context: ssl.SSLContext | None = None, spin_s: float = 0.0):
        """`spin_s`: how long a connection waits awake for its next request (`_spin`)."""
        self.methods, self.ssl_context, self.spin_s = methods, ssl_context, spin_s
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._serve, host, port, ssl=self.ssl_context,
                                                 limit=MAX_FRAME + _LEN.size)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and end every connection (their calls' clients resend them unary)."""
        if self.server is not None:
            self.server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(BaseException):
                await task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        _nodelay(writer)
        peer = writer.get_extra_info("peername")
        context = FrameContext((), f"frames:{peer[0]}:{peer[1]}" if peer else "frames")
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                hello = json.loads(await _read_frame(reader))
            behavior = self.methods.get(hello.get("method")) if isinstance(hello, dict) else None
            if behavior is None:
                known = ", ".join(sorted(self.methods))
                writer.write(_frame(bytes([grpc.StatusCode.UNIMPLEMENTED.value[0]]) + (
                    f"this frame port serves {known}; the hello named {hello!r:.100}").encode()))
                return
            context._metadata = tuple((str(k), str(v)) for k, v in hello.get("metadata") or ())
            behavior, wrap = behavior
            while True:
                _spin(reader, writer, self.spin_s)
                try:
                    data = await _read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client ended the call
                try:
                    response = await behavior(data, context)
                except grpc.aio.AbortError:
                    code = context.code() or grpc.StatusCode.UNKNOWN
                    writer.write(_frame(bytes([code.value[0]]) + context.details().encode()))
                    await writer.drain()
                    return
                writer.write(_frame(bytes([_OK]) + wrap(response).SerializeToString()))
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError, TypeError,
                ssl.SSLError):
            pass  # a client that went away, or never spoke the protocol: nothing to answer
        finally:
            context._done = True
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def server_ssl_context(tls) -> ssl.SSLContext | None:
    """The frame port's TLS from the replica's `TLSSettings` (None: plaintext, as its gRPC port)."""
    if not tls.enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.ca_file:
        ctx.load_verify_locations(tls.ca_file)
    ctx.verify_mode = ssl.CERT_REQUIRED if tls.require_client_auth else ssl.CERT_NONE
    return ctx


def client_ssl_context(ca_file: str | None, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext:
    """Dialing a TLS frame port: trust `ca_file` (the system's roots if None), present cert/key for mTLS."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert_file and key_file:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


# ---------------------------------------------------------------------------------------------------------------
# the caller's side


class FrameCall:
    """One per-round call on a frame port, shaped as the gRPC stream-stream call `RoundStream` drives (`write`,
    `read`, `done_writing`, `cancel`, `done`). It connects on its first write; every failure is a
    `grpc.aio.AioRpcError` with the status a gRPC stream would have ended with (UNAVAILABLE for a connection that
    could not be made or broke)."""

    def __init__(self, host: str, port: int, method: str, response_type, metadata=None,
                 ssl_context: ssl.SSLContext | None = None, server_hostname: str = "",
                 connect_timeout: float = CONNECT_TIMEOUT_S, on_unreachable: Callable[[], None] | None = None,
                 spin_s: float = 0.0):
        """`on_unreachable()`: called when the port cannot be connected to (`FramePorts` then stops dialing it).
        `spin_s`: how long a read waits awake for its answer (`_spin`)."""
        self.host, self.port, self.method, self.response_type = host, port, method, response_type
        self.spin_s = spin_s
        self.metadata = tuple(metadata or ())
        self.ssl_context, self.server_hostname, self.connect_timeout = ssl_context, server_hostname, connect_timeout
        self.on_unreachable = on_unreachable
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._done = False

    def _fail(self, code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        self.cancel()
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    async def _connect(self) -> None:
        kw = {}
        if self.ssl_context is not None:
            kw = {"ssl": self.ssl_context, "server_hostname": self.server_hostname or self.host}
        try:  # asyncio.timeout, not wait_for: before Python 3.12 wait_for can swallow a cancel (specdec_rpc/aio.py)
            async with asyncio.timeout(self.connect_timeout):
                self._reader, self._writer = await asyncio.open_connection(
                    self.host, self.port, limit=MAX_FRAME + _LEN.size, **kw)
        except (OSError, TimeoutError, ssl.SSLError) as e:
            if self.on_unreachable is not None:
                self.on_unreachable()
            raise self._fail(grpc.StatusCode.UNAVAILABLE,
                             f"frame port {self.host}:{self.port}: {e or type(e).__name__}") from None
        _nodelay(self._writer)
        self._writer.write(_frame(json.dumps({"method": self.method,
                                              "metadata": [list(kv) for kv in self.metadata]}).encode()))

    async def write(self, message) -> None:
        if self._done:
            raise self._fail(grpc.StatusCode.CANCELLED, "the frame call was closed")
        if self._writer is None:
            await self._connect()
        try:
            self._writer.write(_frame(message.SerializeToString()))
        except (OSError, FrameError) as e:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, f"frame port {self.host}:{self.port}: {e}") from None

    async def read(self):
        """The next response message; an error frame raises its status."""
        if self._reader is None:
            raise self._fail(grpc.StatusCode.INTERNAL, "read before any write on a frame call")
        _spin(self._reader, self._writer, self.spin_s)
        try:
            data = await _read_frame(self._reader)
        except (asyncio.IncompleteReadError, OSError, FrameError, ssl.SSLError) as e:
            raise self._fail(grpc.StatusCode.UNAVAILABLE,
                             f"frame port {self.host}:{self.port} closed the call ({e or type(e).__name__})") from None
        if not data:
            raise self._fail(grpc.StatusCode.INTERNAL, f"frame port {self.host}:{self.port} sent an empty frame")
        if data[0] != _OK:
            code = next((c for c in grpc.StatusCode if c.value[0] == data[0]), grpc.StatusCode.UNKNOWN)
            raise self._fail(code, data[1:].decode("utf-8", "replace"))
        try:
            return self.response_type.FromString(data[1:])
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise self._fail(grpc.StatusCode.INTERNAL, f"frame port {self.host}:{self.port} sent a response that "
                                                       f"does not decode ({e})") from None

    async def done_writing(self) -> None:
        self.cancel()

    def cancel(self) -> bool:
        if self._done:
            return False
        self._done = True
        if self._writer is not None:
            self._writer.close()
        return True

    def done(self) -> bool:
        return self._done


class FramePorts:
    """A caller's view of the frame ports of the replicas it dials: each endpoint's port as its GetInfo says (asked
    once; 0: it serves none), and the ports that could not be reached lately (not dialed for `DOWN_S`, then asked
    for again: a restarted replica may serve another). `ssl_context`: TLS towards them (None: plaintext); `spin_s`:
    how long a call's read waits awake for its answer (`_spin`)."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None, spin_s: float = 0.0):
        self.ssl_context, self.spin_s = ssl_context, spin_s
        self._port: dict[str, int] = {}
        self._down_until: dict[str, float] = {}

    async def open(self, endpoint: str, method: str, response_type, get_info: Callable[[], Awaitable],
                   metadata=None, server_hostname: str = "") -> FrameCall | None:
        """A call on `endpoint`'s frame port, or None (it serves none, it is down, its GetInfo failed).
        `get_info()`: the replica's GetInfo response."""
        if self._down_until.get(endpoint, 0.0) > time.monotonic():
            return None
        if endpoint not in self._port:
            try:
                self._port[endpoint] = (await get_info()).info.data_port
            except grpc.aio.AioRpcError:
                return None  # asked again next time
        port = self._port[endpoint]
        if not port:
            return None

        def unreachable() -> None:
            log.warning("frame port %s:%d of %s unreachable; per-round messages take gRPC for %.0f s",
                        split_host_port(endpoint)[0], port, endpoint, DOWN_S)
            self._down_until[endpoint] = time.monotonic() + DOWN_S
            self._port.pop(endpoint, None)

        return FrameCall(split_host_port(endpoint)[0], port, method, response_type, metadata, self.ssl_context,
                         server_hostname, on_unreachable=unreachable, spin_s=self.spin_s)

    def forget(self, endpoint: str) -> None:
        self._port.pop(endpoint, None)
        self._down_until.pop(endpoint, None)


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
