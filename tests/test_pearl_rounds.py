"""PEARL's state machine (`specdec.scheduling.schedule.PearlRounds`) driven round by round against scripted backends: a
target whose greedy token at each position is fixed, and a draft that proposes a scripted token per position and
stops (as its pre-verifier would) where the script says."""
from __future__ import annotations

import asyncio
import random

import pytest

from specdec.scheduling.request import GenerationRequest
from specdec.scheduling.run_state import _Run
from specdec.scheduling.schedule import PEARL_TRANSITIONS, PearlPhase, PearlRounds, PearlStateError, generate
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import VerifyOutcome

PRE, POST, DONE = PearlPhase.PRE_VERIFY, PearlPhase.POST_VERIFY, PearlPhase.DONE
PROMPT = [1, 2, 3]  # positions 0-2; generated tokens start at position 3


def want(pos: int) -> int:
    """The target's token at `pos`."""
    return 100 + pos


class ScriptedTarget:
    chain_window = 1

    def __init__(self, bonus: bool = False):
        self.calls: list[tuple] = []
        self.bonus = bonus  # break the protocol: sample a bonus token even where none is asked

    async def start(self, *a, **k):
        return None

    async def end(self, sid):
        pass

    async def verify(self, sid, base, feed, draft, q, method, feed_draft=True, sample_bonus=True):
        self.calls.append(("verify", base, list(feed), list(draft), feed_draft, sample_bonus))
        await asyncio.sleep(0)  # the target takes a while: a draft stream started beside it runs meanwhile
        pos = base + len(feed)  # the position of draft[0]
        n = 0
        while n < len(draft) and draft[n] == want(pos + n):
            n += 1
        rejected = n < len(draft)
        return VerifyOutcome(n, want(pos + n) if rejected or sample_bonus or self.bonus else None)


class ScriptedDraft:
    """Proposes `guess.get(pos, want(pos))` at each position. Its pre-verifier stops a call before any position in
    `stop_before` once the call has drafted a token. `slow`: each streamed token waits for the target's verify to
    return (so a cut finds none); `empty`: a draft that nobody cuts comes back empty (as when cancelled). `cancel`
    ends the stream in flight at its next token."""
    reads_features = False

    def __init__(self, guess: dict[int, int] | None = None, stop_before: set[int] = frozenset(), slow=False,
                 empty=False):
        self.guess, self.stop_before, self.slow, self.empty = guess or {}, stop_before, slow, empty
        self.calls: list[tuple] = []
        self.epoch = 0

    async def start(self, *a, **k):
        pass

    async def end(self, sid):
        pass

    def _tokens(self, base, append, gamma) -> tuple[list[int], str]:
        out = []
        for pos in range(base + len(append), base + len(append) + gamma):
            if pos in self.stop_before and out:
                return out, "preverifier"
            out.append(self.guess.get(pos, want(pos)))
        return out, "gamma_max"

    async def draft(self, sid, base, append, gamma, stop, block_size, features=None) -> DraftBlock:
        self.calls.append(("draft", base, list(append), gamma))
        if self.empty:
            return DraftBlock(tokens=[], q=[], stop_reason="cancelled")
        tokens, why = self._tokens(base, append, gamma)
        return DraftBlock(tokens=tokens, q=[None] * len(tokens), stop_reason=why)

    def draft_stream(self, sid, base, append, gamma, stop, block_size, features=None):
        self.calls.append(("stream", base, list(append), gamma))
        epoch = self.epoch
        tokens, why = self._tokens(base, append, gamma)

        async def blocks():
            for i, t in enumerate(tokens):
                for _ in range(3 if self.slow else 0):
                    await asyncio.sleep(0)
                if self.epoch != epoch:
                    return
                yield DraftBlock(tokens=[t], q=[None], stop_reason=why if i == len(tokens) - 1 else "")
        return blocks()

    async def cancel(self, sid):
        self.calls.append(("cancel",))
        self.epoch += 1


class Recorded(PearlRounds):
    """Notes every phase it enters."""

    def __init__(self, *a):
        super().__init__(*a)
        self.path: list[PearlPhase] = []

    def _enter(self, phase):
        super()._enter(phase)
        self.path.append(phase)


def machine(draft=None, target=None, max_new=20, **kw) -> Recorded:
    kw = {"gamma": 3, "pearl_first_block": 0, "pearl_overlap": "always", **kw}
    req = GenerationRequest(list(PROMPT), max_new, mode="pearl", **kw)
    return Recorded(_Run(req, None), draft or ScriptedDraft(), target or ScriptedTarget())


def generated(m: PearlRounds) -> list[int]:
    return m.run.generated


def expected(n: int) -> list[int]:
    return [want(p) for p in range(3, 3 + n)]


async def test_accept_all_moves_to_post_verify_and_stays_there():
    m = machine()
    assert m.phase is PRE
    await m.round()  # pre-verify 103 while 104, 105 are drafted; post-verify them while 106-108 are drafted
    assert m.path == [POST, POST] and m.phase is POST
    assert generated(m) == expected(3) and m.block.tokens == expected(6)[3:] and m.checked == 0
    assert m.target.calls == [("verify", 2, [3], [], True, False),  # forward the pending token
                              ("verify", 3, [], [103], False, False),  # check the first token on the stored row
                              ("verify", 3, [103], [104, 105], True, False)]  # post-verify the rest
    await m.round()  # the pending block, verified whole while the next one is drafted
    assert m.path == [POST, POST, POST] and generated(m) == expected(6)
    assert m.run.stats.rounds == 2 and m.run.stats.wasted_draft_tokens == 0


async def test_a_rejection_in_the_pre_verified_token_stays_in_pre_verify():
    draft = ScriptedDraft(guess={3: 7})
    m = machine(draft)
    await m.round()
    assert m.path == [] and m.phase is PRE and m.block is None
    assert generated(m) == expected(1)  # the target's own token replaces the rejected one
    assert ("cancel",) in draft.calls and m.run.stats.wasted_draft_tokens == 2  # the block's other two tokens
    await m.round()  # the next round opens a block again
    assert m.path == [POST, POST] and generated(m) == expected(4)


async def test_a_rejection_in_the_post_verified_block_returns_to_pre_verify():
    m = machine(ScriptedDraft(guess={4: 7}))
    await m.round()  # 103 pre-verified; 7 (for 104) rejected in post-verify
    assert m.path == [POST, PRE] and m.phase is PRE and generated(m) == expected(2)
    assert m.run.stats.wasted_draft_tokens == 2 + 3  # the block's unverified tail, and the speculative next block

    m = machine(ScriptedDraft(guess={7: 7}))
    await m.round()
    await m.round()  # the chained block 106, 7, 108: 106 accepted, 107 recovered
    assert m.path == [POST, POST, PRE] and generated(m) == expected(5)


async def test_a_preverifier_stop_shortens_the_next_block_or_ends_it():
    m = machine(ScriptedDraft(stop_before={7}))
    await m.round()  # the speculative draft stops after 106
    assert m.phase is POST and m.block.tokens == [106]
    await m.round()
    assert m.path == [POST, POST, POST] and generated(m) == expected(4)



async def test_a_next_block_cut_before_its_first_token_returns_to_pre_verify():
    m = machine(ScriptedDraft(slow=True))
    await m.round()  # 103 pre-verified, the rest of its block and the next one cut before any token
    assert m.path == [POST, PRE] and m.phase is PRE and generated(m) == expected(1)
    assert m.target.calls[-1] == ("verify", 3, [103], [], True, False)  # nothing left to check: 103 is fed


async def test_draft_first_opens_a_block_or_falls_back_to_a_target_step():
    m = machine(pearl_first_block=2)
    await m.round()  # 103, 104 drafted first, post-verified at once with the pending token
    assert m.path == [POST, POST] and generated(m) == expected(2)
    assert m.draft.calls[0] == ("draft", 2, [3], 2)

    m = machine(ScriptedDraft(empty=True), pearl_first_block=2)
    await m.round()  # nothing drafted: one target step
    assert m.path == [] and m.phase is PRE and generated(m) == expected(1)


@pytest.mark.parametrize("eos", [103, 104])
async def test_end_of_generation(eos):
    """EOS in the pre-verified token (the round ends before post-verify) or in the post-verified block."""
    m = machine(eos_token_ids=(eos,))
    await m.run_to_end()
    assert m.phase is DONE and m.run.finish == "stop" and generated(m) == expected(eos - 102)
    assert m.path[-1] is DONE and len(m.target.calls) == (2 if eos == 103 else 3)
    with pytest.raises(PearlStateError, match="done"):
        await m.round()


async def test_the_length_limit_ends_it_and_no_draft_runs_past_it():
    m = machine(max_new=4)
    await m.run_to_end()
    assert m.path == [POST, POST, PRE, DONE] and m.run.finish == "length" and generated(m) == expected(4)
    assert max(c[3] for c in m.draft.calls if c[0] == "stream") <= 3
    assert [c for c in m.draft.calls if c[0] == "stream"][-1][3] == 1  # the room left once 103-106 are accepted


async def test_impossible_steps_raise():
    m = machine()
    with pytest.raises(PearlStateError, match="post-verify needs a pending block"):
        await m._post_verify()
    with pytest.raises(PearlStateError, match="from pre-verify to pre-verify"):
        m._to_pre()
    assert PRE not in PEARL_TRANSITIONS[PRE] and not PEARL_TRANSITIONS[DONE]
    m = machine(target=ScriptedTarget(bonus=True))  # a target that samples a bonus nobody asked for
    with pytest.raises(PearlStateError, match="bonus token"):
        await m.round()


@pytest.mark.parametrize("seed", range(12))
async def test_random_scripts_keep_the_target_output(seed):
    """Whatever the draft proposes and wherever it stops, generate returns the target's tokens."""
    rng = random.Random(seed)
    guess = {p: 7 for p in range(3, 60) if rng.random() < 0.3}
    stops = {p for p in range(3, 60) if rng.random() < 0.15}
    kw = rng.choice([dict(pearl_first_block=0), dict(pearl_first_block=2), dict(pearl_first_block=None)])
    req = GenerationRequest(list(PROMPT), 30, mode="pearl", gamma=rng.randint(1, 4) + 1, pearl_overlap="always",
                            **kw)
    res = await generate(req, ScriptedDraft(guess, stops, slow=rng.random() < 0.3), ScriptedTarget())
    assert res.token_ids == expected(30) and res.finish_reason == "length"
