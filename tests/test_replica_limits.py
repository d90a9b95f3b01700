"""A replica's limits as the coordinator meets them, and the warnings a server logs at start about its settings."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from specdec_rpc.settings import startup_warnings
from target_service.config import TargetSettings
from tests.helpers_models import start_coordinator, start_replica, target_greedy, tiny_pair

PROMPT = [3, 1, 4, 1, 5]


@pytest.mark.parametrize("mode", ["sd", "pearl"])
async def test_a_full_call_queue_is_waited_out_not_failed(mode):
    """A replica whose call queue is full refuses a round call RESOURCE_EXHAUSTED before applying it; the coordinator
    backs off and sends it again. Before, the whole request failed, sometimes after streaming most of its tokens
    (an audit: 6 of 8 requests, with max_queue 2)."""
    target, draft = tiny_pair()
    t = await start_replica("target", target, max_queue=1, batch_window_ms=0.0)
    d = await start_replica("draft", draft, max_queue=1)
    coord = await start_coordinator(t.endpoint, d.endpoint)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            prompts = [PROMPT + [i] for i in range(8)]
            outs = await asyncio.gather(*(stub.Generate(g.GenerateRequest(
                prompt_token_ids=p, max_new_tokens=40, mode=mode, ignore_eos=True)) for p in prompts))
        for p, out in zip(prompts, outs):
            assert list(out.token_ids) == target_greedy(target, p, 40)
        codes = {sample.labels["code"] for app in (t, d) for m in app.metrics.registry.collect()
                 if m.name == "specdec_rpc_errors" for sample in m.samples if sample.value}
        assert "RESOURCE_EXHAUSTED" in codes, "no call met a full queue: the test checks nothing"
    finally:
        for a in (coord, d, t):
            await a.shutdown(0)


def test_misspelt_settings_and_a_short_queue_are_warned_about():
    env = {"TARGET_MAX_SESION": "3", "TARGET_GRACE_S": "1", "TARGET_TLS__CERT_FILE": "a", "TARGET_TLS_CERT_FILE": "a",
           "TARGET_TLS_KEY_FILE": "b", "DRAFT_MAX_SESION": "1", "PATH": "/bin"}
    warnings = startup_warnings(TargetSettings(max_queue=8, max_sessions=16), env)
    assert len(warnings) == 2, warnings
    # a flat TLS spelling without its nested twin sets nothing either
    assert warnings[0].startswith("TARGET_MAX_SESION, TARGET_TLS_KEY_FILE: no such setting")
    assert "max_queue 8 is under twice max_sessions (16)" in warnings[1]
    assert startup_warnings(TargetSettings(), {"TARGET_GRACE_S": "1"}) == []


async def test_a_whole_answer_over_the_message_limit_names_the_setting():
    """Before, gRPC refused to send it ("Sent message larger than max"), the request counted as a success, and the
    log had an ERROR traceback."""
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    coord = await start_coordinator(t.endpoint, max_message_bytes=4096)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
            request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=200, mode="ar", ignore_eos=True,
                                        logprobs=5)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await gg.GenerationServiceStub(ch).Generate(request)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "COORDINATOR_MAX_MESSAGE_BYTES" in ei.value.details() and "GenerateStream" in ei.value.details()
            streamed = [tok async for part in gg.GenerationServiceStub(ch).GenerateStream(request)
                        for tok in part.token_ids]
            assert streamed == target_greedy(target, PROMPT, 200)
        errors = coord.metrics.registry.get_sample_value("specdec_request_errors_total",
                                                         {"code": "RESOURCE_EXHAUSTED"})
        assert errors == 1
    finally:
        for a in (coord, t):
            await a.shutdown(0)


def test_a_prompt_past_the_context_is_told_to_shorten_the_prompt():
    """Not to "lower max_new_tokens by 7" when max_new_tokens was 1 (an audit)."""
    from specdec.common.errors import ContextOverflowError
    from specdec.workers.base import Worker

    class Sized:
        max_context, context_bound = 64, "--max-context"

    with pytest.raises(ContextOverflowError, match="the prompt alone has 70 tokens: shorten it by at least 7$"):
        Worker.check_reserve(Sized(), 71, 70)
    with pytest.raises(ContextOverflowError, match="lower max_new_tokens by 6 or shorten the prompt$"):
        Worker.check_reserve(Sized(), 70, 60)
    Worker.check_reserve(Sized(), 64, 60)


async def test_a_replica_full_of_sessions_the_pool_does_not_count_is_waited_for():
    """Sessions the coordinator did not start (a crashed coordinator's, another one's) fill a replica, and its pool
    counts them not: StartSession is refused RESOURCE_EXHAUSTED until the replica's LRU frees an idle one
    (`lru_min_idle_s`). With no other replica, the request waits and asks again; before, it failed at once (found by an
    audit)."""
    from specdec_rpc.pb import target_pb2, target_pb2_grpc

    target, _ = tiny_pair()
    t = await start_replica("target", target, max_sessions=2, lru_min_idle_s=0.5)
    coord = await start_coordinator(t.endpoint)
    try:
        async with grpc.aio.insecure_channel(t.endpoint) as direct:
            for sid in ("orphan-1", "orphan-2"):  # what a coordinator that crashed left behind
                await target_pb2_grpc.TargetServiceStub(direct).StartSession(
                    target_pb2.TargetServiceStartSessionRequest(session_id=sid, prompt_ids=PROMPT))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}") as ch:
            out = await gg.GenerationServiceStub(ch).Generate(g.GenerateRequest(
                prompt_token_ids=PROMPT, max_new_tokens=8, mode="ar", ignore_eos=True))
        assert list(out.token_ids) == target_greedy(target, PROMPT, 8)
        assert out.stats.wall_s >= 0.3, "it waited for the replica's LRU to free an idle session"
    finally:
        for a in (coord, t):
            await a.shutdown(0)
