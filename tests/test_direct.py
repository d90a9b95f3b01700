"""The direct data plane (COORDINATOR_DATA_PLANE=direct; draft_service/speculate.py, coordinator/backends/direct.py):
the draft replica runs a request's rounds and calls the target replica itself.

Every mode stays lossless through it (greedy equal to the target alone, sampled output by a chi-square test against
the exact distribution), the coordinator never calls the target for such a request, and a draft or target replica
lost mid-request, a cancel and bad input all end as with the coordinator's own rounds."""
from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import grpc
import pytest
import torch
import pytest_asyncio

from draft_service.speculate import parse_routes
from specdec_rpc.pb import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import start_coordinator, start_replica, target_greedy, tiny_pair
from tests.test_exactness import chi_square_pvalue

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROMPT = [3, 1, 4, 1, 5]
MODES = ["sd", "pacer", "pearl", "pacer_pearl"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def direct():
    target, draft = tiny_pair()
    t1, t2 = await start_replica("target", target), await start_replica("target", target)
    d1, d2 = (await start_replica("draft", draft, preverifier="random"),
              await start_replica("draft", draft, preverifier="random"))
    app = await start_coordinator(f"{t1.endpoint},{t2.endpoint}", f"{d1.endpoint},{d2.endpoint}",
                                  data_plane="direct", dns_refresh_s=60)
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
    yield {"target": target, "stub": gg.GenerationServiceStub(ch), "targets": (t1, t2), "drafts": (d1, d2)}
    await ch.close()
    for a in (app, t1, t2, d1, d2):
        await a.shutdown(0)


@pytest.mark.parametrize("mode", MODES)
async def test_greedy_output_equals_the_target_alone_and_the_coordinator_never_calls_the_target(direct, mode):
    want = target_greedy(direct["target"], PROMPT, 24)
    out = await direct["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode,
                                                          ignore_eos=True))
    assert list(out.token_ids) == want
    st = out.stats
    assert st.rounds > 0 and st.draft_tokens > 0 and st.target_forwards > 0
    assert st.peer_network_s > 0, "the draft replica called the target"
    assert st.target_network_s == 0, "the coordinator made no target call"
    streamed = [t async for part in direct["stub"].GenerateStream(g.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode, ignore_eos=True)) for t in part.token_ids]
    assert streamed == want


async def test_ar_and_prompt_logprobs_take_the_coordinators_rounds(direct):
    want = target_greedy(direct["target"], PROMPT, 10)
    ar = await direct["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=10, mode="ar",
                                                         ignore_eos=True))
    assert list(ar.token_ids) == want and ar.stats.peer_network_s == 0 and ar.stats.target_network_s > 0
    pl = await direct["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=10, mode="sd",
                                                         ignore_eos=True, prompt_logprobs=2))
    assert list(pl.token_ids) == want and pl.stats.peer_network_s == 0 and len(pl.prompt_logprobs.logprobs) > 0


async def test_logprobs_match_the_coordinators_rounds(direct):
    """The per-token logprobs travel back with the tokens: the same numbers as the coordinator's own rounds give."""
    t1, _ = direct["targets"]
    d1, _ = direct["drafts"]
    own = await start_coordinator(t1.endpoint, d1.endpoint)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{own.port}") as ch:
            req = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=12, mode="sd", ignore_eos=True,
                                    logprobs=3)
            a = await direct["stub"].Generate(req)
            b = await gg.GenerationServiceStub(ch).Generate(req)
    finally:
        await own.shutdown(0)
    assert list(a.token_ids) == list(b.token_ids)
    assert list(a.logprobs.logprobs) == pytest.approx(list(b.logprobs.logprobs), abs=1e-6)
    assert [list(t.ids) for t in a.logprobs.top] == [list(t.ids) for t in b.logprobs.top]


async def _stream_killing(stub, request, replicas, after: int):
    """Stream `request`; once `after` tokens arrived, shut down whichever of `replicas` holds a session."""
    ids, last = [], None
    async for part in stub.GenerateStream(request):
        ids.extend(part.token_ids)
        last = part
        if len(ids) >= after and not any(r.draining for r in replicas):
            await next(r for r in replicas if len(r.host.table)).shutdown(0)
    return ids, last


@pytest.mark.parametrize("rtt_ms", [0, 40])
@pytest.mark.parametrize("kind", ["target", "draft"])
async def test_a_replica_lost_mid_request_still_gives_exact_output(kind, rtt_ms):
    """The tokens already streamed stand; the rest comes from the coordinator's rounds on the replica left: no
    token lost or repeated. Also with a 40 ms round trip on every link (delay relays: about one target forward of
    the default pair on a CPU), where answers and chained verifies are on the wire when the replica dies."""
    from specdec_rpc.netem import DelayRelay

    target, draft = tiny_pair()
    t1, t2 = await start_replica("target", target), await start_replica("target", target)
    relays = []

    async def relay(endpoint: str) -> str:
        if not rtt_ms:
            return endpoint
        r = DelayRelay(endpoint, rtt_ms / 2000)
        relays.append(r)
        return await r.start()

    # the draft replicas dial the targets through relays of their own (the draft <-> target link)
    routes = ",".join([f"{t.endpoint}={await relay(t.endpoint)}" for t in (t1, t2)]) if rtt_ms else ""
    d1, d2 = (await start_replica("draft", draft, target_routes=routes),
              await start_replica("draft", draft, target_routes=routes))
    # the coordinator dials every replica through a relay; the draft replicas are told the targets' real endpoints
    # by it, which `target_routes` maps: so the coordinator names the targets by their real endpoints
    app = await start_coordinator(f"{t1.endpoint},{t2.endpoint}",
                                  ",".join([await relay(d1.endpoint), await relay(d2.endpoint)]),
                                  data_plane="direct", dns_refresh_s=60)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            mode = "pearl" if rtt_ms else "sd"  # greedy pearl: chained rounds, several verifies in flight
            want = target_greedy(target, PROMPT, 60)
            if rtt_ms:  # each draft replica measures its links first (one request each way): then pearl chains
                chained = 0
                for _ in range(8):
                    warm = await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=60,
                                                                 mode=mode, ignore_eos=True))
                    assert list(warm.token_ids) == want
                    chained += warm.stats.chained_rounds > 0
                assert chained >= 4, "greedy pearl chains its verifies across a 40 ms round trip"
            req = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=60, mode=mode, ignore_eos=True)
            ids, last = await _stream_killing(stub, req, (t1, t2) if kind == "target" else (d1, d2), after=6)
            assert ids == want, mode
            served = last.stats.target_replica if kind == "target" else last.stats.draft_replica
            assert "," in served, f"{mode}: the request moved to the other {kind} replica ({served})"
    finally:
        for a in (app, t1, t2, d1, d2):
            await a.shutdown(0)
        for r in relays:
            await r.stop()


async def test_a_cancelled_request_ends_both_sessions(direct):
    stub = direct["stub"]
    call = stub.GenerateStream(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=200, mode="pearl",
                                                 ignore_eos=True))
    got = 0
    async for part in call:
        got += len(part.token_ids)
        if got >= 4:
            break
    call.cancel()
    replicas = direct["targets"] + direct["drafts"]
    for _ in range(100):
        if not any(len(r.host.table) for r in replicas):
            break
        await asyncio.sleep(0.05)
    assert not any(len(r.host.table) for r in replicas), "a session was left behind"


async def test_speculate_refuses_what_it_cannot_run(direct):
    d1, _ = direct["drafts"]
    t1, _ = direct["targets"]
    async with grpc.aio.insecure_channel(d1.endpoint) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        cases = [(dict(mode="ar", target_endpoint=t1.endpoint), "mode"),
                 (dict(speculation=common_pb2.Speculation(draft_stop=common_pb2.DRAFT_STOP_NONE),
                       target_endpoint=t1.endpoint), "speculation.draft_stop"),
                 (dict(mode="sd"), "target_endpoint"),
                 (dict(mode="sd", target_endpoint=t1.endpoint, verify_method="nope"), "verify_method")]
        for kw, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Speculate(draft_pb2.SpeculateRequest(session_id="bad", prompt_ids=PROMPT,
                                                                         max_new_tokens=4, **kw)):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), kw


@pytest.mark.parametrize("mode", MODES)
async def test_an_old_style_speculate_request_gives_the_same_tokens(direct, mode):
    """A coordinator of the last release sends the speculation in the flat fields only (mode, gamma, verify_method
    as strings); this release's sends `speculation` beside them. Both run the same request on the draft replica:
    the same tokens (greedy: the target's own) and, for the sequential modes, the same counts."""
    from specdec.decoding.sampling import SamplingParams
    from specdec.scheduling.request import GenerationRequest
    from specdec_rpc.encode import speculate_request

    d1, _ = direct["drafts"]
    t1, _ = direct["targets"]
    req = GenerationRequest(PROMPT, max_new_tokens=16, params=SamplingParams(temperature=0.0), mode=mode, gamma=3,
                            block_size=1, verify_method="token", pearl_overlap="always")
    typed = speculate_request(req, target_endpoint=t1.endpoint, reserve_positions=len(PROMPT) + 16)
    old = draft_pb2.SpeculateRequest()
    old.CopyFrom(typed)
    old.ClearField("speculation")
    assert typed.HasField("speculation") and typed.speculation.gamma == 3 and old.mode == mode
    async with grpc.aio.insecure_channel(d1.endpoint) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        answers = []
        for sid, msg in (("typed", typed), ("old-style", old)):
            msg.session_id = f"{sid}-{mode}"
            msgs = [m async for m in stub.Speculate(msg)]
            answers.append(([t for m in msgs for t in m.token_ids], msgs[-1]))
    (a, last_a), (b, last_b) = answers
    assert a == b == target_greedy(direct["target"], PROMPT, 16)
    assert last_a.done and last_b.done and last_a.finish_reason == last_b.finish_reason
    if mode in ("sd", "pacer"):  # PEARL's drafting runs while verifies do: its counts depend on timing
        assert {k: last_a.stats[k] for k in ("rounds", "target_forwards", "draft_tokens", "accepted_tokens")} == \
            {k: last_b.stats[k] for k in ("rounds", "target_forwards", "draft_tokens", "accepted_tokens")}


async def test_a_report_interval_gathers_the_rounds_tokens_into_fewer_messages(direct):
    """report_interval_ms: the first round's tokens at once, then one message per interval (here: the rest at the
    end); the same tokens and logprobs in the same order as a message per round."""
    d1, _ = direct["drafts"]
    t1, _ = direct["targets"]
    async with grpc.aio.insecure_channel(d1.endpoint) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)

        async def run(interval_ms: int, sid: str):
            req = draft_pb2.SpeculateRequest(session_id=sid, prompt_ids=PROMPT, max_new_tokens=40, mode="sd",
                                             gamma=2, target_endpoint=t1.endpoint, report_interval_ms=interval_ms)
            req.params.logprobs = 1
            msgs = [m async for m in stub.Speculate(req)]
            parts = [m for m in msgs if not m.done]
            tokens = [t for m in parts for t in m.token_ids]
            logprobs = [x for m in parts for x in m.logprobs.logprobs]
            return parts, tokens, logprobs, msgs[-1]

        every, tokens, logprobs, last = await run(0, "every-round")
        gathered, tokens2, logprobs2, last2 = await run(60_000, "gathered")
    want = target_greedy(direct["target"], PROMPT, 40)
    assert tokens == want and tokens2 == want and logprobs2 == logprobs
    assert last.done and last2.done and last2.stats["rounds"] == last.stats["rounds"] > 2
    # a message a round (rounds verified while the last message was still being written go together)
    assert len(gathered) < len(every) <= last.stats["rounds"]
    assert len(gathered) == 2, "the first round's tokens at once, the rest when the request ends"
    assert list(gathered[0].token_ids) == list(every[0].token_ids)


async def test_a_unary_request_on_the_direct_plane_is_reported_in_batches(direct, monkeypatch):
    """The coordinator asks for batched reports where its caller reads only the final answer, and for every
    round's tokens on a stream; both give the target's own tokens."""
    from coordinator.backends import direct as direct_backend
    seen = []
    real = direct_backend.speculate_request

    def spy(*a, **kw):
        msg = real(*a, **kw)
        seen.append(msg)
        return msg

    monkeypatch.setattr(direct_backend, "speculate_request", spy)
    want = target_greedy(direct["target"], PROMPT, 24)
    out = await direct["stub"].Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode="sd",
                                                          ignore_eos=True))
    streamed = [t async for part in direct["stub"].GenerateStream(g.GenerateRequest(
        prompt_token_ids=PROMPT, max_new_tokens=24, mode="sd", ignore_eos=True)) for t in part.token_ids]
    assert list(out.token_ids) == want and streamed == want
    assert [m.report_interval_ms for m in seen] == [direct_backend.REPORT_INTERVAL_MS, 0]


@pytest.mark.asyncio(loop_scope="module")
async def test_target_routes_parse_and_refuse_malformed_entries():
    assert parse_routes("") == {}
    assert parse_routes("10.0.0.5:50052=127.0.0.1:7001, a:1=b:2") == {"10.0.0.5:50052": "127.0.0.1:7001",
                                                                       "a:1": "b:2"}
    for bad in ("10.0.0.5:50052", "=b:2", "a:1="):
        with pytest.raises(ValueError, match="endpoint=address"):
            parse_routes(bad)


def exact_continuations(model, prompt: list[int], vocab: int, n: int = 3) -> dict:
    """P(x_1..x_n | prompt) at temperature 1 for every continuation, by enumeration of the model's conditionals."""
    @torch.no_grad()
    def cond(prefix):
        kv = model.new_kv_slots(1, len(prefix) + 1)
        logits, _ = model(torch.tensor([prefix]), torch.arange(len(prefix))[None], torch.tensor([0]), kv)
        return torch.softmax(logits[0, -1].double(), -1)

    probs = {}
    for k in range(n):
        for seq in itertools.product(range(vocab), repeat=k):
            probs[seq] = cond(prompt + list(seq))
    return {seq: float(torch.prod(torch.stack([probs[seq[:i]][seq[i]] for i in range(n)])))
            for seq in itertools.product(range(vocab), repeat=n)}


async def test_sampled_output_is_the_targets_distribution():
    """Temperature 1 through the direct data plane (gRPC both hops, the draft replica's schedule; sd and pearl, block
    verification): the 3-token continuations of 3,000 seeded requests on a vocabulary of 8 pass a chi-square test
    against the exact target distribution."""
    vocab, prompt = 8, [1, 5, 2]
    target, draft = tiny_pair(vocab=vocab, logit_scale=3.0)
    t = await start_replica("target", target, max_sessions=64)
    d = await start_replica("draft", draft, max_sessions=64)
    app = await start_coordinator(t.endpoint, d.endpoint, data_plane="direct")
    runs, counts, rejected = 3000, Counter(), 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = gg.GenerationServiceStub(ch)
            sem = asyncio.Semaphore(32)

            async def one(seed: int, mode: str):
                nonlocal rejected
                async with sem:
                    r = await stub.Generate(g.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=3, mode=mode,
                                                              gamma=3, temperature=1.0, seed=seed,
                                                              verify_method="block", ignore_eos=True))
                    assert r.stats.peer_network_s > 0
                    rejected += r.stats.accepted_tokens < r.stats.verified_draft_tokens
                    counts[tuple(r.token_ids)] += 1

            await asyncio.gather(*(one(s, "sd" if s % 2 else "pearl") for s in range(runs)))
    finally:
        for a in (app, t, d):
            await a.shutdown(0)
    assert rejected > runs // 10, "the draft must be rejected often for the test to mean something"
    assert chi_square_pvalue(counts, exact_continuations(target, prompt, vocab), runs) > 0.001


async def test_chained_rounds_are_chosen_where_the_round_trip_is_long():
    """A draft replica chains a greedy PEARL request's verifies on a link whose measured round trip is at least
    half a target forward, and runs PEARL's rounds elsewhere, or before it has measured both."""
    from draft_service.speculate import CHAIN_MIN_RTT, LinkEstimate, PeerTarget

    link = LinkEstimate()
    assert not link.chains()
    link.forward(0.040)
    assert not link.chains()
    link.round_trip(0.001)
    assert not link.chains()
    for _ in range(30):
        link.round_trip(0.040)
    assert link.chains() and link.rtt_s >= CHAIN_MIN_RTT * link.forward_s
    target = PeerTarget.__new__(PeerTarget)
    target.window, target.link = 4, link
    assert target.chain_window == 4
    target.window = 1
    assert target.chain_window == 0
