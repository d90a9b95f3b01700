"""Operating specdec like the engines operators already run (vLLM's, TGI's), measured on a running stack: a target and a
draft replica and a coordinator, in this process, each serving /metrics on a port of its own.

- Every process's /metrics, scraped over HTTP after real requests in every mode, carries vLLM's spec-decode series
  under our prefix and the series only a disaggregated stack has, with values that agree with the requests' own
  stats: accepted tokens per position sum to the accepted tokens, drafts equal the rounds that drafted, the target
  replica verified exactly the draft tokens the coordinator counted; and every series the dashboard and the alerts
  read is one of those the processes served.
- With traces exported (an in-memory exporter), one request is followed from the coordinator's span into both
  replicas by its trace id: their prefill, draft and verify spans are the request span's children, and continue
  the client's `tracestate`.
"""
from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from coordinator.stack import free_port
from coordinator.tracing import init_tracer
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from specdec_rpc.tracing import replica_spans
from tests.helpers_models import start_coordinator, start_replica, tiny_pair
from tests.test_monitoring import queries

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack():
    import grpc

    target, draft = tiny_pair()
    ports = {k: free_port() for k in ("target", "draft", "coordinator")}
    t = await start_replica("target", target, metrics_port=ports["target"])
    d = await start_replica("draft", draft, metrics_port=ports["draft"], preverifier="random")
    c = await start_coordinator(t.endpoint, d.endpoint, metrics_port=ports["coordinator"])
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{c.port}")
    yield {"apps": {"target": t, "draft": d, "coordinator": c}, "ports": ports,
           "stub": gg.GenerationServiceStub(ch)}
    await ch.close()
    for a in (c, d, t):
        await a.shutdown(0)


SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


async def scrape(port: int) -> tuple[dict[tuple[str, tuple], float], set[str]]:
    """({(sample name, sorted labels): value}, every series name declared) of a process's /metrics, over HTTP (a
    labelled counter no event has hit yet is declared, with no sample)."""
    def get():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    families = list(text_string_to_metric_families(await asyncio.to_thread(get)))
    return ({(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families for s in fam.samples},
            {fam.name + suffix for fam in families for suffix in SERIES.get(fam.type, ("",))})


def total(samples: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


async def test_every_process_exports_series_that_agree_with_the_requests_stats(stack):
    stub = stack["stub"]
    stats: dict[str, list] = {}
    for mode in ("sd", "pacer", "pearl", "pacer_pearl", "ar"):
        for seed, temperature in ((0, 0.0), (3, 0.9)):
            r = await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode,
                                                      ignore_eos=True, seed=seed, temperature=temperature))
            stats.setdefault(mode, []).append(r.stats)
    scraped, declared = {}, set()
    for k, port in stack["ports"].items():
        scraped[k], names = await scrape(port)
        declared |= names
    coord = scraped["coordinator"]

    for mode, runs in stats.items():
        for s in runs:  # each request's own stats hold together
            assert sum(s.accepted_per_position) == s.accepted_tokens, mode
            assert s.drafts <= s.rounds and s.verified_draft_tokens <= s.draft_tokens, mode
            assert s.network_s == pytest.approx(s.draft_network_s + s.target_network_s + s.peer_network_s)
            assert s.target_model == "default-target" and s.draft_model == ("" if mode == "ar" else "default-draft")
            if mode in ("sd", "pacer"):  # every round drafts but a target-only one (a PACER skip drafts nothing)
                assert s.drafts == s.rounds - s.target_only_rounds, (mode, s)
            if mode == "sd":
                assert s.verified_draft_tokens == s.draft_tokens
            if mode in ("pearl", "pacer_pearl"):
                assert 0 < s.overlap_wall_s <= s.wall_s + 1e-6
                assert 0 <= s.draft_idle_s <= s.overlap_wall_s + 1e-9
                assert 0 <= s.target_idle_s <= s.overlap_wall_s + 1e-9
            assert s.pacer_false_stops <= s.pacer_stops and s.pacer_false_continues <= s.pacer_continues
            if mode not in ("pacer", "pacer_pearl"):
                assert s.pacer_stops == s.pacer_continues == 0
        pair = {"mode": mode, "draft_model": "" if mode == "ar" else "default-draft", "target_model": "default-target"}
        want = {"drafts": sum(s.drafts for s in runs), "draft_tokens": sum(s.verified_draft_tokens for s in runs),
                "accepted_tokens": sum(s.accepted_tokens for s in runs)}
        assert total(coord, "specdec_spec_decode_num_drafts_total", **pair) == want["drafts"], mode
        assert total(coord, "specdec_spec_decode_num_draft_tokens_total", **pair) == want["draft_tokens"], mode
        assert total(coord, "specdec_spec_decode_num_accepted_tokens_total", **pair) == want["accepted_tokens"], mode
        # vLLM's per-position counter: position i counts the drafts whose token i was accepted
        assert total(coord, "specdec_spec_decode_num_accepted_tokens_per_pos_total", **pair) == want["accepted_tokens"]
        pos0 = total(coord, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position="0", **pair)
        assert pos0 <= want["drafts"] and pos0 == sum(s.accepted_per_position[0] for s in runs
                                                      if s.accepted_per_position)
        if mode != "ar":
            assert want["drafts"] > 0 and want["accepted_tokens"] > 0, mode
        if mode in ("pacer", "pacer_pearl"):
            for k in ("stops", "false_stops", "continues", "false_continues"):
                assert total(coord, f"specdec_pacer_{k}_total", mode=mode) == sum(
                    getattr(s, f"pacer_{k}") for s in runs), (mode, k)
        if mode in ("pearl", "pacer_pearl"):
            assert total(coord, "specdec_overlap_seconds_total", mode=mode) == pytest.approx(
                sum(s.overlap_wall_s for s in runs))
            assert total(coord, "specdec_overlap_target_idle_seconds_total", mode=mode) == pytest.approx(
                sum(s.target_idle_s for s in runs))
            assert total(coord, "specdec_overlap_draft_idle_seconds_total", mode=mode) == pytest.approx(
                sum(s.draft_idle_s for s in runs))
            assert total(coord, "specdec_overlap_rounds_total", mode=mode) == sum(
                s.rounds - s.target_only_rounds - s.sequential_rounds for s in runs)
    pacer_decisions = sum(s.pacer_stops + s.pacer_continues for m in ("pacer", "pacer_pearl") for s in stats[m])
    assert pacer_decisions > 0, "the random pre-verifier made decisions that were judged"

    everything = [s for runs in stats.values() for s in runs]
    n_draft = sum(1 for s in everything if s.draft_model)
    assert total(coord, "specdec_request_network_seconds_count", link="coordinator-draft") == n_draft
    n_direct = sum(1 for s in everything if s.peer_network_s)  # sd and pacer on the direct data plane (auto)
    assert n_direct > 0 and total(coord, "specdec_request_network_seconds_count", link="draft-target") == n_direct
    assert total(coord, "specdec_request_network_seconds_count", link="coordinator-target") == len(everything) - n_direct
    assert total(coord, "specdec_request_network_seconds_sum", link="coordinator-target") == pytest.approx(
        sum(s.target_network_s for s in everything))
    assert total(coord, "specdec_request_network_seconds_sum", link="coordinator-draft") == pytest.approx(
        sum(s.draft_network_s for s in everything))
    # the target replica verified exactly the draft tokens the coordinator counted, and accepted the same
    tgt, drf = scraped["target"], scraped["draft"]
    assert total(tgt, "specdec_num_draft_tokens_total") == sum(s.verified_draft_tokens for s in everything)
    assert total(tgt, "specdec_num_accepted_tokens_total") == sum(s.accepted_tokens for s in everything)
    assert total(drf, "specdec_num_draft_tokens_total") >= sum(s.draft_tokens for s in everything) > 0
    assert total(drf, "specdec_num_drafts_total") > 0

    # every series the dashboard and the alerts read is one a process served
    read = {name for _, expr in queries() for name in re.findall(r"\bspecdec_[a-z0-9_]+", expr)}
    assert read <= declared, sorted(read - declared)


async def test_one_request_is_followed_into_both_replicas_by_its_trace_id(stack):
    apps, spans = stack["apps"], InMemorySpanExporter()
    coordinator = apps["coordinator"]
    coordinator.servicer.tracer, _ = init_tracer("", exporter=spans)
    apps["target"].servicer.spans = replica_spans("", "specdec-target", exporter=spans)
    apps["draft"].servicer.spans = replica_spans("", "specdec-draft", exporter=spans)
    try:
        for mode in ("sd", "pacer_pearl"):
            r = await stack["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=12, mode=mode,
                                                               ignore_eos=True),
                                             metadata=(("traceparent", TRACEPARENT),))
            for _ in range(100):  # the replicas' EndSession spans land after the answer
                if any(s.name == "llm_request" for s in spans.get_finished_spans()):
                    break
                await asyncio.sleep(0.01)
            finished = spans.get_finished_spans()
            spans.clear()
            (request,) = [s for s in finished if s.name == "llm_request"]
            assert format(request.context.trace_id, "032x") == TRACE_ID  # the client's trace, continued
            assert request.attributes["gen_ai.request.id"] == r.stats.request_id
            ours = [s for s in finished if s.context.trace_id == request.context.trace_id and s is not request]
            by_service = {}
            for s in ours:
                by_service.setdefault(s.resource.attributes["service.name"], set()).add(s.name)
                if s.name != "batch_wait":  # a call's span is the request span's child; a wait, the call's
                    assert s.parent.span_id == request.context.span_id, s.name
            assert {"prefill", "verify"} <= by_service["specdec-target"], (mode, by_service)
            assert {"prefill", "draft"} <= by_service["specdec-draft"], (mode, by_service)
            verifies = [s for s in ours if s.name == "verify"]
            assert sum(s.attributes["specdec.accepted_tokens"] for s in verifies) == r.stats.accepted_tokens
            assert all(s.attributes["specdec.session_id"] == r.stats.request_id for s in ours
                       if "specdec.session_id" in s.attributes)
            for s in ours:
                assert request.start_time <= s.start_time <= s.end_time <= request.end_time + 50_000_000, s.name
    finally:
        coordinator.servicer.tracer = None
        apps["target"].servicer.spans = apps["draft"].servicer.spans = None


async def test_the_callers_tracestate_goes_with_every_replica_call(stack):
    """A client's `tracestate` (its tracing vendors' data) is continued by the request span and sent with its
    `traceparent` in every replica call's metadata: each replica call's parent, read from that metadata, carries
    it, and so does every span of the trace."""
    apps, spans = stack["apps"], InMemorySpanExporter()
    coordinator = apps["coordinator"]
    coordinator.servicer.tracer, _ = init_tracer("", exporter=spans)
    apps["target"].servicer.spans = replica_spans("", "specdec-target", exporter=spans)
    apps["draft"].servicer.spans = replica_spans("", "specdec-draft", exporter=spans)
    tracestate = "vendor=opaque-1,other=x"
    try:
        await stack["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=8, mode="sd",
                                                       ignore_eos=True),
                                     metadata=(("traceparent", TRACEPARENT), ("tracestate", tracestate)))
        for _ in range(100):  # the replicas' EndSession spans land after the answer
            if any(s.name == "llm_request" for s in spans.get_finished_spans()):
                break
            await asyncio.sleep(0.01)
        finished = spans.get_finished_spans()
        (request,) = [s for s in finished if s.name == "llm_request"]
        assert request.parent.trace_state.to_header() == tracestate
        calls = [s for s in finished if s.parent is not None and s.parent.span_id == request.context.span_id]
        assert {"prefill", "verify", "draft"} <= {s.name for s in calls}
        for s in calls:
            assert s.parent.is_remote and s.parent.trace_state.to_header() == tracestate, s.name
        assert all(s.context.trace_state.to_header() == tracestate for s in finished)
    finally:
        coordinator.servicer.tracer = None
        apps["target"].servicer.spans = apps["draft"].servicer.spans = None


async def test_untraced_calls_carry_no_trace_context(stack):
    """Tracing off (the default): no traceparent goes to the replicas, and their servicers record nothing."""
    apps = stack["apps"]
    assert apps["coordinator"].servicer.tracer is None
    assert apps["target"].servicer.spans is None and apps["draft"].servicer.spans is None
    r = await stack["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=6, mode="sd"))
    assert r.stats.completion_tokens == 6


@pytest.mark.parametrize("n,size,accepted,stop,want", [
    # (tokens drafted, PACER's B, accepted from the first, stop reason) -> (stops, false stops, continues, false ones)
    (6, 2, 6, "preverifier", (1, 1, 2, 0)),  # stopped a draft the target took whole: a false stop
    (6, 2, 5, "preverifier", (1, 0, 2, 0)),  # its last block was partly accepted: both continues paid
    (6, 2, 2, "preverifier", (1, 0, 2, 2)),  # rejected at block 1's first token: both continues were wasted
    (6, 2, 3, "gamma_max", (0, 0, 2, 1)),  # block 1 partly accepted (paid), block 2 none of it
    (6, 2, 0, "cancelled", (0, 0, 2, 2)),
    (3, 4, 3, "gamma_max", (0, 0, 0, 0)),  # one block: no decision but the end, and gamma_max is no stop
    (4, 0, 0, "preverifier", (0, 0, 0, 0)),  # no block size reported: not judged
])
async def test_pacer_decisions_are_judged_by_the_block_they_drafted(n, size, accepted, stop, want):
    from specdec.scheduling.request import GenerationRequest
    from specdec.scheduling.run_state import _Run
    from specdec.workers.drafting import DraftBlock

    run = _Run(GenerationRequest(prompt_ids=[1], mode="pacer"), None)
    run.judge_pacer(DraftBlock(tokens=list(range(n)), q=[], stop_reason=stop, block_size=size), accepted)
    st = run.stats
    assert (st.pacer_stops, st.pacer_false_stops, st.pacer_continues, st.pacer_false_continues) == want
