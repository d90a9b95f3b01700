"""Assemble the coordinator: pool manager + pipelines (Ray actors, or in-process with ray=False) + the front server.

    app, router = await build_coordinator(settings)     # inside the running loop
    await app.start(); ...; await app.shutdown(); await router.close()
"""
from __future__ import annotations

import asyncio
import logging

from coordinator.backends.pipeline import AsyncPool, Pipeline
from coordinator.channels import Dialer
from coordinator.routing.pool import PoolManager
from coordinator.routing.router import LocalRouter, RayRouter
from coordinator.tracing import init_tracer
from specdec.common.defaults import GENERATION_SERVICE_NAME
from specdec.common.settings import setdefault_environ
from specdec.modeling.hub import resolve_tokenizer
from specdec.text.tokenizer import eos_token_ids, load_tokenizer
from specdec_rpc.app import ServerApp
from specdec_rpc.auth import ApiKeyInterceptor
from specdec_rpc.logs import adopt_loggers
from specdec_rpc.metrics import ServiceMetrics

from coordinator.config import CoordinatorSettings
from coordinator.routing.discovery import source_from_spec, split_host_port
from coordinator.metrics import CoordinatorMetrics
from coordinator.grpc_api.service import GenerationServicer, add_to_server

log = logging.getLogger(__name__)


def load_tokenizer_for(spec: str):
    """(tokenizer | None, eos ids) of a model spec; '' / 'none' means token-id prompts only."""
    if not spec or spec.lower() == "none":
        return None, set()

    d = resolve_tokenizer(spec)
    return load_tokenizer(d), eos_token_ids(d)


def client_tls(s: CoordinatorSettings) -> dict | None:
    """mTLS towards the pools reuses the coordinator's own certificate and CA (one Secret per component). A pool
    found by DNS is dialed by pod IP: its replicas' certificates are checked against its DNS name
    (`server_names`; coordinator/channels.py). Picklable: Ray actors build their credentials from it."""
    if not s.tls.ca_file:
        return None
    names = {k: split_host_port(spec[len("dns:"):])[0] for k in ("draft", "target")
             if (spec := s.pool_spec(k)).startswith("dns:")}
    return {"ca_file": s.tls.ca_file, "cert_file": s.tls.cert_file, "key_file": s.tls.key_file,
            "server_names": names}


def init_ray(s: CoordinatorSettings, log_to_driver: bool = True) -> None:
    import ray  # lazy: ray (~0.6 s) loads only where the coordinator runs on Ray

    if ray.is_initialized():
        return
    if s.log_format == "json":
        adopt_loggers("ray")  # Ray's own handler writes plain text
    if s.ray_address:
        ray.init(address=s.ray_address, log_to_driver=log_to_driver)
    else:  # a small local instance: no dashboard, few CPUs, a small object store
        # on a loaded 2-core host the local GCS can take longer than Ray's default 30 s to publish its port
        setdefault_environ(RAY_gcs_server_port_wait_time_s="120")
        # address "local": a new instance even where another runs on this machine (ray.init() would join that
        # one and refuse num_cpus)
        ray.init(address="local", num_cpus=s.ray_num_cpus, include_dashboard=False,
                 object_store_memory=128 * 1024 * 1024, log_to_driver=log_to_driver, configure_logging=False)


async def build_router(s: CoordinatorSettings, resolve=None, health_check=None, tokenizer_size: int = 0):
    """`tokenizer_size`: the coordinator's tokenizer's tokens; a replica whose vocabulary cannot be that
    tokenizer's gets no requests (coordinator/routing/probes.py, `vocabulary_mismatch`)."""
    specs = {k: s.pool_spec(k) for k in ("draft", "target")}
    affinity_slack = s.prefix_affinity_slack if s.prefix_affinity_chunk else None  # None: least loaded only
    tls = client_tls(s)
    if not s.ray:
        dialer = Dialer.from_tls(tls)
        pm = PoolManager({k: source_from_spec(v, resolve) for k, v in specs.items() if v}, s.dns_refresh_s,
                         s.health_timeout_s, health_check=health_check, dialer=dialer, wait_s=s.queue_wait_s,
                         max_waiting=s.max_waiting, affinity_slack=affinity_slack, preempt=s.preempt,
                         tokenizer_size=tokenizer_size)
        await pm.start()
        router = LocalRouter(Pipeline(AsyncPool(pm), dialer, s.rpc_timeout_s, s.pool_view_refresh_s,
                                      s.replica_streams, s.prefix_affinity_chunk, data_plane=s.data_plane,
                                      chain_window=s.chain_window, replica_frames=s.replica_frames))
        router.pool_manager = pm
        return router
    from coordinator.actor import PipelineActor, PoolManagerActor  # lazy: imports ray (~0.6 s), only on Ray

    pool = PoolManagerActor.remote(specs, s.dns_refresh_s, s.health_timeout_s, tls, s.queue_wait_s, s.max_waiting,
                                   affinity_slack, s.preempt, s.log_level, tokenizer_size, s.log_format)
    snap = await pool.start.remote()
    log.info("pools: %s", snap)

    def make_actor(tag: str):
        return PipelineActor.options(scheduling_strategy="SPREAD").remote(pool, s.rpc_timeout_s,
                                                                           s.pool_view_refresh_s, tls,
                                                                           s.replica_streams,
                                                                           s.prefix_affinity_chunk, tag,
                                                                           s.log_level, s.log_format,
                                                                           s.data_plane, s.chain_window,
                                                                           s.replica_frames)

    router = RayRouter([], make_actor, fixed=s.pipelines or None)
    await router.grow()  # fail fast (and warm up) before serving
    router.start_autogrow()
    router.pool_actor = pool
    return router


async def build_coordinator(s: CoordinatorSettings, tokenizer=None, eos_token_ids=None, resolve=None,
                            health_check=None):
    """→ (ServerApp, router). `tokenizer`/`eos_token_ids` override loading `s.tokenizer` (tests)."""
    if tokenizer is None and eos_token_ids is None:
        tokenizer, eos_token_ids = load_tokenizer_for(s.tokenizer)
    if s.ray:
        init_ray(s)
    router = await build_router(s, resolve, health_check, len(tokenizer) if tokenizer is not None else 0)
    holder = {}

    def register(server):
        metrics = CoordinatorMetrics(holder["app"].metrics.registry)
        servicer = GenerationServicer(router, tokenizer, eos_token_ids or (), s.max_new_tokens_cap, metrics,
                                    s.spec_off_batch, s.pacer_post_threshold, s.default_mode, s.gamma,
                                    s.verify_method, s.pacer_threshold)
        def running() -> float:  # in flight less those waiting for sessions (waiting: NaN when it is unknown)
            w = router.waiting_now()
            return float(max(0, servicer.in_flight - (0 if w != w else w)))

        metrics.waiting.set_function(router.waiting_now)
        metrics.running.set_function(running)
        servicer.tracer, servicer.draft_fallback = tracer, s.draft_fallback
        servicer.max_message_bytes = s.max_message_bytes
        servicer.reasoning_parser = s.reasoning_parser
        holder["app"].servicer = servicer
        add_to_server(servicer, server)

    on_start, on_close, on_stop = [], [], [router.close]
    tracer = None
    if s.otlp_traces_endpoint:  # one span per generation (coordinator/tracing.py)
        tracer, provider = init_tracer(s.otlp_traces_endpoint)

        async def export_the_rest():  # the last requests' spans, before the process exits
            await asyncio.to_thread(provider.shutdown)
        on_stop.append(export_the_rest)
    if s.http_port:
        from coordinator.http_api.server import HttpFrontDoor  # lazy: fastapi and uvicorn (~0.7 s), only with http_port

        http = HttpFrontDoor(s, lambda: holder["app"])
        on_start.append(http.start)
        on_close.append(http.begin_shutdown)  # after the drain delay: until then it answers as before
        on_stop.insert(0, http.wait_closed)  # in-flight HTTP requests finish before the router closes
    guards = ()
    if s.api_key:
        guards = (ApiKeyInterceptor(s.api_key, (GENERATION_SERVICE_NAME,), "COORDINATOR_API_KEY"),)
    app = ServerApp(s, GENERATION_SERVICE_NAME, register, ServiceMetrics(replica=False), on_stop=on_stop,
                    on_close=on_close, on_start=on_start, interceptors=guards)
    holder["app"] = app
    app.router = router
    return app, router
