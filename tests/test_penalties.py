"""Penalties and logit_bias (specdec/decoding/penalties.py) change only the target's p: every mode reproduces
target-only decoding with the same adjustments (greedy), and sampling follows the adjusted target's exact
distribution."""
import os
import random

import pytest
import torch

from specdec.decoding.penalties import adjust_logits
from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.engine import Engine
from specdec.scheduling.request import MODES, GenerationRequest
from specdec.workers.target import TargetWorker
from tests.helpers_models import build_tiny_model
from tests.table_lm import TableLM
from tests.test_exactness import PROMPT as TABLE_PROMPT, V as TABLE_V, chi_square_pvalue, run_many

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
ADJUST = dict(presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.5,
              logit_bias=((2, 2.0), (7, -1.5)))


def reference_adjust(row: torch.Tensor, history: list[int], output_start: int, p: SamplingParams) -> torch.Tensor:
    """The definitions, one token at a time (an independent reading of the docstring of specdec/decoding/penalties.py).
    """
    row = row.double().clone()
    for tok, bias in p.logit_bias:
        row[tok] += bias
    output = history[output_start:]
    for tok in set(history):
        if p.repetition_penalty != 1.0:
            row[tok] = row[tok] / p.repetition_penalty if row[tok] > 0 else row[tok] * p.repetition_penalty
    for tok in set(output):
        row[tok] -= p.frequency_penalty * output.count(tok) + p.presence_penalty
    return row


def test_adjust_logits_matches_the_definitions():
    rng = random.Random(0)
    for _ in range(50):
        vocab = 12
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        start = rng.randrange(len(history) + 1)
        draft = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
        params = SamplingParams(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                                repetition_penalty=rng.uniform(0.5, 2),
                                logit_bias=((rng.randrange(vocab), rng.uniform(-5, 5)),))
        rows = torch.randn(len(draft) + 1, vocab)
        got = adjust_logits(rows, history, start, draft, params)
        for i in range(len(draft) + 1):
            want = reference_adjust(rows[i], history + draft[:i], start, params)
            torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)
    plain = torch.randn(2, 5)
    assert torch.equal(adjust_logits(plain, [1, 2], 1, [3], SamplingParams()), plain)


def test_min_tokens_masks_exactly_the_first_m_output_rows():
    """Row i decides output token k + i (k already generated): it gets -inf at the stop ids iff k + i < min_tokens.
    A mutation audit found that masking one row too few (`:held - 1`, which lets EOS through as the
    min_tokens-th token) passed every test: the engine-level tests never put EOS at greedy's index min_tokens - 1."""
    prompt, draft, stop = [3, 1, 4], [2, 3, 4, 5], (1, 6)
    params = SamplingParams(min_tokens=3, stop_ids=stop)
    for k in (0, 1, 2, 3):
        history = prompt + [7] * k  # k output tokens already generated
        got = adjust_logits(torch.zeros(len(draft) + 1, 8), history, len(prompt), draft, params)
        for i in range(len(draft) + 1):
            held = k + i < params.min_tokens
            assert torch.isneginf(got[i, list(stop)]).tolist() == [held] * len(stop), (k, i, got[i].tolist())
            others = [t for t in range(8) if t not in stop]
            assert torch.equal(got[i, others], torch.zeros(len(others))), (k, i, got[i].tolist())


def adjusted_greedy(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Target-only greedy decoding with the adjustments, full forwards, no caches."""
    ids = list(prompt)
    kv = model.new_kv_slots(1, len(prompt) + n + 8)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), kv)
            ids.append(int(reference_adjust(logits[0, -1], ids, len(prompt), params).argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_equals_adjusted_target_only_greedy(mode):
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(draft.config.hidden_size, seed=5, block_size=2, threshold=0.5)
    eng = Engine(target, draft, preverifier=pv)
    params = SamplingParams(**ADJUST)
    want = adjusted_greedy(target, PROMPT, 24, params)
    assert want != adjusted_greedy(target, PROMPT, 24, SamplingParams()), "the adjustments must change the output"
    for gamma in (1, 4):
        res = eng.generate(GenerationRequest(PROMPT, 24, mode=mode, gamma=gamma, params=params))
        assert res.token_ids == want, (mode, gamma)
    same = Engine(target, target)  # draft == target, adjusting its proposals alike: every draft token accepted
    for p in (params, SamplingParams(temperature=1.0, seed=3, **ADJUST)):
        res = same.generate(GenerationRequest(PROMPT, 24, mode="sd", gamma=4, params=p))
        assert res.stats.accepted_tokens == res.stats.draft_tokens > 0, p
    eng.close()
    same.close()


def test_a_rebuilt_session_counts_only_the_output():
    """A session restarted from a request's history (failover) with output_start scores as the original did."""
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    w = TargetWorker(target, max_sessions=2)
    params = SamplingParams(**ADJUST)
    out = adjusted_greedy(target, PROMPT, 6, params)
    history = PROMPT + out
    w.start_session("rebuilt", history, params, output_start=len(PROMPT))
    w.start_session("as-prompt", history, params)  # output_start 0: all of it is prompt, nothing counted
    a = w.verify("rebuilt", len(history) - 1, history[-1:], [], method="greedy")
    b = w.verify("as-prompt", len(history) - 1, history[-1:], [], method="greedy")
    assert a.next_token == adjusted_greedy(target, PROMPT, 7, params)[-1]
    assert w.sessions["rebuilt"].output_start == len(PROMPT) and w.sessions["as-prompt"].output_start == len(history)


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampling_with_adjustments_matches_the_exact_adjusted_target(method):
    target, draft = TableLM(TABLE_V, seed=21, scale=1.5), TableLM(TABLE_V, seed=22, scale=1.5)
    kw = dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.5,
              logit_bias=((3, 1.0),))
    params = SamplingParams(**kw)

    def cond(prefix):
        row = reference_adjust(target.next_logits(tuple(prefix)), list(prefix), len(TABLE_PROMPT), params)
        return logits_to_probs(row.float(), params).double()

    import itertools

    exact = {}
    for seq in itertools.product(range(TABLE_V), repeat=3):
        prob = 1.0
        for i in range(3):
            prob *= float(cond(TABLE_PROMPT + list(seq[:i]))[seq[i]])
        exact[seq] = prob
    eng = Engine(target, draft, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts = run_many(eng, "sd", method, kw, n)
    eng.close()
    assert chi_square_pvalue(counts, exact, n) > 0.001
    plain = {}  # guard: the unadjusted target's distribution is told apart with as many runs
    for seq in exact:
        prob = 1.0
        for i in range(3):
            row = target.next_logits(tuple(TABLE_PROMPT + list(seq[:i])))
            prob *= float(logits_to_probs(row, SamplingParams(temperature=1.0)).double()[seq[i]])
        plain[seq] = prob
    assert chi_square_pvalue(counts, plain, n) < 1e-6


async def test_over_the_wire_and_across_a_failover():
    """GenerateRequest's adjustments reach the target: the answer equals adjusted target-only greedy decoding, also
    when the pinned target replica dies mid-request and the session is rebuilt on the other from its history
    (StartSession.output_start keeps the output's counts)."""
    import grpc

    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import start_replica, stream_killing_the_pinned_target, tiny_pair

    target, draft = tiny_pair()
    r1, r2 = await start_replica("target", target), await start_replica("target", target)
    d = await start_replica("draft", draft)
    app, _ = await build_coordinator(CoordinatorSettings(
        host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0, dns_refresh_s=60,
        log_level="WARNING", draft_endpoints=d.endpoint, target_endpoints=f"{r1.endpoint},{r2.endpoint}"))
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))
    params = SamplingParams(**ADJUST)
    try:
        want = adjusted_greedy(target, PROMPT, 40, params)
        request = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=40, mode="sd", gamma=3,
                                    presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.5,
                                    logit_bias={2: 2.0, 7: -1.5})
        assert list((await stub.Generate(request)).token_ids) == want
        ids, last = await stream_killing_the_pinned_target(stub, request, r1, r2, after=8)
        assert ids == want and "," in last.stats.target_replica, "the session moved and kept its counts"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, logit_bias={500: 1.0}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()
    finally:
        await ch.close()
        for a in (app, r1, r2, d):
            await a.shutdown(0)

