"""OpenTelemetry traces across the three services (the core never imports opentelemetry: spans live in the shells).

- The coordinator makes one `llm_request` span per generation (coordinator/tracing.py) and sends its W3C trace
  context (`traceparent`, and `tracestate` when the caller's trace has one) as gRPC metadata with every replica
  call of the request (coordinator/backends/clients.py).
- The headers are W3C Trace Context's, written and read by OpenTelemetry's `TraceContextTextMapPropagator`
  (`trace_headers`, `parent_of`): the ones the HTTP door passes on and the replicas read, whatever
  OTEL_PROPAGATORS says (baggage is not carried).
- A replica with `otlp_traces_endpoint` set records, as children of that span: `prefill` (StartSession), `verify`
  (target) and `draft` (draft) per call, each with a `batch_wait` child for the time the call waited for a batched
  forward (the target's verify batcher, the draft's step loop). A call without a traceparent starts a trace of its
  own. Spans are recorded when the call ends, from times taken during it, so a call costs the same while it runs.
- Without an endpoint nothing here is imported by the replicas and no call reads its metadata.
"""
from __future__ import annotations

import time

TRACE_HEADERS = ("traceparent", "tracestate")  # the propagator's fields, lower case as gRPC metadata keys are
_propagator = None


def _trace_context():
    """OpenTelemetry's W3C Trace Context propagator (one, made on first use: imported only where traces are)."""
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    return _propagator


def init_tracer(endpoint: str, service: str, exporter=None, scope: str = ""):
    """→ (tracer, provider): a tracer exporting to `endpoint` (OTLP/gRPC, e.g. http://otel-collector:4317), in
    batches off the event loop, as `service` (the resource's service.name); `exporter` (tests): export there,
    span by span, instead. `provider.shutdown()` exports what is left."""
    # lazy: the SDK and the OTLP exporter (~0.7 s) load only where traces are exported
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(
            endpoint=endpoint, insecure=not endpoint.startswith("https://"))))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer(scope or service), provider


def parent_of(metadata) -> object | None:
    """The caller's trace context (its span and tracestate) from (key, value) pairs (gRPC metadata, HTTP headers),
    or None when they carry no trace header."""
    carrier = {}
    for key, value in metadata or ():
        key = key.lower() if isinstance(key, str) else key.decode("latin-1").lower()
        if key in TRACE_HEADERS:
            carrier[key] = value if isinstance(value, str) else value.decode("latin-1")
    if not carrier:
        return None
    return _trace_context().extract(carrier)


def trace_headers(span) -> dict[str, str]:
    """The W3C trace-context headers that make a callee's spans children of `span`: `traceparent`, and `tracestate`
    when the span's trace carries one (a span continues its parent's tracestate)."""
    from opentelemetry.trace import set_span_in_context

    carrier: dict[str, str] = {}
    _trace_context().inject(carrier, context=set_span_in_context(span))
    return carrier


class CallClock:
    """When a call started: wall-clock ns for the span, perf_counter ns for its length."""
    __slots__ = ("wall_ns", "perf_ns")

    def __init__(self):
        self.wall_ns, self.perf_ns = time.time_ns(), time.perf_counter_ns()

    def at(self, perf_ns: int) -> int:
        """The wall-clock ns of a perf_counter_ns reading taken during the call."""
        return self.wall_ns + (perf_ns - self.perf_ns)


class ReplicaSpans:
    """A replica's span recorder; servicers hold one only when traces are exported (else None: no cost)."""

    def __init__(self, tracer, provider=None):
        self.tracer, self.provider = tracer, provider
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self._set_span_in_context, self._server = trace.set_span_in_context, SpanKind.SERVER
        self._parents: dict[tuple, object] = {}  # metadata's trace headers -> context: a request's calls share one

    def _parent(self, context):
        """The trace context in the call's metadata, parsed once per request (its calls all carry the same)."""
        if context is None:
            return None
        key = tuple((k, v) for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS)
        if not key:
            return None
        parent = self._parents.get(key)
        if parent is None:
            if len(self._parents) >= 1024:  # requests come and go: keep the recent ones
                self._parents.clear()
            parent = self._parents[key] = parent_of(key)
        return parent

    def record(self, name: str, context, clock: CallClock, attributes: dict, wait_ns: int = 0) -> None:
        """A span `name` from `clock` to now, child of the trace context in the call's metadata (`context`: the
        grpc ServicerContext); `wait_ns` > 0 adds its first `wait_ns` as a `batch_wait` child."""
        end = clock.at(time.perf_counter_ns())
        parent = self._parent(context)
        span = self.tracer.start_span(name, context=parent, kind=self._server, start_time=clock.wall_ns,
                                      attributes=attributes)
        if wait_ns > 0:
            self.tracer.start_span("batch_wait", context=self._set_span_in_context(span), start_time=clock.wall_ns,
                                   ).end(end_time=min(end, clock.wall_ns + wait_ns))
        span.end(end_time=end)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def replica_spans(endpoint: str, service: str, exporter=None) -> ReplicaSpans | None:
    """The recorder of a replica whose `otlp_traces_endpoint` is `endpoint` ('' and no exporter: None)."""
    if not endpoint and exporter is None:
        return None
    tracer, provider = init_tracer(endpoint, service, exporter)
    return ReplicaSpans(tracer, provider)
