"""The coordinator over real loopback replicas: exactness for every mode, streaming, errors, cancel, failover,
losslessness under sampling (chi-square against the exact target distribution), and one run over Ray.

Most tests use the in-process pipeline path (`ray=False`): same pipelines, gRPC clients and front server, minus
the Ray hop. `test_ray_stack` runs the real Ray actors once (one shared local Ray instance).
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import os
import time

import grpc
import pytest
import pytest_asyncio
import torch

from coordinator.config import CoordinatorSettings
from coordinator.events import DoneEvent, ServedEvent
from coordinator.server import build_coordinator
from specdec.scheduling.request import MODES
from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
from tests.helpers_models import build_tiny_model, start_replica, target_greedy, tiny_pair

pytestmark = pytest.mark.asyncio(loop_scope="module")
N = 24


class Stack:
    """Target + three drafts (a different random model, an exact copy of the target, and a random feature draft
    reading the target's hidden states) + a coordinator each."""

    async def start(self, use_ray: bool = False):
        self.target, self.draft = tiny_pair()
        self.t = await start_replica("target", self.target)
        self.d = await start_replica("draft", self.draft, preverifier="random")
        self.same = await start_replica("draft", copy.deepcopy(self.target), preverifier="random")
        self.feature_draft = build_tiny_model(vocab_size=self.target.config.vocab_size, hidden_size=16,
                                              num_layers=1, seed=3, feature_size=self.target.config.hidden_size)
        self.feat = await start_replica("draft", self.feature_draft, preverifier="random")
        self.apps, self.stubs, self.channels = [], {}, []
        for name, d in (("random", self.d), ("same", self.same), ("feature", self.feat)):
            s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=use_ray, tokenizer="",
                                    draft_endpoints=d.endpoint, target_endpoints=self.t.endpoint, pipelines=1,
                                    max_new_tokens_cap=256, log_level="WARNING", grace_s=0)
            app, _ = await build_coordinator(s)
            await app.start()
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
            self.apps.append(app)
            self.channels.append(ch)
            self.stubs[name] = gg.GenerationServiceStub(ch)
        return self

    def sessions(self) -> int:
        return sum(len(r.host.table) for r in (self.t, self.d, self.same, self.feat))

    async def stop(self):
        for ch in self.channels:
            await ch.close()
        for a in self.apps + [self.t, self.d, self.same, self.feat]:
            await a.shutdown(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack():
    s = await Stack().start()
    yield s
    await s.stop()


def req(prompt, mode="sd", n=N, **kw):
    return g.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n, mode=mode, **kw)


async def until(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)


# ---- exactness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft", ["random", "same", "feature"])
async def test_greedy_every_mode_equals_target_only(stack, draft):
    prompts = [[1, 2, 3], [7, 5, 9, 11, 2]]
    for prompt in prompts:
        ref = target_greedy(stack.target, prompt, N)
        for mode in MODES:
            for gamma in (1, 3):
                r = await stack.stubs[draft].Generate(req(prompt, mode, gamma=gamma))
                assert list(r.token_ids) == ref, (mode, gamma, draft)
                assert r.finish_reason == g.FINISH_REASON_LENGTH
                st = r.stats
                assert st.mode == mode and st.target_forwards > 0 and st.wall_s > 0
                assert st.completion_tokens == N and st.prompt_tokens == len(prompt)
    r = await stack.stubs["same"].Generate(req([1, 2, 3], "sd", gamma=4))
    assert r.stats.accepted_tokens == r.stats.draft_tokens, "draft == target accepts every token"
    await until(lambda: stack.sessions() == 0)


async def test_feature_draft_gets_the_targets_features_over_the_wire(stack):
    """Remote sd with a feature draft drafts exactly what the in-process engine drafts, which it can only do if
    every feature reached it (drafting with zeros instead proposes other tokens)."""
    from specdec.engine import Engine
    from specdec.scheduling.request import GenerationRequest

    from draft_service.config import DraftSettings

    served = DraftSettings().prompt_lookup()  # the replica's default
    eng = Engine(stack.target, stack.feature_draft, lookup=served)
    for prompt, gamma in (([1, 2, 3], 3), ([7, 5, 9, 11, 2], 2)):
        local = (await eng.agenerate(GenerationRequest(prompt, N, mode="sd", gamma=gamma))).stats
        r = await stack.stubs["feature"].Generate(req(prompt, "sd", gamma=gamma))
        assert (r.stats.draft_tokens, r.stats.accepted_tokens) == (local.draft_tokens, local.accepted_tokens)
    blind = Engine(stack.target, stack.feature_draft, lookup=served)
    blind.draft.reads_features = False  # the schedule sends nothing: the draft drafts on zeros
    s_blind = (await blind.agenerate(GenerationRequest([1, 2, 3], N, mode="sd", gamma=3))).stats
    s_seen = (await eng.agenerate(GenerationRequest([1, 2, 3], N, mode="sd", gamma=3))).stats
    assert s_blind.accepted_tokens != s_seen.accepted_tokens, "features must change what the draft proposes"
    eng.close()
    blind.close()
    await until(lambda: stack.sessions() == 0)


async def test_pearl_first_block_both_ways_over_the_wire(stack):
    """PEARL's PRE round as pre-verify (0) and draft first (2), and pacer_pearl's PACER-chosen first block, reach
    the schedule through the front door and keep the target's greedy output; pre-verify takes more forwards."""
    prompt = [4, 8, 15, 16]
    ref = target_greedy(stack.target, prompt, N)
    fwd = {}
    for mode, first in (("pearl", 0), ("pearl", 2), ("pacer_pearl", None), ("pacer_pearl", 0)):
        kw = {} if first is None else {"pearl_first_block": first}
        r = await stack.stubs["random"].Generate(req(prompt, mode, gamma=4, **kw))
        assert list(r.token_ids) == ref, (mode, first)
        fwd[(mode, first)] = r.stats.target_forwards
    assert fwd[("pearl", 0)] >= fwd[("pearl", 2)]


async def test_stream_concatenation_equals_unary(stack):
    """Equal tokens either way; the unary call (no stop strings) gets one event from the pipeline, not one per
    round."""
    pipeline = stack.apps[0].router.pipeline
    events = []
    stream = pipeline.stream

    async def counted(request):
        async for ev in stream(request):
            events.append(ev)
            yield ev

    pipeline.stream = counted
    for mode, temp in (("pearl", 0.0), ("sd", 1.0), ("ar", 0.7), ("pearl", 1.0)):
        r = req([2, 4, 6], mode, seed=11, temperature=temp, verify_method="token")
        events.clear()
        unary = await stack.stubs["random"].Generate(r)
        tokens = [e for e in events if not isinstance(e, ServedEvent)]  # the replicas it holds, for an abort's log line
        assert len(tokens) == 1 and isinstance(tokens[0], DoneEvent), [type(e).__name__ for e in events]
        ids, finals = [], []
        async for part in stack.stubs["random"].GenerateStream(r):
            ids.extend(part.token_ids)
            if part.finish_reason:
                finals.append(part)
        assert ids == list(unary.token_ids), mode
        assert len(finals) == 1 and finals[0].finish_reason == unary.finish_reason
        assert len(events) > 2, "a stream gets the tokens of every round as they are verified"
    pipeline.stream = stream


async def test_text_stream_with_tokenizer_and_stop_string(tmp_path):
    from tests.helpers_models import TOKENIZER_CHARS, save_tiny_tokenizer
    from specdec.text.tokenizer import load_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))
    target, draft = tiny_pair()
    t, d = await start_replica("target", target), await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    try:
        r = g.GenerateRequest(prompt="hello", max_new_tokens=30, mode="pearl")
        unary = await stub.Generate(r)
        expect = "".join(TOKENIZER_CHARS[i] if i else "" for i in unary.token_ids)
        assert unary.text == expect and len(unary.token_ids) == 30
        parts = [p async for p in stub.GenerateStream(r)]
        assert "".join(p.text_delta for p in parts) == unary.text
        stop = unary.text[10:12]
        cut = unary.text.index(stop)
        r2 = g.GenerateRequest(prompt="hello", max_new_tokens=30, mode="pearl", stop=[stop])
        stopped = await stub.Generate(r2)
        assert stopped.text == unary.text[:cut] and stopped.finish_reason == g.FINISH_REASON_STOP
        streamed = [p async for p in stub.GenerateStream(r2)]
        assert "".join(p.text_delta for p in streamed) == stopped.text
        assert list(stopped.token_ids) == list(unary.token_ids[:len(stopped.token_ids)])
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)


def slowed(model, seconds: float):
    """The model, each forward taking `seconds` longer (time.sleep releases the GIL, like torch kernels)."""
    fwd = model.forward

    def forward(*a, **kw):
        time.sleep(seconds)
        return fwd(*a, **kw)

    model.forward = forward
    return model


async def generate_over_slowed_pair(target_s: float, draft_s: float, requests: dict, same: bool = True) -> dict:
    """{name: GenerateResponse} for `requests` through a fresh stack whose target (and draft) forwards take
    `target_s` (`draft_s`) seconds longer; the draft is a copy of the target when `same`."""
    target, draft = tiny_pair()
    t = await start_replica("target", slowed(copy.deepcopy(target), target_s))
    d = await start_replica("draft", slowed(copy.deepcopy(target if same else draft), draft_s))
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s)
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    try:
        res = {name: await stub.Generate(r) for name, r in requests.items()}
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)
    for r in res.values():
        assert r.stats.target_replica == t.endpoint and r.stats.draft_replica == d.endpoint
    return res


async def test_pearl_chains_post_rounds_and_reports_stats():
    """Draft == target and the draft far faster than a verify: the shadow drafting fills its window every round,
    so rounds chain (accepted length well above 1). Slowed so that it does not depend on machine load."""
    res = await generate_over_slowed_pair(0.05, 0.0, {"pearl": req([3, 1, 4, 1, 5], "pearl", n=40, gamma=4)})
    st = res["pearl"].stats
    assert st.draft_busy_s > 0 and st.target_busy_s > 0 and st.network_s >= 0
    assert st.mean_accepted_length > 2.0, ("POST rounds chain when the draft is always right", st)


async def test_pearl_draft_and_target_really_overlap():
    """A target forward ~ gamma draft steps (PEARL's optimal gamma, with slack so that the shadow draft fits
    in the verify under load): wall well below the busy sum, and faster than draft-then-verify. The forwards are
    slowed by sleeps long against the tiny models' compute, so that a loaded CI host shifts the ratio little;
    a wall-clock bound on a shared 2-core host can still be hit by a burst of other load, so it gets 3 tries
    (no overlap at all puts every try at or above the busy sum, so it still fails)."""
    tries = []
    for _ in range(3):
        res = await generate_over_slowed_pair(0.12, 0.025, {m: req([1, 2, 3], m, n=32, gamma=4)
                                                            for m in ("sd", "pearl")})
        assert list(res["sd"].token_ids) == list(res["pearl"].token_ids)
        st = res["pearl"].stats
        tries.append((st.wall_s / (st.draft_busy_s + st.target_busy_s), st.wall_s / res["sd"].stats.wall_s))
        if tries[-1][0] < 0.75 and tries[-1][1] < 1.0:
            return
    pytest.fail(f"PEARL did not overlap: (wall / busy sum, wall / sd's wall) per try = {tries}")


# ---- errors ----------------------------------------------------------------------------------------------------
async def test_stop_token_ids_end_the_request_as_eos_does(stack):
    """GenerateRequest.stop_token_ids (vLLM's): the first one generated ends the request, returned last, with
    finish_reason STOP, in every mode, also with ignore_eos."""
    prompt = [1, 2, 3]
    ref = target_greedy(stack.target, prompt, N)
    stop = ref[5]
    end = ref.index(stop) + 1
    for mode in MODES:
        for ignore in (False, True):
            r = await stack.stubs["random"].Generate(req(prompt, mode, stop_token_ids=[stop], ignore_eos=ignore))
            assert list(r.token_ids) == ref[:end] and r.finish_reason == g.FINISH_REASON_STOP, (mode, ignore)
    await until(lambda: stack.sessions() == 0)


@pytest.mark.parametrize("kw,field", [
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt"),
    (dict(prompt_token_ids=[1], mode="fast"), "mode"),
    (dict(prompt_token_ids=[1], temperature=-0.5), "temperature"),
    (dict(prompt_token_ids=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_token_ids=[1], max_new_tokens=257), "max_new_tokens"),
    (dict(prompt_token_ids=[1], verify_method="magic"), "verify_method"),
    (dict(), "prompt"),
    (dict(prompt="text but no tokenizer"), "prompt"),
    (dict(prompt_token_ids=[1, 999]), "prompt_ids"),  # checked by the replicas, passed through
    (dict(prompt_token_ids=[1], mode="pacer", pacer_skip_below=1.5), "pacer_skip_below"),
    (dict(prompt_token_ids=[1], mode="pearl", pearl_first_block=-1), "pearl_first_block"),
    (dict(prompt_token_ids=[1], mode="pearl", gamma=4, pearl_first_block=5), "pearl_first_block"),
    (dict(prompt_token_ids=[1], spec_off_batch=-1), "spec_off_batch"),
    (dict(prompt_token_ids=[1], mode="pacer_pearl", pacer_post_threshold=1.5), "pacer_post_threshold"),
    (dict(prompt_token_ids=[1], mode="pearl", pearl_overlap="sometimes"), "pearl_overlap"),
    (dict(prompt_token_ids=[1], stop_token_ids=list(range(65))), "stop_token_ids"),
    (dict(prompt_token_ids=[1], presence_penalty=2.5), "presence_penalty"),
])
async def test_bad_requests_are_invalid_argument(stack, kw, field):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.stubs["random"].Generate(g.GenerateRequest(**kw))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


async def test_pacer_skip_over_the_wire(stack):
    """pacer_skip_below reaches the draft replica: at 1.0 every first block is dropped (nothing drafted, one
    target forward per token); at 0.5 some are; the output is the target's greedy output either way."""
    prompt = [7, 5, 9, 11, 2]
    ref = target_greedy(stack.target, prompt, N)
    always = await stack.stubs["random"].Generate(req(prompt, "pacer", gamma=4, block_size=1, pacer_skip_below=1.0))
    assert list(always.token_ids) == ref
    assert always.stats.draft_tokens == 0 and always.stats.target_forwards == N
    some = await stack.stubs["random"].Generate(req(prompt, "pacer", gamma=4, block_size=1, pacer_skip_below=0.5))
    plain = await stack.stubs["random"].Generate(req(prompt, "pacer", gamma=4, block_size=1))
    assert list(some.token_ids) == list(plain.token_ids) == ref
    assert plain.stats.draft_tokens > some.stats.draft_tokens
    await until(lambda: stack.sessions() == 0)


async def test_pacer_post_threshold_reaches_the_schedule():
    """A request's pacer_post_threshold, else the coordinator's default (COORDINATOR_PACER_POST_THRESHOLD), is
    the θ that stops pacer_pearl's drafting in a verify's shadow."""
    from coordinator.grpc_api.service import GenerationServicer
    from specdec.scheduling.schedule import _post_stop_spec

    svc = GenerationServicer(router=None, pacer_post_threshold=0.42)
    for kw, want in ((dict(), 0.42), (dict(pacer_post_threshold=0.1), 0.1)):
        prepared = svc.prepare(g.GenerateRequest(prompt_token_ids=[1, 2], mode="pacer_pearl", **kw))
        spec = _post_stop_spec(prepared.request.generation.resolve_defaults())
        assert (spec.kind, spec.threshold) == ("pacer", pytest.approx(want))


async def test_spec_off_batch_over_the_wire(stack):
    """spec_off_batch reaches the schedule: at 1 (a session alone batches 1) every round is a target step and
    nothing is drafted; unset (the coordinator's default, 2) a session alone speculates; both give the target's
    greedy output."""
    prompt = [4, 8, 15, 16, 23]
    ref = target_greedy(stack.target, prompt, N)
    m = stack.apps[0].metrics  # the "random" coordinator's registry
    before = m.value("specdec_rounds_total", {"kind": "target_only"}) or 0.0
    off = await stack.stubs["random"].Generate(req(prompt, "pacer_pearl", spec_off_batch=1))
    on = await stack.stubs["random"].Generate(req(prompt, "pacer_pearl"))
    assert list(off.token_ids) == list(on.token_ids) == ref
    assert off.stats.draft_tokens == 0 and off.stats.target_only_rounds == off.stats.target_forwards == N
    assert on.stats.target_only_rounds == 0 and on.stats.draft_tokens > 0
    assert m.value("specdec_rounds_total", {"kind": "target_only"}) - before == N  # operators see the switch
    assert m.value("specdec_rounds_total", {"kind": "speculative"}) >= on.stats.rounds
    await until(lambda: stack.sessions() == 0)


async def test_pacer_without_preverifier_is_a_clear_error():
    target, draft = tiny_pair()
    t, d = await start_replica("target", target), await start_replica("draft", draft)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gg.GenerationServiceStub(ch).Generate(req([1, 2], "pacer_pearl"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pre-verifier" in e.value.details()
        await until(lambda: len(t.host.table) + len(d.host.table) == 0)
    finally:
        for a in (app, t, d):
            await a.shutdown(0)


async def test_no_replica_reachable_is_unavailable_with_address():
    dead = "127.0.0.1:9"  # discard port: nothing listens
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="",
                            draft_endpoints=dead, target_endpoints=dead, health_timeout_s=0.3, log_level="WARNING")
    app, _ = await build_coordinator(s)
    await app.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await gg.GenerationServiceStub(ch).Generate(req([1, 2], "sd"))
    await app.shutdown(0)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dead in e.value.details()


# ---- cancel, deadline, failover --------------------------------------------------------------------------------
async def test_client_cancel_and_deadline_free_both_sessions(stack):
    stub = stack.stubs["random"]
    call = stub.GenerateStream(req([1, 2, 3], "pearl", n=200))
    async for _ in call:
        break
    assert len(stack.t.host.table) == 1 and len(stack.d.host.table) == 1
    call.cancel()
    await until(lambda: stack.sessions() == 0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(req([1, 2, 3], "sd", n=250), timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: stack.sessions() == 0)


async def test_a_random_mix_under_load_stays_exact_and_frees_every_session(stack):
    """scripts/soak.py in small: concurrent clients send every mode through two drafts (one equal to the target,
    so whole blocks are accepted), unary and streamed, some with a short deadline, some streams dropped after a
    message, with load-adaptive speculation on or off. Every greedy answer is target-only greedy decoding (fp32),
    the only errors are the clients' own deadlines, and no replica holds a session afterwards."""
    import random

    prompts = [[1, 2, 3], [5, 9, 2, 6, 5], [7] * 6]
    refs = [target_greedy(stack.target, p, 40) for p in prompts]
    codes, checked = [], [0]

    async def client(seed):
        rng = random.Random(seed)
        for _ in range(12):
            i = rng.randrange(len(prompts))
            r = req(prompts[i], rng.choice(MODES), n=rng.randint(4, 40), spec_off_batch=rng.choice([0, 2]))
            stub = stack.stubs[rng.choice(["random", "same"])]
            deadline = 0.05 if rng.random() < 0.15 else 30
            try:
                if rng.random() < 0.5:
                    ids = list((await stub.Generate(r, timeout=deadline)).token_ids)
                else:
                    call, ids = stub.GenerateStream(r, timeout=deadline), []
                    drop = rng.random() < 0.2
                    async for part in call:
                        ids += part.token_ids
                        if drop:
                            call.cancel()
                            break
                    if drop:
                        continue
                assert ids == refs[i][:len(ids)] and len(ids) == r.max_new_tokens, (r.mode, i)
                checked[0] += 1
            except grpc.aio.AioRpcError as e:
                codes.append(e.code())

    await asyncio.gather(*(client(k) for k in range(6)))
    assert set(codes) <= {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert checked[0] >= 20
    await until(lambda: stack.sessions() == 0)


@pytest.mark.parametrize("kind", ["target", "draft"])
async def test_replica_dies_mid_request_output_exact(kind):
    target, draft = tiny_pair()
    model = target if kind == "target" else draft
    r1, r2 = await start_replica(kind, model), await start_replica(kind, model)
    other = await start_replica("draft" if kind == "target" else "target", draft if kind == "target" else target)
    pool = f"{r1.endpoint},{r2.endpoint}"
    eps = dict(draft_endpoints=other.endpoint, target_endpoints=pool) if kind == "target" else \
        dict(draft_endpoints=pool, target_endpoints=other.endpoint)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            dns_refresh_s=60, log_level="WARNING", **eps)
    app, _ = await build_coordinator(s)
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    try:
        for mode in ("sd", "pearl", "ar"):
            if kind == "draft" and mode == "ar":
                continue
            prompt = [5, 6, 7]
            ref = target_greedy(target, prompt, 60)
            call = stub.GenerateStream(req(prompt, mode, n=60))
            ids, killed, last = [], False, None
            async for part in call:
                ids.extend(part.token_ids)
                last = part
                if len(ids) >= 8 and not r1.draining and not r2.draining:
                    victim = r1 if len(r1.host.table) else r2
                    await victim.shutdown(0)  # the pinned replica dies mid-request
                    killed = True
            assert ids == ref, mode
            if killed:
                served = last.stats.target_replica if kind == "target" else last.stats.draft_replica
                assert "," in served, "the session moved to the other replica"
            if r1.draining and r2.draining:
                break
    finally:
        await ch.close()
        for a in (app, r1, r2, other):
            await a.shutdown(0)


# ---- losslessness under sampling -------------------------------------------------------------------------------
def exact_3token_distribution(model, prompt, temperature=1.0) -> torch.Tensor:
    """p(x1, x2, x3 | prompt) over V^3, from full forwards of the target."""
    V = model.config.vocab_size
    kv = model.new_kv_slots(1, len(prompt) + 4)

    def nxt(seqs):  # [B, L] -> [B, V] probabilities of the next token
        out = []
        for s in seqs:
            logits, _ = model(torch.tensor([s]), torch.arange(len(s))[None], torch.tensor([0]), kv)
            out.append(torch.softmax(logits[0, -1].double() / temperature, -1))
        return torch.stack(out)

    with torch.no_grad():
        p1 = nxt([prompt])[0]
        p2 = nxt([prompt + [a] for a in range(V)])  # [V, V]
        p3 = nxt([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    from scipy.stats import chisquare

    obs = counts.flatten().double().numpy()
    exp = probs.flatten().double().numpy()
    exp = exp / exp.sum() * obs.sum()
    keep = exp >= min_expected
    o = list(obs[keep]) + [obs[~keep].sum()]
    e = list(exp[keep]) + [exp[~keep].sum()]
    return float(chisquare(o, e).pvalue)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~3 min on an idle 2-core machine; give loaded CI machines room
async def test_sampling_is_lossless_chi_square():
    """≥ 3,000 seeded requests per (mode, method): 3-token continuations follow the exact target distribution."""
    V = 8
    target = build_tiny_model(vocab_size=V, seed=3, logit_scale=1.5)
    draft = copy.deepcopy(target)
    with torch.no_grad():  # a close but wrong draft: many accepts, real rejections and residual samples
        draft.lm_head.weight.add_(torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(9)))
    t = await start_replica("target", target, max_sessions=64, batch_window_ms=0.5)
    d = await start_replica("draft", draft, max_sessions=64)
    # spec_off_batch=0: 24 concurrent requests must still speculate (load-adaptive switching has its own test)
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING",
                            spec_off_batch=0)
    app, _ = await build_coordinator(s)
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    prompt = [1, 2, 3]
    probs = exact_3token_distribution(target, prompt)
    n_req, conc = int(os.environ.get("SPECDEC_CHI_REQUESTS", "3000")), 24  # ~10 min on 2 busy cores
    pvals = {}
    try:
        for mode, method in itertools.product(("sd", "pearl"), ("token", "block")):
            counts = torch.zeros(V, V, V)
            seeds = iter(range(n_req))
            accepted = 0

            async def worker():
                nonlocal accepted
                for seed in seeds:
                    r = await stub.Generate(req(prompt, mode, n=3, temperature=1.0, seed=seed + 1,
                                                verify_method=method, gamma=2))
                    a, b, c = r.token_ids
                    counts[a, b, c] += 1
                    accepted += r.stats.accepted_tokens

            await asyncio.gather(*(worker() for _ in range(conc)))
            assert counts.sum() == n_req and accepted > 0
            pvals[(mode, method)] = chi_square_p(counts, probs)
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)
    assert all(p > 1e-3 for p in pvals.values()), pvals


# ---- the same over Ray -----------------------------------------------------------------------------------------
async def _ray_stack_check() -> None:
    """Pipelines in Ray actors: every mode exact, stream == unary, cancel frees both sessions."""
    s = await Stack().start(use_ray=True)
    try:
        stub = s.stubs["same"]
        ref = target_greedy(s.target, [4, 2], N)
        for mode in MODES:
            r = await stub.Generate(req([4, 2], mode))
            assert list(r.token_ids) == ref, mode
            ids = [t async for part in stub.GenerateStream(req([4, 2], mode)) for t in part.token_ids]
            assert ids == ref
        call = s.stubs["random"].GenerateStream(req([1, 2, 3], "pearl", n=200))
        async for _ in call:
            break
        call.cancel()
        await until(lambda: s.sessions() == 0, timeout=10)
        assert s.apps[0].metrics.value("specdec_num_requests_waiting") == 0.0  # asked of the pool actor
        async def ray_coordinator(draft: str, target: str, **kw):
            """A stub of one more coordinator over Ray (stopped with the stack)."""
            cs = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=True, tokenizer="", pipelines=1,
                                     draft_endpoints=draft, target_endpoints=target, log_level="WARNING", grace_s=0,
                                     **kw)
            app, _ = await build_coordinator(cs)
            s.apps.append(app)
            await app.start()
            s.channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
            return gg.GenerationServiceStub(s.channels[-1])

        # the pool actor's errors reach the client as themselves, not as a Ray traceback
        no_target = await ray_coordinator(s.d.endpoint, "127.0.0.1:1", health_timeout_s=0.2)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await no_target.Generate(req([1, 2], "sd"))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ei.value.details().startswith("no target replica reachable"), ei.value.details()
        # preemption by priority through the pool actor (holdings, marks in the pipelines' views)
        from tests.test_preemption import one_session_pair, urgent_after_long

        target, t, d = await one_session_pair()
        s.apps += [t, d]
        stub = await ray_coordinator(d.endpoint, t.endpoint, pool_view_refresh_s=0.05)
        last, high, urgent_first = await urgent_after_long(stub, target, "sd")
        assert urgent_first and last.stats.preemptions == 1 and high.stats.preemptions == 0
    finally:
        await s.stop()


def ray_stack_main() -> None:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=96 * 1024 * 1024,
             log_to_driver=False)  # "local": a new instance even where another one runs on this machine
    try:
        asyncio.run(_ray_stack_check())
    finally:
        ray.shutdown()
    print("RAY STACK OK")


async def test_ray_stack():
    """The Ray path, in a fresh interpreter. `ray.init()` starts the GCS and raylet with a Python `preexec_fn`
    between fork and exec; from this test process, whose earlier tests left gRPC threads running ("Other threads
    are currently calling into gRPC, skipping fork() handlers"), the new node twice never registered within Ray's
    fixed 30 s on a loaded 2-core host. The services' own stack calls ray.init before any gRPC
    (coordinator/stack.py)."""
    import subprocess
    import sys

    pytest.importorskip("ray")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", "import tests.test_coordinator as t; "
                                "t.ray_stack_main()"], cwd=root, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "RAY STACK OK" in p.stdout, (p.stdout[-3000:], p.stderr[-6000:])


# ---- text assembly (pure) --------------------------------------------------------------------------------------
def _cached_default_tokenizer():
    from specdec.modeling.hub import cache_root

    for d in sorted((cache_root() / "gguf").glob("*/tokenizer.json")):
        from specdec.text.tokenizer import load_tokenizer

        return load_tokenizer(d.parent)
    return None


async def test_text_assembler_never_splits_multibyte_characters():
    from coordinator.grpc_api.text_output import TextAssembler

    tok = _cached_default_tokenizer()
    if tok is None:
        pytest.skip("the default target's tokenizer is not cached")
    text = "héllo 😀 wörld — 日本語 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for stop in ([], ["wör"]):
        asm = TextAssembler(tok, [], stop)
        parts = [asm.push([t])[0] for t in ids] + [asm.finish()]
        assert all("\ufffd" not in p for p in parts)
        assert "".join(parts) == (text if not stop else text[:text.index("wör")])


async def test_text_assembler_holds_back_a_possible_stop_string(tmp_path):
    from coordinator.grpc_api.text_output import TextAssembler
    from tests.helpers_models import TOKENIZER_CHARS, save_tiny_tokenizer
    from specdec.text.tokenizer import load_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path))
    ids = [TOKENIZER_CHARS.index(c) for c in "abc stop here"]
    asm = TextAssembler(tok, [], ["stop"])
    sent = [asm.push([t]) for t in ids]
    text = "".join(t for t, _ in sent) + asm.finish()
    assert text == "abc " and asm.stopped
    assert "".join(t for t, _ in sent[:6]) == "abc", "the last 3 characters (may begin 'stop') are held back"
    assert sum(len(i) for _, i in sent) == len("abc stop"), "token ids end with the one completing the stop"


async def test_a_request_past_the_context_is_refused_before_any_work():
    """Prompt + max_new_tokens up to the replicas' context runs in every mode (exact); one position more is
    OUT_OF_RANGE from StartSession (reserve_positions), not a failure after the work is done."""
    target, draft = tiny_pair()
    t = await start_replica("target", target, max_context=40)
    d = await start_replica("draft", draft, max_context=40, preverifier="random")
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s)
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    prompt = [1, 2, 3, 4, 5]
    ref = target_greedy(target, prompt, 35)
    try:
        for mode in MODES:
            for gamma, temperature in ((1, 0.0), (4, 0.0), (8, 0.0), (8, 1.0)):
                r = await stub.Generate(req(prompt, mode, n=35, gamma=gamma, temperature=temperature))
                assert len(r.token_ids) == 35, (mode, gamma)
                if temperature == 0:
                    assert list(r.token_ids) == ref, (mode, gamma)
            t0 = time.perf_counter()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(req(prompt, mode, n=36))
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert "needs up to 41 positions (prompt + max_new_tokens)" in e.value.details()
            assert "maximum context length is 40 tokens" in e.value.details()  # OpenAI's words, which clients read
            assert "lower max_new_tokens by 1" in e.value.details()
            assert time.perf_counter() - t0 < 1.0
        assert not t.host.table and not d.host.table
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)


async def test_free_port_is_bindable_and_below_the_ephemeral_range(monkeypatch):
    """The embedded stack's ports come from below the kernel's ephemeral range, where no bind(0) or outgoing
    connection of another process (Ray's workers start while the replicas load) takes them meanwhile; where the
    range leaves no room below it, a kernel-chosen port."""
    import socket

    from coordinator import stack

    lo, _ = stack._ephemeral_range()
    for _ in range(20):
        port = stack.free_port()
        if lo - stack.PORT_FLOOR >= 1000:
            assert stack.PORT_FLOOR <= port < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    monkeypatch.setattr(stack, "_ephemeral_range", lambda: (stack.PORT_FLOOR + 10, 65535))
    port = stack.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
