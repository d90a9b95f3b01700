"""Prefix caching (specdec/state/prefix_cache.py): a session reuses whole aligned prefill chunks another session
computed, and its K/V, rows and outputs are bitwise those of a cold prefill."""
import random

import grpc

import pytest
import torch

from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.request import MODES, GenerationRequest
from specdec.state.prefix_cache import SlotPrefixes, common_prefix_len
from specdec.workers.draft import DraftWorker
from specdec.workers.target import TargetWorker
from tests.helpers_models import build_tiny_model

CHUNK = 4
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # a shared "system prompt": two whole chunks and a part of one


def test_common_prefix_len_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(12))]
        b = a[:rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(5))]
        want = 0
        while want < min(len(a), len(b)) and a[want] == b[want]:
            want += 1
        assert common_prefix_len(a, b) == want
        assert common_prefix_len(a, b, limit=2) == min(want, 2)


def test_slot_choice():
    free = SlotPrefixes(4)
    a = free.take(None, {})
    assert (a.slot, a.source, a.tokens) == (0, None, 0)  # oldest first
    b = free.take([1, 2, 3, 4, 5], {a.slot: ("", [1, 2, 3, 4, 9])}, align=2)
    assert (b.slot, b.source, b.tokens, b.copy) == (1, 0, 4, True)  # from a live slot, in whole chunks: a copy
    free.release(b.slot, [1, 2, 3, 4])
    c = free.take([1, 2, 3, 4, 5, 6], {a.slot: ("", [1, 2, 3, 4])}, align=2)
    assert (c.slot, c.source, c.tokens, c.copy) == (1, 1, 4, False)  # a tie: the free slot that holds just it
    free.release(c.slot, [1, 2, 3, 4, 5, 6])
    d = free.take([1, 2, 3, 4, 7], {}, align=2)  # slot 1 holds more than the match: copied, so it keeps it all
    assert (d.slot, d.source, d.tokens, d.copy) == (2, 1, 4, True) and free.held(1) == [1, 2, 3, 4, 5, 6]
    e = free.take([8, 8], {}, align=1)  # no match: the slot released longest ago (3, never used) goes first
    assert (e.slot, e.tokens) == (3, 0)
    f = free.take([1, 2, 3, 4, 7], {}, align=2)  # the last free slot: taken as it is, whatever it holds
    assert (f.slot, f.source, f.tokens, f.copy) == (1, 1, 4, False)
    with pytest.raises(IndexError):
        free.take(None, {})


def test_on_a_tie_the_most_recently_released_free_slot_wins():
    """Two free slots holding the same prefix: the one released last is taken (the other keeps its K/V longer).
    A mutation audit found that dropping the tie-break (the first slot scanned, the oldest, won)
    passed every test: test_slot_choice has no tie between two free slots."""
    for order in ((0, 1), (1, 0)):
        free = SlotPrefixes(3)
        assert [free.take(None, {}).slot for _ in range(2)] == [0, 1]
        for slot in order:
            free.release(slot, [1, 2, 3, 4])
        got = free.take([1, 2, 3, 4, 5], {}, align=2)
        assert (got.slot, got.source, got.tokens, got.copy) == (order[-1], order[-1], 4, False), order
        assert free.held(order[0]) == [1, 2, 3, 4]  # the other one still holds the prefix


def kv_rows(worker, sid: str, n: int) -> list[torch.Tensor]:
    slot = worker.sessions[sid].slot
    return [t[slot, :n].clone() for t in worker.kv.k + worker.kv.v]


def conversation() -> list[list[int]]:
    """Prompts as a chat service sees them: one system prompt, different questions, then a conversation's second
    turn (its first prompt, an answer, a new question), and a prompt sent twice."""
    q1, q2, answer, q3 = [7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20], [21, 22, 23]
    first = SYSTEM + q1
    return [first, SYSTEM + q2, first + answer + q3, SYSTEM + q2, [30, 31], SYSTEM[:3]]


@pytest.mark.parametrize("worker_cls", [TargetWorker, DraftWorker])
def test_reused_prefixes_are_bitwise_a_cold_prefill(worker_cls):
    model = build_tiny_model(vocab_size=40, seed=1, logit_scale=2.0)
    warm = worker_cls(model, max_sessions=3, prefix_cache=True, prefill_chunk=CHUNK)
    cold = worker_cls(model, max_sessions=3, prefix_cache=False, prefill_chunk=CHUNK)
    params = SamplingParams()
    cached = []
    for i, prompt in enumerate(conversation()):
        for w in (warm, cold):
            w.start_session(f"s{i}", prompt, params)
        n = len(prompt) - 1
        for a, b in zip(kv_rows(warm, f"s{i}", n), kv_rows(cold, f"s{i}", n)):
            assert torch.equal(a, b)
        cached.append(warm.sessions[f"s{i}"].cached_tokens)
        assert cold.sessions[f"s{i}"].cached_tokens == 0
        if worker_cls is TargetWorker:  # the first verify's rows, and the generated tokens that follow
            outs = [w.verify(f"s{i}", n, prompt[-1:], [], method="greedy") for w in (warm, cold)]
            assert outs[0].next_token == outs[1].next_token
            assert torch.equal(warm.sessions[f"s{i}"].last_row, cold.sessions[f"s{i}"].last_row)
        else:
            blocks = [w.draft(f"s{i}", n, prompt[-1:], 3) for w in (warm, cold)]
            assert blocks[0].tokens == blocks[1].tokens
        if i in (0, 2):
            continue  # s0 stays live: s1 copies from it; s2's turn stays live too
        for w in (warm, cold):
            w.end_session(f"s{i}")
    # s1 copies s0's two whole system chunks (8 of its 11 prefilled positions: the third chunk is partial in s0's
    # prefill, so rounding could differ); s2 extends s0's prompt: 12 = s0's whole chunks, not the answer's
    # decoded positions; the repeat of s1 takes its free slot; a new prompt and a prompt inside one chunk: none
    assert cached == [0, 8, 12, 8, 0, 0]
    assert warm.prefix_hits == 28 and warm.prefix_queries == sum(len(p) - 1 for p in conversation())


def test_a_reused_slot_forgets_its_prefix():
    model = build_tiny_model(vocab_size=40, seed=1)
    w = TargetWorker(model, max_sessions=2, prefill_chunk=CHUNK)
    w.start_session("a", SYSTEM + [7], SamplingParams())
    w.end_session("a")
    w.start_session("b", [20] * 12, SamplingParams())  # takes the never-used slot
    w.start_session("c", [21] * 12, SamplingParams())  # takes a's slot: its K/V is overwritten
    w.end_session("b")
    w.end_session("c")
    w.start_session("d", SYSTEM + [8], SamplingParams())
    assert w.sessions["d"].cached_tokens == 0
    w.start_session("e", [21] * 9 + [5], SamplingParams())
    assert w.sessions["e"].cached_tokens == 8  # c's two whole chunks, from the slot it left


def test_nothing_is_reused_where_every_prefill_row_is_needed():
    model = build_tiny_model(vocab_size=40, seed=1)
    w = TargetWorker(model, max_sessions=3, prefill_chunk=CHUNK)
    w.start_session("a", SYSTEM + [7], SamplingParams())
    w.start_session("b", SYSTEM + [8], SamplingParams(prompt_logprobs=1))
    w.start_session("c", SYSTEM + [9], SamplingParams(), want_features=True)
    assert [w.sessions[s].cached_tokens for s in "abc"] == [0, 0, 0]
    off = TargetWorker(model, max_sessions=2, prefill_chunk=0)  # one forward per prompt: no aligned chunks
    off.start_session("a", SYSTEM + [7], SamplingParams())
    off.start_session("b", SYSTEM + [8], SamplingParams())
    assert off.sessions["b"].cached_tokens == 0 and not off.prefix_cache


@pytest.mark.parametrize("mode", MODES)
def test_generation_with_the_prefix_cache_equals_without(mode):
    """Every mode, greedy and sampled: each prompt of a chat-like sequence returns the same tokens with the
    prefix cache as without, and the later prompts did reuse."""
    from specdec.decoding.preverifier import build_random_preverifier

    target = build_tiny_model(vocab_size=40, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=40, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(draft.config.hidden_size, seed=5, block_size=2, threshold=0.5)
    runs = {}
    for cache in (True, False):
        eng = Engine(target, draft, preverifier=pv, prefix_cache=cache, prefill_chunk=CHUNK)
        out = []
        for i, prompt in enumerate(conversation()[:4]):
            for temp in (0.0, 1.0):
                res = eng.generate(GenerationRequest(prompt, 12, mode=mode, gamma=3,
                                                     params=SamplingParams(temperature=temp, seed=5 + i)))
                out.append((res.token_ids, res.stats.cached_prompt_tokens))
        eng.close()
        runs[cache] = out
    assert [t for t, _ in runs[True]] == [t for t, _ in runs[False]]
    assert all(c == 0 for _, c in runs[False])
    # a repeat reuses all of its whole chunks: the turn of 25 tokens, all 24 prefilled positions
    assert [c for _, c in runs[True]] == [0, 12, 8, 8, 12, 24, 8, 8]


def test_decoded_positions_are_never_reused():
    """A chat's next turn repeats the answer the model generated; those positions were written by decode steps,
    whose rows round unlike a prefill's, so only the first turn's whole prefill chunks are reused."""
    model = build_tiny_model(vocab_size=40, seed=1, logit_scale=2.0)
    warm = TargetWorker(model, max_sessions=2, prefill_chunk=CHUNK)
    cold = TargetWorker(model, max_sessions=2, prefix_cache=False, prefill_chunk=CHUNK)
    first = SYSTEM + [7, 8, 9]
    warm.start_session("t1", first, SamplingParams())
    answer, feed = [], first[-1:]
    for _ in range(9):  # nine greedy decode steps
        out = warm.verify("t1", len(first) - 1 + len(answer), feed, [], method="greedy")
        answer.append(out.next_token)
        feed = [out.next_token]
    warm.end_session("t1")
    second = first + answer + [21, 22]
    for w in (warm, cold):
        w.start_session("t2", second, SamplingParams())
    assert warm.sessions["t2"].cached_tokens == 12  # first's 12 prefilled positions: 3 whole chunks
    for a, b in zip(kv_rows(warm, "t2", len(second) - 1), kv_rows(cold, "t2", len(second) - 1)):
        assert torch.equal(a, b)


async def test_over_the_wire_a_chat_turn_reuses_the_first_turns_chunks():
    """Through the coordinator (in-process pipelines, loopback replicas with 4-position chunks): the second turn of
    a conversation reports the target's reused positions in its stats, both replicas count them in their
    metrics, every answer equals target-only decoding, and `--no-prefix-cache` replicas reuse nothing."""
    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import start_replica, target_greedy, tiny_pair

    target, draft = tiny_pair()
    for cache in (True, False):
        kw = dict(prefill_chunk=CHUNK, prefix_cache=cache)
        t = await start_replica("target", target, **kw)
        d = await start_replica("draft", draft, **kw)
        app, _ = await build_coordinator(CoordinatorSettings(
            host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", draft_endpoints=d.endpoint,
            target_endpoints=t.endpoint, pipelines=1, log_level="WARNING", grace_s=0))
        await app.start()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
        try:
            stub = gg.GenerationServiceStub(ch)
            first = SYSTEM + [7, 8, 9]
            one = await stub.Generate(g.GenerateRequest(prompt_token_ids=first, max_new_tokens=9, mode="sd"))
            second = first + list(one.token_ids) + [21, 22]
            parts = [r async for r in stub.GenerateStream(g.GenerateRequest(prompt_token_ids=second, max_new_tokens=9,
                                                                           mode="sd"))]
            two = parts[-1]
            two.token_ids[:] = [t for r in parts for t in r.token_ids]
            assert list(one.token_ids) == target_greedy(target, first, 9)
            assert list(two.token_ids) == target_greedy(target, second, 9)
            assert (one.stats.cached_prompt_tokens, two.stats.cached_prompt_tokens) == ((0, 12) if cache else (0, 0))
            reg = app.metrics.registry  # the coordinator's: what the clients got
            assert reg.get_sample_value("specdec_prompt_tokens_total") == len(first) + len(second)
            assert reg.get_sample_value("specdec_cached_prompt_tokens_total") == (12 if cache else 0)
            assert reg.get_sample_value("specdec_time_per_output_token_seconds_count") == 1  # the streamed one
            for replica in (t, d):
                m = replica.host.metrics
                assert m.value("specdec_prefix_cache_queries_total") == len(first) - 1 + len(second) - 1
                assert m.value("specdec_prefix_cache_hits_total") == (12 if cache else 0)
            # another tenant's salt: nothing reused, the same answer; a salt too long is refused with its field
            salted = await stub.Generate(g.GenerateRequest(prompt_token_ids=second, max_new_tokens=9, mode="sd",
                                                           cache_salt="tenant-b"))
            assert list(salted.token_ids) == list(two.token_ids) and salted.stats.cached_prompt_tokens == 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(g.GenerateRequest(prompt_token_ids=second, cache_salt="x" * 300))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()
        finally:
            await ch.close()
            await app.shutdown(0)
            await t.shutdown(0)
            await d.shutdown(0)


def test_a_rollback_into_the_prompt_shrinks_what_others_may_reuse():
    model = build_tiny_model(vocab_size=40, seed=1)
    w = TargetWorker(model, max_sessions=3, prefill_chunk=CHUNK)
    w.start_session("a", SYSTEM + [7, 8, 9], SamplingParams())  # 12 prefilled positions: 3 whole chunks
    w.rollback("a", 6)
    w.verify("a", 6, SYSTEM[6:10] + [7, 8], [], method="greedy")  # the same tokens again, by a verify forward
    w.start_session("b", SYSTEM + [7, 8, 1], SamplingParams())
    assert w.sessions["a"].chunked == 6 and w.sessions["b"].cached_tokens == 4  # not 8: positions 6-11 are re-fed


def test_a_cache_salt_keeps_prefixes_apart():
    """Sessions reuse only prefixes of sessions with the same salt (a tenant's cache is not another's)."""
    model = build_tiny_model(vocab_size=40, seed=1)
    w = TargetWorker(model, max_sessions=4, prefill_chunk=CHUNK)
    prompt = SYSTEM + [7, 8, 9]
    w.start_session("a", prompt, SamplingParams(cache_salt="tenant-a"))
    w.start_session("b", prompt, SamplingParams(cache_salt="tenant-b"))
    w.start_session("shared", prompt, SamplingParams())
    w.start_session("a2", prompt, SamplingParams(cache_salt="tenant-a"))
    assert [w.sessions[s].cached_tokens for s in ("a", "b", "shared", "a2")] == [0, 0, 0, 12]
    w.end_session("b")
    w.start_session("b2", prompt, SamplingParams(cache_salt="tenant-b"))  # from b's free slot
    assert w.sessions["b2"].cached_tokens == 12
    from specdec_rpc.decode import read_sampling
    from specdec_rpc.pb import common_pb2

    with pytest.raises(Exception, match="cache_salt"):  # a replica's read of what it is sent refuses it
        read_sampling(common_pb2.SamplingParams(cache_salt="x" * 300))


def test_affinity_keys_depend_on_the_salt():
    from coordinator.routing.affinity import prefix_keys

    p = list(range(20))
    assert prefix_keys(p, 4) == prefix_keys(p, 4, "") != prefix_keys(p, 4, "t1") != prefix_keys(p, 4, "t2")


@pytest.mark.parametrize("extra", [0, 2])
async def test_prefix_cache_slots_keep_ended_conversations_while_the_replica_is_full(extra):
    """A replica of 2 sessions: a conversation ends, two other requests come and go, then its next turn arrives.
    The spare slots (`prefix_cache_slots`) still hold its prompt; without them the newcomers overwrote it."""
    from specdec_rpc.pb import target_pb2, target_pb2_grpc
    from tests.helpers_models import start_replica

    app = await start_replica("target", build_tiny_model(vocab_size=40, seed=1), max_sessions=2, prefill_chunk=CHUNK,
                              prefix_cache_slots=extra)
    ch = grpc.aio.insecure_channel(app.endpoint)
    try:
        assert app.host.worker.kv.num_slots == 2 + 1 + extra
        stub = target_pb2_grpc.TargetServiceStub(ch)

        async def start(sid, prompt):
            return await stub.StartSession(target_pb2.TargetServiceStartSessionRequest(session_id=sid,
                                                                                       prompt_ids=prompt))

        async def end(sid):
            await stub.EndSession(target_pb2.TargetServiceEndSessionRequest(session_id=sid))

        first = SYSTEM + [7, 8, 9]
        await start("turn-1", first)
        await start("x1", [30] * 13)
        await end("turn-1")
        await start("x2", [31] * 13)
        await end("x1")
        await start("x3", [32] * 13)
        await end("x2")
        again = await start("turn-2", first + [11, 12, 13, 14])
        assert again.cached_tokens == (12 if extra else 0)
    finally:
        await ch.close()
        await app.shutdown(0)
