"""Bad or odd input to the replicas, found by an audit: token ids past the vocabulary in stop ids and
bad words, temperatures too small to divide by, malformed draft distributions, a tensor shape whose size
overflows, two StartSessions of one id at once, and per-session state of sessions that went away without an
EndSession."""
from __future__ import annotations

import asyncio

import grpc
import msgpack
import numpy as np
import pytest
import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
from specdec_rpc.decode import decode_q, dense_q_to_sparse, tensor_from_proto
from specdec_rpc.pb import common_pb2 as cp, draft_pb2 as dp, draft_pb2_grpc as dg, target_pb2 as tp
from specdec_rpc.pb import target_pb2_grpc as tg
from tests.helpers_models import start_replica, target_greedy, tiny_pair

PROMPT = [1, 2, 3]


def q_bytes(rows) -> bytes:
    return msgpack.packb([[np.array(i, "<i4").tobytes(), np.array(p, "<f4").tobytes()] for i, p in rows],
                         use_bin_type=True)


@pytest.mark.parametrize("rows, words", [
    ([([4], [float("nan")])], "finite"), ([([4], [float("inf")])], "finite"), ([([4, 6], [1.5, -0.5])], ">= 0"),
    ([([4, 6], [2.5, 2.5])], "sum to 5"), ([([4, 4], [0.5, 0.5])], "more than once"),
])
def test_a_malformed_draft_distribution_is_refused(rows, words):
    with pytest.raises(InvalidRequestError, match=words):
        decode_q(q_bytes(rows))
    dense = torch.zeros(1, 8)
    if len(set(rows[0][0])) == len(rows[0][0]):  # a dense row cannot name a token twice
        dense[0, rows[0][0]] = torch.tensor(rows[0][1])
        with pytest.raises(InvalidRequestError, match=words):
            dense_q_to_sparse(dense)
    ok = decode_q(q_bytes([([4, 6], [0.25, 0.75]), ([5], [1.0])]))  # float32 rounding of a sum of 1 passes
    assert [d.ids.tolist() for d in ok] == [[4, 6], [5]]


@pytest.mark.parametrize("bad, words", [(([4], [float("nan")]), "finite"), (([4, 6], [0.75, 0.5]), "sum to 1.25"),
                                        (([7, 7], [0.5, 0.5]), "more than once")])
def test_the_refusal_names_the_row_that_breaks_the_rule(bad, words):
    """All rows are checked together: the error still names the first bad row, and one id in two rows is fine."""
    good = ([7, 9], [0.5, 0.5])
    with pytest.raises(InvalidRequestError, match=rf"q\[2\].*{words}"):
        decode_q(q_bytes([good, good, bad, good]))
    dense = torch.zeros(4, 12)
    if len(set(bad[0])) == len(bad[0]):
        for i, (ids, probs) in enumerate([good, good, bad, good]):
            dense[i, ids] = torch.tensor(probs)
        with pytest.raises(InvalidRequestError, match=rf"q_dense\[2\].*{words}"):
            dense_q_to_sparse(dense)
    rows = decode_q(q_bytes([good, ([], []), good]))
    assert [d.ids.tolist() for d in rows] == [[7, 9], [], [7, 9]]
    assert [d.ids.tolist() for d in dense_q_to_sparse(torch.tensor([[0, .5, .5], [0, 0, 0], [1., 0, 0]]))] == \
        [[1, 2], [], [0]]


def test_a_shape_whose_size_overflows_is_invalid_not_internal():
    msg = cp.Tensor(data=b"", dtype=cp.DTYPE_FLOAT32, shape=[2**40, 2**40])
    with pytest.raises(InvalidRequestError, match="needs 4835703278458516698824704"):
        tensor_from_proto(msg, "q_dense")


@pytest.mark.parametrize("mode", ["ar", "sd", "pearl"])
def test_a_temperature_below_sampling_eps_is_greedy(mode):
    """1e-40 would overflow logits / T to inf and NaN: it samples as its limit, greedy (vLLM's rule)."""
    target, draft = tiny_pair()
    eng = Engine(target, draft)
    try:
        for t in (1e-40, 1e-6):
            out = eng.generate(GenerationRequest(PROMPT, 8, mode=mode, params=SamplingParams(temperature=t, seed=7)))
            assert out.token_ids == target_greedy(target, PROMPT, 8), t
    finally:
        eng.close()
    assert SamplingParams(temperature=1e-5).greedy is False and SamplingParams(temperature=9e-6).greedy


@pytest.mark.asyncio
async def test_ids_past_the_vocabulary_in_stops_and_bad_words_never_fire_and_negative_ones_are_refused():
    target, _ = tiny_pair()
    app = await start_replica("target", target)
    ch = grpc.aio.insecure_channel(app.endpoint)
    stub = tg.TargetServiceStub(ch)
    try:
        ref = target_greedy(target, [1, 2], 1)[0]
        for sid, params in (("stop", cp.SamplingParams(min_tokens=3, stop_ids=[999])),
                            ("bad", cp.SamplingParams(bad_words=[cp.TokenIds(ids=[1, 999])]))):
            await stub.StartSession(tp.TargetServiceStartSessionRequest(session_id=sid, prompt_ids=[1, 2],
                                                                        params=params))
            out = await stub.Verify(tp.VerifyRequest(session_id=sid, base_position=1, feed_ids=[2]))
            assert out.next_token == ref, sid  # nothing masked: the plain greedy token
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.StartSession(tp.TargetServiceStartSessionRequest(
                session_id="neg", prompt_ids=[1, 2], params=cp.SamplingParams(min_tokens=3, stop_ids=[-1])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_ids" in err.value.details()
    finally:
        await ch.close()
        await app.shutdown(0)


@pytest.mark.asyncio
async def test_two_starts_of_one_id_at_once_leave_the_later_one():
    """A 250-token prompt prefills in two chunks, so the two calls interleave: the later start replaces the
    earlier, which fails NOT_FOUND without ending the later one's session; the survivor reports its own length."""
    target, _ = tiny_pair()
    app = await start_replica("target", target)
    ch = grpc.aio.insecure_channel(app.endpoint)
    stub = tg.TargetServiceStub(ch)
    try:
        for k in range(3):
            sid, p1, p2 = f"dup{k}", [1 + k] * 250, [9 + k] * 240

            async def start(prompt):
                try:
                    return await stub.StartSession(tp.TargetServiceStartSessionRequest(session_id=sid,
                                                                                       prompt_ids=prompt))
                except grpc.aio.AioRpcError as e:
                    return e.code()

            r1, r2 = await asyncio.gather(start(p1), start(p2))
            held = app.host.worker.sessions.get(sid)
            assert held is not None and sid in app.host.table, (r1, r2)
            winner = p1 if held.tokens[0] == p1[0] else p2
            won = r1 if winner is p1 else r2
            assert not isinstance(won, grpc.StatusCode) and won.position == len(winner) - 1, (r1, r2)
            assert held.length() == len(winner) - 1
            await stub.EndSession(tp.TargetServiceEndSessionRequest(session_id=sid))
        assert not app.host.prefilling and not app.host._starts and not app.host.worker.sessions
    finally:
        await ch.close()
        await app.shutdown(0)


@pytest.mark.asyncio
async def test_draft_state_of_sessions_gone_without_end_session_stays_bounded():
    _, draft = tiny_pair()
    app = await start_replica("draft", draft, max_sessions=4, lru_min_idle_s=0.0)
    ch = grpc.aio.insecure_channel(app.endpoint)
    stub = dg.DraftServiceStub(ch)
    try:
        for i in range(30):
            sid = f"gone{i}"
            await stub.StartSession(dp.DraftServiceStartSessionRequest(session_id=sid, prompt_ids=PROMPT))
            await stub.Draft(dp.DraftRequest(session_id=sid, base_position=2, append_ids=[3], gamma_max=2))
            await stub.Commit(dp.CommitRequest(session_id=sid, position=3))
        assert len(app.host.table) == 4
        assert len(app.servicer._latest) <= 8 + 1 and len(app.servicer.committed) <= 8 + 1
    finally:
        await ch.close()
        await app.shutdown(0)


@pytest.mark.asyncio
async def test_a_start_that_will_be_refused_compiles_no_grammar():
    """A full replica refused a grammar request only after compiling its grammar, which pushed a cached one out
    (a memory audit: 4,503 compiles for 255 admitted sessions)."""
    target, _ = tiny_pair()
    app = await start_replica("target", target, max_sessions=1)
    compiled = []

    class Vocab:
        def check(self, grammar):
            compiled.append(grammar)

    try:
        app.host.worker._grammar_vocab = Vocab()
        await app.host.start_session("held", PROMPT, SamplingParams())
        with pytest.raises(Exception, match="max_sessions=1"):
            await app.host.start_session("next", PROMPT, SamplingParams(grammar='{"type": "object"}'))
        assert compiled == [] and len(app.host.table) == 1
    finally:
        await app.shutdown(0)
