"""Admission: a pool at capacity queues requests (first come, first served, bounded, with a timeout) instead of
failing them, and says what to change when the queue is full or the wait runs out."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.config import CoordinatorSettings
from coordinator.routing.discovery import StaticSource
from coordinator.routing.pool import PoolManager, ReplicaUnavailableError
from coordinator.server import build_coordinator
from specdec.common.errors import CapacityError
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, target_greedy, tiny_pair

EP = "10.0.0.1:7"


def pool(capacity: int, up: set[str] | None = None, endpoints=(EP,), **kw) -> PoolManager:
    """Target replicas (EP) with `capacity` sessions each; `up` (mutable) holds the endpoints that pass health
    checks (default: all)."""
    up = set(endpoints) if up is None else up

    async def health(endpoint, service):
        return endpoint in up, "" if endpoint in up else "down"

    async def capacity_check(kind, endpoint):
        return capacity

    return PoolManager({"target": StaticSource(list(endpoints))}, refresh_s=60, health_check=health,
                       capacity_check=capacity_check, **kw)


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_full_pool_queues_in_arrival_order(caplog):
    caplog.set_level("INFO", logger="coordinator.routing.pool")
    pm = pool(2)
    await pm.start()
    assert pm.snapshot()["target"][EP]["capacity"] == 2
    held = [await pm.acquire("target"), await pm.acquire("target")]
    waiters = [asyncio.ensure_future(pm.acquire("target")) for _ in range(3)]
    await settle()
    assert not any(w.done() for w in waiters) and pm.waiting() == {"target": 3}
    pm.release("target", held.pop())
    await settle()
    assert [w.done() for w in waiters] == [True, False, False], "the first to arrive gets the first free session"
    late = asyncio.ensure_future(pm.acquire("target"))  # arrives last, served last
    pm.release("target", held.pop())
    await settle()
    assert [w.done() for w in waiters] == [True, True, False] and not late.done()
    waiters[2].cancel()  # a request that goes away leaves the queue
    await settle()
    pm.release("target", await waiters[0])
    await settle()
    assert await late == EP and pm.waiting() == {"target": 0}
    assert pm.snapshot()["target"][EP]["sessions"] == 2
    said = [r.getMessage() for r in caplog.records]
    assert sum("target pool at capacity (2 sessions)" in m for m in said) == 1, said  # once, not per request
    assert any("the queue drained after" in m for m in said), said
    await pm.stop()


async def test_waiters_are_served_by_priority_then_arrival():
    """A full pool serves waiting requests lower priority first (vLLM's), equal priorities in arrival order."""
    pm = pool(1)
    await pm.start()
    held = await pm.acquire("target")
    order = []

    async def wait(name, priority):
        order.append((name, await pm.acquire("target", priority=priority)))

    tasks = []
    for name, priority in (("batch", 5), ("chat-1", 0), ("urgent", -1), ("chat-2", 0)):
        tasks.append(asyncio.ensure_future(wait(name, priority)))
        await settle()
    for _ in range(4):
        pm.release("target", held)
        await settle()
    await asyncio.gather(*tasks)
    assert [n for n, _ in order] == ["urgent", "chat-1", "chat-2", "batch"]
    await pm.stop()


async def test_room_a_waiter_cannot_use_goes_to_the_next_one():
    """After a failover a waiter excludes the replica it left; room there must not sit idle behind it."""
    a, b = "10.0.0.1:7", "10.0.0.2:7"
    pm = pool(1, endpoints=(a, b))
    await pm.start()
    held = {await pm.acquire("target"), await pm.acquire("target")}
    assert held == {a, b}
    moved = asyncio.ensure_future(pm.acquire("target", exclude=[b]))
    fresh = asyncio.ensure_future(pm.acquire("target"))
    await settle()
    pm.release("target", b)
    await settle()
    assert not moved.done() and fresh.done() and await fresh == b
    pm.release("target", a)
    await settle()
    assert await moved == a
    await pm.stop()


async def test_queue_bound_and_wait_timeout_say_what_to_change():
    pm = pool(1, max_waiting=1, wait_s=0.2)
    await pm.start()
    await pm.acquire("target")
    first = asyncio.ensure_future(pm.acquire("target"))
    await settle()
    with pytest.raises(CapacityError, match=r"queue is full \(1 waiting\).*COORDINATOR_MAX_WAITING"):
        await pm.acquire("target")
    with pytest.raises(CapacityError, match=r"no target session became free within 0.2 s.*--max-sessions"):
        await first
    assert pm.waiting() == {"target": 0} and pm.snapshot()["target"][EP]["sessions"] == 1
    await pm.stop()


async def test_unknown_capacity_means_no_limit_and_an_emptied_pool_fails_its_waiters():
    unlimited = pool(0)
    await unlimited.start()
    assert len([await unlimited.acquire("target") for _ in range(50)]) == 50
    up = {EP}
    pm = pool(1, up=up)
    await pm.start()
    await pm.acquire("target")
    waiter = asyncio.ensure_future(pm.acquire("target"))
    await settle()
    up.clear()
    pm.report_failure("target", EP, "UNAVAILABLE")
    with pytest.raises(ReplicaUnavailableError, match="no target replica reachable"):
        await waiter


async def test_requests_beyond_the_targets_sessions_wait_and_finish_exactly():
    """A target replica with max_sessions=1 behind the coordinator: three concurrent requests all finish with the
    target's greedy output, one after another (the replica would refuse a second session); with no queue allowed
    the second fails at once with RESOURCE_EXHAUSTED."""
    target, draft = tiny_pair()
    t = await start_replica("target", target, max_sessions=1)
    d = await start_replica("draft", draft)
    apps, channels, routers = [], [], []
    try:
        stubs = []
        for max_waiting in (8, 0):
            s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", pipelines=1,
                                    draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                                    grace_s=0, max_waiting=max_waiting, queue_wait_s=60)
            app, router = await build_coordinator(s)
            await app.start()
            apps.append(app)
            routers.append(router)
            channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
            stubs.append(gg.GenerationServiceStub(channels[-1]))
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
        rs = await asyncio.gather(*(stubs[0].Generate(g.GenerateRequest(
            prompt_token_ids=p, max_new_tokens=16, mode="sd", gamma=3)) for p in prompts))
        for p, r in zip(prompts, rs):
            assert list(r.token_ids) == target_greedy(target, p, 16)
        assert max(r.stats.queued_s for r in rs) > 0.01, "two of them waited for the target's one session"
        held = await routers[0].pool_manager.acquire("target")
        waiting = asyncio.ensure_future(stubs[0].Generate(g.GenerateRequest(prompt_token_ids=[4, 5],
                                                                            max_new_tokens=4, mode="sd")))
        metric = lambda: apps[0].metrics.value("specdec_num_requests_waiting")  # noqa: E731
        for _ in range(100):
            if metric() == 1:
                break
            await asyncio.sleep(0.02)
        assert metric() == 1
        routers[0].pool_manager.release("target", held)
        assert list((await waiting).token_ids) == target_greedy(target, [4, 5], 4) and metric() == 0

        async def waiters(n):
            for _ in range(100):
                if metric() == n:
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"{metric()} waiting, not {n}")

        held = await routers[0].pool_manager.acquire("target")  # GenerateRequest.priority: the lower goes first
        low = asyncio.ensure_future(stubs[0].Generate(g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4,
                                                                        mode="sd", priority=5)))
        await waiters(1)
        high = asyncio.ensure_future(stubs[0].Generate(g.GenerateRequest(prompt_token_ids=[6, 7], max_new_tokens=4,
                                                                         mode="sd", priority=-1)))
        await waiters(2)
        routers[0].pool_manager.release("target", held)
        done, _ = await asyncio.wait({low, high}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {high}, "the later request of lower priority value ran first"
        assert list((await low).token_ids) == target_greedy(target, [1, 2, 3], 4)
        held = await routers[1].pool_manager.acquire("target")  # the replica's one session, pinned elsewhere
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stubs[1].Generate(g.GenerateRequest(prompt_token_ids=[4, 5], max_new_tokens=4, mode="sd"))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions (1 sessions in all)" in ei.value.details(), ei.value.details()
        routers[1].pool_manager.release("target", held)
    finally:
        for ch in channels:
            await ch.close()
        for a in apps + [t, d]:
            await a.shutdown(0)


class _Ref:
    """A fake ObjectRef: awaitable any number of times; cancelling an await does not cancel the result."""

    def __init__(self, f: asyncio.Future):
        self.f = f

    def __await__(self):
        return asyncio.shield(self.f).__await__()


class _Remote:
    """`handle.method.remote(*args)` of a fake Ray actor handle: each call returns a ref the test resolves."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.futures: list[asyncio.Future] = []

    def remote(self, *args):
        self.calls.append(args)
        f = asyncio.get_running_loop().create_future()
        self.futures.append(f)
        return _Ref(f)


class _Handle:
    def __init__(self):
        self.acquire, self.release = _Remote(), _Remote()


@pytest.mark.parametrize("handed", [True, False])
async def test_a_request_cancelled_while_the_ray_pool_looks_for_room_leaks_no_session(handed):
    """Through Ray the pool actor does not see a pipeline's cancel: the room it hands over afterwards must go
    back, or every client cancel or deadline in the queue would shrink the pools for good (scripts/soak.py, 12
    clients on 4 sessions: 60 of 122 requests got RESOURCE_EXHAUSTED before this was fixed)."""
    from coordinator.actor import RayPool

    h = _Handle()
    pool = RayPool(h)
    req = asyncio.ensure_future(pool.acquire("target"))
    await settle()
    req.cancel()
    with pytest.raises(asyncio.CancelledError):
        await req
    if handed:
        h.acquire.futures[0].set_result(EP)  # the actor found room after all
    else:
        h.acquire.futures[0].set_exception(RuntimeError("cancelled in the actor"))
    await settle()
    assert h.release.calls == ([("target", EP, "")] if handed else [])
    if h.release.futures:
        h.release.futures[0].set_result(None)
    await settle()
    assert not pool._giving_back
