"""Assemble a DraftService replica: load the model on its thread, wrap it in the shared server skeleton."""
from __future__ import annotations

import asyncio
import math

from specdec.common.defaults import DRAFT_SERVICE_NAME
from specdec.common.threads import ModelThread
from specdec.decoding.preverifier import load_preverifier
from specdec.modeling.dtypes import resolve_dtype
from specdec.modeling.model import load_model
from specdec.text.vocab import fit_draft_vocabulary
from specdec_rpc.app import ServerApp, advertise_frames
from specdec_rpc.frames import client_ssl_context
from specdec_rpc.host import SessionHost
from specdec_rpc.metrics import ServiceMetrics
from specdec_rpc.pb import draft_pb2
from specdec_rpc.settings import resolve_device
from specdec_rpc.tls import channel_credentials
from specdec_rpc.tracing import replica_spans

from draft_service.batcher import DraftBatcher
from draft_service.config import DraftSettings
from draft_service.servicer import DraftServicer, add_to_server
from draft_service.speculate import PeerChannels, parse_routes


async def build_app(settings: DraftSettings, model=None, preverifier=None, warmup: bool = True) -> ServerApp:
    """`model`: an already built CausalLM (tests); otherwise `settings.model` is loaded onto device/dtype.
    `preverifier`: a loaded pre-verifier; otherwise `settings.preverifier` (a path) is loaded if set."""
    runner = ModelThread("draft-model", settings.threads)
    if model is None:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device, "draft")
        model = await runner.run(lambda: load_model(settings.model, device, dtype, role="draft",
                                                    quant=settings.quant))
    if settings.target_vocab_size:
        try:
            fit_draft_vocabulary(model, settings.target_vocab_size, preverifier)
        except ValueError as e:
            raise ValueError(f"target_vocab_size {settings.target_vocab_size}: {e}") from None
    if preverifier is None and settings.preverifier:
        path = None if settings.preverifier == "default" else settings.preverifier
        preverifier = await runner.run(lambda: load_preverifier(path, draft_model=model))
    if preverifier is not None and settings.pacer_threshold is not None:
        preverifier.threshold = float(settings.pacer_threshold)  # this host's θ for requests that set none
    # the host's session table expires and evicts sessions (specdec_rpc/host.py) and ends them in the worker,
    # which keeps each until then
    # the worker: DraftWorker, or what `worker_factory` names (a subclass built with the same arguments)
    make_worker = settings.draft_worker()
    worker = await runner.run(lambda: make_worker(
        model, preverifier=preverifier, q_top_k=settings.q_top_k, lookup=settings.prompt_lookup(),
        max_sessions=settings.worker_slots(), max_context=settings.max_context or None,
        session_ttl_s=math.inf, prefix_cache=settings.prefix_cache,
        prefill_chunk=settings.prefill_chunk))
    metrics = ServiceMetrics()
    host = SessionHost(worker, runner, settings, metrics, model_name=settings.model)
    if warmup:
        await runner.run(host.warmup_sync)
    batcher = DraftBatcher(worker, runner, settings.max_batch_size, settings.max_queue, metrics)
    servicer = DraftServicer(host, batcher)
    # spans of prefill, draft and batching waits, children of the coordinator's (specdec_rpc/tracing.py)
    servicer.spans = replica_spans(settings.otlp_traces_endpoint, "specdec-draft")
    # the direct data plane dials target replicas: through `target_routes`, with this replica's mTLS identity
    credentials = (channel_credentials(settings.tls.ca_file, settings.tls.cert_file, settings.tls.key_file)
                   if settings.tls.ca_file else None)
    ssl_context = (client_ssl_context(settings.tls.ca_file, settings.tls.cert_file, settings.tls.key_file)
                   if settings.tls.ca_file else None)
    servicer.peers = PeerChannels(parse_routes(settings.target_routes), credentials, settings.peer_frames, ssl_context,
                                  settings.frame_spin_us / 1e6)

    async def _close():
        await batcher.close()
        await host.close()
        await servicer.peers.close()
        if servicer.spans is not None:  # the last calls' spans, before the process exits
            await asyncio.to_thread(servicer.spans.shutdown)

    app = ServerApp(settings, DRAFT_SERVICE_NAME, lambda server: add_to_server(servicer, server), metrics,
                    on_stop=[_close], on_drain=[host.begin_drain], idle=host.idle,
                    on_start=[lambda: advertise_frames(app, host)],
                    frames={"DraftRounds": (servicer.Draft,
                                            lambda data: draft_pb2.DraftRoundsRequest.FromString(data).draft,
                                            lambda r: draft_pb2.DraftRoundsResponse(draft=r))})
    app.servicer, app.host, app.batcher = servicer, host, batcher
    batcher.start()
    host.start_reaper()
    return app
