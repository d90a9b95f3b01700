"""Assemble a TargetService replica: model on its thread, verify batcher, shared server skeleton."""
from __future__ import annotations

import asyncio
import math

from specdec.common.defaults import TARGET_SERVICE_NAME
from specdec.common.threads import ModelThread
from specdec.modeling.dtypes import resolve_dtype
from specdec.modeling.model import load_model
from specdec.workers.target import TargetWorker
from specdec_rpc.app import ServerApp, advertise_frames
from specdec_rpc.host import SessionHost
from specdec_rpc.metrics import ServiceMetrics
from specdec_rpc.pb import target_pb2
from specdec_rpc.settings import resolve_device
from specdec_rpc.tracing import replica_spans

from target_service.batcher import VerifyBatcher
from target_service.config import TargetSettings
from target_service.servicer import TargetServicer, add_to_server


async def build_app(settings: TargetSettings, model=None, warmup: bool = True) -> ServerApp:
    """`model`: an already built CausalLM (tests); otherwise `settings.model` is loaded onto device/dtype."""
    runner = ModelThread("target-model", settings.threads)
    if model is None:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device, "target")
        model = await runner.run(load_model, settings.model, device, dtype)
    # the host's session table expires and evicts sessions (specdec_rpc/host.py) and ends them in the worker,
    # which keeps each until then
    worker = await runner.run(lambda: TargetWorker(
        model, max_sessions=settings.worker_slots(), max_context=settings.max_context or None,
        session_ttl_s=math.inf, prefix_cache=settings.prefix_cache,
        prefill_chunk=settings.prefill_chunk, step_lookup=settings.step_lookup()))
    metrics = ServiceMetrics()
    host = SessionHost(worker, runner, settings, metrics, model_name=settings.model)
    if warmup:
        await runner.run(host.warmup_sync)
    batcher = VerifyBatcher(worker, runner, host.open_sessions, settings.batch_window_ms,
                            settings.max_batch_size, settings.max_queue, metrics)
    servicer = TargetServicer(host, batcher)
    # spans of prefill, target and batching waits, children of the coordinator's (specdec_rpc/tracing.py)
    servicer.spans = replica_spans(settings.otlp_traces_endpoint, "specdec-target")

    async def _close():
        await batcher.close()
        await host.close()
        if servicer.spans is not None:  # the last calls' spans, before the process exits
            await asyncio.to_thread(servicer.spans.shutdown)

    app = ServerApp(settings, TARGET_SERVICE_NAME, lambda server: add_to_server(servicer, server), metrics,
                    on_stop=[_close], on_drain=[host.begin_drain], idle=host.idle,
                    on_start=[lambda: advertise_frames(app, host)],
                    frames={"VerifyRounds": (servicer.Verify,
                                             lambda data: target_pb2.VerifyRoundsRequest.FromString(data).verify,
                                             lambda r: target_pb2.VerifyRoundsResponse(verify=r))})
    app.servicer, app.host, app.batcher = servicer, host, batcher
    batcher.start()
    host.start_reaper()
    return app
