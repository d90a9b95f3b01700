"""DraftWorker: hosts the draft model and, through its stop rules, the pre-verifier. Drafting is step-wise so that
concurrent sessions share forwards (draft_service/batcher.py); the step itself is specdec/workers/drafting.py, and the
sources it drafts from are specdec/workers/proposers/. Torch only."""
from __future__ import annotations

import time
from typing import Iterator

import torch

from specdec.workers.drafting import (FORCED_ACCEPT_PROB, BlockShape, DraftBlock, DraftCall, FeatureNeeds, certain,
                              end_of_token, row_index)
from specdec.common.errors import InvalidRequestError
from specdec.decoding.lookup import PromptLookup
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stop import FixedLength, StopRule
from specdec.modeling.model import CausalLM
from specdec.state.feature_state import TargetFeatures
from specdec.workers.base import DraftSession, Worker, feature_size
from specdec.workers.proposers import CertainProposer, FeatureInputs, ForcedTokens, LookupTokens, ModelTokens


class DraftWorker(Worker):
    """Hosts the draft model (and, through its stop rules, the pre-verifier).

    Drafting is step-wise so that concurrent sessions share forwards: `begin` checks and truncates, each
    `advance(calls)` runs ONE padded forward for all of them and drafts one token each. A call alone runs the
    exact single-session forward. `draft_blocks` / `draft` are the one-session loops over the same steps.

    It composes the proposal sources (specdec/workers/proposers/): `proposers`, asked in order for a token known
    with certainty (a grammar's forced token, prompt lookup's), else `drafter`, the draft model; `features`, a
    feature draft's inputs."""
    session_type = DraftSession

    def __init__(self, model: CausalLM, preverifier=None, q_top_k: int = 64, lookup: PromptLookup | None = None,
                 **kw):
        super().__init__(model, **kw)
        self.preverifier = preverifier
        self.drafter = ModelTokens(model, q_top_k)  # the draft model's token, from its logits row
        # tokens proposed with certainty (q one-hot) from the context alone, asked in order: a grammar's forced
        # token, then prompt lookup's (specdec/decoding/lookup.py; None: no lookup)
        self.proposers: list[CertainProposer] = [ForcedTokens()] + ([LookupTokens(lookup)] if lookup else [])
        # a block of such tokens' predicted acceptance: lookup's measured precision, or a grammar-forced token's
        self.certain_accept_prob = lookup.accept_prob if lookup is not None else FORCED_ACCEPT_PROB
        # a feature draft's (EAGLE-style) inputs: the target's features where known, zeros else; None: a plain draft
        self.features = FeatureInputs(model, self.kv.max_len) if feature_size(model) > 0 else None
        self.looked_up_tokens = 0  # drafted tokens that `proposers` proposed, since start (metrics, tests)
        self.grammar_required = False  # without a tokenizer.json it drafts unmasked (specdec/text/grammar.py)

    @property
    def reads_features(self) -> bool:
        return self.features is not None

    @property
    def lookup(self) -> PromptLookup | None:
        """The prompt lookup it drafts with (a replica's GetInfo reports it); None: none."""
        return next((p.lookup for p in self.proposers if isinstance(p, LookupTokens)), None)

    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                      features: list[TargetFeatures] | None = None, output_start: int = 0) -> DraftSession:
        s = self.open_session(session_id, prompt_ids, params, output_start=output_start)
        if self.features is not None:
            self.features.open(s, features)
        self._prefill(s, prompt_ids)
        return s

    def _input_features(self, s: DraftSession, base: int, ids: list[int]) -> torch.Tensor | None:
        return self.features.inputs(s, base, len(ids)) if s.feats is not None else None

    def _after_feed(self, s: DraftSession, base: int, hidden: torch.Tensor) -> None:
        if s.feats is not None:
            self.features.fed(s, base, hidden)

    def begin(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
              stop: StopRule | None = None, block_size: int = 0,
              features: list[TargetFeatures] | None = None) -> DraftCall:
        """Check and truncate; the first `advance` feeds `append` and drafts the first token. A feature draft
        first stores `features` and re-feeds the cached positions they improve (one forward with `append`)."""
        s = self._get(session_id)
        if not append:
            raise InvalidRequestError("append", "send at least the pending token to draft from")
        if gamma_max < 1:
            raise InvalidRequestError("gamma_max", f"must be >= 1, got {gamma_max}")
        self._check_tokens("append", append)
        self._check_context(base_position + len(append) + gamma_max, "this draft")
        stop = stop or FixedLength()
        # 0: the stop rule's own block size (a pre-verifier's trained B), else one block of gamma_max
        block_size = block_size if block_size > 0 else (stop.block_size or gamma_max)
        self._truncate(s, base_position)  # inside the session's unfed tokens (lookup): keeps those before it
        feed = list(append)
        if s.pending:  # known but unfed positions up to base_position: the first forward feeds them too
            feed, base_position = s.pending + feed, len(s.tokens)
        stop.reset()  # a new round: a stop rule's per-round state starts over
        if s.feats is not None:  # stores `features`; the first forward re-feeds the positions they improve
            feed, base_position = self.features.begin(s, features, feed, base_position)
        c = DraftCall(s, s.epoch, start=base_position, gamma_max=gamma_max, stop=stop, needs=FeatureNeeds.of(stop),
                      block=BlockShape(block_size), pos=base_position, feed=feed)
        self._hold_unfed(c)  # a call cancelled before its first forward leaves what its caller assumes
        return c

    def advance(self, calls: list[DraftCall]) -> list[list[DraftBlock]]:
        """One batched forward: each live call drafts one token. → the blocks each call completed (its last
        block has final=True and sets call.done). A call whose session was cancelled or ended stops unfed."""
        out: list[list[DraftBlock]] = [[] for _ in calls]
        live = []
        for i, c in enumerate(calls):
            if c.done:
                continue
            if c.s.epoch != c.epoch:
                out[i].append(c.close("cancelled", None))
            else:
                live.append(i)
        if not live:
            return out
        fwd = []
        for i in live:
            c = calls[i]
            # a feature draft's re-feed (begin): the session keeps its tokens until this forward re-feeds them, so
            # a call cancelled before it leaves the session holding what its caller assumes
            if len(c.s.tokens) > c.pos:
                self._truncate(c.s, c.pos)
            t1 = time.perf_counter_ns()
            looked = self._propose_before_forward(c)
            if looked is None:
                fwd.append(i)
                continue
            block = self._draft_token(c, None, None, looked)  # a looked-up token needs no forward
            self._hold_unfed(c)
            c.block.ns += time.perf_counter_ns() - t1
            if block is not None:
                block.draft_ns, c.block.ns = c.block.ns, 0
                out[i].append(block)
        if not fwd:
            return out
        t0 = time.perf_counter_ns()
        rows = self._feed_many([(calls[i].s, calls[i].pos, calls[i].feed) for i in fwd],
                               compact=self._subset is not None)
        fwd_ns = time.perf_counter_ns() - t0
        for i, (logits, hidden) in zip(fwd, rows):
            t1 = time.perf_counter_ns()
            c = calls[i]
            c.s.pending.clear()  # fed by this forward, if the feed carried them
            c.pos += len(c.feed)
            if c.deferred:
                self._fill_deferred(c, logits, hidden)
            block = self._draft_token(c, logits[-1], hidden[-1], None)
            c.block.ns += fwd_ns + time.perf_counter_ns() - t1  # each call is charged the shared forward
            if block is not None:
                block.draft_ns, c.block.ns = c.block.ns, 0
                out[i].append(block)
        return out

    @property
    def _subset(self) -> torch.Tensor | None:
        """A compact-head draft's vocabulary subset (its logits rows are compact: `advance`); None for others."""
        return self.drafter.subset

    @staticmethod
    def _hold_unfed(c: DraftCall) -> None:
        """The caller takes every token the call has streamed but the last as fed (and, before the first token,
        its `append` but the last): the session holds the unfed ones as `pending` from the moment they exist, so
        a call cancelled or dropped at any point (a cut PEARL stream the replica never advances again) leaves
        the session holding what its caller assumes. A forward feeds them and clears `pending`."""
        if c.pos == len(c.s.tokens) and c.s.feats is None:
            c.s.pending = c.feed[:-1]

    # ---- the proposal sources: tokens proposed with certainty (q one-hot), else the draft model's -----------------
    def _propose_before_forward(self, c: DraftCall) -> int | None:
        """The call's next token where a certain proposer knows it *before* any forward: it needs no draft logits,
        so its position is fed with the next forward (a run of k such tokens costs one multi-row forward, not k).
        Not for feature drafts, which re-feed positions as target features arrive (they look up after the
        forward, `_propose_after_forward`)."""
        s = c.s
        if s.feats is not None:
            return None
        for p in self.proposers:
            if p.applies(s):
                break
        else:  # none may propose for this session (a loop: cheaper than any() per drafted token)
            return None
        if c.needs.features and not all(c.drafted.looked[c.block.start:]):
            return None  # a block mixing model and looked-up tokens is scored at once: its features are needed now
        context = s.tokens + c.feed
        c.looked_ahead = True  # asked for this position: not again after its forward
        for p in self.proposers:
            if p.applies(s):
                x = p.propose(s, context)
                if x is not None:
                    return x
        return None

    def _propose_after_forward(self, c: DraftCall) -> int | None:
        """A certain proposer's token once the forward fed the call's position (those `also_after_forward`),
        unless they were asked before it."""
        asked, c.looked_ahead = c.looked_ahead, False
        if asked:
            return None
        s = c.s
        for p in self.proposers:
            if p.also_after_forward and p.applies(s):
                x = p.propose(s, s.tokens)
                if x is not None:
                    return x
        return None

    # ---- the drafting step ------------------------------------------------------------------------------------------
    def _draft_token(self, c: DraftCall, row: torch.Tensor | None, row_hidden: torch.Tensor | None,
                     looked: int | None) -> DraftBlock | None:
        """Draft the token at the call's next position (the steps of specdec/workers/drafting.py); → the block it
        completes, if any. `looked`: a certain proposer's token from before the forward, drafted without one (`row`
        is None); else the token comes after the forward that computed `row`, the logits at the call's position: a
        certain proposer's asked there (`_propose_after_forward`), else the draft model's (`drafter`)."""
        deferred = looked is not None
        if looked is None:
            looked = self._propose_after_forward(c)
        if looked is not None:  # 1. proposed with certainty
            choice = certain(looked, row_index(looked, self._subset) if c.needs.features and not deferred else None)
            self.looked_up_tokens += 1
        else:  # 2.-3. the draft model's: its logits processed as the target's are, then argmax or a sample
            choice = self.drafter.choose(c, row)
        c.add(choice, looked is not None, deferred)
        if c.needs.features:  # 4. the pre-verifier's features (a deferred token's come with the next forward)
            c.features.add(c.needs, None if deferred else row, row_hidden, choice)
        return end_of_token(c, self.certain_accept_prob)  # 5. the stop rule

    def _fill_deferred(self, c: DraftCall, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """The pre-verifier features of the looked-up tokens drafted without a forward, from the forward that fed
        them: the feed ends with those tokens, and row r of the forward predicts feed[r + 1]."""
        m, d = len(c.feed), c.deferred
        for j in range(d if c.needs.features else 0):
            r, t = m - d + j - 1, len(c.drafted) - d + j
            c.features.fill(c.needs, t, logits[r], hidden[r], row_index(c.drafted.tokens[t], self._subset))
        c.deferred = 0

    def draft_blocks(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                     stop: StopRule | None = None, block_size: int = 0,
                     features: list[TargetFeatures] | None = None) -> Iterator[DraftBlock]:
        """Truncate, feed `append`, then draft up to `gamma_max` tokens, yielding a block every `block_size`."""
        c = self.begin(session_id, base_position, append, gamma_max, stop, block_size, features)
        while not c.done:
            yield from self.advance([c])[0]

    def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
              stop: StopRule | None = None, block_size: int = 0,
              features: list[TargetFeatures] | None = None) -> DraftBlock:
        blocks = list(self.draft_blocks(session_id, base_position, append, gamma_max, stop, block_size, features))
        return DraftBlock(tokens=[t for b in blocks for t in b.tokens], q=[d for b in blocks for d in b.q],
                          stop_reason=blocks[-1].stop_reason, draft_ns=sum(b.draft_ns for b in blocks),
                          score=blocks[-1].score, looked_up=sum(b.looked_up for b in blocks),
                          block_size=blocks[-1].block_size)
