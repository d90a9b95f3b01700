"""A TCP delay relay: a network round trip between two processes of one machine, with real bytes on real sockets.

A test and planning aid, not for production traffic. Operators run the draft pool and the target pool on separate
machines; a relay between two processes on loopback makes each byte arrive `one_way_delay_s` after it was sent
(and, optionally, no faster than a bandwidth cap), so the tests, `specdec serve --emulate-rtt-ms` and
`specdec bench --rtt-ms` see what a given network round trip costs each mode and data plane. It forwards any TCP
stream unchanged (gRPC's plaintext HTTP/2 included); it neither terminates TLS nor drops or reorders packets.

How it delays: each connection it accepts is paired with a connection to `upstream`. Per direction, a reader
stamps every chunk it reads with the time it is due at the other side (read time + one-way delay, after the
chunks before it have passed the bandwidth cap) and queues it; a writer sleeps until each chunk is due and writes
it. The reader never waits for the delay, so a bulk transfer streams at the link's rate and pays the delay once,
as on a real link (the delay is latency, not a throughput limit). Both sockets set TCP_NODELAY, so loopback adds
no batching of its own. The delay is a floor: each crossing also pays the host's wake-up latency (tens of
microseconds on an idle host, a few tenths of a millisecond on a loaded one). When one side closes, what was already read from it is still delivered (on time), then
the other side gets the close; once both directions have ended (or either side resets) both sockets are closed.

    async with DelayRelay("127.0.0.1:50061", one_way_delay_s=0.005) as relay:
        channel = grpc.aio.insecure_channel(relay.address)    # every call now pays a 10 ms round trip

As a process of its own (what LocalStack starts: the relay's timing then does not depend on a busy parent):

    python -m specdec_rpc.netem --upstream 127.0.0.1:50061 --delay-ms 5 [--bandwidth-mbit 1000] [--listen-port P]

prints `listening 127.0.0.1:PORT` on one line of stdout once it accepts connections, and serves until SIGTERM or
SIGINT (or, with `--exit-with-parent PID`, until that process is no longer its parent).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import selectors
import signal
import socket
import sys

log = logging.getLogger("specdec.netem")

CHUNK_BYTES = 64 * 1024  # one read from a socket at most
QUEUED_CHUNKS = 1024  # per direction: chunks read but not yet due (a reader waits when the writer is this far behind)


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """'host:port' (or '[v6]:port') → (host, port), with an error message that names `what`."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {address!r}: use host:port, e.g. 127.0.0.1:50051")
    return host, int(port)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Link:
    """One direction of one connection: when each byte read from `reader` is due at `writer`."""

    def __init__(self, delay_s: float, bandwidth_bytes_per_s: float | None):
        self.delay_s, self.rate = delay_s, bandwidth_bytes_per_s
        self.sent_until = 0.0  # the loop time the bandwidth cap has let every queued byte through by
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue(QUEUED_CHUNKS)
        self.closed = False  # the writing side is gone: what is read from here on is dropped

    def due(self, now: float, n: int) -> float:
        """The time a chunk of n bytes read at `now` arrives: after the bytes before it and its own have passed
        the bandwidth cap, plus the one-way delay."""
        if self.rate:
            self.sent_until = max(self.sent_until, now) + n / self.rate
            return self.sent_until + self.delay_s
        return now + self.delay_s

    async def read(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(CHUNK_BYTES):
                if not self.closed:
                    await self.queue.put((self.due(loop.time(), len(data)), data))
        except (ConnectionError, OSError):
            pass
        if not self.closed:  # the close travels like data: what was read before it still arrives, on time
            await self.queue.put((loop.time() + self.delay_s, None))

    async def write(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await self.queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:  # the sender closed its side: so does this one (its other direction goes on)
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            writer.close()  # the receiver is gone: the connection ends both ways
        finally:
            self.closed = True
            while not self.queue.empty():  # a reader waiting on a full queue goes on (and drops what it reads)
                self.queue.get_nowait()


class DelayRelay:
    """Accepts TCP connections on `listen_host:listen_port` (0: a free port) and relays each to `upstream`
    ("host:port"), delaying every byte by `one_way_delay_s` in each direction (a round trip costs twice that) and,
    with `bandwidth_bytes_per_s`, pacing each direction to that rate. A test and planning aid (module docstring)."""

    def __init__(self, upstream: str, one_way_delay_s: float, bandwidth_bytes_per_s: float | None = None,
                 listen_host: str = "127.0.0.1", listen_port: int = 0):
        self.upstream_host, self.upstream_port = parse_address(upstream, "upstream")
        if not one_way_delay_s >= 0:
            raise ValueError(f"one-way delay {one_way_delay_s!r}: must be 0 or more seconds")
        if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth {bandwidth_bytes_per_s!r}: must be more than 0 bytes/s (None: no cap)")
        self.upstream = upstream
        self.one_way_delay_s, self.bandwidth_bytes_per_s = float(one_way_delay_s), bandwidth_bytes_per_s
        self.listen_host, self.listen_port = listen_host, listen_port
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task] = set()
        self.address = ""  # "host:port" it listens on, once started

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, self.listen_host, self.listen_port)
        port = self.server.sockets[0].getsockname()[1]
        self.address = f"{self.listen_host}:{port}"
        return self.address

    async def stop(self) -> None:
        """Stop accepting, and close every relayed connection at once (bytes not yet due are dropped)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)

    async def __aenter__(self) -> "DelayRelay":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            except OSError as e:
                # the client sees its connection closed, as if the far side refused it
                log.debug("relay to %s: cannot connect: %s", self.upstream, e)
                client_writer.close()
                return
            _nodelay(client_writer)
            _nodelay(up_writer)
            to_upstream = _Link(self.one_way_delay_s, self.bandwidth_bytes_per_s)
            to_client = _Link(self.one_way_delay_s, self.bandwidth_bytes_per_s)
            pumps = [asyncio.ensure_future(c) for c in (
                to_upstream.read(client_reader), to_upstream.write(up_writer),
                to_client.read(up_reader), to_client.write(client_writer))]
            try:
                await asyncio.gather(*pumps)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                client_writer.close()
                up_writer.close()
        except asyncio.CancelledError:
            pass  # stop(): the connection's own task ends here (asyncio's server would log a cancelled handler)
        finally:
            self.connections.discard(task)


# ---- the relay as a process of its own -------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m specdec_rpc.netem",
        description="A TCP relay that delays every byte (a network round trip between processes of one machine). "
                    "A test and planning aid, not for production traffic.")
    ap.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the address each connection is relayed to")
    ap.add_argument("--delay-ms", type=float, required=True,
                    help="one-way delay in milliseconds, each direction (a round trip costs twice this)")
    ap.add_argument("--bandwidth-mbit", type=float, default=None,
                    help="each direction's rate cap in megabits per second (default: none)")
    ap.add_argument("--listen-host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    ap.add_argument("--listen-port", type=int, default=0, help="port to listen on (default: 0, a free one)")
    ap.add_argument("--exit-with-parent", type=int, default=0, metavar="PID",
                    help="stop once the process with this pid is no longer this one's parent (0: never)")
    return ap


async def _serve(args: argparse.Namespace) -> None:
    rate = args.bandwidth_mbit * 1e6 / 8 if args.bandwidth_mbit is not None else None
    relay = DelayRelay(args.upstream, args.delay_ms / 1e3, rate, args.listen_host, args.listen_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch_parent() -> None:
        while os.getppid() == args.exit_with_parent:
            await asyncio.sleep(1.0)
        log.warning("parent process %d is gone: stopping", args.exit_with_parent)
        stop.set()

    async with relay:
        print(f"listening {relay.address}", flush=True)
        watch = asyncio.ensure_future(watch_parent()) if args.exit_with_parent else None
        await stop.wait()
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.delay_ms >= 0:
        ap.error(f"--delay-ms {args.delay_ms}: must be 0 or more")
    if args.bandwidth_mbit is not None and not args.bandwidth_mbit > 0:
        ap.error(f"--bandwidth-mbit {args.bandwidth_mbit}: must be more than 0")
    if not 0 <= args.listen_port < 65536:
        ap.error(f"--listen-port {args.listen_port}: must be 0 (a free port) to 65535")
    try:
        parse_address(args.upstream, "--upstream")
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s netem %(levelname)s %(message)s")
    try:
        # select() waits to the microsecond, where epoll (asyncio's default) rounds each wait up to a whole
        # millisecond: a sub-millisecond delay would come out as ~1 ms per crossing. A relay holds a few sockets.
        loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        try:
            loop.run_until_complete(_serve(args))
        finally:
            loop.close()
    except OSError as e:  # the port in use, an address this host lacks
        print(f"netem: cannot listen on {args.listen_host}:{args.listen_port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
