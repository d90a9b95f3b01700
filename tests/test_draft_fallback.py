"""COORDINATOR_DRAFT_FALLBACK: with no draft replica reachable, a speculative request runs target-only (the same
greedy output as `ar`, stats.draft_unavailable) instead of failing; switched off, it fails UNAVAILABLE naming the
pool."""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio

from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, target_greedy, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [3, 1, 4, 1, 5]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def no_draft():
    target, _ = tiny_pair()
    t = await start_replica("target", target)
    apps, stubs, channels = [], {}, []
    nowhere = f"127.0.0.1:{free_port()}"  # a draft pool whose one replica is not there
    for fallback in (True, False):
        s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                                draft_endpoints=nowhere, target_endpoints=t.endpoint, health_timeout_s=0.2,
                                log_level="WARNING", draft_fallback=fallback)
        app, _ = await build_coordinator(s, tokenizer=None, eos_token_ids=set())
        await app.start()
        apps.append(app)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
        channels.append(ch)
        stubs[fallback] = gg.GenerationServiceStub(ch)
    yield target, stubs, nowhere, apps[0]  # apps[0]: the coordinator with the fallback
    for ch in channels:
        await ch.close()
    for a in apps + [t]:
        await a.shutdown(0)


@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl", "pacer_pearl"])
async def test_requests_run_target_only_without_a_draft(no_draft, mode):
    target, stubs, *_ = no_draft
    out = await stubs[True].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=12, mode=mode,
                                                       ignore_eos=True))
    assert list(out.token_ids) == target_greedy(target, PROMPT, 12)
    assert out.stats.draft_unavailable and out.stats.mode == "ar" and out.stats.draft_tokens == 0
    assert out.stats.draft_fallback == "unreachable"
    streamed = [t async for part in stubs[True].GenerateStream(g.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=12, mode=mode, ignore_eos=True)) for t in part.token_ids]
    assert streamed == list(out.token_ids)


async def test_fallbacks_are_counted_for_alerts(no_draft):
    """specdec_draft_unavailable_total counts the requests that ran target-only for want of a draft (the alert
    SpecdecDraftPoolUnavailable in deploy/monitoring/prometheus-rules.yaml fires on it); `ar` requests are not."""
    from prometheus_client import generate_latest

    _, stubs, _, app = no_draft

    def count() -> float:
        line = next(ln for ln in generate_latest(app.metrics.registry).decode().splitlines()
                    if ln.startswith('specdec_draft_unavailable_total{reason="unreachable"} '))
        return float(line.split()[1])

    await stubs[True].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, mode="sd"))
    before = count()
    await stubs[True].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, mode="sd"))
    await stubs[True].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=2, mode="ar"))
    assert count() == before + 1


async def test_without_the_fallback_the_request_fails_naming_the_pool(no_draft):
    _, stubs, nowhere, _ = no_draft
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stubs[False].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, mode="sd"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and nowhere in e.value.details()
    ar = await stubs[False].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, mode="ar"))
    assert len(ar.token_ids) == 4 and not ar.stats.draft_unavailable  # ar needs no draft either way


async def _stack_with_one_draft(fallback: bool, **draft_kw):
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft, preverifier="random", **draft_kw)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, health_timeout_s=0.2,
                            log_level="WARNING", draft_fallback=fallback)
    app, _ = await build_coordinator(s, tokenizer=None, eos_token_ids=set())
    await app.start()
    return target, t, d, app


@pytest.mark.parametrize("mode", ["sd", "pacer_pearl"])
async def test_the_draft_lost_mid_request_finishes_target_only(mode):
    """The only draft replica shuts down after a few tokens: the request goes on target-only from the tokens
    already verified, and the whole answer equals target-only greedy decoding."""
    target, t, d, app = await _stack_with_one_draft(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            ids, last = [], None
            async for part in stub.GenerateStream(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40,
                                                                    mode=mode, ignore_eos=True, logprobs=1)):
                ids += list(part.token_ids)
                last = part
                if len(ids) >= 4 and not d.draining:
                    await d.shutdown(0)  # the draft pool is gone mid-request
            assert d.draining and ids == target_greedy(target, PROMPT, 40)
            assert last.stats.draft_unavailable and last.stats.completion_tokens == 40
            assert len(t.host.table) == 0  # the failed session and the target-only one both ended
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


async def test_without_the_fallback_a_lost_draft_fails_the_request():
    _, t, d, app = await _stack_with_one_draft(False)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                n = 0
                async for part in stub.GenerateStream(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40,
                                                                        mode="sd", ignore_eos=True)):
                    n += len(part.token_ids)
                    if n >= 4 and not d.draining:
                        await d.shutdown(0)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no draft replica" in e.value.details()
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


@pytest.mark.parametrize("fallback", [True, False])
async def test_a_request_past_the_drafts_context_runs_target_only(fallback):
    """A draft pool run with a shorter context than the target's (DRAFT_MAX_CONTEXT, to save its KV memory): a
    request that fits the target but not the draft runs target-only, exactly, instead of failing OUT_OF_RANGE
    (which it still does with the fallback off, naming the draft)."""
    target, t, d, app = await _stack_with_one_draft(fallback, max_context=24)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            short = await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=12, mode="sd",
                                                          ignore_eos=True))
            assert not short.stats.draft_unavailable and short.stats.draft_tokens > 0  # it fits the draft
            request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40, mode="pacer_pearl",
                                        ignore_eos=True)
            if not fallback:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(request)
                assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and "draft replica" in e.value.details()
                return
            out = await stub.Generate(request)
            assert list(out.token_ids) == target_greedy(target, PROMPT, 40)
            assert out.stats.draft_unavailable and out.stats.draft_fallback == "context" and out.stats.mode == "ar"
            assert len(t.host.table) == len(d.host.table) == 0
            from prometheus_client import generate_latest  # counted apart from an unreachable pool (no alert)

            assert 'specdec_draft_unavailable_total{reason="context"} 1.0' in \
                generate_latest(app.metrics.registry).decode()
    finally:
        for a in (app, t, d):
            await a.shutdown(0)
