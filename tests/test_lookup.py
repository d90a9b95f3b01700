"""Prompt lookup (specdec/decoding/lookup.py): what it proposes, and that drafting with it stays lossless."""
import os

import pytest

from specdec.decoding.lookup import PromptLookup
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
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


def test_the_window_is_exactly_the_last_window_tokens():
    """The earlier "1 2 3" starts exactly `window` tokens from the end: found, and one token less misses it.
    A mutation audit found that searching `window + 1` tokens passed every test."""
    ctx = [5, 1, 2, 3, 4] + [9] * 10 + [1, 2, 3]  # 18 tokens; the earlier "1 2 3" starts 17 from the end
    assert PromptLookup(3, 3, window=17).propose(ctx) == (4, 3)
    assert PromptLookup(3, 3, window=16).propose(ctx) is None  # its "1" is the 17th last token: outside


@pytest.mark.parametrize("kw", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_ngram=6, window=6)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        PromptLookup(**kw)


REPEATS = [3, 1, 4, 1, 5, 9, 2, 6] * 3  # a prompt whose n-grams recur, so lookup proposes from the start


@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl", "pacer_pearl"])
def test_greedy_with_lookup_equals_target_only(mode):
    from specdec.decoding.preverifier import build_random_preverifier

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

    from specdec.common.defaults import PROMPT_LOOKUP_MIN_NGRAM
    from specdec.scheduling.schedule import generate
    from specdec_rpc.pb import draft_pb2
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
            remote = await generate(dataclasses.replace(base, session_id=f"r{n}"), *stack.backends())
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
    from specdec.workers.draft import DraftWorker
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


class IntermittentLookup(PromptLookup):
    """Proposes only at some context lengths. Prompt lookup itself never stops within a call once it proposes
    (the match it copies from moves along with the context), so this is what makes a drafting call go on with
    the draft model after looked-up tokens, whose features the next forward must then supply."""

    def propose(self, context):
        return super().propose(context) if len(context) % 5 < 3 else None


def _counting_worker(draft, pv=None, lazy=True, lookup=None):
    """A draft worker with lookup that counts its forwards; `lazy`: looked-up tokens drafted without one."""
    from specdec.workers.draft import DraftWorker

    dw = DraftWorker(draft, preverifier=pv, max_sessions=2, lookup=lookup or PromptLookup(min_ngram=2, max_ngram=4))
    if not lazy:  # every token after a forward: lookup asked only once the forward fed the position
        dw._propose_before_forward = lambda c: None
    dw.forwards = 0
    feed_many = dw._feed_many

    def counted(items, compact=False):
        dw.forwards += 1
        return feed_many(items, compact)

    dw._feed_many = counted
    return dw


def _rounds(dw, stop_factory, block_size=1):
    """Three drafting rounds as a coordinator runs them: all accepted plus a bonus, a rejection inside the
    previous call's tokens, and a call cancelled before its first forward. → what each round returned and held."""
    sid, prompt = "s", REPEATS[:20]
    dw.start_session(sid, prompt, SamplingParams())
    seen, scores = [], []
    base, append = len(prompt) - 1, [prompt[-1]]
    for rnd in range(3):
        blocks = list(dw.draft_blocks(sid, base, append, 6, stop_factory(), block_size))
        toks = [t for b in blocks for t in b.tokens]
        held = base + len(append) + len(toks) - 1  # what the coordinator takes as fed
        seen.append(([(b.tokens, b.looked_up, b.stop_reason) for b in blocks], dw.session_length(sid)))
        scores.extend(b.score for b in blocks if b.score is not None)
        assert dw.session_length(sid) >= held
        if rnd == 0:  # everything accepted, then the target's bonus token
            base, append = held, [toks[-1], 11]
        else:  # the target rejected the third drafted token: resend from it
            base, append = base + len(append) + 2 - 1, [13]
    c = dw.begin(sid, base, append, 4, stop_factory(), block_size)  # cancelled before its first forward
    dw.cancel(sid)
    assert [b.stop_reason for b in dw.advance([c])[0]] == ["cancelled"]
    assert dw.session_length(sid) >= base + len(append) - 1
    blocks = list(dw.draft_blocks(sid, base, append, 4, stop_factory(), block_size))  # the session still serves it
    seen.append(([(b.tokens, b.looked_up) for b in blocks], dw.sessions[sid].tokens[:base]))
    return seen, scores


@pytest.mark.parametrize("rule", ["fixed", "pacer"])
@pytest.mark.parametrize("lookup", [PromptLookup(min_ngram=2, max_ngram=4), IntermittentLookup(min_ngram=1)])
@pytest.mark.parametrize("block_size", [1, 3])
def test_looked_up_tokens_are_drafted_without_a_forward(rule, lookup, block_size):
    """A run of looked-up tokens costs one forward (the next one feeds them), not one each. The calls return
    what drafting with a forward per token returns (tokens, lookup counts, and the pre-verifier's scores, which
    read the looked-up tokens' features once a forward has computed them), and the session holds every position
    its caller assumes, through accepted rounds, rejections and a call cancelled before its first forward. With
    blocks of 3, a block that mixes model and looked-up tokens is scored at once, so its looked-up tokens take
    the forward."""
    from specdec.decoding.preverifier import build_random_preverifier
    from specdec.decoding.stop import FixedLength, PreverifierStop

    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(hidden_size=draft.config.hidden_size, seed=3, block_size=1)
    factory = FixedLength if rule == "fixed" else (lambda: PreverifierStop(pv, 0.3))
    runs = {}
    for lazy in (False, True):
        dw = _counting_worker(draft, pv, lazy, lookup)
        runs[lazy] = (_rounds(dw, factory, block_size), dw.forwards, dw.looked_up_tokens)
    assert runs[True][0][0] == runs[False][0][0]
    # scores equal up to float rounding: a multi-row forward sums in another order than one row at a time
    assert runs[True][0][1] == pytest.approx(runs[False][0][1], rel=1e-5)
    assert rule == "fixed" or len(runs[True][0][1]) >= (10 if block_size == 1 else 3)  # the pre-verifier ran
    assert runs[True][2] == runs[False][2] > 4  # lookup proposed in every run
    assert runs[True][1] < runs[False][1]


def test_a_rollback_into_unfed_lookup_tokens_keeps_those_before_it():
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    dw = _counting_worker(draft)
    dw.start_session("s", REPEATS, SamplingParams())
    blk = dw.draft("s", len(REPEATS) - 1, [REPEATS[-1]], 5)
    assert blk.looked_up == 5  # REPEATS repeats: every token looked up, so nothing of the call was fed
    n = len(REPEATS) - 1
    assert len(dw.sessions["s"].tokens) == n and dw.session_length("s") == n + 5 and dw.forwards == 0
    assert dw.rollback("s", n + 2) == n + 2
    assert dw.sessions["s"].pending == [REPEATS[-1]] + blk.tokens[:1]
    assert dw.draft("s", n + 2, [blk.tokens[1]], 3).tokens == blk.tokens[2:5]
    with pytest.raises(Exception, match="beyond"):
        dw.rollback("s", 10_000)


def test_a_cut_stream_of_looked_up_tokens_leaves_them_held():
    """PEARL cuts a draft stream when the verify returns, keeping the blocks it got; the replica may drop the
    cut call before advancing it again (so before `_close`). The session must already hold what the caller
    takes as fed, every streamed token but the last, or the next call's base_position is refused (seen through
    the stack at 4 concurrent requests: "base_position 241 is beyond the 238 tokens this session holds")."""
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    dw = _counting_worker(draft)
    dw.start_session("s", REPEATS, SamplingParams())
    base, append = len(REPEATS) - 1, [REPEATS[-1]]
    stream = dw.draft_blocks("s", base, append, 8, None, 1)
    got = [next(stream).tokens[0] for _ in range(3)]  # three looked-up tokens streamed, no forward yet
    assert dw.forwards == 0
    dw.cancel("s")
    stream.close()  # the cut call is dropped, never advanced again
    held = base + len(append) + len(got) - 1
    assert dw.session_length("s") == held
    blk = dw.draft("s", held, [got[-1]], 2)  # the next round starts where the caller stands
    assert blk.tokens and dw.session_length("s") >= held
