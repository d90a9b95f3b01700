"""Preemption by priority (coordinator/routing/preemption.py): a request waiting for room in a full pool takes the
session of a running request of lower priority, which gives it up, waits, and resumes from its verified tokens,
exactly."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from coordinator.backends.moves import give_up_session
from coordinator.config import CoordinatorSettings
from coordinator.routing.preemption import Holdings
from coordinator.server import build_coordinator
from specdec.common.errors import CapacityError
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, target_greedy, tiny_pair
from tests.test_admission import EP, pool, settle
from tests.test_coordinator import slowed


def test_the_victim_is_the_lowest_priority_latest_holding():
    h = Holdings()
    for token, ep, priority in (("a", "x", 5), ("b", "y", 5), ("c", "x", 9), ("d", "x", 0)):
        h.record(token, ep, priority)
    anywhere = lambda token, holding: True  # noqa: E731
    assert h.mark_victim(0, anywhere) == "c", "the largest priority value first"
    assert h.mark_victim(0, anywhere) == "b", "then, among equals, the one handed out last"
    assert h.mark_victim(0, lambda token, holding: holding.endpoint != "x") is None, "only usable holdings"
    assert h.mark_victim(0, anywhere) == "a"
    assert h.mark_victim(0, anywhere) is None, "equal priorities never preempt each other"
    assert sorted(h.marked()) == ["a", "b", "c"]
    h.unmark("b")
    h.drop("c")
    assert h.marked() == ["a"] and h.mark_victim(-1, anywhere) == "b"
    h.record("", "x", 99)  # a session acquired without a token cannot be preempted
    assert "" not in h.by_token


async def test_a_waiter_marks_a_lower_priority_holding_and_unmarks_it_when_it_gives_up():
    pm = pool(1, wait_s=0.3)
    await pm.start()
    assert await pm.acquire("target", priority=3, holder="low/1") == EP
    same = asyncio.ensure_future(pm.acquire("target", priority=3, holder="peer/1"))
    await settle()
    assert pm.view()["preempt"] == {"target": []}, "equal priority: it waits, nothing is preempted"
    urgent = asyncio.ensure_future(pm.acquire("target", priority=-1, holder="urgent/1"))
    await settle()
    assert pm.view()["preempt"] == {"target": ["low/1"]} and pm.marked("target", "low/1")
    pm.release("target", EP, "low/1")  # the victim yields: the room goes to the waiter of highest priority
    await settle()
    assert urgent.done() and await urgent == EP and not same.done()
    assert pm.view()["preempt"] == {"target": []}
    with pytest.raises(CapacityError):
        await same  # times out (0.3 s): the urgent request holds the one session
    late = asyncio.ensure_future(pm.acquire("target", priority=-5, holder="later/1"))
    await settle()
    assert pm.view()["preempt"] == {"target": ["urgent/1"]}
    late.cancel()
    await settle()
    assert pm.view()["preempt"] == {"target": []}, "a waiter that goes away unmarks its victim"
    assert not pm.marked("target", "urgent/1"), "the victim asks before it yields: it keeps its session"
    off = pool(1, preempt=False)
    await off.start()
    await off.acquire("target", priority=3, holder="low/1")
    waiting = asyncio.ensure_future(off.acquire("target", priority=-1, holder="urgent/1"))
    await settle()
    assert off.view()["preempt"] == {"target": []}
    waiting.cancel()
    await pm.stop()
    await off.stop()


async def urgent_after_long(stub, target, mode: str) -> tuple:
    """A long request of priority 5 streams; once it has tokens, one of priority -1 arrives. Both answers must be
    the target's greedy output. → (the long one's last response, the urgent one's, whether the urgent one ended
    first)."""
    long_p, short_p = [1, 2, 3], [6, 7]
    got, first = [], asyncio.Event()

    async def long_request():
        last = None
        async for part in stub.GenerateStream(g.GenerateRequest(
                prompt_token_ids=long_p, max_new_tokens=60, mode=mode, priority=5, ignore_eos=True)):
            got.extend(part.token_ids)
            first.set()
            last = part
        return last, time.perf_counter()

    low = asyncio.ensure_future(long_request())
    await asyncio.wait_for(first.wait(), 30)
    high = await stub.Generate(g.GenerateRequest(prompt_token_ids=short_p, max_new_tokens=4, mode=mode,
                                                 priority=-1, ignore_eos=True))
    high_done = time.perf_counter()
    last, low_done = await low
    assert list(high.token_ids) == target_greedy(target, short_p, 4)
    assert got == target_greedy(target, long_p, 60), "the preempted request resumed exactly"
    return last, high, high_done < low_done


async def one_session_pair():
    """Target and draft replicas of one session each, the target's forwards slowed: both pools fill at once."""
    target, draft = tiny_pair()
    t = await start_replica("target", slowed(target, 0.02), max_sessions=1)
    d = await start_replica("draft", draft, preverifier="random", max_sessions=1)
    return target, t, d


@pytest.mark.parametrize("mode,data_plane", [("sd", "coordinator"), ("pacer_pearl", "coordinator"), ("sd", "direct")])
async def test_a_higher_priority_request_preempts_and_both_answers_stay_exact(mode, data_plane):
    """One target and one draft session (max_sessions=1), the target's forwards slowed: a long request of priority 5
    is running when a request of priority -1 arrives. The urgent one takes both sessions and finishes first; the
    preempted one waits, resumes from its verified tokens and still returns the target's greedy output
    (stats.preemptions = 1). With both pools full, a victim that kept its session in the other pool while waiting
    would deadlock with the waiter. With COORDINATOR_PREEMPT off, the urgent one waits for the long one to end.
    On the direct data plane the coordinator ends the draft replica's rounds at the next tokens after the mark and
    goes on with its own, which give way. (Through Ray: tests/test_coordinator.py, test_ray_stack.)"""
    target, t, d = await one_session_pair()
    apps, channels = [], []
    try:
        for preempt in (True, False):
            s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", pipelines=1,
                                    draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                                    grace_s=0, preempt=preempt, pool_view_refresh_s=0.05, data_plane=data_plane)
            app, _ = await build_coordinator(s)
            await app.start()
            apps.append(app)
            channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
            last, high, urgent_first = await urgent_after_long(gg.GenerationServiceStub(channels[-1]), target, mode)
            if preempt:
                assert last.stats.preemptions == 1 and high.stats.preemptions == 0
                assert urgent_first, "the urgent request did not wait for the long one"
            else:
                assert last.stats.preemptions == 0 and not urgent_first
            for _ in range(100):
                if not t.host.table and not d.host.table:
                    break
                await asyncio.sleep(0.02)
            assert not t.host.table and not d.host.table
    finally:
        for ch in channels:
            await ch.close()
        for a in apps + [t, d]:
            await a.shutdown(0)


@contextlib.asynccontextmanager
async def target_backend(prompt: list[int]):
    """A RemoteTarget over one tiny target replica, its session started on `prompt` (output at the prompt's end).
    → (the target model, its replica, the pool manager, the backend, its pool view)."""
    from coordinator.channels import Channels
    from coordinator.backends.clients import PoolView, RemoteTarget
    from coordinator.routing.discovery import StaticSource
    from coordinator.backends.pipeline import AsyncPool
    from coordinator.routing.pool import PoolManager
    from specdec.decoding.sampling import SamplingParams

    target, _ = tiny_pair()
    t = await start_replica("target", target)
    pm = PoolManager({"target": StaticSource([t.endpoint])}, refresh_s=60)
    await pm.start()
    channels = Channels(None)
    try:
        view = PoolView()
        backend = RemoteTarget(AsyncPool(pm), channels, view)
        backend.start_kw.update(reserve_positions=len(prompt) + 4, output_start=len(prompt))
        await backend.start("s", prompt, SamplingParams())
        yield target, t, pm, backend, view
        await backend.end("s")
    finally:
        await channels.close()
        await pm.stop()
        await t.shutdown(0)


async def test_a_session_rebuilt_at_its_first_verify_holds_the_whole_prompt():
    """A preempted request's sibling gives its session up before it ever verified (found by scripts/soak.py): its
    first verify feeds the prompt's last token, and the rebuilt session must hold the whole prompt. Rebuilt from
    the prompt less that token, the replica refused it (INVALID_ARGUMENT: output_start, the prompt's end, lay past
    the rebuilt prompt)."""
    prompt = [3, 1, 4, 1, 5]
    async with target_backend(prompt) as (target, t, _, backend, _):
        want = target_greedy(target, prompt, 2)
        await give_up_session(backend)  # as a preempted sibling does: the next call takes room again and rebuilds
        assert backend.endpoint is None and not t.host.table
        out = await backend.verify("s", len(prompt) - 1, prompt[-1:], [], None, "greedy")
        assert out.next_token == want[0] and len(t.host.table) == 1
        out = await backend.verify("s", len(prompt), want[:1], [], None, "greedy")
        assert out.next_token == want[1]


async def test_a_mark_the_pool_withdrew_does_not_preempt():
    """A pipeline's view is up to a refresh old: a holding it still lists as marked, whose waiter got room another
    way meanwhile, asks the pool before it yields, and keeps its session (no wasted re-prefill)."""
    prompt = [2, 7, 1, 8]
    async with target_backend(prompt) as (target, t, pm, backend, view):
        view.preempt = {"target": [backend.holding]}  # stale: the pool marks nothing
        out = await backend.verify("s", len(prompt) - 1, prompt[-1:], [], None, "greedy")
        assert out.next_token == target_greedy(target, prompt, 1)[0]
        assert backend.preemptions == 0 and backend.endpoint == t.endpoint
        pm.pools["target"].holdings.by_token[backend.holding].marked = True  # now the pool wants it
        await backend.verify("s", len(prompt), [out.next_token], [], None, "greedy")
        assert backend.preemptions == 1 and backend.endpoint == t.endpoint  # it yielded and took room again


async def test_a_resumed_request_takes_the_draft_before_the_target():
    """Found by a chaos test. One session per pool. L (sd, priority 5) runs; W (ar, priority -1)
    preempts L's target session, so L gives up both and waits; then C (sd, priority 5) arrives. When W ends, L must
    not take the target first: C's probe holds the draft while C waits for the target, and L would hold the target
    while it waited for the draft, both until queue_wait_s (RESOURCE_EXHAUSTED). Taking the draft first, as a new
    request does, runs L and C one after the other, exactly."""
    target, t, d = await one_session_pair()
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", pipelines=1,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING", grace_s=0,
                            queue_wait_s=8, pool_view_refresh_s=0.05)
    app, router = await build_coordinator(s)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    stub = gg.GenerationServiceStub(ch)
    prompts = {"L": ([5, 6, 7], "sd", 40, 5), "W": ([1, 2, 3], "ar", 20, -1), "C": ([9, 9, 1], "sd", 16, 5)}

    async def run(name):
        p, mode, n, prio = prompts[name]
        out = await stub.Generate(g.GenerateRequest(prompt_token_ids=p, max_new_tokens=n, mode=mode, gamma=2,
                                                    priority=prio, temperature=0.0), timeout=60)
        return list(out.token_ids), out.stats.preemptions

    try:
        low = asyncio.ensure_future(run("L"))
        while not t.host.table:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        urgent = asyncio.ensure_future(run("W"))
        waiting = router.pool_manager.pools["target"].waiters
        deadline = time.monotonic() + 20
        while not any(w.priority == 5 for w in waiting):  # L gave its sessions up and waits
            assert time.monotonic() < deadline and not low.done()
            await asyncio.sleep(0.01)
        late = asyncio.ensure_future(run("C"))
        (l_ids, l_pre), (w_ids, _), (c_ids, _) = await asyncio.gather(low, urgent, late)
        assert l_pre == 1
        for name, ids in (("L", l_ids), ("W", w_ids), ("C", c_ids)):
            p, _, n, _ = prompts[name]
            assert ids == target_greedy(target, p, n), name
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)
