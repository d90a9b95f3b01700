"""Build, start and gracefully stop one `grpc.aio` server (shared by draft_service and target_service).

What every replica gets: the error interceptor, message-size limits, keepalive and connection-age
options, the standard health servicer (`""` = liveness, the service name = readiness), reflection,
optional TLS/mTLS, Prometheus metrics on a separate port, a replica's frame port (its per-round streams on a plain
socket, `specdec_rpc/frames.py`; `data_port`), and SIGTERM/SIGINT handling (`shutdown`):

1. health -> NOT_SERVING, and the `on_drain` hooks (a replica refuses new sessions and ends its per-round streams);
2. `drain_delay_s`, serving as before while load balancers catch up;
3. the `on_close` hooks (the coordinator's HTTP door stops accepting), then, within `grace_s` in all: until `idle()`
   (a replica's sessions have ended: their requests finish here), `server.stop` (in-flight RPCs finish);
4. the `on_stop` hooks.

A second signal cuts the drain short: in-flight RPCs are cancelled and the process exits 1.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec_rpc.frames import FrameServer, server_ssl_context
from specdec_rpc.interceptor import ErrorInterceptor
from specdec_rpc.logs import set_process
from specdec_rpc.metrics import ServiceMetrics
from specdec_rpc.settings import ServerSettings
from specdec_rpc.tls import server_credentials

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_CUT_S = 1.0  # after the grace: the calls ended by `cut_short` send their status before gRPC cancels what is left


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


async def advertise_frames(app: "ServerApp", host) -> None:
    """A replica's start hook: its GetInfo names the frame port it serves (0: none)."""
    host.info.data_port = app.data_port


class ServerApp:
    """One server. `register(server)` adds the servicer; `on_start` hooks run once it serves (before it reports
    SERVING), `on_drain` hooks when draining starts, `on_close` hooks after the drain delay, `on_stop` hooks after
    the drain; `idle()` says whether the server's work has ended (the drain waits for it, up to the grace)."""

    def __init__(self, settings: ServerSettings, service_name: str,
                 register: Callable[[grpc.aio.Server], None], metrics: ServiceMetrics | None = None,
                 on_stop: list[Callable[[], Awaitable[None] | None]] | None = None,
                 on_drain: list[Callable[[], None]] | None = None,
                 on_start: list[Callable[[], Awaitable[None]]] | None = None,
                 interceptors: tuple[grpc.aio.ServerInterceptor, ...] = (),
                 on_close: list[Callable[[], None]] | None = None, idle: Callable[[], bool] | None = None,
                 frames: dict[str, tuple[Callable, Callable, Callable]] | None = None):
        """`interceptors` run before the error interceptor (the coordinator's API key). `frames`: what a replica
        serves on its frame port (`data_port`, specdec_rpc/frames.py), {"VerifyRounds": (the unary handler, the
        per-round request's bytes → the unary request, the unary response → the per-round response)}."""
        self.settings, self.service_name = settings, service_name
        self._interceptors = tuple(interceptors)
        self.metrics = metrics or ServiceMetrics()
        self._register = register
        self._on_stop = list(on_stop or [])
        self._on_drain = list(on_drain or [])
        self._on_start = list(on_start or [])
        self._on_close = list(on_close or [])
        self._idle = idle
        self._frame_methods = dict(frames or {})
        self.frames: FrameServer | None = None
        self.data_port = 0  # the frame port, once started (0: none)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.errors: ErrorInterceptor | None = None
        self.port: int | None = None
        self.http_port: int | None = None  # the coordinator's OpenAI-compatible HTTP API, when it serves one
        self.draining = False
        self.forced = False  # a second signal cut the drain short
        self._force = asyncio.Event()
        self._stopped = asyncio.Event()
        self._metrics_http = None

    async def start(self) -> int:
        """Bind, start, report SERVING. Call from inside the running loop (aio binds to it)."""
        s = self.settings
        self.errors = ErrorInterceptor(self.metrics)
        self.server = grpc.aio.server(interceptors=[*self._interceptors, self.errors],
                                      options=server_options(s))
        self._register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{s.host}:{s.port}"
        creds = server_credentials(s.tls)
        try:  # grpc raises its own "Failed to bind ... set GRPC_VERBOSITY=debug" for a taken port
            self.port = (self.server.add_secure_port(address, creds) if creds
                         else self.server.add_insecure_port(address))
        except RuntimeError:
            self.port = 0
        if not self.port:
            raise RuntimeError(f"could not bind {address} (in use, or not an address of this host); choose a "
                               f"free --port")
        try:
            self._metrics_http = self.metrics.serve(s.metrics_port)
        except OSError as e:
            raise RuntimeError(f"could not serve metrics on port {s.metrics_port} ({e.strerror or e}); choose a "
                               f"free --metrics-port (0: no metrics port)") from None
        await self.server.start()
        if self._frame_methods and getattr(s, "data_port", -1) >= 0:
            await self._start_frames(s)
        for hook in self._on_start:
            await hook()
        set_process(replica=f"{s.host}:{self.port}")  # JSON log lines name the process by its address
        await self.health.set("", SERVING)
        await self.health.set(self.service_name, SERVING)
        log.info("%s serving on %s:%d%s", self.service_name, s.host, self.port, " (TLS)" if creds else "")
        return self.port

    async def _start_frames(self, s) -> None:
        methods = {name: (self.errors.wrap_unary(handler, name, deserializer), wrap)
                   for name, (handler, deserializer, wrap) in self._frame_methods.items()}
        self.frames = FrameServer(methods, server_ssl_context(s.tls), s.frame_spin_us / 1e6)
        try:
            self.data_port = await self.frames.start(s.host, s.data_port)
        except OSError as e:
            await self.server.stop(0)
            raise RuntimeError(f"could not serve the frame port {s.host}:{s.data_port} ({e.strerror or e}); choose a "
                               f"free --data-port (0 picks one, -1 turns the frame port off)") from None
        log.info("%s: per-round frames on %s:%d", self.service_name, s.host, self.data_port)

    async def shutdown(self, grace: float | None = None) -> None:
        """Drain (module docstring): NOT_SERVING, the drain delay, then up to `grace` for the work in flight."""
        if self.draining:
            await self._stopped.wait()
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        grace = self.settings.grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        for hook in self._on_drain:
            hook()
        log.info("%s draining (delay %.1fs, grace %.1fs)", self.service_name, self.settings.drain_delay_s, grace)
        if self.settings.drain_delay_s:
            await self._unless_forced(asyncio.sleep(self.settings.drain_delay_s))
        for hook in self._on_close:
            hook()
        deadline = loop.time() + grace
        if self._idle is not None and grace > 0:
            await self._unless_forced(self._until_idle(deadline))
        if self.server is not None:
            await self._stop_server(max(0.0, deadline - loop.time()))
        if self.frames is not None:
            await self.frames.close()
        for hook in self._on_stop:
            res = hook()
            if asyncio.iscoroutine(res):
                await res
        if self._metrics_http is not None:
            self._metrics_http[0].shutdown()
        self._stopped.set()

    async def _stop_server(self, grace: float) -> None:
        """Stop accepting, give the calls in flight `grace` to finish, then end those left with UNAVAILABLE (the
        interceptor's `cut_short`) before gRPC cancels them."""
        stop = asyncio.ensure_future(self.server.stop(grace + _CUT_S))
        if not self.forced:
            await self._unless_forced(asyncio.wait({stop}, timeout=grace))
        if not stop.done():
            if self.errors.cut_short():
                log.warning("%s: %s; the calls still running end with UNAVAILABLE", self.service_name,
                            "stopping at once" if self.forced else "the grace ran out")
            if self.forced:  # a moment for their statuses, then gRPC cancels whatever is left
                await asyncio.wait({stop}, timeout=0.2)
                await self.server.stop(0)
        await stop

    async def _until_idle(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        if not self._idle():
            log.info("%s: waiting up to %.1fs for its sessions to end", self.service_name, deadline - loop.time())
        while not self._idle() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self._idle():
            log.warning("%s: the grace ran out with sessions open; their requests move to another replica",
                        self.service_name)

    async def _unless_forced(self, aw) -> None:
        """Await `aw` unless a second signal comes first."""
        task, force = asyncio.ensure_future(aw), asyncio.ensure_future(self._force.wait())
        try:
            await asyncio.wait({task, force}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, force):
                t.cancel()

    def force_stop(self) -> None:
        """A second signal: stop now (in-flight RPCs are cancelled); the process exits 1 (`run_until_signal`)."""
        log.warning("%s: second signal, stopping without waiting for the work in flight", self.service_name)
        self.forced = True
        self._force.set()
        if self.errors is not None:
            self.errors.cut_short()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def run_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully; a second signal stops at once (exit 1)."""
        loop = asyncio.get_running_loop()

        def on_signal(sig):
            log.info("received %s", sig.name)
            if self.draining:
                self.force_stop()
            else:
                asyncio.ensure_future(self.shutdown())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await self.wait()
        if self.forced:
            raise SystemExit(1)
