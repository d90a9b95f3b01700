"""What the coordinator's /metrics and request log say about each way a request ends. Found by an observability
audit: time to first token missed every non-streamed request; a cancelled request was counted and
logged nowhere; client mistakes counted as finish_reason "error" beside server failures, and errors raised before
generation not at all; "running" counted requests still waiting for sessions; no speculative-decoding counter
named its mode; the coordinator exported replica series stuck at 0; the draft's batch sizes missed its fast path."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
import pytest_asyncio

from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack():
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s, eos_token_ids=set())
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    yield app, t, d, gg.GenerationServiceStub(ch)
    await ch.close()
    for a in (app, t, d):
        await a.shutdown(0)


def value(app, name, **labels) -> float:
    """The sample's value; a series with more labels than given: the sum over the others (the model pair)."""
    exact = app.metrics.registry.get_sample_value(name, labels)
    if exact is not None:
        return exact
    return sum(s.value for m in app.metrics.registry.collect() for s in m.samples
               if s.name == name and labels.items() <= s.labels.items())


def req(n=8, mode="sd", **kw):
    return g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=n, mode=mode, **kw)


async def test_a_whole_answer_counts_its_first_token_and_its_mode(stack):
    app, _, d, stub = stack
    before = {k: value(app, k) for k in ("specdec_time_to_first_token_seconds_count",
                                         "specdec_e2e_request_latency_seconds_count")}
    mode_before = {k: value(app, k, mode="sd") for k in (
        "specdec_spec_decode_num_draft_tokens_total", "specdec_spec_decode_num_accepted_tokens_total",
        "specdec_spec_decode_num_emitted_tokens_total", "specdec_spec_decode_num_target_forwards_total")}
    r = await stub.Generate(req(12))
    assert value(app, "specdec_time_to_first_token_seconds_count") == \
        before["specdec_time_to_first_token_seconds_count"] + 1
    assert value(app, "specdec_e2e_request_latency_seconds_count") == \
        before["specdec_e2e_request_latency_seconds_count"] + 1
    got = {k: value(app, k, mode="sd") - v for k, v in mode_before.items()}
    assert got == {"specdec_spec_decode_num_draft_tokens_total": r.stats.verified_draft_tokens,
                   "specdec_spec_decode_num_accepted_tokens_total": r.stats.accepted_tokens,
                   "specdec_spec_decode_num_emitted_tokens_total": len(r.token_ids),
                   "specdec_spec_decode_num_target_forwards_total": r.stats.target_forwards}
    assert r.stats.draft_tokens == r.stats.verified_draft_tokens > 0  # sd verifies every token it drafts
    pair = {"draft_model": "default-draft", "target_model": "default-target"}  # the replicas' ModelInfo.model
    # every mode's series of a pair from the pair's first request on
    assert app.metrics.registry.get_sample_value("specdec_spec_decode_num_draft_tokens_total",
                                                 {"mode": "pacer_pearl", **pair}) == 0
    assert (d.metrics.value("specdec_batch_size_count") or 0) > 0  # the draft's one-call fast path observes 1


async def test_errors_are_counted_by_status_apart_from_finished_requests(stack, caplog):
    app, _, _, stub = stack
    finished = sum(value(app, "specdec_request_success_total", finish_reason=f) for f in ("stop", "length", "abort"))
    with caplog.at_level(logging.INFO, logger="coordinator.requests"):
        for bad in (req(mode="nonsense"), req(temperature=-1.0)):  # refused before generation
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as e:  # refused by the target replica (past its context)
            await stub.Generate(req(100_000))
    assert value(app, "specdec_request_errors_total", code="INVALID_ARGUMENT") >= 2
    assert value(app, "specdec_request_errors_total", code=e.value.code().name) >= 1
    assert value(app, "specdec_rpc_errors_total", method="Generate", code="INVALID_ARGUMENT") >= 2
    assert sum(value(app, "specdec_request_success_total", finish_reason=f)
               for f in ("stop", "length", "abort")) == finished
    assert len([r for r in caplog.records if "failed INVALID_ARGUMENT" in r.getMessage()]) >= 2


async def test_a_client_that_goes_away_is_an_abort_and_running_excludes_nothing_idle(stack, caplog):
    app, t, _, stub = stack
    assert value(app, "specdec_num_requests_running") == 0
    assert value(app, "specdec_sessions_active") == 0 and \
        "specdec_sessions_active" not in {m.name for m in app.metrics.registry.collect()}  # replica series: not here
    aborted = value(app, "specdec_request_success_total", finish_reason="abort")
    with caplog.at_level(logging.INFO, logger="coordinator.requests"):
        call = stub.GenerateStream(req(200, mode="sd", request_id="gone"))
        async for _ in call:
            assert value(app, "specdec_num_requests_running") == 1  # it holds its sessions, it waits for none
            break
        call.cancel()
        for _ in range(100):
            if value(app, "specdec_request_success_total", finish_reason="abort") > aborted and not t.host.table:
                break
            await asyncio.sleep(0.05)
    assert value(app, "specdec_request_success_total", finish_reason="abort") == aborted + 1
    assert value(app, "specdec_num_requests_running") == 0
    assert any(r.getMessage().startswith("request gone-") and "finish abort" in r.getMessage()
               for r in caplog.records)
