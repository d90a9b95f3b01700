"""Chained rounds: PEARL with several verifies in flight, for a target across a network (greedy requests).

PEARL (`specdec.scheduling.schedule.PearlRounds`) overlaps drafting with one verify at a time: after each verify its
answer must travel back before the next block is verified, so every round pays the network's round trip on top of the
target's forward. Across machines (the direct data plane, draft_service/speculate.py) that round trip can be as
long as the forward itself. Chained rounds keep the target busy instead:

- The draft drafts on without waiting, assuming every block it sent is accepted whole, and each block of `block`
  tokens is sent as a *chained* verify at once, up to `window` verifies in flight. The target answers them in
  order, each right after the one before: while blocks keep being accepted no round trip is waited for.
- A chained verify carries every token its sender assumes after the last position it knows committed. The target
  compares them with what it committed since (TargetWorker._chain): where they agree and go further, the further
  tokens are verified; where an earlier verify rejected what they build on, the call is one target step instead,
  so the target still commits a token per forward while the draft catches up.
- Each answer says what the target committed. Where that is not what the draft assumed, the draft's speculation
  from there is dropped and it drafts again from the committed tokens; the verifies already on their way turn into
  target steps until its next verify reaches the target (which then skips the rest). That verify carries the
  draft's guesses of those steps' tokens ahead of its proposals, and leaves with the draft's first block.

Every committed token is the target's greedy choice: a verify's accepted tokens equal its argmaxes, a step is an
argmax, so the output equals the target alone (`ar`). Greedy only: for a sampled request which proposal is checked
at a position would depend on timing, which could bias the output; those run PEARL's rounds.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator

from specdec.decoding.stop import StopSpec
from specdec.scheduling.run_state import DraftBackend, _Run
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import VerifyOutcome


class ChainStateError(RuntimeError):
    """The target answered a chained verify with tokens at a position that is not the request's next one: a backend
    that broke the protocol (answers out of order), never the request's fault."""


def _agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChainedRounds:
    """One greedy request's chained rounds (module docstring). `target` has `verify_chained(session_id, base_position,
    assumed, proposals)` → an awaitable of the VerifyOutcome (its `committed`, `committed_from`, `proposed` set),
    sent at once and answered in order."""

    def __init__(self, run: _Run, draft: DraftBackend, target, window: int, block: int):
        self.run, self.draft, self.target, self.sid = run, draft, target, run.req.session_id
        self.window, self.block = max(1, window), max(1, block)
        self.spec: list[int] = []  # drafted tokens assumed to follow the committed history, in order
        # how many of `spec` the verifies still in flight are expected to commit at most: those sent as proposals,
        # and after a dropped speculation one per verify then in flight (each a target step, `_on_answer`)
        self.sent = 0
        self.lead = 0  # of those, the guessed ones the next verify carries ahead of its block (after a rejection)
        self.inflight: deque = deque()  # the verifies' answers (futures), oldest first
        self.stream: AsyncIterator[DraftBlock] | None = None
        self.next_block: asyncio.Future | None = None

    # -- the draft ---------------------------------------------------------------------------------------------
    def _room(self) -> int:
        """Tokens the draft may still write ahead: the window's worth, and no further than the request's end."""
        run = self.run
        left = run.req.max_new_tokens - len(run.generated)
        return max(0, min(self.window * self.block, left) - len(self.spec))

    def _start_stream(self) -> None:
        run = self.run
        room = self._room()
        if room <= 0:
            return
        prefix = run.history + self.spec
        base = min(run.draft_fed, len(prefix) - 1)
        self.stream = self.draft.draft_stream(self.sid, base, prefix[base:], room, StopSpec("fixed"), self.block,
                                              run.take_features()).__aiter__()
        self.next_block = asyncio.ensure_future(self.stream.__anext__())

    async def _stop_stream(self) -> None:
        if self.next_block is None:
            return
        task, stream, self.next_block, self.stream = self.next_block, self.stream, None, None
        if not task.done():
            await self.draft.cancel(self.sid)
        try:
            blk = await task
            st = self.run.stats  # drafted, never sent: the speculation it built on was dropped
            st.draft_tokens += len(blk.tokens)
            st.wasted_draft_tokens += len(blk.tokens)
            st.draft_busy_s += blk.draft_ns / 1e9
        except StopAsyncIteration:
            pass
        await stream.aclose()
        # what the stopped stream drafted beyond `run.draft_fed` is dropped by the draft's next call (its base)

    def _on_block(self, blk: DraftBlock) -> None:
        run = self.run
        run.stats.draft_busy_s += blk.draft_ns / 1e9
        run.stats.draft_tokens += len(blk.tokens)
        self.spec.extend(blk.tokens)
        # the draft has fed everything up to its last drafted token
        run.draft_fed = len(run.history) + len(self.spec) - 1

    # -- the target --------------------------------------------------------------------------------------------
    async def _send(self) -> None:
        """Send what the draft wrote as chained verifies, `block` tokens each, while the window has room."""
        run = self.run
        while len(self.inflight) < self.window:
            ready = len(self.spec) - self.sent
            drafting = self.next_block is not None
            # a verify carrying a guess goes with the rest of the draft's first block: the target waits for it
            if ready <= 0 or (ready < self.block - self.lead and drafting):
                return
            n = min(ready, self.block)
            assumed, proposals = self.spec[:self.sent], self.spec[self.sent:self.sent + n]
            fut = await self.target.verify_chained(self.sid, len(run.history), assumed, proposals)
            self.inflight.append(fut)
            self.sent += n
            self.lead = 0

    def _on_answer(self, out: VerifyOutcome) -> bool:
        """Commit what the target committed; → whether the draft's speculation still holds."""
        run = self.run
        if out.committed_from != len(run.history):
            raise ChainStateError(f"chained verify committed at position {out.committed_from}, the request is at "
                                  f"{len(run.history)}")
        run.stats.rounds += 1
        run.stats.chained_rounds += 1
        run.on_verify(out, out.proposed)
        new = list(out.committed or [])
        agree = _agreement(self.spec, new)
        holds = agree == len(new)
        if holds:
            self.spec = self.spec[len(new):]
            self.sent = max(0, self.sent - len(new))
            self.lead = min(self.lead, self.sent)  # the guessed step came back as guessed, before its verify left
        else:
            run.stats.wasted_draft_tokens += len(self.spec) - agree
            # the draft holds the history, then the spec up to its last drafted token: right up to `agree`
            run.draft_fed = min(run.draft_fed, len(run.history) + agree)
            # The verifies still in flight build on what was just rejected: the target turns each into a target
            # step until the draft's next verify reaches it (then it skips the rest), so it commits tokens while the
            # draft catches up instead of idling for the network. The next verify is checked after those steps, so
            # it carries the draft's guesses of their tokens ahead of its proposals (`_send`): sent without them it
            # would be stale in turn. It guesses one token per verify in flight, the most steps there can be;
            # where the target stepped fewer times, the rest of the guesses are checked as proposals.
            self.spec, self.sent = [], len(self.inflight)
            self.lead = self.sent
        if not self.inflight:
            # nothing in flight covers any of the speculation (a stale verify may have been skipped)
            self.sent = self.lead = 0
        run.commit(new)
        return holds

    async def run_to_end(self) -> None:
        run = self.run
        try:
            self._start_stream()
            while run.finish is None:
                await self._send()
                waits = [w for w in (self.next_block, self.inflight[0] if self.inflight else None) if w is not None]
                if not waits:  # nothing drafting, nothing in flight: draft again from the committed tokens
                    self._start_stream()
                    if self.next_block is None:  # no room: the request's end is in flight
                        raise ChainStateError("chained rounds: nothing to draft and nothing in flight")
                    continue
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if await self._take_answer():
                    continue
                self._take_block()
        finally:
            await self._stop_stream()
            for fut in self.inflight:  # the request ended: answers still on their way are not waited for
                fut.cancel()

    async def _take_answer(self) -> bool:
        """Commit the oldest verify's answer if it has come. Where it drops the draft's speculation, the draft's
        stream is stopped and, unless the request ended, drafting starts again from the committed tokens.
        → whether the speculation was dropped."""
        if not (self.inflight and self.inflight[0].done()):
            return False
        out = self.inflight.popleft().result()
        if self._on_answer(out):
            return False
        await self._stop_stream()
        if self.run.finish is None:
            self._start_stream()
        return True

    def _take_block(self) -> None:
        """Take the draft's next block if it has come and ask for the one after (the stream's end leaves nothing
        drafting); where the stream ran out of room earlier and there is room again, start another."""
        if self.next_block is not None and self.next_block.done():
            try:
                self._on_block(self.next_block.result())
                self.next_block = asyncio.ensure_future(self.stream.__anext__())
            except StopAsyncIteration:
                self.next_block = self.stream = None
        if self.next_block is None and self.run.finish is None and self._room() > 0:
            self._start_stream()  # the stream ran out of room earlier: room again
