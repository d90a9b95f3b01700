"""Room and sessions a failing request must not keep, found by a chaos test: a request refused by its
own validation after the draft replica was pinned, and a failover after one call answered UNAVAILABLE from a
replica that stayed up (its session there was never ended; and when no other replica could be pinned, the request's
end released the first replica a second time)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.backends import clients
from coordinator.config import CoordinatorSettings
from coordinator.server import build_coordinator
from coordinator.stack import free_port
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_replica, target_greedy, tiny_pair
from tests.test_coordinator import slowed

pytestmark = pytest.mark.asyncio


async def coordinator(draft_eps: str, target_eps: str, **kw):
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", pipelines=1,
                            draft_endpoints=draft_eps, target_endpoints=target_eps, log_level="WARNING", grace_s=0,
                            replica_streams=False, **kw)
    app, router = await build_coordinator(s)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    return app, router, ch, gg.GenerationServiceStub(ch)


def counts(router, kind: str) -> dict:
    return {ep: m["sessions"] for ep, m in router.pool_manager.snapshot()[kind].items()}


async def test_a_request_refused_by_its_validation_holds_no_draft_room():
    target, draft = tiny_pair()
    t = await start_replica("target", target, max_sessions=2)
    d = await start_replica("draft", draft, preverifier="random", max_sessions=2)
    app, router, ch, stub = await coordinator(d.endpoint, t.endpoint, queue_wait_s=2)
    try:
        for _ in range(3):  # pearl_first_block past gamma: refused by GenerationRequest.validate
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8, mode="pearl",
                                                      gamma=4, pearl_first_block=5), timeout=20)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert set(counts(router, "draft").values()) == {0}
        out = await stub.Generate(g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8, mode="sd",
                                                    temperature=0.0), timeout=20)
        assert list(out.token_ids) == target_greedy(target, [1, 2, 3], 8)
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)


@pytest.mark.parametrize("other_up", [True, False])
async def test_a_failover_ends_the_old_session_and_releases_its_replica_once(monkeypatch, other_up):
    """One Verify of request Y answers UNAVAILABLE (injected) from a replica that stays up, where request X runs
    too. With a second target replica up, Y moves there and is exact, and its session on the first replica is
    ended. With none, Y fails UNAVAILABLE, and the first replica still counts X's session while X runs."""
    target, draft = tiny_pair()
    t1 = await start_replica("target", slowed(target, 0.01))
    t2 = await start_replica("target", target) if other_up else None
    d = await start_replica("draft", draft, preverifier="random")
    other = t2.endpoint if other_up else f"127.0.0.1:{free_port()}"
    app, router, ch, stub = await coordinator(d.endpoint, f"{t1.endpoint},{other}")
    real, fired = clients.RemoteTarget._unary_verify, []

    def flaky(self, r):
        if r.session_id.startswith("y-req") and not fired:
            fired.append(self.endpoint)

            async def fail():
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "injected: one call failed, the replica stays up")
            return fail()
        return real(self, r)

    monkeypatch.setattr(clients.RemoteTarget, "_unary_verify", flaky)
    try:
        x = asyncio.ensure_future(stub.Generate(g.GenerateRequest(prompt_token_ids=[5, 6, 7], max_new_tokens=40,
                                                                  mode="ar"), timeout=60))
        while not t1.host.table and not (t2 and t2.host.table):
            await asyncio.sleep(0.01)
        x_on = t1 if t1.host.table else t2
        y = g.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8, mode="ar", request_id="y-req")
        if other_up:
            out = await stub.Generate(y, timeout=30)
            assert list(out.token_ids) == target_greedy(target, [1, 2, 3], 8) and fired
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(y, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        if not x.done():
            assert counts(router, "target")[x_on.endpoint] == 1, "X's session is still counted"
        await x
        for _ in range(100):
            if not t1.host.table and not (t2 and t2.host.table):
                break
            await asyncio.sleep(0.05)
        assert not t1.host.table and not (t2 and t2.host.table), "a session left on a replica"
        assert set(counts(router, "target").values()) == {0}
    finally:
        await ch.close()
        for a in (app, t1, t2, d):
            if a is not None:
                await a.shutdown(0)
