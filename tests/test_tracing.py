"""OpenTelemetry traces (coordinator/tracing.py): one `llm_request` span per generation, a child of the caller's
W3C trace context (HTTP headers or gRPC metadata), with the request's attributes; failures end it with ERROR; and
COORDINATOR_OTLP_TRACES_ENDPOINT exports the spans over OTLP/gRPC to a collector, the last ones on shutdown."""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from coordinator.tracing import init_tracer
from specdec_rpc.pb import generation_pb2 as g
from tests.test_grammar_wire import PROMPT, Stack

pytestmark = pytest.mark.asyncio(loop_scope="module")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def traced(tmp_path_factory):
    s = await Stack().start(tmp_path_factory.mktemp("traced"))
    s.spans = InMemorySpanExporter()
    s.app.servicer.tracer, _ = init_tracer("", exporter=s.spans)
    yield s
    await s.stop()


def only_span(spans: InMemorySpanExporter):
    (span,) = spans.get_finished_spans()
    spans.clear()
    return span


async def test_an_http_request_is_a_child_of_the_callers_trace(traced):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "mode": "pacer_pearl", "ignore_eos": True}
    r = await traced.http.post("/v1/chat/completions", json=body,
                               headers={"traceparent": TRACEPARENT, "X-Request-Id": "traced-1"})
    assert r.status_code == 200, r.text
    span = only_span(traced.spans)
    assert span.name == "llm_request" and format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT and span.status.status_code != StatusCode.ERROR
    a = span.attributes
    assert a["gen_ai.request.id"].startswith("traced-1-") and a["specdec.mode"] == "pacer_pearl"
    assert a["gen_ai.usage.completion_tokens"] == 6 and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",) and a["specdec.target_forwards"] >= 1
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert [e.name for e in span.events] == ["first_token"]
    assert span.end_time - span.start_time == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, rel=1e-3)


async def test_grpc_metadata_carries_the_trace_and_failures_are_errors(traced):
    ok = await traced.stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=3, mode="sd"),
                                    metadata=(("traceparent", TRACEPARENT),))
    span = only_span(traced.spans)
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.attributes["gen_ai.usage.completion_tokens"] == len(ok.token_ids)
    with pytest.raises(grpc.aio.AioRpcError):
        await traced.stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, mode="fast"))
    span = only_span(traced.spans)
    assert span.status.status_code == StatusCode.ERROR and "unknown mode" in span.status.description
    assert span.parent is None  # no trace context sent: a trace of its own
    stream = traced.stub.GenerateStream(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40,
                                                          ignore_eos=True, mode="sd"))
    async for _ in stream:
        stream.cancel()  # the client goes away
        break
    for _ in range(200):
        if traced.spans.get_finished_spans():
            break
        await __import__("asyncio").sleep(0.01)
    span = only_span(traced.spans)
    assert span.status.status_code == StatusCode.ERROR and "went away" in span.status.description


async def test_the_request_span_sends_the_w3c_trace_headers_with_the_callers_tracestate():
    """The headers the replica calls carry are OpenTelemetry's propagator's: `traceparent` naming the request span
    (as W3C Trace Context writes it), and the caller's `tracestate` when it sent one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from coordinator.tracing import TRACE_HEADERS, RequestTrace
    from specdec.scheduling.request import GenerationRequest, PipelineRequest

    assert set(TRACE_HEADERS) == TraceContextTextMapPropagator().fields
    spans = InMemorySpanExporter()
    tracer, _ = init_tracer("", exporter=spans)
    for sent, state in [((("traceparent", TRACEPARENT),), None),
                        ((("traceparent", TRACEPARENT), ("tracestate", "vendor=opaque-1,other=x")),
                         "vendor=opaque-1,other=x"),
                        ((), None)]:
        trace, request = RequestTrace(tracer, sent), PipelineRequest(GenerationRequest([1, 2], session_id="r"))
        trace.request = request
        c = trace.span.get_span_context()
        headers = request.trace_headers
        assert headers.pop("traceparent") == f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"
        assert headers == ({"tracestate": state} if state else {})
        assert (format(c.trace_id, "032x") == TRACE_ID) == bool(sent)


async def test_spans_reach_an_otlp_collector(tmp_path):
    """The setting wires a real OTLP/gRPC exporter; the coordinator's shutdown exports the spans still batched."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.extend(span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    s = await Stack().start(tmp_path, otlp_traces_endpoint=f"http://127.0.0.1:{port}")
    try:
        await s.stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, request_id="exported"))
    finally:
        await s.stop()
        server.stop(0)
    (span,) = got
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert span.name == "llm_request" and attrs["gen_ai.request.id"].string_value.startswith("exported-")
