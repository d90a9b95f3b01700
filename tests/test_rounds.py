"""Per-round streams (`VerifyRounds`, `DraftRounds`, `specdec_rpc/rounds.py`): the same answers as the unary calls,
the same statuses, an end on drain, and a client that falls back to unary on any trouble."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.config import CoordinatorSettings
from specdec_rpc.rounds import RoundStream
from coordinator.server import build_coordinator
from specdec_rpc.pb import common_pb2, draft_pb2, generation_pb2 as g, generation_pb2_grpc as gg, target_pb2
from tests.helpers_models import start_replica, target_greedy, tiny_pair
from tests.test_services import VOCAB, expect, make_stack, models, stack  # noqa: F401 - fixtures

Code = grpc.StatusCode
TIMING = ("forward_ns", "verify_ns", "queue_ns", "draft_ns", "batch_size")


def _answer(msg) -> dict:
    """A response without its timing fields."""
    return {f.name: v for f, v in msg.ListFields() if f.name not in TIMING}


async def test_rounds_answer_exactly_what_unary_calls_answer(stack):
    """Sampled rounds of one session: each request sent unary, then again (same positions) as a stream message."""
    params = common_pb2.SamplingParams(temperature=1.0, seed=11)
    await stack.tstub.StartSession(target_pb2.TargetServiceStartSessionRequest(
        session_id="s", prompt_ids=[3, 4, 5], params=params))
    await stack.dstub.StartSession(draft_pb2.DraftServiceStartSessionRequest(
        session_id="s", prompt_ids=[3, 4, 5], params=params))
    verify_rounds, draft_rounds = stack.tstub.VerifyRounds(), stack.dstub.DraftRounds()
    base, pending, dbase, append = 2, 5, 2, [5]
    for _ in range(5):
        dreq = draft_pb2.DraftRequest(session_id="s", base_position=dbase, append_ids=append, gamma_max=3)
        unary_d = await stack.dstub.Draft(dreq)
        await draft_rounds.write(draft_pb2.DraftRoundsRequest(draft=dreq))
        streamed_d = (await draft_rounds.read()).draft
        assert _answer(streamed_d) == _answer(unary_d)
        vreq = target_pb2.VerifyRequest(session_id="s", base_position=base, feed_ids=[pending],
                                         draft_ids=unary_d.token_ids, q=unary_d.q,
                                         method=common_pb2.VERIFY_METHOD_TOKEN)
        unary_v = await stack.tstub.Verify(vreq)
        await verify_rounds.write(target_pb2.VerifyRoundsRequest(verify=vreq))
        streamed_v = (await verify_rounds.read()).verify
        assert _answer(streamed_v) == _answer(unary_v)
        base += 1 + unary_v.num_accepted
        pending = unary_v.next_token
        # the draft has not fed its last token: after a whole block is accepted, it is sent back with the bonus
        whole = unary_v.num_accepted == len(unary_d.token_ids)
        dbase, append = (base - 1, [unary_d.token_ids[-1], pending]) if whole else (base, [pending])
    for call in (verify_rounds, draft_rounds):
        await call.done_writing()
        assert await call.code() == Code.OK
    # every message was timed on its own, under the stream's method name
    assert stack.target_app.metrics.value("specdec_rpc_latency_seconds_count", {"method": "VerifyRounds"}) == 5
    assert stack.draft_app.metrics.value("specdec_rpc_latency_seconds_count", {"method": "DraftRounds"}) == 5


async def test_a_bad_round_ends_the_stream_with_the_unary_status(stack):
    await stack.tstub.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id="a", prompt_ids=[1, 2, 3]))
    call = stack.tstub.VerifyRounds()
    await call.write(target_pb2.VerifyRoundsRequest(verify=target_pb2.VerifyRequest(
        session_id="a", base_position=2, feed_ids=[3], draft_ids=[VOCAB + 7])))
    await expect(Code.INVALID_ARGUMENT, call.read(), "vocabulary")
    call = stack.dstub.DraftRounds()
    await call.write(draft_pb2.DraftRoundsRequest(draft=draft_pb2.DraftRequest(
        session_id="nope", append_ids=[1], gamma_max=2)))
    await expect(Code.NOT_FOUND, call.read(), "'nope'", "StartSession")


async def test_draining_ends_rounds_with_unavailable(models):  # noqa: F811
    s = await make_stack(models, target_kw=dict(drain_delay_s=1.0))
    try:
        await s.tstub.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id="a", prompt_ids=[1, 2]))
        call = s.tstub.VerifyRounds()
        vreq = target_pb2.VerifyRequest(session_id="a", base_position=1, feed_ids=[2], draft_ids=[3])
        await call.write(target_pb2.VerifyRoundsRequest(verify=vreq))
        await call.read()
        drain = asyncio.ensure_future(s.target_app.shutdown(0.5))
        await asyncio.sleep(0.2)  # inside the drain delay: NOT_SERVING, unary calls still served
        assert s.target_app.host.draining
        await call.write(target_pb2.VerifyRoundsRequest(verify=vreq))
        await expect(Code.UNAVAILABLE, call.read(), "draining")
        assert (await s.tstub.Verify(vreq)).num_accepted in (0, 1)
        await drain
    finally:
        await s.close()


# ---- the client: RoundStream ------------------------------------------------------------------------------------
class _EchoServer:
    """A bytes echo with an optional delay, a stream method that never answers, one that ends without answering,
    and no stream for "/e.E/Missing"."""

    async def start(self):
        async def unary(req, ctx):
            self.unary_calls += 1
            return req

        async def rounds(it, ctx):
            async for req in it:
                await asyncio.sleep(self.delay)
                yield req

        async def mute(it, ctx):
            async for _ in it:
                await asyncio.sleep(3600)
                yield b""

        async def quit_(it, ctx):  # ends the stream (status OK) without answering: the client reads EOF
            self.quit_streams += 1
            async for _ in it:
                return
            yield b""

        self.unary_calls, self.delay, self.quit_streams = 0, 0.0, 0
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("e.E", {
            "U": grpc.unary_unary_rpc_method_handler(unary),
            "Rounds": grpc.stream_stream_rpc_method_handler(rounds),
            "Mute": grpc.stream_stream_rpc_method_handler(mute),
            "Quit": grpc.stream_stream_rpc_method_handler(quit_)}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        return self

    def stream(self, method: str, timeout: float = 5.0) -> RoundStream:
        return RoundStream(lambda ep: self.channel.stream_stream(f"/e.E/{method}")(), lambda b: b, lambda b: b,
                           timeout)

    def unary(self, req):
        return self.channel.unary_unary("/e.E/U")(req)

    async def stop(self):
        await self.channel.close()
        await self.server.stop(0)


@pytest.fixture
async def echo():
    e = await _EchoServer().start()
    yield e
    await e.stop()


async def test_round_stream_uses_one_stream_and_falls_back_when_the_replica_lacks_it(echo):
    rs = echo.stream("Rounds")
    assert [await rs.call("e", b"%d" % i, echo.unary) for i in range(3)] == [b"0", b"1", b"2"]
    assert (rs.messages, rs.fallbacks, echo.unary_calls) == (3, 0, 0)
    missing = echo.stream("Missing")  # an older replica: UNIMPLEMENTED, then unary for the rest of the request
    assert await missing.call("e", b"x", echo.unary) == b"x"
    assert await missing.call("e", b"y", echo.unary) == b"y"
    assert (missing.messages, missing.fallbacks, missing.off, echo.unary_calls) == (0, 1, {"e"}, 2)
    await rs.aclose()
    await missing.aclose()


async def test_round_stream_times_out_and_recovers_from_a_cancel(echo):
    mute = echo.stream("Mute", timeout=0.3)
    await expect(Code.DEADLINE_EXCEEDED, mute.call("e", b"x", echo.unary), "did not answer within 0.3 s")
    assert echo.unary_calls == 0, "a timeout is not resent (it would wait as long again)"
    rs = echo.stream("Rounds")
    echo.delay = 0.5
    task = asyncio.ensure_future(rs.call("e", b"slow", echo.unary))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    echo.delay = 0.0  # the late answer to "slow" must not be read as the answer to the next call
    assert await rs.call("e", b"next", echo.unary) == b"next"
    assert (rs.messages, rs.fallbacks) == (1, 0)
    await rs.aclose()


async def test_concurrent_calls_on_one_round_stream_go_unary(echo):
    """A call made while another waits on the stream is sent unary, so each reads its own answer.
    A mutation audit found that dropping the `_busy` guard (two calls writing and reading one stream
    at once) passed every test."""
    rs = echo.stream("Rounds")
    echo.delay = 0.2  # the first call is still waiting for its answer when the second is made
    got = await asyncio.gather(rs.call("e", b"first", echo.unary), rs.call("e", b"second", echo.unary))
    assert got == [b"first", b"second"]
    assert (rs.messages, rs.fallbacks, echo.unary_calls) == (1, 0, 1), "the second call must go unary"
    echo.delay = 0.0
    assert await rs.call("e", b"third", echo.unary) == b"third"  # the stream is still in step, and used again
    assert (rs.messages, rs.fallbacks, echo.unary_calls) == (2, 0, 1)
    await rs.aclose()


async def test_an_eof_turns_streams_off_for_the_replica(echo):
    """A replica that ends the stream without a status for the request: that call and every later one to it go
    unary, with no new stream. A mutation audit found that not adding the endpoint to `off` on EOF
    (each later call opened a stream, read EOF and fell back again) passed every test."""
    rs = echo.stream("Quit")
    assert await rs.call("e", b"x", echo.unary) == b"x"
    assert (rs.off, rs.messages, rs.fallbacks, echo.unary_calls) == ({"e"}, 0, 1, 1)
    assert await rs.call("e", b"y", echo.unary) == b"y"
    assert (rs.messages, rs.fallbacks, echo.unary_calls) == (0, 1, 2), "the second call must go unary at once"
    assert echo.quit_streams == 1, "no new stream is opened to a replica whose streams are off"
    await rs.aclose()


# ---- through the coordinator ------------------------------------------------------------------------------------
@pytest.mark.parametrize("streams", [True, False])
async def test_coordinator_rounds_travel_on_streams_unless_turned_off(streams):
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft, preverifier="random")
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", pipelines=1,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                            grace_s=0, replica_streams=streams, data_plane="coordinator")  # the coordinator's rounds
    app, _ = await build_coordinator(s)
    await app.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    try:
        prompt = [5, 6, 7]
        for mode in ("sd", "pacer"):
            r = await gg.GenerationServiceStub(ch).Generate(g.GenerateRequest(
                prompt_token_ids=prompt, max_new_tokens=20, mode=mode, gamma=3))
            assert list(r.token_ids) == target_greedy(target, prompt, 20), mode
        verifies = t.metrics.value("specdec_rpc_latency_seconds_count", {"method": "VerifyRounds"}) or 0
        drafts = d.metrics.value("specdec_rpc_latency_seconds_count", {"method": "DraftRounds"}) or 0
        unary = t.metrics.value("specdec_rpc_latency_seconds_count", {"method": "Verify"}) or 0
        if streams:
            assert verifies > 0 and drafts > 0 and unary == 0, (verifies, drafts, unary)
        else:
            assert verifies == drafts == 0 and unary > 0
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)


async def test_a_cancel_that_lands_as_the_reply_arrives_is_not_lost():
    """Cancelled in the loop iteration its reply arrived in, a round's wait ends cancelled. asyncio.wait_for (before
    Python 3.12) returned the reply there, and the request ran on to its last token: 3 of 16 client cancels through
    Ray left both replicas generating."""
    import sys

    from specdec_rpc.aio import within

    async def race(wait):
        reply = asyncio.get_running_loop().create_future()
        caller = asyncio.ensure_future(wait(reply, 10))
        await asyncio.sleep(0)  # the caller now waits for the reply
        reply.set_result("verified")
        caller.cancel()
        try:
            return await caller
        except asyncio.CancelledError:
            return "cancelled"

    assert await race(within) == "cancelled"
    if sys.version_info < (3, 12):  # what it replaces
        assert await race(asyncio.wait_for) == "verified"
    with pytest.raises(asyncio.TimeoutError):
        await within(asyncio.sleep(5), 0.05)
    assert await within(asyncio.sleep(0, "ok"), 1) == "ok"
