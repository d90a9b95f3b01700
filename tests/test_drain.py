"""Draining on SIGTERM (specdec_rpc/app.py, `ServerApp.shutdown`).

A replica that drains refuses new sessions (UNAVAILABLE, so the coordinator starts them elsewhere) and keeps serving
the sessions it holds until they end or the grace runs out: with one target replica, a request in flight when the
replica is told to stop still finishes, with target-only greedy's tokens. A second signal cuts the drain short.
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg, target_pb2, target_pb2_grpc
from tests.helpers_models import start_coordinator, start_replica, target_greedy, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [3, 1, 4, 1, 5]
Start = target_pb2.TargetServiceStartSessionRequest


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair():
    return tiny_pair()


async def _status(channel) -> int:
    h = health_pb2_grpc.HealthStub(channel)
    return (await h.Check(health_pb2.HealthCheckRequest(service="specdec.v1.TargetService"), timeout=5)).status


async def test_a_draining_replica_refuses_new_sessions_and_serves_its_own_until_they_end(pair):
    target, _ = pair
    app = await start_replica("target", target, grace_s=30)
    ch = grpc.aio.insecure_channel(app.endpoint)
    stub = target_pb2_grpc.TargetServiceStub(ch)
    try:
        await stub.StartSession(Start(session_id="held", prompt_ids=PROMPT))
        t0 = time.monotonic()
        stopping = asyncio.ensure_future(app.shutdown())
        await asyncio.sleep(0.2)
        assert await _status(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.StartSession(Start(session_id="new", prompt_ids=PROMPT))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in ei.value.details()
        # the session it holds is served as before (unary calls: a draining replica ends its per-round streams)
        r = await stub.Verify(target_pb2.VerifyRequest(session_id="held", base_position=len(PROMPT) - 1,
                                                       feed_ids=[PROMPT[-1]]))
        assert r.HasField("next_token") and r.forward_ns > 0 and not stopping.done()
        await asyncio.sleep(0.3)
        assert not stopping.done(), "the replica stopped with a session open, well within its grace"
        await stub.EndSession(target_pb2.TargetServiceEndSessionRequest(session_id="held"))
        await asyncio.wait_for(stopping, 5)
        assert time.monotonic() - t0 < 10, "the drain waited for the grace, not for the session"
        assert not app.forced
    finally:
        await ch.close()
        await app.shutdown(0)


async def test_a_second_signal_cuts_the_drain_short(pair):
    target, _ = pair
    app = await start_replica("target", target, grace_s=30)
    ch = grpc.aio.insecure_channel(app.endpoint)
    try:
        await target_pb2_grpc.TargetServiceStub(ch).StartSession(Start(session_id="held", prompt_ids=PROMPT))
        stopping = asyncio.ensure_future(app.shutdown())
        await asyncio.sleep(0.2)
        assert not stopping.done()
        app.force_stop()
        await asyncio.wait_for(stopping, 5)
        assert app.forced
    finally:
        await ch.close()


async def test_a_request_in_flight_finishes_when_its_only_target_replica_drains(pair):
    """The replica's grace covers whole requests, not single calls: before, the replica stopped between two
    rounds (no call in flight) and the request failed UNAVAILABLE with nowhere to move (an audit)."""
    target, draft = pair
    t = await start_replica("target", target, grace_s=30)
    d = await start_replica("draft", draft)
    coord = await start_coordinator(t.endpoint, d.endpoint)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}")
    try:
        ids, stopping = [], None
        request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=120, mode="pearl", ignore_eos=True)
        async for part in gg.GenerationServiceStub(ch).GenerateStream(request):
            ids.extend(part.token_ids)
            if stopping is None and len(ids) >= 8:
                stopping = asyncio.ensure_future(t.shutdown())  # SIGTERM, mid-request
                await asyncio.sleep(0.05)
        assert stopping is not None and ids == target_greedy(target, PROMPT, 120)
        await asyncio.wait_for(stopping, 10)  # ...and it stops once the request has ended its session
        assert not t.forced
    finally:
        await ch.close()
        for a in (coord, d, t):
            await a.shutdown(0)


async def test_the_coordinators_http_door_answers_while_its_drain_delay_runs(pair):
    """Its listener stays open through COORDINATOR_DRAIN_DELAY_S: /health says 503 (so a load balancer takes the
    pod out) and new requests get a 503 that says to retry elsewhere. Before, the door closed its listener as the
    drain began, and clients got connection errors."""
    import httpx

    from coordinator.stack import free_port

    target, draft = pair
    t = await start_replica("target", target)
    coord = await start_coordinator(t.endpoint, grace_s=1, drain_delay_s=1.5, http_port=free_port())
    base = f"http://127.0.0.1:{coord.http_port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:
            assert (await client.get("/health")).status_code == 200
            stopping = asyncio.ensure_future(coord.shutdown())
            await asyncio.sleep(0.3)
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503 and "shutting down" in r.text
            await asyncio.wait_for(stopping, 10)
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=base, timeout=5) as client:
                await client.get("/health")
    finally:
        await coord.shutdown(0)
        await t.shutdown(0)


async def test_calls_left_when_the_grace_runs_out_end_unavailable_with_a_reason(pair):
    """Before, gRPC cancelled them: CANCELLED "Cancelling all calls", which clients do not retry, and an ERROR
    traceback per call in the server's log."""
    from specdec_rpc.interceptor import CUT_SHORT

    target, draft = pair
    t = await start_replica("target", target)
    d = await start_replica("draft", draft)
    coord = await start_coordinator(t.endpoint, d.endpoint, grace_s=0.05)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{coord.port}")
    try:
        request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=240, mode="sd", ignore_eos=True)
        n, stopping = 0, None
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for part in gg.GenerationServiceStub(ch).GenerateStream(request):
                n += len(part.token_ids)
                if stopping is None:
                    stopping = asyncio.ensure_future(coord.shutdown())
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and ei.value.details() == CUT_SHORT, ei.value
        assert n < 240
        await asyncio.wait_for(stopping, 5)
        await asyncio.sleep(0.3)  # the cancelled request ends its replica sessions
        assert not len(t.host.table) and not len(d.host.table)
    finally:
        await ch.close()
        for a in (coord, d, t):
            await a.shutdown(0)


async def test_a_taken_port_is_a_clear_error(pair):
    """gRPC's own error said only "Failed to bind ... set GRPC_VERBOSITY=debug", and a taken metrics port raised a
    bare OSError after the gRPC server had started."""
    import socket

    target, _ = pair
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"could not bind 127.0.0.1:{port}.*choose a free --port"):
            await start_replica("target", target, port=port)
        with pytest.raises(RuntimeError, match=f"metrics on port {port}.*choose a free --metrics-port"):
            await start_replica("target", target, metrics_port=port)
