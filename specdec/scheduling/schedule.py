"""Decoding schedules (`ar`, `sd`, `pacer`, `pearl`, `pacer_pearl`) as async pipelines over two backends.

The same code runs in one process (`specdec.engine`, workers in threads) and across the network (`coordinator/`,
gRPC clients), so the two can be compared like for like. The schedule owns the request's token history, the
source of truth: what a backend holds is always re-derived from it (`base_position` + the tokens it lacks).

PEARL (docs/design/algorithms.md, "PEARL: overlapped drafting"), adapted to services: `PearlRounds`, a state
machine whose phase between two rounds is PRE_VERIFY (no block pending) or POST_VERIFY (a block pending).
- PRE_VERIFY round, pre-verify (`pearl_first_block` = 0): the target forwards the pending token while the draft
  writes the block's first token; that token is then checked against the target's stored row (a check-only
  verify, no forward) while the draft writes the rest.
  Rejected → the draft is cancelled, the recovered token is committed, stay in PRE_VERIFY. Accepted →
  POST_VERIFY, and the rest of the block is post-verified in the same round.
- PRE_VERIFY round, draft first (`pearl_first_block` = k ≥ 1): the draft writes up to k tokens (pacer_pearl:
  PACER decides how many, at most the window) and they are post-verified at once, with the pending token.
- Unset (the default) picks per round: draft first (k = 3; pacer_pearl: PACER) while the session's last verify
  ran alone, pre-verify while it shared a batched forward. Alone, pre-verify spends a whole target forward on one
  token, which pays only where a few draft tokens take about as long as a forward; on a CPU the draft costs
  ~0.05 of the target. Batched, the forward runs for the other sessions anyway (a few more rows cost little) and
  a block drafted on the critical path, behind the draft replica's other sessions, is what delays the session
  (docs/benchmarks.md, "PEARL's first block").
- Post-verify: the target verifies the rest of the current block while the draft already drafts the next block
  from its last token, assuming everything is accepted. All accepted → POST_VERIFY with the next block: its
  first token is checked in the next round against the target's stored row (PEARL uses the "bonus" slot this
  way). A rejection → the speculative block is cancelled and discarded, both sides roll back, PRE_VERIFY.
- Adaptive overlap (`pearl_overlap` = "auto", requests with the default PRE_VERIFY rounds): where no block is
  pending, the next round may instead be one sequential sd/PACER round, whichever kind has committed more
  tokens per second in this request (`specdec/scheduling/overlap.py`); overlap loses where draft and target share cores.
- Chained rounds (`specdec/scheduling/chained.py`): greedy PEARL requests against a target backend that takes chained
  verifies (`chain_window` > 1: the direct data plane's target across a network) keep several verifies in flight
  instead.
"""
from __future__ import annotations

import asyncio
import enum
import time
from typing import AsyncIterator, Callable

from specdec.common.errors import InvalidRequestError
from specdec.decoding.stop import StopSpec
from specdec.scheduling.chained import ChainedRounds
from specdec.scheduling.overlap import OverlapChoice
from specdec.scheduling.request import DEFAULT_POST_THRESHOLD, GenerationRequest, GenerationResult
from specdec.scheduling.run_state import DraftBackend, TargetBackend, _Run
from specdec.workers.drafting import DraftBlock

# pearl: draft tokens a draft-first PRE_VERIFY round waits for before its first verify; pacer_pearl lets PACER choose
# that length instead (up to the window). Used when the request leaves pearl_first_block unset and the session's
# last verify ran alone (batched: PEARL's pre-verify).
DEFAULT_PEARL_FIRST_BLOCK = 3
# PEARL modes against a target that takes chained verifies (`target.chain_window` > 1, the direct data plane across
# a network; specdec/scheduling/chained.py), greedy requests: draft tokens per chained verify
CHAIN_BLOCK = 4


def _drafted(blk: DraftBlock, run: _Run) -> DraftBlock:
    run.stats.draft_busy_s += blk.draft_ns / 1e9
    run.stats.draft_tokens += len(blk.tokens)
    return blk


async def _collect(stream: AsyncIterator[DraftBlock], run: _Run) -> DraftBlock:
    blocks = [b async for b in stream]
    return _drafted(DraftBlock(tokens=[t for b in blocks for t in b.tokens], q=[d for b in blocks for d in b.q],
                               stop_reason=blocks[-1].stop_reason if blocks else "cancelled",
                               draft_ns=sum(b.draft_ns for b in blocks),
                               block_size=blocks[-1].block_size if blocks else 0), run)


async def _all_or_none(starts) -> list:
    """Every start's result; where one fails, the others are cancelled and awaited before the error goes on, so
    that the sessions `generate` ends afterwards are all there is (asyncio.gather would leave a draft start still
    waiting for room, to start its session after its request ended: a replica session left behind)."""
    tasks = [asyncio.ensure_future(s) for s in starts]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def generate(req: GenerationRequest, draft: DraftBackend | None, target: TargetBackend,
                   on_tokens: Callable[[list[int], list | None], bool] | None = None) -> GenerationResult:
    """Run one request to completion. `on_tokens(new, logprobs)` sees tokens as they are committed (logprobs: one
    (logprob, top ids, top logprobs) per token when the request asked, else None); True stops."""
    req.resolve_defaults()  # its fields were checked at the door it came in by (field_rules.validate_request)
    run = _Run(req, on_tokens)
    t0 = time.perf_counter()
    sid = req.session_id
    needs_draft = req.mode != "ar"
    if needs_draft and draft is None:
        raise InvalidRequestError("mode", f"mode {req.mode!r} needs a draft model; use mode 'ar' or add a draft")
    # a feature draft reads the target's prompt features: start the target first, then the draft with them
    feature_draft = needs_draft and draft.reads_features
    starts = _session_starts(req, draft, target, needs_draft, feature_draft)
    try:
        feats = (await _all_or_none(starts))[0]
        if feature_draft:
            await draft.start(sid, req.prompt_ids, req.params, features=[feats] if feats is not None else None)
        if req.mode == "ar":
            await _run_ar(run, target)
        elif req.mode in ("sd", "pacer"):
            await _run_sd(run, draft, target)
        elif target.chain_window > 1 and req.params.greedy:
            await ChainedRounds(run, draft, target, target.chain_window, CHAIN_BLOCK).run_to_end()
        else:
            await PearlRounds(run, draft, target).run_to_end()
    except asyncio.CancelledError:
        run.finish = "cancelled"
        raise
    finally:
        ends = [target.end(sid)] + ([draft.end(sid)] if needs_draft else [])
        await asyncio.shield(asyncio.gather(*ends, return_exceptions=True))
        st = run.stats
        st.wall_s = time.perf_counter() - t0
        st.mean_accepted_length = len(run.generated) / st.target_forwards if st.target_forwards else 0.0
    return GenerationResult(run.generated, run.finish or "length", run.stats,
                            run.logprobs if run.wants_logprobs else None)


def _session_starts(req: GenerationRequest, draft: DraftBackend | None, target: TargetBackend, needs_draft: bool,
                    feature_draft: bool) -> list:
    """The session starts `generate` runs together (not yet awaited): the target's, asking for the prompt's
    features where a feature draft reads them, and the draft's unless it is a feature draft (that one starts
    after the target, with those features)."""
    sid = req.session_id
    starts = [target.start(sid, req.prompt_ids, req.params, want_features=True) if feature_draft
              else target.start(sid, req.prompt_ids, req.params)]
    if needs_draft and not feature_draft:
        starts.append(draft.start(sid, req.prompt_ids, req.params))
    return starts


def _stop_spec(req: GenerationRequest) -> StopSpec:
    if req.mode not in ("pacer", "pacer_pearl"):
        return StopSpec("fixed")
    return StopSpec("pacer", req.pacer_threshold, req.pacer_skip_below if req.mode == "pacer" else None)


def _pacer_block(req: GenerationRequest) -> int:
    """Tokens per pre-verifier check; 0 lets the draft use its pre-verifier's trained B."""
    return min(req.block_size, req.gamma) if req.block_size else 0


def _post_stop_spec(req: GenerationRequest) -> StopSpec:
    """Drafting while a verify runs (PEARL post-verify): the draft's time is hidden, so only a much lower
    pre-verifier score stops it; otherwise the verify's return (a cancel) or the window ends it."""
    if req.mode != "pacer_pearl":
        return StopSpec("fixed")
    th = req.pacer_post_threshold if req.pacer_post_threshold is not None else DEFAULT_POST_THRESHOLD
    return StopSpec("pacer", th)


def _first_block(req: GenerationRequest) -> tuple[int, StopSpec, int]:
    """A PEARL PRE_VERIFY round: (most draft tokens to wait for, stop rule, block size); 0 tokens = PEARL pre-verify."""
    if req.pearl_first_block is None and req.mode == "pacer_pearl":
        return req.gamma, _stop_spec(req), _pacer_block(req)
    k = DEFAULT_PEARL_FIRST_BLOCK if req.pearl_first_block is None else req.pearl_first_block
    k = min(k, req.gamma)
    return k, StopSpec("fixed"), max(k, 1)


async def _no_draft() -> DraftBlock:
    return DraftBlock(tokens=[], q=[], stop_reason="gamma_max")


async def _cut(draft: DraftBackend, sid: str, task: asyncio.Future) -> DraftBlock:
    """Stop a speculative draft stream now (PEARL: the target never waits for the draft) and keep what it wrote."""
    if not task.done():
        await draft.cancel(sid)
    return await task


async def _target_step(run: _Run, target: TargetBackend) -> None:
    """One target-only step: feed what the target lacks, commit the token it samples."""
    base, feed = run.target_args()
    out = await target.verify(run.req.session_id, base, feed, [], None, run.req.method)
    run.on_verify(out, 0)
    run.target_fed = base + len(feed)
    run.commit([out.next_token])


async def _run_ar(run: _Run, target: TargetBackend) -> None:
    while run.finish is None:
        run.stats.rounds += 1
        await _target_step(run, target)


def _target_busy(run: _Run) -> bool:
    """Load-adaptive speculation: the target's last forward batched at least `spec_off_batch` sessions. Then a
    verify's extra rows and the draft's CPU cost the other sessions more than the accepted tokens give back, so
    the round is a plain target step (its one row joins the batch); the draft catches up at the next draft call."""
    return bool(run.req.spec_off_batch) and run.last_batch >= run.req.spec_off_batch


async def _target_only_round(run: _Run, target: TargetBackend) -> None:
    run.stats.rounds += 1
    run.stats.target_only_rounds += 1
    await _target_step(run, target)


async def _run_sd(run: _Run, draft: DraftBackend, target: TargetBackend) -> None:
    req = run.req
    stop = _stop_spec(req)
    block = _pacer_block(req) if stop.kind == "pacer" else req.gamma
    while run.finish is None:
        if _target_busy(run):
            await _target_only_round(run, target)
            continue
        await _sd_round(run, draft, target, req.gamma, stop, block)


async def _sd_round(run: _Run, draft: DraftBackend, target: TargetBackend, gamma: int, stop: StopSpec,
                    block: int) -> None:
    """One sequential round: draft up to `gamma` tokens, then verify them (with the bonus token) and commit."""
    req = run.req
    base_d, append = run.draft_args()
    gamma = min(gamma, req.max_new_tokens - len(run.generated))
    blk = _drafted(await draft.draft(req.session_id, base_d, append, gamma, stop, block, run.take_features()), run)
    run.draft_fed = base_d + len(append) + len(blk.tokens) - 1
    base_t, feed = run.target_args()
    out = await target.verify(req.session_id, base_t, feed, blk.tokens, blk.q, req.method)
    run.stats.rounds += 1
    run.on_verify(out, len(blk.tokens))
    if stop.kind == "pacer":
        run.judge_pacer(blk, out.num_accepted)
    run.target_fed = base_t + len(feed) + out.num_accepted
    run.commit(blk.tokens[:out.num_accepted] + [out.next_token])


class PearlPhase(enum.Enum):
    """Where a PEARL request stands between two rounds: the paper's two strategies, and the end."""
    PRE_VERIFY = "pre-verify"  # no drafted block is pending: the next round opens one
    POST_VERIFY = "post-verify"  # a drafted block is pending: the next round verifies it while the draft writes on
    DONE = "done"  # the request finished


# the transitions a PEARL request may take (staying in PRE_VERIFY is no transition)
PEARL_TRANSITIONS = {
    PearlPhase.PRE_VERIFY: {PearlPhase.POST_VERIFY, PearlPhase.DONE},
    PearlPhase.POST_VERIFY: {PearlPhase.POST_VERIFY, PearlPhase.PRE_VERIFY, PearlPhase.DONE},
    PearlPhase.DONE: set(),
}


class PearlStateError(RuntimeError):
    """A step the PEARL state machine does not allow: a bug in the schedule, or a backend that broke the protocol
    (a bonus token nobody asked for); never the request's fault."""


class PearlRounds:
    """One request's PEARL rounds (module docstring) as a state machine over `PearlPhase`.

    - PRE_VERIFY: no block is pending. A round opens one: it pre-verifies the block's first token (the target
      checks it while the draft writes the rest; `_pre_verify`) or drafts a short block first (`_draft_first`),
      and moves to POST_VERIFY with the block, then post-verifies what of it is still unchecked in the same round.
      A rejected first token, or a draft-first block that came back empty, stays in PRE_VERIFY; so do the rounds
      that run outside PEARL (a target-only round under load, a sequential round the adaptive overlap chose).
    - POST_VERIFY: a block is pending. A round verifies it while the draft writes the next block from the
      block's last token, assuming it is all accepted (`_post_verify`). All accepted and a next block drafted:
      POST_VERIFY with that block. A rejection, or no next block: PRE_VERIFY.
    - DONE: the request finished (EOS, a stop, its length), entered at the end of the round that finished it.

    The phase, the pending block and the adaptive-overlap bookkeeping live in fields; every phase change goes
    through `_enter`, which refuses a transition `PEARL_TRANSITIONS` does not list.
    """

    def __init__(self, run: _Run, draft: DraftBackend, target: TargetBackend):
        req = run.req
        self.run, self.draft, self.target, self.sid = run, draft, target, req.session_id
        # every draft token after a round's first runs while the target works (pre- or post-verify), so the
        # pre-verifier's shadow threshold applies throughout; the first token of a PRE_VERIFY round is the only wait
        self.post_stop = _post_stop_spec(req)
        # fixed rule: stream token by token (a cut keeps everything drafted so far)
        self.post_block = _pacer_block(req) if self.post_stop.kind == "pacer" else 1
        self.first_max, self.first_stop, self.first_bs = _first_block(req)
        # adaptive overlap (specdec/scheduling/overlap.py): requests with PEARL's default PRE_VERIFY rounds
        self.choice = OverlapChoice() if req.pearl_overlap == "auto" and req.pearl_first_block is None else None
        self.episode: tuple[int, float] | None = None  # an overlapped stretch's start: (tokens generated, time)
        self.phase = PearlPhase.PRE_VERIFY
        self.block: DraftBlock | None = None  # POST_VERIFY: the pending block
        self.block_pacer = False  # the pending block's length was PACER's choice (its decisions are judged)
        self.checked = 0  # POST_VERIFY: the pending block's leading tokens already verified and committed

    def _enter(self, phase: PearlPhase) -> None:
        if phase not in PEARL_TRANSITIONS[self.phase]:
            raise PearlStateError(f"PEARL: no transition from {self.phase.value} to {phase.value}")
        self.phase = phase

    def _to_post(self, block: DraftBlock, checked: int, pacer: bool = False) -> None:
        """A block is pending; its first `checked` tokens are verified and committed already; `pacer`: PACER chose
        its length."""
        self._enter(PearlPhase.POST_VERIFY)
        self.block, self.checked, self.block_pacer = block, checked, pacer

    def _to_pre(self) -> None:
        self._enter(PearlPhase.PRE_VERIFY)
        self.block, self.checked = None, 0

    async def run_to_end(self) -> None:
        while self.phase is not PearlPhase.DONE:
            await self.round()

    async def round(self) -> None:
        """One round from the current phase; DONE once the request has finished."""
        st = self.run.stats
        t0, busy, apart = time.perf_counter(), (st.draft_busy_s, st.target_busy_s), \
            st.target_only_rounds + st.sequential_rounds
        if self.phase is PearlPhase.PRE_VERIFY:
            await self._pre_verify_round()
        elif self.phase is PearlPhase.POST_VERIFY:
            st.rounds += 1
            await self._post_verify()
        else:
            raise PearlStateError("PEARL: the request is done; no round follows")
        if st.target_only_rounds + st.sequential_rounds == apart:  # an overlapped round: how long each side idled
            wall = time.perf_counter() - t0
            st.overlap_wall_s += wall
            st.draft_idle_s += max(0.0, wall - (st.draft_busy_s - busy[0]))
            st.target_idle_s += max(0.0, wall - (st.target_busy_s - busy[1]))
        if self.run.finish is not None:
            self._enter(PearlPhase.DONE)

    async def _pre_verify_round(self) -> None:
        run = self.run
        if self.episode is not None:  # the overlapped stretch ended: score it
            self.choice.record(True, len(run.generated) - self.episode[0], time.perf_counter() - self.episode[1])
            self.episode = None
        if _target_busy(run):
            await _target_only_round(run, self.target)
            return
        if self.choice is not None:
            if not self.choice.next_overlapped():
                n0, t0 = len(run.generated), time.perf_counter()
                await _sd_round(run, self.draft, self.target, self.first_max, self.first_stop, self.first_bs)
                run.stats.sequential_rounds += 1
                self.choice.record(False, len(run.generated) - n0, time.perf_counter() - t0)
                return
            self.episode = (len(run.generated), time.perf_counter())
        run.stats.rounds += 1
        draft_first = self.first_max > 0 and (run.req.pearl_first_block is not None or run.last_batch <= 1)
        opened = await (self._draft_first() if draft_first else self._pre_verify())
        if opened and run.finish is None:
            await self._post_verify()

    async def _draft_first(self) -> bool:
        """Draft a short block and wait for it (`pearl_first_block` = k ≥ 1); → whether a block is pending."""
        run, req = self.run, self.run.req
        base_d, append = run.draft_args()
        gamma = min(self.first_max, req.max_new_tokens - len(run.generated))
        blk = _drafted(await self.draft.draft(self.sid, base_d, append, gamma, self.first_stop, self.first_bs,
                                              run.take_features()), run)
        if not blk.tokens:  # nothing drafted (cancelled): an `ar` step
            run.draft_fed = base_d + len(append)
            await _target_step(run, self.target)
            return False
        run.draft_fed = base_d + len(append) + len(blk.tokens) - 1
        self._to_post(blk, 0, self.first_stop.kind == "pacer")
        return True

    async def _pre_verify(self) -> bool:
        """PEARL's pre-verify: the target forwards the pending token(s) while the draft writes its first token, then
        checks that token against the stored row (no second forward) while the draft writes the rest, so the
        draft's first token is off the critical path. → whether a block is pending (its first token accepted)."""
        run, req, sid = self.run, self.run.req, self.sid
        base_d, append = run.draft_args()
        stream = self.draft.draft_stream(sid, base_d, append, min(req.gamma, req.max_new_tokens - len(run.generated)),
                                         self.post_stop, 1, run.take_features()).__aiter__()
        first_task = asyncio.ensure_future(stream.__anext__())
        base_t, feed = run.target_args()
        fwd = None
        if feed:
            fwd = asyncio.ensure_future(self.target.verify(sid, base_t, feed, [], None, req.method,
                                                           feed_draft=True, sample_bonus=False))
        try:
            first = await first_task
        except BaseException:
            if fwd is not None:
                fwd.cancel()
            raise
        rest = asyncio.ensure_future(_collect(stream, run))
        run.stats.draft_tokens += len(first.tokens)
        run.stats.draft_busy_s += first.draft_ns / 1e9
        if fwd is not None:
            run.on_verify(await fwd, 0)
            run.target_fed = base_t + len(feed)
        out = await self.target.verify(sid, run.target_fed, [], first.tokens[:1], first.q[:1], req.method,
                                       feed_draft=False, sample_bonus=False)
        run.on_verify(out, 1)
        if out.num_accepted == 0:
            await self.draft.cancel(sid)
            wasted = await rest
            run.stats.wasted_draft_tokens += len(wasted.tokens) + len(first.tokens) - 1
            run.draft_fed = base_d + len(append)  # the first drafted token was never fed
            run.commit([out.next_token])
            return False
        run.commit(first.tokens[:1])
        tail = await _cut(self.draft, sid, rest)
        block = DraftBlock(tokens=first.tokens + tail.tokens, q=first.q + tail.q, stop_reason=tail.stop_reason,
                           block_size=tail.block_size or first.block_size)
        run.draft_fed = base_d + len(append) + len(block.tokens) - 1
        # the first token is committed: post-verify checks the rest
        self._to_post(block, 1, self.post_stop.kind == "pacer")
        return True

    async def _post_verify(self) -> None:
        """Verify the pending block's unchecked tokens while the draft writes the next block from its last token,
        assuming everything is accepted."""
        if self.phase is not PearlPhase.POST_VERIFY:
            raise PearlStateError(f"PEARL: post-verify needs a pending block; the request is in {self.phase.value}")
        run, req, sid, block = self.run, self.run.req, self.sid, self.block
        to_check, to_check_q = block.tokens[self.checked:], block.q[self.checked:]
        base_t, feed = run.target_args()
        verify_task = asyncio.ensure_future(self.target.verify(sid, base_t, feed, to_check, to_check_q, req.method,
                                                               feed_draft=True, sample_bonus=False))
        spec_base = run.draft_fed
        # what the request has left if `to_check` is accepted whole: no draft past its end (nor past the context)
        room = req.max_new_tokens - len(run.generated) - len(to_check)
        spec = asyncio.ensure_future(
            _collect(self.draft.draft_stream(sid, spec_base, [block.tokens[-1]], min(req.gamma, room), self.post_stop,
                                             self.post_block, run.take_features()), run)
            if room > 0 else _no_draft())
        out = await verify_task
        run.on_verify(out, len(to_check), self.checked)
        if self.block_pacer:
            run.judge_pacer(block, self.checked + out.num_accepted)
        run.target_fed = base_t + len(feed) + out.num_accepted
        if out.num_accepted == len(to_check):
            run.commit(to_check)
            nxt = await _cut(self.draft, sid, spec)
            if out.next_token is not None:
                raise PearlStateError("PEARL: the target sampled a bonus token after a whole block, which post-verify "
                                      "does not ask for (sample_bonus=False)")
            run.draft_fed = spec_base + len(nxt.tokens)  # the block's last token and all but the last of the next
            if not nxt.tokens or run.finish is not None:
                run.stats.wasted_draft_tokens += len(nxt.tokens)
                self._to_pre()
            else:
                self._to_post(nxt, 0, self.post_stop.kind == "pacer")
        else:
            if room > 0:
                await self.draft.cancel(sid)
            wasted = await spec
            run.stats.wasted_draft_tokens += len(wasted.tokens) + len(to_check) - out.num_accepted
            run.commit(to_check[:out.num_accepted] + [out.next_token])
            self._to_pre()
