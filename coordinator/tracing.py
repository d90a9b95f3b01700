"""OpenTelemetry traces of generations (vLLM's `--otlp-traces-endpoint`): with `COORDINATOR_OTLP_TRACES_ENDPOINT`
set, every generation the coordinator serves becomes one `llm_request` span, exported over OTLP/gRPC.

- The span's parent is the caller's trace: a W3C `traceparent` (and `tracestate`) in the HTTP headers or the gRPC
  metadata, so a client's trace shows specdec's part of it.
- It runs from the request's arrival to its end, with an event at the first token. Its attributes follow vLLM's
  (OpenTelemetry's gen_ai conventions): the request id, sampling fields, token usage, finish reason, time in the
  admission queue, to the first token and end to end; plus specdec's own: mode, target forwards, draft and accepted
  tokens, tokens per target forward and the replicas that served it.
- A request that fails (a refused body, a replica error, a client gone) ends its span with status ERROR and the
  message.
- The span's own trace context (`traceparent`, and the caller's `tracestate`, which the span continues) goes with
  every replica call of the request (gRPC metadata): replicas that export traces too record their prefill, draft,
  verify and batching-wait spans as its children (specdec_rpc/tracing.py), so one trace follows the request into
  the replicas that served it.
Unset, nothing is imported and nothing is recorded.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec_rpc.tracing import TRACE_HEADERS, init_tracer as _init_tracer, parent_of, trace_headers

if TYPE_CHECKING:
    from coordinator.events import RequestStats
    from specdec.scheduling.request import PipelineRequest

__all__ = ["TRACE_HEADERS", "RequestTrace", "init_tracer", "parent_of"]


def init_tracer(endpoint: str, exporter=None):
    """→ (tracer, provider): a tracer exporting to `endpoint` (OTLP/gRPC, e.g. http://otel-collector:4317), in
    batches off the event loop; `exporter` (tests): export there, span by span, instead. `provider.shutdown()`
    exports what is left (the coordinator calls it when it stops)."""
    return _init_tracer(endpoint, "specdec-coordinator", exporter, scope="specdec.coordinator")


class RequestTrace:
    """One generation's span: started on arrival (its id goes to the replicas), its attributes set when it ends."""

    def __init__(self, tracer, metadata):
        self.tracer, self.parent = tracer, parent_of(metadata)
        self.start_ns, self.t0 = time.time_ns(), time.perf_counter()
        self.span = tracer.start_span("llm_request", context=self.parent, kind=SpanKind.SERVER,
                                      start_time=self.start_ns)
        self.headers = trace_headers(self.span)  # {"traceparent": ..., ["tracestate": ...]}
        self.ttft_s: float | None = None
        self._request: PipelineRequest | None = None
        self.error = ""  # the replica's or pipeline's error, before the abort that carries it
        self.ended = False

    @property
    def request(self) -> PipelineRequest | None:
        """The prepared request, once it is."""
        return self._request

    @request.setter
    def request(self, request: PipelineRequest | None) -> None:
        """Setting it also gives the request this span's trace headers (`traceparent`, `tracestate`, in its
        `trace_headers`): the pipeline sends them with every replica call (coordinator/backends/clients.py), so the
        replicas' spans are this span's children."""
        if request is not None:
            request.trace_headers.update(self.headers)
        self._request = request

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.t0

    def end(self, request: PipelineRequest | None, stats: RequestStats | None = None, finish: str = "",
            error: str = "") -> None:
        """Record the span (once: a request that ended is not recorded again by a later error)."""
        if self.ended:
            return
        self.ended = True
        e2e = time.perf_counter() - self.t0
        attrs = {"gen_ai.latency.e2e": e2e}
        if request is not None:
            g = request.generation
            attrs.update({"gen_ai.request.id": request.request_id, "gen_ai.request.temperature": g.params.temperature,
                          "gen_ai.request.top_p": g.params.top_p, "gen_ai.request.max_tokens": g.max_new_tokens,
                          "gen_ai.usage.prompt_tokens": len(g.prompt_ids), "specdec.mode": g.mode})
        if stats is not None:
            n, forwards = stats.completion_tokens, stats.target_forwards
            attrs.update({"gen_ai.usage.completion_tokens": n, "gen_ai.response.finish_reasons": [finish],
                          "gen_ai.latency.time_in_queue": stats.queued_s,
                          "specdec.target_forwards": forwards, "specdec.draft_tokens": stats.draft_tokens,
                          "specdec.accepted_tokens": stats.accepted_tokens,
                          "specdec.tokens_per_target_forward": n / forwards if forwards else 0.0,
                          "specdec.cached_prompt_tokens": stats.cached_prompt_tokens,
                          "specdec.target_replica": stats.target_replica,
                          "specdec.draft_replica": stats.draft_replica,
                          "specdec.drafts": stats.drafts,
                          "specdec.network.draft_s": stats.draft_network_s,
                          "specdec.network.target_s": stats.target_network_s,
                          "specdec.draft_idle_s": stats.draft_idle_s,
                          "specdec.target_idle_s": stats.target_idle_s})
        if self.ttft_s is not None:
            attrs["gen_ai.latency.time_to_first_token"] = self.ttft_s
        span = self.span
        span.set_attributes(attrs)
        if self.ttft_s is not None:
            span.add_event("first_token", timestamp=self.start_ns + int(self.ttft_s * 1e9))
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.start_ns + int(e2e * 1e9))
