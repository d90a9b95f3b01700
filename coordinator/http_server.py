"""The HTTP API's server beside a coordinator's ServerApp (coordinator/server.py wires its hooks): uvicorn in the
coordinator's event loop, serving coordinator/openai_http.py's app."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from coordinator.openai_http import OpenAIFrontDoor, ServicerBackend
from coordinator.response_store import ResponseStore

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
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        s, app = self.settings, self.get_app()
        door = OpenAIFrontDoor(ServicerBackend(app.servicer), s.model_name(), s.http_api_key or s.api_key,
                               s.max_message_bytes,
                               is_draining=lambda: app.draining, registry=app.metrics.registry,
                               max_in_flight=s.http_max_in_flight, tool_call_parser=s.tool_call_parser,
                               reasoning_parser=s.reasoning_parser,
                               store=ResponseStore(s.responses_store, s.responses_store_ttl_s,
                                                   s.responses_store_max_mb << 20))
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
            import ssl

            tls = {"ssl_certfile": s.tls.cert_file, "ssl_keyfile": s.tls.key_file, "ssl_ca_certs": s.tls.ca_file,
                   "ssl_cert_reqs": ssl.CERT_REQUIRED if s.tls.require_client_auth else ssl.CERT_NONE}
        # connections past the requests in flight (idle keep-alives, probes) are capped too: plain 503s from uvicorn
        self.server = Server(uvicorn.Config(door.app(), lifespan="off", log_config=None, access_log=False,
                                            timeout_graceful_shutdown=max(1, int(s.grace_s)),
                                            limit_concurrency=2 * s.http_max_in_flight + 64, **tls))
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
