"""Build, start and gracefully stop one `grpc.aio` server (shared by draft_service and target_service).

What every replica gets: the error interceptor, message-size limits, keepalive and connection-age
options, the standard health servicer (`""` = liveness, the service name = readiness), reflection,
optional TLS/mTLS, Prometheus metrics on a separate port, and SIGTERM/SIGINT handling:
health -> NOT_SERVING (and the `on_drain` hooks: per-round streams end), optional drain delay,
`server.stop(grace)` (in-flight RPCs finish), close hooks.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.server.interceptor import ErrorInterceptor
from specdec.server.metrics import ServiceMetrics
from specdec.server.settings import ServerSettings
from specdec.server.tls import server_credentials

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def server_options(s: ServerSettings) -> list[tuple[str, int]]:
    opts = [
        ("grpc.max_send_message_length", s.max_message_bytes),
        ("grpc.max_receive_message_length", s.max_message_bytes),
        ("grpc.keepalive_time_ms", s.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", s.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # clients may ping every 10 s; anything faster is answered with GOAWAY(too_many_pings)
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.so_reuseport", 0),  # a taken port is an error, not a silent second listener
    ]
    if s.max_connection_age_ms:
        opts += [("grpc.max_connection_age_ms", s.max_connection_age_ms),
                 ("grpc.max_connection_age_grace_ms", int(s.grace_s * 1000))]
    return opts


class ServerApp:
    """One replica's server. `register(server)` adds the servicer; `on_start` hooks run once it serves (before
    it reports SERVING), `on_drain` hooks when draining starts, `on_stop` hooks after the drain."""

    def __init__(self, settings: ServerSettings, service_name: str,
                 register: Callable[[grpc.aio.Server], None], metrics: ServiceMetrics | None = None,
                 on_stop: list[Callable[[], Awaitable[None] | None]] | None = None,
                 on_drain: list[Callable[[], None]] | None = None,
                 on_start: list[Callable[[], Awaitable[None]]] | None = None,
                 interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()):
        """`interceptors` run before the error interceptor (the coordinator's API key)."""
        self.settings, self.service_name = settings, service_name
        self._interceptors = tuple(interceptors)
        self.metrics = metrics or ServiceMetrics()
        self._register = register
        self._on_stop = list(on_stop or [])
        self._on_drain = list(on_drain or [])
        self._on_start = list(on_start or [])
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.http_port: int | None = None  # the coordinator's OpenAI-compatible HTTP API, when it serves one
        self.draining = False
        self._stopped = asyncio.Event()
        self._metrics_http = None

    async def start(self) -> int:
        """Bind, start, report SERVING. Call from inside the running loop (aio binds to it)."""
        s = self.settings
        self.server = grpc.aio.server(interceptors=[*self._interceptors, ErrorInterceptor(self.metrics)],
                                      options=server_options(s))
        self._register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{s.host}:{s.port}"
        creds = server_credentials(s.tls)
        self.port = (self.server.add_secure_port(address, creds) if creds
                     else self.server.add_insecure_port(address))
        if not self.port:
            raise RuntimeError(f"could not bind {address}; choose a free --port")
        await self.server.start()
        self._metrics_http = self.metrics.serve(s.metrics_port)
        for hook in self._on_start:
            await hook()
        await self.health.set("", SERVING)
        await self.health.set(self.service_name, SERVING)
        log.info("%s serving on %s:%d%s", self.service_name, s.host, self.port, " (TLS)" if creds else "")
        return self.port

    async def shutdown(self, grace: float | None = None) -> None:
        """health -> NOT_SERVING, wait drain_delay_s, stop accepting and drain for `grace`, run hooks."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        grace = self.settings.grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        for hook in self._on_drain:
            hook()
        log.info("%s draining (grace %.1fs)", self.service_name, grace)
        if self.settings.drain_delay_s:
            await asyncio.sleep(self.settings.drain_delay_s)
        if self.server is not None:
            await self.server.stop(grace)
        for hook in self._on_stop:
            res = hook()
            if asyncio.iscoroutine(res):
                await res
        if self._metrics_http is not None:
            self._metrics_http[0].shutdown()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def run_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (log.info("received %s", s.name),
                                                        asyncio.ensure_future(self.shutdown())))
        await self.wait()
