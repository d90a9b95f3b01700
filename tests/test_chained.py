"""Chained rounds (specdec/scheduling/chained.py) and chained verifies (TargetWorker._chain): several verifies in
flight, each built on the assumption that the ones before it were accepted whole, and the output still the target's own
greedy output, token for token, whatever the proposals, the lag and the window."""
from __future__ import annotations

import asyncio
import random

import pytest

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams
from specdec.engine import LocalDraft
from specdec.scheduling.chained import ChainedRounds
from specdec.scheduling.request import GenerationRequest
from specdec.scheduling.run_state import _Run
from specdec.workers.draft import DraftWorker
from specdec.workers.target import TargetWorker, VerifyArgs
from tests.helpers_models import target_greedy, tiny_pair

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _chained(worker: TargetWorker, sid: str, base: int, assumed: list[int], proposals: list[int]):
    out = worker.verify_batch([VerifyArgs(sid, base, assumed, proposals, None, "greedy", True, False, chained=True)])[0]
    if isinstance(out, Exception):
        raise out
    return out


@pytest.mark.parametrize("seed", range(6))
def test_chained_verifies_commit_the_targets_greedy_tokens_whatever_they_propose(pair, seed):
    """A sender that lags behind (it knows only some of what was committed), assumes its earlier proposals were
    accepted and proposes right and wrong tokens: every call commits the next tokens of the target's greedy output,
    contiguously, and a call that agrees with everything committed and goes further checks its further tokens."""
    target, _ = pair
    n = 40
    want = PROMPT + target_greedy(target, PROMPT, n + 20)
    worker = TargetWorker(target, max_sessions=2, max_context=256)
    worker.start_session("s", PROMPT, SamplingParams())
    rng = random.Random(seed)
    committed = list(PROMPT)
    known = len(PROMPT)  # what the sender has heard of
    proposed_calls = 0
    while len(committed) < len(PROMPT) + n:
        base = rng.randint(max(1, known - 3), known)  # it may know less than it could
        ahead = rng.randint(0, 6)
        # its assumption after `base`: the truth with some tokens wrong, or an older wrong guess
        assumed = [t if rng.random() < 0.8 else (t + 1) % 32 for t in want[base:base + ahead]]
        proposals = [t if rng.random() < 0.7 else (t + 3) % 32 for t in want[base + ahead:base + ahead + 4]]
        out = _chained(worker, "s", base, assumed, proposals)
        assert out.committed_from == len(committed) and out.committed
        committed += out.committed
        assert committed == want[:len(committed)]
        since = want[base:out.committed_from]
        agreed = (assumed + proposals)[:len(since)] == since and len(assumed) + len(proposals) > len(since)
        assert out.proposed == (len(assumed) + len(proposals) - len(since) if agreed else 0)
        proposed_calls += out.proposed > 0
        known = rng.randint(known, len(committed))
    assert proposed_calls > 0


def test_chained_verifies_are_refused_for_sampled_sessions_and_past_the_committed_end(pair):
    target, _ = pair
    worker = TargetWorker(target, max_sessions=2, max_context=256)
    worker.start_session("hot", PROMPT, SamplingParams(temperature=1.0))
    with pytest.raises(InvalidRequestError, match="greedy"):
        _chained(worker, "hot", len(PROMPT), [], [1])
    worker.start_session("cold", PROMPT, SamplingParams())
    with pytest.raises(Exception, match="committed 5 tokens"):
        _chained(worker, "cold", len(PROMPT) + 1, [], [1])


class _LaggingTarget:
    """A TargetBackend taking chained verifies over a link that delays every answer by `delay_s` (in order), over
    a real TargetWorker: what the direct data plane's PeerTarget does across a network."""

    def __init__(self, worker: TargetWorker, delay_s: float, window: int):
        self.worker, self.delay_s, self.chain_window = worker, delay_s, window
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = None
        self.max_in_flight = 0

    async def start(self, sid, prompt_ids, params, want_features=False):
        self.worker.start_session(sid, prompt_ids, params)
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self):
        while True:
            args, fut = await self.queue.get()
            await asyncio.sleep(self.delay_s / 2)  # the request's way there, then the forward, then the way back
            # as the replica does (ROUNDS_WAITING): the newer verifies already waiting
            args.waiting = [(a.base_position, a.feed + a.draft) for a, _ in list(self.queue._queue)]
            out = self.worker.verify_batch([args])[0]
            loop = asyncio.get_running_loop()
            loop.call_later(self.delay_s / 2, lambda f=fut, o=out: f.done() or (
                f.set_exception(o) if isinstance(o, Exception) else f.set_result(o)))

    async def verify_chained(self, sid, base, assumed, proposals):
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((VerifyArgs(sid, base, list(assumed), list(proposals), None, "greedy", True, False,
                                          chained=True), fut))
        self.max_in_flight = max(self.max_in_flight, self.queue.qsize())
        return fut

    async def verify(self, *a, **kw):
        raise AssertionError("chained rounds make chained verifies only")

    async def end(self, sid):
        self.task.cancel()
        self.worker.end_session(sid)


@pytest.mark.parametrize("window,delay_s", [(2, 0.0), (2, 0.004), (4, 0.004), (4, 0.0), (8, 0.01)])
async def test_chained_rounds_give_the_targets_greedy_output(pair, window, delay_s):
    from specdec.scheduling.schedule import generate

    target, draft = pair
    n = 48
    tgt = _LaggingTarget(TargetWorker(target, max_sessions=2, max_context=256), delay_s, window)
    drf = LocalDraft(DraftWorker(draft, max_sessions=2, max_context=256), inline=True)
    req = GenerationRequest(PROMPT, n, mode="pearl")
    res = await generate(req, drf, tgt)
    assert res.token_ids == target_greedy(target, PROMPT, n)
    st = res.stats
    assert st.rounds > 0 and st.draft_tokens > 0
    assert st.accepted_tokens < st.verified_draft_tokens, "some proposals were rejected: the recovery path ran"


@pytest.mark.parametrize("window,delay_s", [(2, 0.0), (4, 0.004), (8, 0.01)])
async def test_a_draft_equal_to_the_target_is_accepted_whole_with_the_verifies_in_flight(pair, window, delay_s):
    """draft == target: every proposal is accepted, none is wasted, and the verifies overlap (more than one in
    flight) instead of waiting for each other."""
    from specdec.scheduling.schedule import generate

    target, _ = pair
    n = 40
    tgt = _LaggingTarget(TargetWorker(target, max_sessions=2, max_context=256), delay_s, window)
    drf = LocalDraft(DraftWorker(target, max_sessions=2, max_context=256), inline=True)
    res = await generate(GenerationRequest(PROMPT, n, mode="pearl"), drf, tgt)
    assert res.token_ids == target_greedy(target, PROMPT, n)
    st = res.stats
    assert st.accepted_tokens == st.verified_draft_tokens == n and st.rounds == n // 4
    if delay_s:
        assert tgt.max_in_flight >= 2


def test_chained_rounds_are_greedy_only():
    """A sampled PEARL request takes PEARL's own rounds even against a chaining target (`generate` picks)."""
    import inspect

    from specdec.scheduling import schedule

    src = inspect.getsource(schedule.generate)
    assert "req.params.greedy" in src and "ChainedRounds" in src
    assert ChainedRounds.__doc__


def test_a_stale_chained_verify_is_skipped_only_for_a_newer_one_that_applies(pair):
    """A chained verify built on what was rejected commits nothing and runs no forward where a newer verify of the
    caller that does apply already waits (a step would delay it and commit a token it may not have guessed); where
    none waits, or only stale ones, it is a target step, so the target does not idle while the caller catches up."""
    target, _ = pair
    want = PROMPT + target_greedy(target, PROMPT, 4)
    worker = TargetWorker(target, max_sessions=2, max_context=256)
    worker.start_session("s", PROMPT, SamplingParams())
    wrong = (want[5] + 1) % 32
    first = worker.verify_batch([VerifyArgs("s", 5, [], [wrong, 1], None, "greedy", True, False, chained=True)])[0]
    assert first.committed == [want[5]] and first.proposed == 2  # rejected at once: the correction
    fresh, stale = (6, [want[6], 7]), (5, [wrong, 1, 2, 3])
    skipped = worker.verify_batch([VerifyArgs("s", 5, [wrong], [1, 2], None, "greedy", True, False, chained=True,
                                              waiting=[stale, fresh])])[0]
    assert skipped.committed == [] and skipped.committed_from == 6 and not skipped.forwarded
    step = worker.verify_batch([VerifyArgs("s", 5, [wrong], [1, 2], None, "greedy", True, False, chained=True,
                                           waiting=[stale])])[0]
    assert step.committed == [want[6]] and step.committed_from == 6 and step.forwarded and step.proposed == 0


async def test_a_per_round_stream_counts_the_requests_that_arrived_while_a_forward_held_the_loop():
    """The target's direct dispatch runs a forward on the event loop's thread; requests arriving meanwhile are handed
    over by gRPC only once the loop turns. The next request's `ROUNDS_WAITING` must hold them, or a stale chained
    verify is stepped although a newer one already waits."""
    import threading
    import time
    from types import SimpleNamespace

    from specdec_rpc.host import ROUNDS_WAITING, SessionHost

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (r := await inbox.get()) is not None:
            yield r

    seen = []

    async def handle(value, context):
        seen.append((value, await ROUNDS_WAITING.get()()))
        if value == 1:  # a forward on the loop's thread while the third request and the stream's end arrive
            sender = threading.Thread(target=lambda: [loop.call_soon_threadsafe(inbox.put_nowait, r)
                                                      for r in (SimpleNamespace(v=3), None)])
            sender.start()
            time.sleep(0.05)
            sender.join()
        return value

    inbox.put_nowait(SimpleNamespace(v=1))
    inbox.put_nowait(SimpleNamespace(v=2))
    host = SimpleNamespace(draining=False)
    answers = [r async for r in SessionHost.rounds(host, requests(), None, handle, "v", lambda r: r)]
    assert answers == [1, 2, 3]
    assert seen == [(1, (2,)), (2, (3,)), (3, ())]


def _looping_history(target, n: int) -> list[int]:
    """PROMPT and the target's greedy continuation, long enough to repeat itself (tiny random models loop)."""
    return PROMPT + target_greedy(target, PROMPT, n)


def test_a_target_step_checks_what_prompt_lookup_finds_and_commits_the_targets_tokens(pair):
    """With a step lookup, a chained verify that turns into a target step proposes the looked-up continuation of
    the committed tokens: where the session repeats itself it commits several tokens in one forward, and every
    committed token is still the target's greedy one."""
    from specdec.decoding.lookup import PromptLookup

    target, _ = pair
    n = 60
    want = _looping_history(target, n + 8)
    worker = TargetWorker(target, max_sessions=2, max_context=256, step_lookup=PromptLookup(min_ngram=2))
    worker.start_session("s", PROMPT, SamplingParams())
    committed, multi = list(PROMPT), 0
    while len(committed) < len(PROMPT) + n:
        wrong = (committed[-1] + 1) % 32  # stale: built on a token the target did not commit
        out = _chained(worker, "s", len(committed) - 1, [wrong], [1, 2])
        assert out.committed_from == len(committed) and out.committed
        committed += out.committed
        assert committed == want[:len(committed)]
        multi += len(out.committed) > 1
        assert out.proposed <= 4
    assert multi > 0, "the greedy continuation repeats itself: some steps commit looked-up tokens"


def test_a_target_step_looks_up_no_further_than_the_context_holds(pair):
    from specdec.decoding.lookup import PromptLookup

    target, _ = pair
    history = [1, 2, 3, 4, 5] * 6  # prompt lookup finds a continuation at every position
    worker = TargetWorker(target, max_sessions=2, max_context=len(history) + 2,
                          step_lookup=PromptLookup(min_ngram=2))
    worker.start_session("s", history, SamplingParams())
    out = _chained(worker, "s", len(history) - 1, [(history[-1] + 1) % 32], [])
    assert out.committed and out.proposed == 2


@pytest.mark.parametrize("window,delay_s", [(4, 0.004), (8, 0.01)])
async def test_chained_rounds_with_target_step_lookup_give_the_targets_greedy_output(pair, window, delay_s):
    from specdec.decoding.lookup import PromptLookup
    from specdec.scheduling.schedule import generate

    target, draft = pair
    n = 64
    tgt = _LaggingTarget(TargetWorker(target, max_sessions=2, max_context=256, step_lookup=PromptLookup(min_ngram=2)),
                         delay_s, window)
    drf = LocalDraft(DraftWorker(draft, max_sessions=2, max_context=256), inline=True)
    res = await generate(GenerationRequest(PROMPT, n, mode="pearl"), drf, tgt)
    assert res.token_ids == target_greedy(target, PROMPT, n)


async def test_after_a_rejection_the_next_verify_carries_a_guess_of_the_step_before_it(pair):
    """A rejection makes the verifies still in flight stale: the target steps on them until it reaches the next
    one, so that one carries the draft's guesses of the steps' tokens ahead of its proposals, instead of arriving
    behind and being stale in turn; and it leaves with the draft's first block, without waiting for a second."""
    from specdec.scheduling.schedule import generate

    target, draft = pair
    sends, rejections = [], []

    class _Recording(_LaggingTarget):
        async def verify_chained(self, sid, base, assumed, proposals):
            sends.append((base, len(assumed), len(proposals)))
            fut = await super().verify_chained(sid, base, assumed, proposals)
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or (
                f.result().num_accepted < f.result().proposed and rejections.append(
                    f.result().committed_from + len(f.result().committed))))
            return fut

    tgt = _Recording(TargetWorker(target, max_sessions=2, max_context=256), 0.01, 4)
    drf = LocalDraft(DraftWorker(draft, max_sessions=2, max_context=256), inline=True)
    res = await generate(GenerationRequest(PROMPT, 48, mode="pearl"), drf, tgt)
    assert res.token_ids == target_greedy(target, PROMPT, 48)
    assert rejections, "the tiny draft is often wrong"
    # the draft's first verify from a rejection's end position guesses the tokens of the steps before it (one per
    # verify then in flight) and goes as soon as the draft's first block is there, the rest of it as proposals
    assert any(a >= 1 and a + n == 4 for end in rejections for b, a, n in sends if b == end), (sends, rejections)
