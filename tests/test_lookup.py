"""Prompt lookup (specdec/lookup.py): what it proposes, and that drafting with it stays lossless."""
import os

import pytest

from specdec.engine import Engine
from specdec.lookup import PromptLookup
from specdec.request import GenerationRequest
from specdec.sampling import SamplingParams
from tests.helpers_models import build_tiny_model
from tests.table_lm import TableLM
from tests.test_exactness import PROMPT as EXACT_PROMPT, V, chi_square_pvalue, exact_continuations, run_many


def test_proposes_what_followed_the_longest_latest_match():
    lk = PromptLookup(min_ngram=2, max_ngram=4)
    assert lk.propose([1, 2, 3, 9, 1, 2]) == (3, 2)
    # "7 1 2" matched once (→ 8), "1 2" later (→ 3): the longest match wins
    assert lk.propose([7, 1, 2, 8, 5, 1, 2, 3, 7, 1, 2]) == (8, 3)
    assert lk.propose([1, 2, 3, 1, 2, 4, 1, 2]) == (4, 2)  # equal lengths: the latest
    assert lk.propose([5, 5, 5, 5]) == (5, 3)  # a run continues itself (overlapping match)
    assert lk.propose([1, 2, 3, 4]) is None
    assert lk.propose([2, 9, 1, 2]) is None  # a 1-token match is below min_ngram
    assert lk.propose([1, 2]) is None and lk.propose([]) is None
    assert PromptLookup(min_ngram=1, max_ngram=1).propose([2, 9, 1, 2]) == (9, 1)


def test_window_bounds_the_search():
    ctx = [1, 2, 3, 4] + [9] * 10 + [1, 2, 3]
    assert PromptLookup(3, 3, window=64).propose(ctx) == (4, 3)
    assert PromptLookup(3, 3, window=8).propose(ctx) is None  # the earlier "1 2 3" lies outside the window


@pytest.mark.parametrize("kw", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_ngram=6, window=6)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        PromptLookup(**kw)


REPEATS = [3, 1, 4, 1, 5, 9, 2, 6] * 3  # a prompt whose n-grams recur, so lookup proposes from the start


@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl", "pacer_pearl"])
def test_greedy_with_lookup_equals_target_only(mode):
    from specdec.preverifier import build_random_preverifier

    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(hidden_size=draft.config.hidden_size, seed=3, block_size=1) \
        if mode.startswith("pacer") else None
    eng = Engine(target, draft, preverifier=pv, lookup=PromptLookup(min_ngram=2, max_ngram=4))
    ref = eng.generate(GenerationRequest(REPEATS, 40, mode="ar")).token_ids
    out = eng.generate(GenerationRequest(REPEATS, 40, mode=mode, gamma=4))
    assert out.token_ids == ref
    assert eng.draft_worker.looked_up_tokens > 0  # the test exercised lookup
    eng.close()


def test_lookup_proposals_are_accepted_where_the_target_repeats():
    """A target that copies (draft = a different model): lookup lifts acceptance, and changes no output."""
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=4, logit_scale=2.0)
    req = dict(prompt_ids=REPEATS, max_new_tokens=48, mode="sd", gamma=4)
    runs = {}
    for on in (False, True):
        eng = Engine(target, draft, lookup=PromptLookup(min_ngram=2) if on else None)
        runs[on] = eng.generate(GenerationRequest(**req))
        eng.close()
    assert runs[True].token_ids == runs[False].token_ids
    # the tiny target falls into a loop within 48 tokens (it does for seed 1), which lookup then copies
    assert runs[True].stats.mean_accepted_length > runs[False].stats.mean_accepted_length


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampling_with_lookup_matches_exact_target_distribution(method):
    """q of a looked-up token is one-hot: speculative sampling with it is still exactly the target's law."""
    target, draft = TableLM(V, seed=21, scale=1.5), TableLM(V, seed=22, scale=1.5)
    exact = exact_continuations(target, EXACT_PROMPT, SamplingParams(temperature=1.0))
    eng = Engine(target, draft, inline=True, lookup=PromptLookup(min_ngram=1, max_ngram=2, greedy_only=False))
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts = run_many(eng, "sd", method, dict(temperature=1.0), n)
    share = eng.draft_worker.looked_up_tokens / max(1, n)
    eng.close()
    assert share > 0.3  # lookup proposed in a good share of the runs
    assert chi_square_pvalue(counts, exact, n) > 0.001


async def test_draft_replica_drafts_with_lookup_and_says_so():
    """The draft service's default: lookup on (min_ngram 3), reported by GetInfo, counted in its metrics; greedy
    output over gRPC equals target-only decoding and the in-process engine with the same lookup; 0 turns it off."""
    import dataclasses

    from specdec.defaults import PROMPT_LOOKUP_MIN_NGRAM
    from specdec.pb import draft_pb2
    from specdec.schedule import generate
    from tests.test_services import make_stack

    target = build_tiny_model(vocab_size=64, hidden_size=32, seed=1, max_position_embeddings=128, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=64, hidden_size=32, num_layers=1, seed=2, max_position_embeddings=128)
    base = GenerationRequest(prompt_ids=REPEATS, max_new_tokens=32, mode="sd", gamma=4)
    eng = Engine(target, draft, lookup=PromptLookup(PROMPT_LOOKUP_MIN_NGRAM))
    ar = (await eng.agenerate(dataclasses.replace(base, mode="ar", session_id="ar"))).token_ids
    local = await eng.agenerate(dataclasses.replace(base, session_id="local"))
    eng.close()
    for n in (PROMPT_LOOKUP_MIN_NGRAM, 0):
        stack = await make_stack((target, draft), draft_kw={"prompt_lookup_min_ngram": n})
        try:
            info = await stack.dstub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
            assert info.info.prompt_lookup_min_ngram == n
            remote = await generate(dataclasses.replace(base, session_id=f"r{n}"), stack.draft, stack.target)
            assert remote.token_ids == ar
            looked = stack.draft_app.metrics.value("specdec_num_lookup_tokens_total")
            if n:
                assert remote.stats.draft_tokens == local.stats.draft_tokens  # the same proposals as in process
                assert looked > 0
            else:
                assert looked == 0
        finally:
            await stack.close()


def test_sampled_requests_draft_from_the_model_unless_asked():
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    req = GenerationRequest(REPEATS, 24, mode="sd", gamma=4, params=SamplingParams(temperature=1.0, seed=3))
    for greedy_only, used in ((True, False), (False, True)):
        eng = Engine(target, draft, lookup=PromptLookup(min_ngram=2, greedy_only=greedy_only))
        eng.generate(req)
        assert (eng.draft_worker.looked_up_tokens > 0) == used
        eng.close()


def test_batched_drafting_with_lookup_equals_separate():
    """Sessions drafting in shared forwards draft what each would alone with lookup too: each session looks up in
    its own context, and its KV state after the calls is the same."""
    from specdec.workers import DraftWorker
    from tests.test_core import draft_all

    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    prompts = [REPEATS, [1, 2, 3], REPEATS[:12] + [9, 2], [7, 7, 7, 7, 7]]
    plan = [(6, 0), (4, 1), (7, 2), (5, 0)]  # (gamma_max, block_size)
    runs = []
    for batched in (False, True):
        dw = DraftWorker(draft, max_sessions=4, lookup=PromptLookup(min_ngram=2))
        for i, pr in enumerate(prompts):
            dw.start_session(f"s{i}", pr, SamplingParams())
        args = [(f"s{i}", len(pr) - 1, [pr[-1]], g, None, b) for i, (pr, (g, b)) in enumerate(zip(prompts, plan))]
        blocks = draft_all(dw, args, batched)
        runs.append(([[(b.tokens, b.final, b.looked_up) for b in bs] for bs in blocks],
                     [dw.sessions[f"s{i}"].tokens for i in range(4)], dw.looked_up_tokens))
    assert runs[0] == runs[1]
    assert runs[0][2] > 0
