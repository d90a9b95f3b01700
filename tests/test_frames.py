"""The replicas' frame ports (specdec_rpc/frames.py): the per-round streams' messages on a plain socket, answered as
the gRPC stream answers them (the same results, the same statuses and messages), advertised by GetInfo, off with
data_port -1, over TLS where gRPC is; and a caller that falls back to gRPC where a frame port fails."""
from __future__ import annotations

import asyncio
import shutil
import struct

import grpc
import pytest

from coordinator.channels import Channels, Dialer
from coordinator.server import client_tls
from specdec_rpc.frames import MAX_FRAME, FrameCall
from specdec_rpc.pb import common_pb2, draft_pb2, target_pb2
from specdec_rpc.rounds import RoundStream
from tests.helpers_models import start_replica, tiny_pair

pytestmark = pytest.mark.asyncio
PROMPT = [1, 2, 3, 4]


@pytest.fixture
async def replicas():
    target, draft = tiny_pair()
    t, d = await start_replica("target", target), await start_replica("draft", draft)
    yield t, d
    await t.shutdown(0)
    await d.shutdown(0)


def verify_call(app, port: int | None = None) -> FrameCall:
    return FrameCall("127.0.0.1", port or app.data_port, "VerifyRounds", target_pb2.VerifyRoundsResponse)


async def start_both(channels: Channels, t, d, sid: str) -> None:
    await channels.target(t.endpoint).StartSession(target_pb2.TargetServiceStartSessionRequest(
        session_id=sid, prompt_ids=PROMPT))  # default params: greedy
    await channels.draft(d.endpoint).StartSession(draft_pb2.DraftServiceStartSessionRequest(
        session_id=sid, prompt_ids=PROMPT))


async def test_getinfo_advertises_the_frame_port_and_rounds_answer_as_on_grpc(replicas):
    t, d = replicas
    channels = Channels()
    try:
        info = (await channels.target(t.endpoint).GetInfo(target_pb2.TargetServiceGetInfoRequest())).info
        assert info.data_port == t.data_port > 0
        assert (await channels.draft(d.endpoint).GetInfo(draft_pb2.DraftServiceGetInfoRequest())).info.data_port \
            == d.data_port > 0
        # the same rounds, once on frames and once on the gRPC streams: the same answers
        answers = {}
        for wire in ("frames", "grpc"):
            sid = f"s-{wire}"
            await start_both(channels, t, d, sid)
            draft_calls = (await channels.frame_call("draft", d.endpoint, None, 5.0) if wire == "frames"
                           else channels.draft(d.endpoint).DraftRounds())
            target_calls = (await channels.frame_call("target", t.endpoint, None, 5.0) if wire == "frames"
                            else channels.target(t.endpoint).VerifyRounds())
            base, pending, got = len(PROMPT) - 1, [PROMPT[-1]], []
            for _ in range(6):
                await draft_calls.write(draft_pb2.DraftRoundsRequest(draft=draft_pb2.DraftRequest(
                    session_id=sid, base_position=base, append_ids=pending, gamma_max=3, block_size=3)))
                block = (await draft_calls.read()).draft
                await target_calls.write(target_pb2.VerifyRoundsRequest(verify=target_pb2.VerifyRequest(
                    session_id=sid, base_position=base, feed_ids=pending, draft_ids=list(block.token_ids),
                    method=common_pb2.VERIFY_METHOD_GREEDY)))
                out = (await target_calls.read()).verify
                kept = list(block.token_ids)[:out.num_accepted] + [out.next_token]
                got += kept
                base, pending = base + len(pending) + out.num_accepted, [out.next_token]
            answers[wire] = got
            draft_calls.cancel()
            target_calls.cancel()
        assert answers["frames"] == answers["grpc"] and len(answers["frames"]) >= 6
    finally:
        await channels.close()


async def test_a_refused_call_carries_the_status_and_message_grpc_gives(replicas):
    t, _ = replicas
    channels = Channels()
    try:
        bad = target_pb2.VerifyRequest(session_id="nope", base_position=0, feed_ids=[1])
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await channels.target(t.endpoint).Verify(bad)
        call = verify_call(t)
        await call.write(target_pb2.VerifyRoundsRequest(verify=bad))
        with pytest.raises(grpc.aio.AioRpcError) as framed:
            await call.read()
        assert framed.value.code() == unary.value.code() == grpc.StatusCode.NOT_FOUND
        assert framed.value.details() == unary.value.details()
    finally:
        await channels.close()


async def test_a_broken_frame_protocol_is_refused_without_harm(replicas):
    t, _ = replicas
    # an unknown method: UNIMPLEMENTED naming what the port serves
    call = FrameCall("127.0.0.1", t.data_port, "Generate", target_pb2.VerifyRoundsResponse)
    await call.write(target_pb2.VerifyRoundsRequest())
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "VerifyRounds" in e.value.details()
    # a frame over the limit, and garbage: the connection is closed, the port goes on serving
    bad_metadata = b'{"method": "VerifyRounds", "metadata": 7}'
    for payload in (struct.pack("<I", MAX_FRAME + 1), b"\x05\x00\x00\x00{oops",
                    struct.pack("<I", len(bad_metadata)) + bad_metadata):
        reader, writer = await asyncio.open_connection("127.0.0.1", t.data_port)
        writer.write(payload)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once: no answer, no hang
        writer.close()
    good = verify_call(t)
    await good.write(target_pb2.VerifyRoundsRequest(verify=target_pb2.VerifyRequest(session_id="nope",
                                                                                     feed_ids=[1])))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await good.read()
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_data_port_minus_one_serves_no_frames_and_callers_take_grpc():
    target, _ = tiny_pair()
    t = await start_replica("target", target, data_port=-1)
    channels = Channels()
    try:
        assert t.data_port == 0 and t.frames is None
        assert await channels.frame_call("target", t.endpoint, None, 5.0) is None
    finally:
        await channels.close()
        await t.shutdown(0)


async def test_a_frame_port_that_fails_sends_the_call_unary_then_grpc_streams(replicas):
    """The frame port goes away (here: closed under the caller): the call is answered by the unary RPC, the
    request's later calls to that replica take its gRPC stream, and other requests do not dial the port for a while."""
    t, d = replicas
    channels = Channels()
    try:
        await start_both(channels, t, d, "s")
        stub = channels.target(t.endpoint)
        rounds = RoundStream(lambda ep: stub.VerifyRounds(), lambda r: target_pb2.VerifyRoundsRequest(verify=r),
                             lambda m: m.verify, 5.0,
                             frames=lambda ep: channels.frame_call("target", ep, None, 5.0))
        unary = lambda r: stub.Verify(r, timeout=5.0)  # noqa: E731
        req = target_pb2.VerifyRequest(session_id="s", base_position=len(PROMPT) - 1, feed_ids=[PROMPT[-1]])
        first = await rounds.call(t.endpoint, req, unary)
        assert rounds.on_frames and rounds.messages == 1
        await t.frames.close()  # the frame port is gone; gRPC still serves
        again = await rounds.call(t.endpoint, req, unary)  # the same call again: the same answer (positions)
        assert again.next_token == first.next_token
        assert rounds.fallbacks == 1 and t.endpoint in rounds.frames_off and t.endpoint not in rounds.off
        # the next request's frame call finds the port refusing connections: no request dials it for a while
        # (they take gRPC from the start)
        refused = await channels.frame_call("target", t.endpoint, None, 5.0)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await refused.write(target_pb2.VerifyRoundsRequest(verify=req))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await channels.frame_call("target", t.endpoint, None, 5.0) is None
        third = await rounds.call(t.endpoint, req, unary)
        assert not rounds.on_frames and rounds.messages == 2 and third.next_token == first.next_token
        await rounds.aclose()
    finally:
        await channels.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")
async def test_the_frame_port_serves_tls_with_the_replicas_certificate(tmp_path):
    from coordinator.config import CoordinatorSettings
    from tests.test_tls_pools import make_certs

    certs = make_certs(tmp_path)
    target, _ = tiny_pair()
    t = await start_replica("target", target, tls=certs["target"])
    s = CoordinatorSettings(ray=False, target_dns=f"target-headless:{t.port}", draft_endpoints="unused:1",
                            tls=certs["coordinator"])
    channels = Channels(Dialer.from_tls(client_tls(s)))
    try:
        call = await channels.frame_call("target", t.endpoint, None, 5.0)
        await call.write(target_pb2.VerifyRoundsRequest(verify=target_pb2.VerifyRequest(session_id="nope",
                                                                                         feed_ids=[1])))
        with pytest.raises(grpc.aio.AioRpcError) as e:  # answered: the TLS handshake (mTLS) went through
            await call.read()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        plain = verify_call(t)  # no TLS: the handshake fails, reported as UNAVAILABLE (callers fall back)
        await plain.write(target_pb2.VerifyRoundsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await channels.close()
        await t.shutdown(0)


async def test_auto_data_plane_runs_sequential_modes_direct_and_pearl_modes_through_the_coordinator():
    """COORDINATOR_DATA_PLANE=auto: sd and pacer on the draft replica (the draft <-> target link carries their
    verifies), pearl and pacer_pearl on the coordinator's rounds; every one equal to the target alone."""
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import start_coordinator, target_greedy

    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft, preverifier="random")
    app = await start_coordinator(t.endpoint, d.endpoint, data_plane="auto")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            want = target_greedy(target, PROMPT, 20)
            for mode in ("sd", "pacer", "pearl", "pacer_pearl"):
                out = await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=20, mode=mode,
                                                            ignore_eos=True))
                assert list(out.token_ids) == want, mode
                direct = mode in ("sd", "pacer")
                assert (out.stats.peer_network_s > 0) == direct, mode
                assert (out.stats.target_network_s > 0) == (not direct), mode
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


async def test_a_spinning_wait_takes_the_answer_as_it_lands_and_never_outlasts_its_bound():
    """`frame_spin_us`: a read polls the socket awake for at most the bound, returns as soon as bytes are there,
    and does not spin at all where the loop has other callbacks ready."""
    import time

    from specdec_rpc.frames import _spin

    got = asyncio.Event()

    async def serve(reader, writer):
        await reader.readexactly(1)
        await asyncio.sleep(0.05)
        writer.write(b"y")
        await writer.drain()
        got.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await asyncio.sleep(0.01)  # the server's accept runs first: nothing else is ready below
        t0 = time.perf_counter()
        _spin(reader, writer, 0.02)  # nothing comes within the bound (the server answers after 50 ms)
        assert 0.015 < time.perf_counter() - t0 < 0.2
        writer.write(b"x")
        await writer.drain()
        await got.wait()
        t0 = time.perf_counter()
        _spin(reader, writer, 5.0)  # the answer is in the socket: back at once
        assert time.perf_counter() - t0 < 0.5
        assert await reader.readexactly(1) == b"y"
        asyncio.get_running_loop().call_soon(lambda: None)  # something else is ready: no spin
        t0 = time.perf_counter()
        _spin(reader, writer, 5.0)
        assert time.perf_counter() - t0 < 0.5
    finally:
        writer.close()
        server.close()


async def test_direct_rounds_with_spinning_frame_waits_give_the_target_alone():
    from tests.helpers_models import start_coordinator, target_greedy
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg

    target, draft = tiny_pair()
    t = await start_replica("target", target, frame_spin_us=300)
    d = await start_replica("draft", draft, frame_spin_us=300)
    app = await start_coordinator(t.endpoint, d.endpoint, data_plane="direct")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            out = await gg.GenerationServiceStub(ch).Generate(g.GenerateRequest(
                prompt_token_ids=PROMPT, max_new_tokens=20, mode="sd", ignore_eos=True))
        assert list(out.token_ids) == target_greedy(target, PROMPT, 20) and out.stats.peer_network_s > 0
    finally:
        for a in (app, t, d):
            await a.shutdown(0)
