"""Draft and target services on real in-process servers (127.0.0.1:0): the issue's acceptance tests."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
try:
    from specdec_rpc.pb import target_pb2  # noqa: F401
except ImportError:  # stubs are generated at install time (`make proto`); generate them for a bare checkout
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py")], check=True)

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from specdec_rpc.decode import decode_q  # noqa: E402
from specdec_rpc.encode import sampling_to_proto as sampling_pb  # noqa: E402
from draft_service.config import DraftSettings  # noqa: E402
from draft_service.server import build_app as build_draft  # noqa: E402
from specdec.decoding.sampling import SamplingParams  # noqa: E402
from specdec.decoding.verify import SparseDist  # noqa: E402
from specdec.engine import Engine  # noqa: E402
from specdec.scheduling.request import GenerationRequest  # noqa: E402
from specdec.scheduling.schedule import generate  # noqa: E402
from specdec.workers.target import TargetWorker  # noqa: E402
from specdec_rpc.pb import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402
from target_service.config import TargetSettings  # noqa: E402
from target_service.server import build_app as build_target  # noqa: E402
from coordinator.channels import Channels  # noqa: E402
from tests.helpers_backends import remote_draft, remote_target  # noqa: E402
from tests.helpers_models import build_tiny_model  # noqa: E402

VOCAB = 64
SERVED_LOOKUP = DraftSettings().prompt_lookup()  # the draft replica's default prompt lookup
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return (build_tiny_model(vocab_size=VOCAB, hidden_size=32, seed=1, max_position_embeddings=128),
            build_tiny_model(vocab_size=VOCAB, hidden_size=32, num_layers=1, seed=2, max_position_embeddings=128))


class Stack:
    """A draft and a target server plus raw stubs and the coordinator's clients, all in this event loop."""

    def __init__(self, target_app, draft_app):
        self.target_app, self.draft_app = target_app, draft_app
        self.target_endpoint, self.draft_endpoint = f"127.0.0.1:{target_app.port}", f"127.0.0.1:{draft_app.port}"
        self.tch = grpc.aio.insecure_channel(self.target_endpoint)
        self.dch = grpc.aio.insecure_channel(self.draft_endpoint)
        self.tstub, self.dstub = target_pb2_grpc.TargetServiceStub(self.tch), draft_pb2_grpc.DraftServiceStub(self.dch)
        self.channels = Channels()  # the clients' (coordinator/channels.py)

    def remote_target(self):
        """A `TargetBackend` for one session on this target replica (tests/helpers_backends.py)."""
        return remote_target(self.channels, self.target_endpoint)

    def remote_draft(self):
        return remote_draft(self.channels, self.draft_endpoint)

    def backends(self):
        """One request's (draft, target) backends, as `specdec.scheduling.schedule.generate` takes them."""
        return self.remote_draft(), self.remote_target()

    async def close(self):
        await self.channels.close()
        await self.tch.close()
        await self.dch.close()
        await self.target_app.shutdown(0.5)
        await self.draft_app.shutdown(0.5)


async def make_stack(models, target_kw=None, draft_kw=None) -> Stack:
    common = dict(host="127.0.0.1", port=0, metrics_port=0, grace_s=0.5)
    tapp = await build_target(TargetSettings(**{**common, **(target_kw or {})}), model=models[0])
    dapp = await build_draft(DraftSettings(**{**common, **(draft_kw or {})}), model=models[1])
    await tapp.start()
    await dapp.start()
    return Stack(tapp, dapp)


@pytest.fixture
async def stack(models):
    s = await make_stack(models)
    yield s
    await s.close()


async def expect(code: grpc.StatusCode, coro, *fragments: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await coro
    err = ei.value
    assert err.code() == code, f"{err.code()} {err.details()}"
    for f in fragments:
        assert f in err.details(), err.details()
    return err.details()


# ---------------------------------------------------------------- generation over gRPC == in-process
@pytest.mark.parametrize("mode,temperature,method", [("sd", 0.0, "block"), ("pearl", 0.0, "block"),
                                                     ("sd", 1.0, "block"), ("sd", 1.0, "token")])
async def test_generation_over_grpc_equals_in_process(models, stack, mode, temperature, method):
    target, draft = models
    base = GenerationRequest(prompt_ids=[5, 9, 2, 33, 7], max_new_tokens=24, mode=mode, gamma=4,
                             verify_method=method, params=SamplingParams(temperature=temperature, seed=7))
    engine = Engine(target, draft, max_sessions=2, lookup=SERVED_LOOKUP)  # as the draft replica drafts
    try:
        local = await engine.agenerate(dataclasses.replace(base, session_id="local"))
        ar = await engine.agenerate(dataclasses.replace(base, session_id="ar", mode="ar"))
    finally:
        engine.close()
    remote = await generate(dataclasses.replace(base, session_id="remote"), *stack.backends())
    assert remote.token_ids == local.token_ids, (remote.token_ids, local.token_ids)
    assert len(remote.token_ids) == 24
    if temperature == 0.0:
        assert remote.token_ids == ar.token_ids  # greedy speculative == target-only greedy
    m = stack.target_app.metrics
    assert m.value("specdec_num_draft_tokens_total") > 0
    assert m.value("specdec_num_accepted_tokens_total") == remote.stats.accepted_tokens
    assert stack.draft_app.metrics.value("specdec_num_draft_tokens_total") >= remote.stats.draft_tokens


async def test_pacer_over_grpc_equals_in_process(models):
    from specdec.decoding.preverifier import build_random_preverifier

    target, draft = models
    pv = build_random_preverifier(draft.config.hidden_size, seed=4, block_size=2, threshold=0.5)
    common = dict(host="127.0.0.1", port=0, metrics_port=0, grace_s=0.5)
    tapp = await build_target(TargetSettings(**common), model=target)
    dapp = await build_draft(DraftSettings(**common), model=draft, preverifier=pv)
    await tapp.start()
    await dapp.start()
    s = Stack(tapp, dapp)
    req = GenerationRequest(prompt_ids=[5, 9, 2, 33], max_new_tokens=20, mode="pacer", gamma=6, block_size=2,
                            params=SamplingParams(temperature=1.0, seed=11))
    engine = Engine(target, draft, preverifier=pv, max_sessions=2, lookup=SERVED_LOOKUP)
    try:
        local = await engine.agenerate(dataclasses.replace(req, session_id="local"))
        remote = await generate(dataclasses.replace(req, session_id="remote"), *s.backends())
        assert remote.token_ids == local.token_ids
        assert remote.stats.draft_tokens == local.stats.draft_tokens  # the same stops at the same blocks
    finally:
        engine.close()
        await s.close()


async def test_draft_replica_pacer_threshold_is_the_default_theta(models):
    """DRAFT_PACER_THRESHOLD sets the θ of requests that name none; a request's own θ still wins."""
    from pydantic import ValidationError

    from specdec.decoding.preverifier import build_random_preverifier
    from specdec.decoding.stop import make_stop_rule
    from specdec.decoding.stop import StopSpec

    _, draft = models
    pv = build_random_preverifier(draft.config.hidden_size, seed=4, block_size=2, threshold=0.5)
    dapp = await build_draft(DraftSettings(host="127.0.0.1", port=0, metrics_port=0, grace_s=0.5,
                                           pacer_threshold=0.83), model=draft, preverifier=pv, warmup=False)
    try:
        assert make_stop_rule(StopSpec("pacer"), dapp.host.worker.preverifier).threshold == pytest.approx(0.83)
        assert make_stop_rule(StopSpec("pacer", 0.2), dapp.host.worker.preverifier).threshold == pytest.approx(0.2)
    finally:
        await dapp.shutdown()
    with pytest.raises(ValidationError, match="pacer_threshold"):
        DraftSettings(pacer_threshold=1.5)


# ---------------------------------------------------------------- batched verify == separate verifies
def _sparse_q(draft: list[int], gen: torch.Generator) -> list[SparseDist]:
    out = []
    for t in draft:
        others = torch.randperm(VOCAB, generator=gen)[:4]
        ids = torch.unique(torch.cat([torch.tensor([t]), others]))
        probs = torch.rand(len(ids), generator=gen) + 0.05
        out.append(SparseDist(ids=ids, probs=probs / probs.sum()))
    return out


@pytest.mark.parametrize("temperature,method", [(0.0, "greedy"), (1.0, "block"), (1.0, "token")])
async def test_batched_verify_equals_separate(models, temperature, method):
    # Round 0's 4 calls land in one forward: the batcher waits for new sessions up to the window (wide enough for a
    # loaded CI machine, where the calls can arrive tens of ms apart; it costs nothing once all 4 are queued).
    # Later rounds check the KV state that batched forward left behind; whether they batch again depends on the
    # phase-locking estimate of each session's return (test_batchers.py), i.e. on this machine's timing.
    s = await make_stack(models, target_kw=dict(batch_window_ms=1000.0))
    ref = TargetWorker(models[0], max_sessions=4)
    try:
        gen = torch.Generator().manual_seed(3)
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16] * 10]
        sids = [f"s{i}" for i in range(4)]
        targets = {sid: s.remote_target() for sid in sids}
        pos = []
        for i, (sid, p) in enumerate(zip(sids, prompts)):
            params = SamplingParams(temperature=temperature, seed=100 + i)
            await targets[sid].start(sid, p, params)
            ref.start_session(sid, p, params)
            pos.append((len(p) - 1, [p[-1]]))
        for rnd in range(3):  # later rounds check the KV state batching left behind
            calls = []
            for i, sid in enumerate(sids):
                draft = torch.randint(0, VOCAB, (1 + (i + rnd) % 4,), generator=gen).tolist()
                q = _sparse_q(draft, gen) if temperature else None
                calls.append((sid, pos[i][0], pos[i][1], draft, q, method))
            got = await asyncio.gather(*[targets[c[0]].verify(*c) for c in calls])
            for i, (c, g) in enumerate(zip(calls, got)):
                want = ref.verify(*c)
                assert g.batch_size == 4 or rnd > 0, "round 0's 4 calls should share one forward"
                assert (g.num_accepted, g.next_token) == (want.num_accepted, want.next_token), (rnd, i)
                base, feed, draft = c[1], c[2], c[3]
                pos[i] = (base + len(feed) + g.num_accepted, [g.next_token])
        assert 3 <= s.target_app.metrics.value("specdec_batch_size_count") <= 1 + 2 * 4
    finally:
        await s.close()


async def test_concurrent_draft_streams_share_forwards(models, stack):
    """4 sessions drafting at once go through shared (batched) draft steps and draft what each would alone."""
    from specdec.workers.draft import DraftWorker

    ref = DraftWorker(models[1], max_sessions=4, lookup=SERVED_LOOKUP)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [16] * 10]
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=40 + i)
        await stack.remote_draft().start(f"c{i}", p, params)
        ref.start_session(f"c{i}", p, params)

    async def one(i, p):
        req = draft_pb2.DraftStreamRequest(session_id=f"c{i}", base_position=len(p) - 1, append_ids=p[-1:],
                                           gamma_max=12, block_size=3)
        return [t for b in [b async for b in stack.dstub.DraftStream(req)] for t in b.token_ids]

    # Hold the model thread until all four calls are queued: otherwise a loaded host may run the first stream to
    # its end before the others arrive, and nothing is left to share.
    # Count the submitted calls: some may have been admitted already (taken out of the queue for the step that
    # waits behind the hold), so the queue's length alone does not tell.
    batcher, hold, submitted = stack.draft_app.batcher, threading.Event(), []
    submit = batcher.submit
    batcher.submit = lambda *a: submitted.append(a) or submit(*a)
    held = asyncio.ensure_future(stack.draft_app.host.runner.run(hold.wait))
    streams = asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    try:
        async with asyncio.timeout(60):
            while len(submitted) < len(prompts):
                await asyncio.sleep(0.005)
    finally:
        batcher.submit = submit
        hold.set()
    await held
    got = await streams
    for i, p in enumerate(prompts):
        assert got[i] == ref.draft(f"c{i}", len(p) - 1, p[-1:], 12, block_size=3).tokens, i
    while batcher._active or batcher._pending:  # the batch-size metric is observed after each model-thread run
        await asyncio.sleep(0.005)
    m = stack.draft_app.metrics
    steps, sessions = m.value("specdec_batch_size_count"), m.value("specdec_batch_size_sum")
    assert sessions > steps, f"no draft step was shared ({sessions} session-steps in {steps} steps)"


# ---------------------------------------------------------------- draft RPCs
async def test_draft_stream_blocks_match_unary_and_retry_is_idempotent(stack):
    d = stack.dstub
    await d.StartSession(draft_pb2.DraftServiceStartSessionRequest(
        session_id="a", prompt_ids=[3, 4, 5], params=common_pb2.SamplingParams(temperature=1.0, seed=5)))
    req = dict(session_id="a", base_position=2, append_ids=[5], gamma_max=6, block_size=2)
    blocks = [b async for b in d.DraftStream(draft_pb2.DraftStreamRequest(**req))]
    # whole blocks of 2 (blocks drafted while the stream was busy come as one message), offsets contiguous
    assert [b.offset for b in blocks] == [sum(len(x.token_ids) for x in blocks[:i]) for i in range(len(blocks))]
    assert all(len(b.token_ids) % 2 == 0 for b in blocks) and sum(len(b.token_ids) for b in blocks) == 6
    assert [b.last for b in blocks] == [False] * (len(blocks) - 1) + [True]
    assert blocks[-1].stop_reason == draft_pb2.STOP_REASON_GAMMA_MAX
    unary = await d.Draft(draft_pb2.DraftRequest(**req))  # a retry of the same position
    assert list(unary.token_ids) == [t for b in blocks for t in b.token_ids]
    q = decode_q(unary.q)
    assert len(q) == 6 and all(len(x.ids) <= 64 and abs(float(x.probs.sum()) - 1) < 1e-4 for x in q)
    assert all(int(t) in x.ids.tolist() for t, x in zip(unary.token_ids, q))
    # commit, then a call below the commit is refused; rollback above it is fine
    assert (await d.Commit(draft_pb2.CommitRequest(session_id="a", position=4))).position == 4
    await expect(Code.FAILED_PRECONDITION, d.Draft(draft_pb2.DraftRequest(**{**req, "base_position": 2})),
                 "committed position 4")
    assert (await d.Rollback(draft_pb2.RollbackRequest(session_id="a", position=5))).position == 5
    info = (await d.GetInfo(draft_pb2.DraftServiceGetInfoRequest())).info
    assert info.vocab_size == VOCAB and info.device == "cpu" and info.weight_quant == "none"  # an fp32 test draft
    from specdec.modeling import native
    assert info.attention_kernel == ("native" if native.available() else "torch")
    assert (await d.EndSession(draft_pb2.DraftServiceEndSessionRequest(session_id="a"))).existed
    assert not (await d.EndSession(draft_pb2.DraftServiceEndSessionRequest(session_id="a"))).existed


async def test_lone_calls_run_on_the_servers_event_loops_with_the_same_results(models):
    """One torch thread per process: a lone unary Draft and a lone Verify run on the servers' event loops (no
    hand-off to the model thread and back) and return what the model threads return."""
    from specdec.common.threads import set_thread_count

    before = torch.get_num_threads()
    set_thread_count(1)
    s = await make_stack(models, target_kw=dict(threads=1), draft_kw=dict(threads=1))
    try:
        d, t = s.dstub, s.tstub
        drunner, trunner = s.draft_app.host.runner, s.target_app.host.runner
        params = common_pb2.SamplingParams(temperature=1.0, seed=3)
        await d.StartSession(draft_pb2.DraftServiceStartSessionRequest(session_id="x", prompt_ids=[3, 4, 5],
                                                                       params=params))
        await t.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id="x", prompt_ids=[3, 4, 5],
                                                                         params=params))
        req = dict(session_id="x", base_position=2, append_ids=[5], gamma_max=4, block_size=2)
        last = drunner._last
        unary = await d.Draft(draft_pb2.DraftRequest(**req))
        assert drunner._last is last, "the lone unary Draft should not go to the model thread"
        streamed = [b async for b in d.DraftStream(draft_pb2.DraftStreamRequest(**req))]  # on the model thread
        assert drunner._last is not last
        assert list(unary.token_ids) == [x for b in streamed for x in b.token_ids]
        assert decode_q(unary.q)[0].probs.tolist() == decode_q(streamed[0].q)[0].probs.tolist()

        vreq = target_pb2.VerifyRequest(session_id="x", base_position=2, feed_ids=[5], draft_ids=unary.token_ids,
                                        q=unary.q, method=common_pb2.VERIFY_METHOD_TOKEN)
        last = trunner._last
        here = await t.Verify(vreq)
        assert trunner._last is last, "the lone Verify should not go to the model thread"
        trunner.threads = 0  # now it cannot run there: the model thread verifies the same call
        there = await t.Verify(vreq)
        assert trunner._last is not last
        assert (here.num_accepted, here.next_token) == (there.num_accepted, there.next_token)
    finally:
        await s.close()
        set_thread_count(before)


async def test_preverifier_stop_without_preverifier_is_invalid(stack):
    d = stack.dstub
    await d.StartSession(draft_pb2.DraftServiceStartSessionRequest(session_id="p", prompt_ids=[1, 2]))
    await expect(Code.INVALID_ARGUMENT, d.Draft(draft_pb2.DraftRequest(
        session_id="p", base_position=1, append_ids=[2], gamma_max=4,
        stop=draft_pb2.StopRule(kind=draft_pb2.STOP_KIND_PREVERIFIER))), "pre-verifier")


# ---------------------------------------------------------------- bad input → status + message
async def test_bad_inputs_map_to_status_codes(models):
    s = await make_stack(models, target_kw=dict(max_sessions=2, lru_min_idle_s=60, max_context=32),
                         draft_kw=dict(max_context=32))
    t, d = s.tstub, s.dstub
    Start = target_pb2.TargetServiceStartSessionRequest
    try:
        # unknown session
        await expect(Code.NOT_FOUND, t.Verify(target_pb2.VerifyRequest(session_id="nope", feed_ids=[1])),
                     "'nope'", "StartSession")
        await expect(Code.NOT_FOUND, d.Draft(draft_pb2.DraftRequest(session_id="nope", append_ids=[1],
                                                                   gamma_max=2)), "StartSession")
        # empty prompt, ids outside vocab, bad sampling params, empty id
        await expect(Code.INVALID_ARGUMENT, t.StartSession(Start(session_id="x", prompt_ids=[])), "prompt", "empty")
        await expect(Code.INVALID_ARGUMENT, t.StartSession(Start(session_id="x", prompt_ids=[1, VOCAB + 5])),
                     "outside the vocabulary")
        for bad, field in ((dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"),
                           (dict(top_k=-3), "top_k")):
            await expect(Code.INVALID_ARGUMENT, t.StartSession(Start(
                session_id="x", prompt_ids=[1, 2], params=common_pb2.SamplingParams(**bad))), field)
        await expect(Code.INVALID_ARGUMENT, t.StartSession(Start(session_id="", prompt_ids=[1])), "session_id")
        # prompt or prompt + draft beyond the context
        await expect(Code.OUT_OF_RANGE, t.StartSession(Start(session_id="x", prompt_ids=[1] * 40)), "context")
        await t.StartSession(Start(session_id="a", prompt_ids=[1, 2, 3]))
        await expect(Code.OUT_OF_RANGE, t.Verify(target_pb2.VerifyRequest(
            session_id="a", base_position=2, feed_ids=[3], draft_ids=[1] * 40)), "context")
        await d.StartSession(draft_pb2.DraftServiceStartSessionRequest(session_id="a", prompt_ids=[1, 2, 3]))
        await expect(Code.OUT_OF_RANGE, d.Draft(draft_pb2.DraftRequest(
            session_id="a", base_position=2, append_ids=[3], gamma_max=40)), "gamma")
        # wrong position, and ids outside vocab in a verify
        await expect(Code.FAILED_PRECONDITION, t.Verify(target_pb2.VerifyRequest(
            session_id="a", base_position=9, feed_ids=[3], draft_ids=[4])), "position 2")
        await expect(Code.INVALID_ARGUMENT, t.Verify(target_pb2.VerifyRequest(
            session_id="a", base_position=2, feed_ids=[3], draft_ids=[999])), "vocabulary")
        await expect(Code.INVALID_ARGUMENT, t.Verify(target_pb2.VerifyRequest(
            session_id="a", base_position=2, feed_ids=[3], draft_ids=[4], q=b"\xc1")), "q")
        # over session capacity (both sessions used just now, LRU eviction needs 60 s idle)
        await t.StartSession(Start(session_id="b", prompt_ids=[1, 2]))
        await expect(Code.RESOURCE_EXHAUSTED, t.StartSession(Start(session_id="c", prompt_ids=[1, 2])),
                     "max_sessions=2")
    finally:
        await s.close()


async def test_expired_session_and_queue_capacity(models):
    s = await make_stack(models, target_kw=dict(session_ttl_s=0.3, max_queue=1, batch_window_ms=50.0))
    t = s.tstub
    Start = target_pb2.TargetServiceStartSessionRequest
    try:
        for sid in ("q1", "q2", "q3"):
            await t.StartSession(Start(session_id=sid, prompt_ids=[1, 2]))
        calls = [t.Verify(target_pb2.VerifyRequest(session_id=sid, base_position=1, feed_ids=[2], draft_ids=[3]))
                 for sid in ("q1", "q2")]
        res = await asyncio.gather(*calls, return_exceptions=True)
        codes = sorted(r.code().name if isinstance(r, grpc.aio.AioRpcError) else "OK" for r in res)
        assert codes == ["OK", "RESOURCE_EXHAUSTED"], res
        assert any("queue is full" in r.details() for r in res if isinstance(r, grpc.aio.AioRpcError))
        await asyncio.sleep(0.45)
        await expect(Code.NOT_FOUND, t.Verify(target_pb2.VerifyRequest(session_id="q3", base_position=1,
                                                                       feed_ids=[2])), "expired")
    finally:
        await s.close()


# ---------------------------------------------------------------- health, reflection, shutdown
async def test_health_reflection_and_shutdown(models):
    s = await make_stack(models)
    try:
        for ch, name in ((s.tch, "specdec.v1.TargetService"), (s.dch, "specdec.v1.DraftService")):
            h = health_pb2_grpc.HealthStub(ch)
            assert (await h.Check(health_pb2.HealthCheckRequest(service=name))).status == \
                health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo()
            await refl.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            names = {x.name for x in (await refl.read()).list_services_response.service}
            assert {name, "grpc.health.v1.Health"} <= names
            await refl.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=name))
            files = (await refl.read()).file_descriptor_response.file_descriptor_proto
            assert files, "reflection should serve the proto descriptors (grpcurl works without .proto files)"
            await refl.done_writing()
        watch = health_pb2_grpc.HealthStub(s.tch).Watch(health_pb2.HealthCheckRequest(service="specdec.v1.TargetService"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.ensure_future(s.target_app.shutdown(0.5))
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        await stopping
    finally:
        await s.close()


# ---------------------------------------------------------------- the real entry point and SIGTERM
def _save_tiny(model, path: Path):
    from safetensors.torch import save_file

    c = model.config
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))


def test_python_m_target_service_serves_and_stops_on_sigterm(models, tmp_path):
    _save_tiny(models[0], tmp_path / "m")
    env = {**os.environ, "TARGET_METRICS_PORT": "0", "TARGET_GRACE_S": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "target_service", "--model", str(tmp_path / "m"),
                             "--host", "127.0.0.1", "--port", "0", "--threads", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = None
        deadline = time.time() + 120
        for line in proc.stdout:
            if "serving on" in line:
                port = int(line.rsplit(":", 1)[1].split()[0])
                break
            assert time.time() < deadline
        assert port, "server did not report its port"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.TargetService"),
                                                     timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "draining" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------- round-trip overhead of one verify
async def test_verify_round_trip_latency(stack, capsys):
    await stack.remote_target().start("lat", [1, 2, 3], SamplingParams())
    req = dict(session_id="lat", base_position=2, feed_ids=[3], draft_ids=[4])
    rtt, compute = [], []
    for _ in range(300):
        t0 = time.perf_counter_ns()
        r = await stack.tstub.Verify(target_pb2.VerifyRequest(**req), timeout=5)
        rtt.append(time.perf_counter_ns() - t0)
        compute.append(r.forward_ns + r.verify_ns)
    rtt, compute = rtt[50:], compute[50:]  # drop warm-up
    med, med_c = statistics.median(rtt) / 1e6, statistics.median(compute) / 1e6
    overhead = statistics.median(a - b for a, b in zip(rtt, compute)) / 1e6
    with capsys.disabled():
        print(f"\nverify round trip (tiny model, loopback): median {med:.3f} ms, server compute {med_c:.3f} ms, "
              f"overhead {overhead:.3f} ms")
    assert overhead < 20  # the target is <= 2 ms; loose bound here because CI CPUs are shared


# ---------------------------------------------------------------- --dtype / --device
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
async def test_load_from_dir_with_dtype_and_device(models, tmp_path, device):
    _save_tiny(models[0], tmp_path / "m")
    app = await build_target(TargetSettings(host="127.0.0.1", port=0, metrics_port=0, grace_s=0.5,
                                            model=str(tmp_path / "m"), dtype="bfloat16", device=device))
    await app.start()
    channels = Channels()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub, client = target_pb2_grpc.TargetServiceStub(ch), remote_target(channels, f"127.0.0.1:{app.port}")
            info = (await stub.GetInfo(target_pb2.TargetServiceGetInfoRequest())).info
            assert info.dtype == "bfloat16" and info.device.startswith(device)
            await client.start("d", [1, 2, 3], SamplingParams(temperature=1.0, seed=1))
            q = _sparse_q([4, 5], torch.Generator().manual_seed(0))
            out = await client.verify("d", 2, [3], [4, 5], q, "block")
            assert 0 <= out.num_accepted <= 2 and out.next_token is not None and 0 <= out.next_token < VOCAB
    finally:
        await channels.close()
        await app.shutdown(0.5)


async def test_dense_q_tensor_equals_sparse_q(stack):
    from specdec_rpc.encode import tensor_to_proto

    gen = torch.Generator().manual_seed(9)
    targets = {sid: stack.remote_target() for sid in ("sp", "de")}
    for sid, target in targets.items():
        await target.start(sid, [1, 2, 3], SamplingParams(temperature=1.0, seed=2))
    q = _sparse_q([4, 5, 6], gen)
    sparse = await targets["sp"].verify("sp", 2, [3], [4, 5, 6], q, "block")
    dense = torch.stack([d.to_dense(VOCAB) for d in q])
    req = target_pb2.VerifyRequest(session_id="de", base_position=2, feed_ids=[3], draft_ids=[4, 5, 6],
                                   q_dense=tensor_to_proto(dense), method=common_pb2.VERIFY_METHOD_BLOCK)
    r = await stack.tstub.Verify(req)
    assert (r.num_accepted, r.next_token) == (sparse.num_accepted, sparse.next_token)
