"""DraftWorker: hosts the draft model and, through its stop rules, the pre-verifier. Drafting is step-wise so that
concurrent sessions share forwards (draft_service/batcher.py); the step itself is specdec/drafting.py. Torch only."""
from __future__ import annotations

import time
from typing import Iterator

import torch

from specdec.drafting import (FORCED_ACCEPT_PROB, BlockShape, DraftBlock, DraftCall, FeatureNeeds, certain,
                              choose_token, end_of_token, grammar_allows, processes_logits, row_index)
from specdec.errors import InvalidRequestError
from specdec.feature_state import FeatureState
from specdec.lookup import PromptLookup
from specdec.model import CausalLM
from specdec.sampling import SamplingParams
from specdec.stop import FixedLength, StopRule
from specdec.workers.base import Session, TargetFeatures, Worker, feature_size


class DraftWorker(Worker):
    """Hosts the draft model (and, through its stop rules, the pre-verifier).

    Drafting is step-wise so that concurrent sessions share forwards: `begin` checks and truncates, each
    `advance(calls)` runs ONE padded forward for all of them and drafts one token each. A call alone runs the
    exact single-session forward. `draft_blocks` / `draft` are the one-session loops over the same steps."""

    def __init__(self, model: CausalLM, preverifier=None, q_top_k: int = 64, lookup: PromptLookup | None = None,
                 **kw):
        super().__init__(model, **kw)
        self.preverifier = preverifier
        self.q_top_k = q_top_k  # proposal truncation: q is exactly sparse on the wire (still lossless)
        # prompt lookup (specdec/lookup.py): where the context's last n-gram occurred before, draft the token that
        # followed it, with q one-hot; None: every token from the draft model
        self.lookup = lookup
        self.looked_up_tokens = 0  # drafted tokens that prompt lookup proposed, since start (metrics, tests)
        self.grammar_required = False  # without a tokenizer.json it drafts unmasked (specdec/grammar.py)

    # ---- feature drafts (EAGLE-style): inputs are the target's features where known, zeros else (FeatureState) ----
    @property
    def reads_features(self) -> bool:
        return feature_size(self.model) > 0

    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                      features: list[TargetFeatures] | None = None, output_start: int = 0) -> Session:
        s = self.open_session(session_id, prompt_ids, params, output_start=output_start)
        if self.reads_features:
            s.feats = FeatureState(self.kv.max_len, feature_size(self.model), self.model.dtype,
                                   self.model.device)
            for f in features or []:
                s.feats.add(f)
        self._prefill(s, prompt_ids)
        return s

    def _input_features(self, s: Session, base: int, ids: list[int]) -> torch.Tensor | None:
        return s.feats.inputs(base, len(ids)) if s.feats is not None else None

    def _after_feed(self, s: Session, base: int, hidden: torch.Tensor) -> None:
        if s.feats is not None:
            s.feats.fed(base, hidden.shape[0])

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
        if s.feats is not None:
            for f in features or []:
                s.feats.add(f)
            redo = s.feats.first_refeed(base_position)
            if redo < base_position:  # re-fed by the call's first forward, which truncates to `redo` (advance)
                feed = s.tokens[redo:] + feed
                base_position = redo
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
        return getattr(self.model, "vocab_subset", None)

    @staticmethod
    def _hold_unfed(c: DraftCall) -> None:
        """The caller takes every token the call has streamed but the last as fed (and, before the first token,
        its `append` but the last): the session holds the unfed ones as `pending` from the moment they exist, so
        a call cancelled or dropped at any point (a cut PEARL stream the replica never advances again) leaves
        the session holding what its caller assumes. A forward feeds them and clears `pending`."""
        if c.pos == len(c.s.tokens) and c.s.feats is None:
            c.s.pending = c.feed[:-1]

    # ---- the proposal source: tokens proposed with certainty (q one-hot), without the draft's logits -------------
    def _lookup_applies(self, s: Session) -> bool:
        return self.lookup is not None and (s.params.greedy or not self.lookup.greedy_only)

    def _propose_lookup(self, s: Session, context: list[int]) -> int | None:
        """Prompt lookup's proposal after `context`, where lookup applies and the session's grammar allows it."""
        if not self._lookup_applies(s):
            return None
        looked = self.lookup.propose(context)
        return looked[0] if looked is not None and grammar_allows(s, context, looked[0]) else None

    def _forced_token(self, s: Session, context: list[int]) -> int | None:
        """Structured output: the token the session's grammar forces after `context`, if it forces one."""
        if s.grammar is None:
            return None
        forced = s.grammar.forced(context[s.output_start:], 1)
        return forced[0] if forced else None

    def _propose_before_forward(self, c: DraftCall) -> int | None:
        """The call's next token where it is known *before* any forward (a grammar's forced token, else prompt
        lookup's): it needs no draft logits, so its position is fed with the next forward (a run of k such tokens
        costs one multi-row forward, not k). Not for feature drafts, which re-feed positions as target features
        arrive (they look up after the forward, `_propose_after_forward`)."""
        s = c.s
        if s.feats is not None or (s.grammar is None and not self._lookup_applies(s)):
            return None
        if c.needs.features and not all(c.drafted.looked[c.block.start:]):
            return None  # a block mixing model and looked-up tokens is scored at once: its features are needed now
        context = s.tokens + c.feed
        forced = self._forced_token(s, context)
        if forced is not None:
            return forced
        c.looked_ahead = True
        return self._propose_lookup(s, context)

    def _propose_after_forward(self, c: DraftCall) -> int | None:
        """Prompt lookup's proposal after the forward fed the call's position, unless it was asked before."""
        asked, c.looked_ahead = c.looked_ahead, False
        return None if asked else self._propose_lookup(c.s, c.s.tokens)

    def _lookup_accept_prob(self) -> float:
        """A looked-up token's predicted acceptance: lookup's measured precision, or a grammar-forced token's."""
        return self.lookup.accept_prob if self.lookup is not None else FORCED_ACCEPT_PROB

    # ---- the drafting step ------------------------------------------------------------------------------------------
    def _draft_token(self, c: DraftCall, row: torch.Tensor | None, row_hidden: torch.Tensor | None,
                     looked: int | None) -> DraftBlock | None:
        """Draft the token at the call's next position (the steps of specdec/drafting.py); → the block it
        completes, if any. `looked`: a token proposed before the forward, drafted without one (`row` is None);
        else the token comes from `row`, the logits the forward just computed (a feature draft may still look up
        here)."""
        deferred = looked is not None
        if looked is None:
            looked = self._propose_after_forward(c)
        if looked is not None:  # 1. proposed with certainty
            choice = certain(looked, row_index(looked, self._subset) if c.needs.features and not deferred else None)
            self.looked_up_tokens += 1
        else:  # 2.-3. the draft model's: its logits processed as the target's are, then argmax or a sample
            subset = self._subset
            expand = None if subset is None else self.model.expand_logits
            if row.device.type != "cpu" and not (c.s.params.greedy and not processes_logits(c.s)):
                # a GPU draft samples (keyed CPU generators) and processes logits on the host: one copy of its
                # full-vocabulary row per drafted token; a plain greedy step reads the argmax on the device
                choice = choose_token(c, (row if subset is None else expand(row)).cpu(), None, None, self.q_top_k)
            else:
                choice = choose_token(c, row, subset, expand, self.q_top_k)
        c.add(choice, looked is not None, deferred)
        if c.needs.features:  # 4. the pre-verifier's features (a deferred token's come with the next forward)
            c.features.add(c.needs, None if deferred else row, row_hidden, choice)
        return end_of_token(c, self._lookup_accept_prob())  # 5. the stop rule

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
