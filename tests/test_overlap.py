"""Adaptive overlap (specdec/scheduling/overlap.py): the choice itself, and PEARL rounds mixed with sequential ones."""
import pytest

from specdec.common.errors import InvalidRequestError
from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.field_rules import validate_request
from specdec.scheduling.overlap import OverlapChoice
from specdec.scheduling.request import GenerationRequest
import specdec.scheduling.schedule
from tests.helpers_models import build_tiny_model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_choice_tries_both_then_keeps_the_faster_and_reexplores():
    c = OverlapChoice(explore_every=4, explore_rounds=1)
    assert c.next_overlapped() is True  # the mode's own schedule first
    c.record(True, 10, 1.0)  # 10 tok/s overlapped
    assert c.next_overlapped() is False  # then a sequential round
    c.record(False, 3, 0.1)  # 30 tok/s sequential
    picks = [c.next_overlapped() for _ in range(8)]  # decisions 3..10: the 4th and 8th explore
    assert picks == [False, True, False, False, False, True, False, False]
    c.record(True, 100, 1.0)  # overlap turned faster (100 tok/s over 2 s in all: 55 tok/s)
    assert c.next_overlapped() is True


def test_sequential_rounds_are_tried_a_few_in_a_row():
    """One sequential round says little (its tokens are the luck of its content): a try runs explore_rounds of
    them before the rates are compared, also when the first one came out slow."""
    c = OverlapChoice(explore_every=5, explore_rounds=3)
    assert c.next_overlapped() is True
    c.record(True, 30, 1.0)  # overlapped: 30 tok/s
    picks = []
    for tokens in (1, 8, 8):  # a first round rejected early (10 tok/s), then two good ones
        picks.append(c.next_overlapped())
        c.record(False, tokens, 0.1)
    assert picks == [False, False, False] and c.rate(False) > c.rate(True)
    assert c.next_overlapped() is True  # the 5th decision re-tries overlap (one stretch)...
    c.record(True, 300, 1.0)  # ...which turned much faster
    assert [c.next_overlapped() for _ in range(5)] == [True, True, True, True, False]  # the 10th: sequential...
    assert [c.next_overlapped() for _ in range(3)] == [False, False, True]  # ...for 3 rounds in a row


class Alternating(OverlapChoice):
    """Deterministic for tests: overlapped and sequential stretches take turns."""

    def next_overlapped(self) -> bool:
        self.decisions += 1
        return self.decisions % 2 == 1


@pytest.fixture
def pair():
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(hidden_size=draft.config.hidden_size, seed=3, block_size=1)
    return target, draft, pv


@pytest.mark.parametrize("mode", ["pearl", "pacer_pearl"])
@pytest.mark.parametrize("gamma", [2, 5])
def test_mixed_rounds_keep_the_greedy_output(pair, monkeypatch, mode, gamma):
    target, draft, pv = pair
    monkeypatch.setattr(specdec.scheduling.schedule, "OverlapChoice", Alternating)
    eng = Engine(target, draft, preverifier=pv)
    ref = eng.generate(GenerationRequest(PROMPT, 40, mode="ar")).token_ids
    out = eng.generate(GenerationRequest(PROMPT, 40, mode=mode, gamma=gamma))
    assert out.token_ids == ref
    assert 0 < out.stats.sequential_rounds < out.stats.rounds  # both kinds ran
    eng.close()


@pytest.mark.parametrize("mode", ["pearl", "pacer_pearl"])
def test_mixed_rounds_keep_the_target_distribution(monkeypatch, mode):
    """T=1: 3-token continuations whose rounds alternate between overlapped and sequential ones are distributed
    exactly as the target's (chi-square against the enumerated distribution)."""
    import os

    from tests.table_lm import TableLM
    from tests.test_exactness import PROMPT as TABLE_PROMPT, V, chi_square_pvalue, exact_continuations, \
        sample_continuations

    monkeypatch.setattr(specdec.scheduling.schedule, "OverlapChoice", Alternating)
    target, draft = TableLM(V, seed=31, scale=1.5), TableLM(V, seed=32, scale=1.5)
    pv = build_random_preverifier(hidden_size=4, seed=3, block_size=1) if mode == "pacer_pearl" else None
    eng = Engine(target, draft, preverifier=pv, inline=True)
    params = SamplingParams(temperature=1.0)
    exact = exact_continuations(target, TABLE_PROMPT, params)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts, stats = sample_continuations(lambda: (eng.draft, eng.target), n, mode=mode, gamma=2)
    eng.close()
    mixed = sum(0 < st.sequential_rounds < st.rounds for st in stats)
    assert mixed > n // 4, mixed  # both kinds ran in many requests
    assert chi_square_pvalue(counts, exact, n) > 0.001


def test_who_adapts(pair):
    target, draft, pv = pair
    eng = Engine(target, draft, preverifier=pv)
    cases = [(dict(), True),  # greedy, defaults: adapts
             (dict(pearl_overlap="always"), False),
             (dict(pearl_first_block=2), False),  # a fixed PRE round is a request for PEARL's schedule
             (dict(params=SamplingParams(temperature=1.0, seed=4)), True)]  # sampled: adapts too
    for kw, adapts in cases:
        st = eng.generate(GenerationRequest(PROMPT, 48, mode="pearl", gamma=4, **kw)).stats
        # adapting tries a sequential round after the first overlapped stretch
        assert (st.sequential_rounds > 0) == adapts, kw
    with pytest.raises(InvalidRequestError, match="pearl_overlap"):
        validate_request(GenerationRequest(PROMPT, 8, mode="pearl", pearl_overlap="sometimes"))
    eng.close()
