"""Losslessness, measured: exact target distributions by enumeration vs many seeded speculative runs.

On a vocabulary of 8, the exact distribution of every 3-token continuation is computed from the target; the
empirical distribution of 20,000 seeded runs of `sd` (token and block verification) must pass a chi-square test.
Block verification's expected accepted length on the toy example of docs/design/algorithms.md ("Block
verification") must be exactly 11/9 (token-level: 10/9), by enumeration.
"""
import asyncio
import itertools
import os
from collections import Counter
from fractions import Fraction

import pytest
import torch
from scipy.stats import chisquare

from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.decoding.verify import block_acceptance_weights
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
from specdec.scheduling.schedule import generate
from tests.table_lm import TableLM

V = 8
PROMPT = [1, 5, 2]


def exact_continuations(model: TableLM, prompt, params, n=3):
    """P(x_1..x_n | prompt) for every continuation, by enumeration of the model's exact conditionals."""
    def cond(prefix):
        return logits_to_probs(model.next_logits(tuple(prefix)), params).double()

    dist = {}
    for seq in itertools.product(range(V), repeat=n):
        prob = 1.0
        for i in range(n):
            prob *= float(cond(prompt + list(seq[:i]))[seq[i]])
        dist[seq] = prob
    return dist


def chi_square_pvalue(counts: Counter, exact: dict, n: int) -> float:
    """Pool cells with expected count < 5 into one, then a chi-square goodness-of-fit p-value."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for key, p in exact.items():
        e = p * n
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            rest_o += counts.get(key, 0)
            rest_e += e
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    assert sum(counts.values()) == n and all(len(k) == 3 for k in counts)
    total = sum(exp)
    exp = [e * n / total for e in exp]  # exact probabilities sum to 1 up to float rounding
    return float(chisquare(obs, exp).pvalue)


def sample_continuations(backends, runs: int, **req_kw):
    """T=1 3-token continuations of PROMPT with seeds 0..runs-1, each run on `backends()` → (draft, target).
    → (Counter of continuations, each run's stats)."""
    async def all_runs():
        out = []
        for seed in range(runs):
            req = GenerationRequest(PROMPT, 3, params=SamplingParams(temperature=1.0, seed=seed), **req_kw)
            out.append(await generate(req, *backends()))
        return out

    results = asyncio.run(all_runs())
    return Counter(tuple(r.token_ids) for r in results), [r.stats for r in results]


def run_many(engine, mode, method, params_kw, runs, gamma=3, **req_kw):
    counts = Counter()
    for seed in range(runs):
        req = GenerationRequest(PROMPT, 3, params=SamplingParams(seed=seed, **params_kw), mode=mode,
                                verify_method=method, gamma=gamma, **req_kw)
        counts[tuple(engine.generate(req).token_ids)] += 1
    return counts


@pytest.fixture(scope="module")
def pair():
    return TableLM(V, seed=21, scale=1.5), TableLM(V, seed=22, scale=1.5)


@pytest.mark.parametrize("method", ["token", "block"])
def test_sd_matches_exact_target_distribution(pair, method):
    target, draft = pair
    exact = exact_continuations(target, PROMPT, SamplingParams(temperature=1.0))
    eng = Engine(target, draft, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS", "20000"))
    counts = run_many(eng, "sd", method, dict(temperature=1.0), n)
    eng.close()
    p = chi_square_pvalue(counts, exact, n)
    assert p > 0.001, (method, p)


@pytest.mark.parametrize("mode,method", [("pearl", "block"), ("pearl", "token"), ("sd", "token"),
                                         ("pacer", "block"), ("pearl-pre-verify", "block")])
def test_truncated_sampling_matches_exact(pair, mode, method):
    """The same top-k/top-p transform on p and q: still exactly the target's (truncated) distribution. pearl runs
    its PRE rounds draft-first (the default) and with PEARL's one-token pre-verify."""
    target, draft = pair
    kw = dict(temperature=0.8, top_k=5, top_p=0.95)
    exact = exact_continuations(target, PROMPT, SamplingParams(**kw))
    pv = build_random_preverifier(hidden_size=4, seed=3, block_size=1) if mode == "pacer" else None
    eng = Engine(target, draft, preverifier=pv, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    extra = {"pearl_first_block": 0} if mode == "pearl-pre-verify" else {}
    counts = run_many(eng, mode.split("-")[0], method, kw, n, **extra)
    eng.close()
    assert chi_square_pvalue(counts, exact, n) > 0.001


@pytest.mark.parametrize("method", ["token", "block"])
def test_pacer_skip_below_leaves_sampled_requests_exact(pair, method):
    """pacer_skip_below throws the first block away when the pre-verifier scores it low. The score reads the drafted
    tokens, so for a sampled request that kept blocks by their own draws, and the output was biased (an audit:
    chi-square p 3e-31 on 100,000 runs). It applies to greedy requests alone now, where it still
    skips."""
    target, draft = pair
    pv = build_random_preverifier(hidden_size=4, seed=4, block_size=1, threshold=0.5)
    eng = Engine(target, draft, preverifier=pv, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    kw = dict(gamma=4, block_size=2, pacer_skip_below=0.3)
    counts = run_many(eng, "pacer", method, dict(temperature=1.0), n, **kw)
    greedy = [eng.generate(GenerationRequest(PROMPT, 12, params=SamplingParams(temperature=0.0), mode="pacer",
                                             **dict(kw, pacer_skip_below=skip))) for skip in (None, 0.3)]
    eng.close()
    assert chi_square_pvalue(counts, exact_continuations(target, PROMPT, SamplingParams(temperature=1.0)), n) > 0.001
    assert greedy[0].token_ids == greedy[1].token_ids  # greedy: it still skips blocks (fewer drafted), output alike
    assert greedy[1].stats.draft_tokens < greedy[0].stats.draft_tokens


def test_the_bonus_token_comes_from_the_row_after_the_draft():
    """A fully accepted draft's bonus token is drawn from p[g], the row after it, by both sampled rules."""
    from specdec.decoding.verify import verify_block, verify_token

    eye = torch.eye(V)
    q, p = eye[[2]], eye[[2, 5]]  # draft token 2 (certain), then the target is certain of 5
    for rule in (verify_token, verify_block):
        r = rule([2], q, p, seed=0, pos0=7)
        assert (r.num_accepted, r.next_token) == (1, 5), rule.__name__


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("path", ["bonus", "q_top_k"])
def test_bonus_tokens_and_truncated_proposals_match_exact(pair, method, path):
    """Two paths the other exactness tests never took (a mutation audit changed each and no test
    failed). `bonus`: with gamma 3 and 3 new tokens a round's gamma is cut to the tokens left, so an accepted
    round's bonus was never committed; gamma 1 commits many. `q_top_k`: the draft proposes from its top-k (64 by
    default, more than this vocabulary of 8, so never truncated); with 3, q must be the renormalised top-3 that x
    was drawn from."""
    target, draft = pair
    exact = exact_continuations(target, PROMPT, SamplingParams(temperature=1.0))
    eng = Engine(target, draft, inline=True, q_top_k=3 if path == "q_top_k" else 64)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts, forwards = Counter(), Counter()
    for seed in range(n):
        out = eng.generate(GenerationRequest(PROMPT, 3, params=SamplingParams(temperature=1.0, seed=seed),
                                             mode="sd", verify_method=method, gamma=1 if path == "bonus" else 2))
        counts[tuple(out.token_ids)] += 1
        forwards[out.stats.target_forwards] += 1
    eng.close()
    if path == "bonus":  # 3 tokens in fewer than 3 forwards of one draft token each: bonuses were committed
        assert sum(c for f, c in forwards.items() if f < 3) > n // 10, forwards
    assert chi_square_pvalue(counts, exact, n) > 0.001


def test_chi_square_detects_a_wrong_distribution(pair):
    """Guard against a test that cannot fail: the draft's own samples must be rejected as the target's."""
    target, draft = pair
    exact = exact_continuations(target, PROMPT, SamplingParams(temperature=1.0))
    wrong = exact_continuations(draft, PROMPT, SamplingParams(temperature=1.0))
    wrong = {k: 0.8 * exact[k] + 0.2 * wrong[k] for k in exact}  # only 20% off: the test must still see it
    gen = torch.Generator().manual_seed(0)
    keys = list(wrong)
    draws = torch.multinomial(torch.tensor([wrong[k] for k in keys]), 20_000, replacement=True, generator=gen)
    counts = Counter(keys[i] for i in draws.tolist())
    assert chi_square_pvalue(counts, exact, 20_000) < 1e-6


def _expected_accepted(p_ab, q_ab, gamma, rule):
    """E[accepted] by enumeration over draft blocks for context-independent p, q (exact fractions)."""
    total = Fraction(0)
    for xs in itertools.product(range(2), repeat=gamma):
        qx = Fraction(1)
        for x in xs:
            qx *= q_ab[x]
        if rule == "token":
            run, acc = Fraction(1), Fraction(0)
            for x in xs:
                run *= min(Fraction(1), p_ab[x] / q_ab[x])
                acc += run
        else:
            pt = torch.tensor([float(v) for v in p_ab], dtype=torch.float64).expand(gamma + 1, 2)
            qt = torch.tensor([float(v) for v in q_ab], dtype=torch.float64).expand(gamma, 2)
            _, h = block_acceptance_weights(list(xs), qt, pt)
            acc = Fraction(0)  # P(tau = i) = h_i * prod_{j > i} (1 - h_j)
            for i in range(1, gamma + 1):
                p_tau = Fraction(h[i]).limit_denominator(10_000)
                for j in range(i + 1, gamma + 1):
                    p_tau *= 1 - Fraction(h[j]).limit_denominator(10_000)
                acc += i * p_tau
        total += qx * acc
    return total


def test_block_verification_toy_example_is_11_over_9():
    p = (Fraction(1, 3), Fraction(2, 3))  # target (a, b)
    q = (Fraction(2, 3), Fraction(1, 3))  # draft
    assert _expected_accepted(p, q, 2, "token") == Fraction(10, 9)
    assert _expected_accepted(p, q, 2, "block") == Fraction(11, 9)
