"""Load-adaptive speculation (`spec_off_batch`): while the target batches at least that many sessions, rounds are
plain target steps; speculation resumes when the batch shrinks. Both kinds of round sample from the target, so the
output distribution must stay exactly the target's, and greedy output equals target-only decoding."""
from __future__ import annotations

import asyncio
import os

import pytest

from specdec.common.errors import InvalidRequestError
from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.field_rules import validate_request
from specdec.scheduling.request import GenerationRequest
from specdec.scheduling.schedule import generate
from tests.helpers_models import target_greedy
from tests.table_lm import TableLM
from tests.test_exactness import PROMPT, V, chi_square_pvalue, exact_continuations, sample_continuations


class LoadedTarget:
    """A target backend whose verifies report `pattern[i]` sessions in their forward (as a replica shared with
    other sessions would), cycling; everything else is the wrapped backend's."""

    chain_window = 1

    def __init__(self, inner, pattern):
        self.inner, self.pattern, self.calls = inner, pattern, 0

    async def start(self, *a, **kw):
        return await self.inner.start(*a, **kw)

    async def verify(self, *a, **kw):
        out = await self.inner.verify(*a, **kw)
        out.batch_size = self.pattern[self.calls % len(self.pattern)]
        self.calls += 1
        return out

    async def end(self, *a, **kw):
        return await self.inner.end(*a, **kw)


def run(engine: Engine, req: GenerationRequest, pattern):
    return asyncio.run(generate(req, engine.draft, LoadedTarget(engine.target, pattern)))


@pytest.fixture(scope="module")
def pair():
    return TableLM(V, seed=21, scale=1.5), TableLM(V, seed=22, scale=1.5)


@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl", "pacer_pearl"])
def test_greedy_equals_target_only_while_load_comes_and_goes(pair, mode):
    target, draft = pair
    pv = build_random_preverifier(hidden_size=4, seed=3, block_size=1) if "pacer" in mode else None
    eng = Engine(target, draft, preverifier=pv, inline=True)
    req = GenerationRequest(PROMPT, 40, mode=mode, gamma=3, spec_off_batch=2)
    res = run(eng, req, [1, 1, 3, 3, 3])  # busy for 3 of every 5 verifies
    eng.close()
    assert res.token_ids == target_greedy(target, PROMPT, 40)
    st = res.stats
    assert st.target_only_rounds > 0 and st.draft_tokens > 0, st  # both kinds of round ran
    assert st.target_only_rounds < st.rounds


def test_off_below_threshold_and_always_at_one(pair):
    """spec_off_batch=0 never switches; 1 switches from the first round (a session alone batches 1)."""
    target, draft = pair
    eng = Engine(target, draft, inline=True)
    never = run(eng, GenerationRequest(PROMPT, 16, mode="sd", gamma=3, spec_off_batch=0), [8])
    always = run(eng, GenerationRequest(PROMPT, 16, mode="sd", gamma=3, spec_off_batch=1), [1])
    eng.close()
    assert never.stats.target_only_rounds == 0 and never.stats.draft_tokens > 0
    assert always.stats.draft_tokens == 0 and always.stats.target_only_rounds == always.stats.target_forwards == 16
    assert never.token_ids == always.token_ids == target_greedy(target, PROMPT, 16)


@pytest.mark.parametrize("mode", ["sd", "pearl"])
def test_sampling_stays_exact_when_rounds_switch(pair, mode):
    """T=1: a 3-token continuation whose rounds alternate between speculation and target-only steps is still
    distributed exactly as the target's (chi-square against the enumerated distribution)."""
    target, draft = pair
    exact = exact_continuations(target, PROMPT, SamplingParams(temperature=1.0))
    eng = Engine(target, draft, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts, stats = sample_continuations(lambda: (eng.draft, LoadedTarget(eng.target, [3, 1])),  # every other
                                         n, mode=mode, gamma=2, spec_off_batch=2)  # verify busy
    eng.close()
    assert sum(st.target_only_rounds > 0 for st in stats) > n // 2
    assert chi_square_pvalue(counts, exact, n) > 0.001


class CutBeforeFirstToken:
    """A draft backend whose streams end empty when cut: the cut always lands before their first token, as on a
    loaded draft replica (PEARL's post-verify stream). Unary drafts are the wrapped backend's."""

    def __init__(self, inner):
        self.inner, self.reads_features, self._cut = inner, inner.reads_features, asyncio.Event()

    async def start(self, *a, **kw):
        return await self.inner.start(*a, **kw)

    async def draft(self, *a, **kw):
        return await self.inner.draft(*a, **kw)

    async def draft_stream(self, *a, **kw):
        await self._cut.wait()
        self._cut.clear()
        return
        yield

    async def cancel(self, sid):
        self._cut.set()
        await self.inner.cancel(sid)

    async def end(self, *a, **kw):
        return await self.inner.end(*a, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_target_step_after_a_fully_accepted_post_verify_reads_the_stored_row(pair, temperature):
    """PEARL under load: a post-verify accepts its whole block (no bonus asked), the shadow stream was cut before
    its first token, and the target turns busy, so the next round is a target-only step with nothing to feed.
    The target samples it from its stored row (this failed with INVALID_ARGUMENT "nothing to verify")."""
    target, _ = pair
    eng = Engine(target, target, inline=True)  # draft == target: every block is accepted
    params = SamplingParams(temperature=temperature, seed=5)
    req = GenerationRequest(PROMPT, 12, params=params, mode="pearl", gamma=3, pearl_first_block=2, spec_off_batch=2)
    ref = GenerationRequest(PROMPT, 12, params=params, mode="ar")
    res = asyncio.run(generate(req, CutBeforeFirstToken(eng.draft), LoadedTarget(eng.target, [3, 1])))
    alone = asyncio.run(generate(ref, None, eng.target))
    eng.close()
    st = res.stats
    assert st.target_only_rounds > 0 and st.accepted_tokens > 0, st
    assert st.target_forwards < st.rounds  # the stored row's steps ran no forward
    if temperature == 0:
        assert res.token_ids == alone.token_ids == target_greedy(target, PROMPT, 12)


def test_bad_threshold_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="spec_off_batch"):
        validate_request(GenerationRequest([1, 2], spec_off_batch=-1))
