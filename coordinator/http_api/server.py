"""The HTTP API's server beside a coordinator's ServerApp (coordinator/server.py wires its hooks): uvicorn in the
coordinator's event loop, serving coordinator/http_api/app.py's app."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from coordinator.http_api.app import OpenAIFrontDoor
from coordinator.http_api.backend import ServicerBackend
from coordinator.http_api.response_store import ResponseStore

log = logging.getLogger(__name__)


class HttpFrontDoor:
    """The HTTP API beside a coordinator's ServerApp: uvicorn in the same event loop, on a socket bound here (a taken
    port is our error to report), with the ServerApp owning the signals. Hooks: `start` once the servicer exists,
    `begin_shutdown` when draining starts (stop accepting), `wait_closed` before the router closes (in-flight
    requests finish, up to the grace)."""

    def __init__(self, settings, get_app):
        self.settings, self.get_app = settings, get_app
        self.server = None
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        s, app = self.settings, self.get_app()
        door = OpenAIFrontDoor(ServicerBackend(app.servicer), s.model_names(), s.http_api_key or s.api_key,
                               s.max_message_bytes,
                               is_draining=lambda: app.draining, registry=app.metrics.registry,
                               max_in_flight=s.http_max_in_flight, tool_call_parser=s.tool_call_parser,
                               reasoning_parser=s.reasoning_parser,
                               store=ResponseStore(s.responses_store, s.responses_store_ttl_s,
                                                   s.responses_store_max_mb << 20),
                               client_timeout_s=s.http_client_timeout_s)
        app.http_door = door  # its counters, for the metrics and the tests
        host = s.host or "0.0.0.0"
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, s.http_port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"could not bind the HTTP port {host}:{s.http_port} ({e}); choose a free "
                               f"--http-port") from None
        tls = {}
        if s.tls.enabled:  # the gRPC port's certificate; mTLS when it requires client certificates
            tls = {"ssl_certfile": s.tls.cert_file, "ssl_keyfile": s.tls.key_file, "ssl_ca_certs": s.tls.ca_file,
                   "ssl_cert_reqs": ssl.CERT_REQUIRED if s.tls.require_client_auth else ssl.CERT_NONE}
        # connections past the requests in flight (idle keep-alives, probes) are capped too: plain 503s from uvicorn
        self.server = Server(uvicorn.Config(door.app(), lifespan="off", log_config=None, access_log=False,
                                            timeout_graceful_shutdown=max(1, int(s.grace_s)),
                                            limit_concurrency=2 * s.http_max_in_flight + 64,
                                            http=headers_within(s.http_client_timeout_s), **tls))
        self.task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        app.http_port = sock.getsockname()[1]
        log.info("OpenAI-compatible HTTP API on %s:%d", host, app.http_port)
        return app.http_port

    def begin_shutdown(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    async def wait_closed(self) -> None:
        if self.task is not None:
            self.begin_shutdown()
            await self.task
            self.task = None


def headers_within(timeout_s: float):
    """uvicorn's h11 protocol, closing a connection that takes longer than `timeout_s` to send a request's headers
    (its first, or the next one on a kept-alive connection). uvicorn has no such limit: connections that sent
    nothing, or half a request line, stayed open, and 2,112 of them (the connection cap) made every request, /health
    included, a 503 for as long as they stayed."""
    class H11WithHeaderTimeout(H11Protocol):
        _headers_timer = None
        _armed_for = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            super().connection_lost(exc)

        def _arm(self):
            if self._headers_timer is not None:
                self._headers_timer.cancel()
            self._armed_for = self.cycle  # a new request's headers make a new cycle
            self._headers_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self):
            if self.cycle is self._armed_for and not self.transport.is_closing():
                self.transport.close()

    return H11WithHeaderTimeout
