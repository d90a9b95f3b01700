"""DraftWorker: the draft model and, through its stop rules, the pre-verifier; drafting is step-wise so that
concurrent sessions share forwards (draft_service/batcher.py). Torch only."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specdec.errors import InvalidRequestError
from specdec.feature_state import FeatureState
from specdec.lookup import PromptLookup
from specdec.model import CausalLM
from specdec.penalties import adjust_logits, adjusts
from specdec.sampling import Purpose, SamplingParams, keyed_generator, logits_to_probs, sample, truncate_top_k
from specdec.stop import DraftFeatures, FixedLength, StopRule
from specdec.verify import SparseDist
from specdec.worker_base import Session, TargetFeatures, Worker, feature_size


LOGQ_FLOOR = -30.0  # the pre-verifier's log q(x) feature for a token the draft gives no mass (lookup proposals)
FORCED_ACCEPT_PROB = 0.9  # a grammar-forced token's predicted acceptance where prompt lookup (its own figure) is off


@dataclass
class DraftBlock:
    tokens: list[int]  # drafted token ids of this block
    q: list[SparseDist]  # the exact distribution each token was sampled from
    stop_reason: str = ""  # on the final block: gamma_max | preverifier | cancelled
    draft_ns: int = 0  # compute time spent on this block
    final: bool = True  # last block of the call
    score: float | None = None  # pre-verifier's P(block accepted), when one ran
    looked_up: int = 0  # of `tokens`, those prompt lookup proposed


@dataclass
class DraftCall:
    """One session's drafting between batched steps: `DraftWorker.begin`, then `advance` until `done`."""
    s: Session
    epoch: int  # the session's epoch at begin; a change (cancel, end) stops the call
    gamma_max: int
    stop: StopRule
    block_size: int
    want_features: bool
    want_hidden: bool  # of the features: the draft's hidden rows (a rule with needs_hidden False reads none)
    want_margin: bool  # of the features: the top-1 - top-2 margin (rules with needs_margin)
    pos: int  # position of feed[0]
    feed: list[int]  # tokens the next forward feeds (the append, then each drafted token)
    toks: list[int] = field(default_factory=list)
    qs: list[SparseDist] = field(default_factory=list)
    looked: list[bool] = field(default_factory=list)  # per drafted token: proposed by prompt lookup
    hids: list[torch.Tensor] = field(default_factory=list)
    logq: list[float] = field(default_factory=list)
    ent: list[float] = field(default_factory=list)
    margin: list[float] = field(default_factory=list)
    deferred: int = 0  # the last `deferred` drafted tokens were looked up without a forward: features pending
    looked_ahead: bool = False  # lookup already found nothing for the next position (no need to ask again)
    block_start: int = 0
    block_ns: int = 0
    done: bool = False
    start: int = -1  # `pos` at begin: keys the call's samples (specdec/sampling.py: a new call draws anew)


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
        # look up before the forward, and draft a looked-up token without one (`_lookup`); False: after every
        # forward, as feature drafts do (the same tokens; A/B runs and tests)
        self.lookup_without_forward = True
        self.grammar_required = False  # without a tokenizer.json it drafts unmasked (specdec/grammar.py)
        self.grammar_forced = True  # propose the tokens a grammar forces without a forward (False: A/B runs)

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
        block_size = block_size if block_size > 0 else (getattr(stop, "block_size", 0) or gamma_max)
        self._truncate(s, base_position)  # inside the session's unfed tokens (lookup): keeps those before it
        feed = list(append)
        if s.pending:  # known but unfed positions up to base_position: the first forward feeds them too
            feed, base_position = s.pending + feed, len(s.tokens)
        if hasattr(stop, "reset"):
            stop.reset()  # a new round: a stop rule's per-round state starts over
        if s.feats is not None:
            for f in features or []:
                s.feats.add(f)
            redo = s.feats.first_refeed(base_position)
            if redo < base_position:  # re-fed by the call's first forward, which truncates to `redo` (advance)
                feed = s.tokens[redo:] + feed
                base_position = redo
        # skip the feature work for rules that never read it
        want = getattr(stop, "needs_features", True)
        c = DraftCall(s, s.epoch, gamma_max, stop, block_size, want, want and getattr(stop, "needs_hidden", True),
                      want and getattr(stop, "needs_margin", False), base_position, feed, start=base_position)
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
                out[i].append(self._close(c, "cancelled", None))
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
            looked = self._lookup(c)
            if looked is None:
                fwd.append(i)
                continue
            block = self._draft_token(c, None, None, looked)  # a looked-up token needs no forward
            self._hold_unfed(c)
            c.block_ns += time.perf_counter_ns() - t1
            if block is not None:
                block.draft_ns, c.block_ns = c.block_ns, 0
                out[i].append(block)
        if not fwd:
            return out
        t0 = time.perf_counter_ns()
        rows = self._feed_many([(calls[i].s, calls[i].pos, calls[i].feed) for i in fwd],
                               compact=getattr(self.model, "vocab_subset", None) is not None)
        fwd_ns = time.perf_counter_ns() - t0
        for i, (logits, hidden) in zip(fwd, rows):
            t1 = time.perf_counter_ns()
            c = calls[i]
            c.s.pending.clear()  # fed by this forward, if the feed carried them
            c.pos += len(c.feed)
            if c.deferred:
                self._fill_deferred(c, logits, hidden)
            block = self._draft_token(c, logits[-1], hidden[-1], None)
            c.block_ns += fwd_ns + time.perf_counter_ns() - t1  # each call is charged the shared forward
            if block is not None:
                block.draft_ns, c.block_ns = c.block_ns, 0
                out[i].append(block)
        return out

    @staticmethod
    def _confidence(row: torch.Tensor, xr: int | None) -> tuple[float, float]:
        """(log q(x), entropy of q) of the untempered softmax of a logits row; xr indexes the row (None: a
        looked-up token the draft's compact head lacks, log q = LOGQ_FLOOR). `advance` feeds a compact-head
        draft's rows compact (its subset's logits, -inf everywhere else in the full row, where q is exactly 0):
        the same two numbers as on the full row at a sixth of the cost (8,192 entries, not 49,152)."""
        lq = torch.log_softmax(row.float(), -1)
        ent = float(torch.special.entr(lq.exp()).sum())
        return (LOGQ_FLOOR if xr is None else max(float(lq[xr]), LOGQ_FLOOR)), ent

    @staticmethod
    def _row_index(x: int, subset: torch.Tensor | None) -> int | None:
        """Where token id x sits in a (compact) logits row; None if the compact head lacks it."""
        if subset is None:
            return x
        i = int(torch.searchsorted(subset, x))  # the subset is sorted
        return i if i < subset.numel() and int(subset[i]) == x else None

    @staticmethod
    def _hold_unfed(c: DraftCall) -> None:
        """The caller takes every token the call has streamed but the last as fed (and, before the first token,
        its `append` but the last): the session holds the unfed ones as `pending` from the moment they exist, so
        a call cancelled or dropped at any point (a cut PEARL stream the replica never advances again) leaves
        the session holding what its caller assumes. A forward feeds them and clears `pending`."""
        if c.pos == len(c.s.tokens) and c.s.feats is None:
            c.s.pending = c.feed[:-1]

    def _close(self, c: DraftCall, reason: str, score: float | None) -> DraftBlock:
        c.done = True
        return DraftBlock(c.toks[c.block_start:], c.qs[c.block_start:], reason, c.block_ns, final=True, score=score,
                          looked_up=sum(c.looked[c.block_start:]))

    def _lookup_applies(self, s: Session) -> bool:
        return self.lookup is not None and (s.params.greedy or not self.lookup.greedy_only)

    def _propose_lookup(self, s: Session, context: list[int]) -> tuple[int, int] | None:
        """Prompt lookup's proposal after `context`, unless the session's grammar forbids it there."""
        looked = self.lookup.propose(context)
        if looked is not None and s.grammar is not None and not s.grammar.allows(context[s.output_start:],
                                                                                looked[0]):
            return None
        return looked

    @staticmethod
    def _grammar_masked(s: Session, full: torch.Tensor) -> torch.Tensor:
        try:
            return s.grammar.mask_rows(full[None], s.tokens[s.output_start:], [])[0]
        except InvalidRequestError:  # the draft's history left the grammar: propose unmasked, the target decides
            return full

    def _lookup(self, c: DraftCall) -> tuple[int, int] | None:
        """Prompt lookup's proposal for the call's next position, taken *before* any forward: a looked-up token
        needs no draft logits, so its position is fed with the next forward (a run of k looked-up tokens costs one
        multi-row forward, not k). Not for feature drafts, which re-feed positions as target features arrive
        (they look up after the forward, `_draft_token`)."""
        s = c.s
        if not self.lookup_without_forward or s.feats is not None:
            return None
        forcing = s.grammar is not None and self.grammar_forced
        if not forcing and not self._lookup_applies(s):
            return None
        if c.want_features and not all(c.looked[c.block_start:]):
            return None  # a block mixing model and looked-up tokens is scored at once: its features are needed now
        context = s.tokens + c.feed
        if forcing:  # structured output: the token the grammar forces here, if it forces one
            forced = s.grammar.forced(context[s.output_start:], 1)
            if forced:
                return forced[0], 0
        c.looked_ahead = True
        return self._propose_lookup(s, context) if self._lookup_applies(s) else None

    def _fill_deferred(self, c: DraftCall, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """The pre-verifier features of the looked-up tokens drafted without a forward, from the forward that fed
        them: the feed ends with those tokens, and row r of the forward predicts feed[r + 1]."""
        m, d = len(c.feed), c.deferred
        subset = getattr(self.model, "vocab_subset", None)
        for j in range(d if c.want_features else 0):
            r, t = m - d + j - 1, len(c.toks) - d + j
            if c.want_hidden:
                c.hids[t] = hidden[r].float()
            c.logq[t], c.ent[t] = self._confidence(logits[r], self._row_index(c.toks[t], subset))
            if c.want_margin:
                top = logits[r].topk(2).values.float()
                c.margin[t] = min(float(top[0] - top[1]), 30.0)
        c.deferred = 0

    def _draft_token(self, c: DraftCall, row: torch.Tensor | None, row_hidden: torch.Tensor | None,
                     looked: tuple[int, int] | None) -> DraftBlock | None:
        """Draft the token at the call's next position; → the block it completes, if any. `looked`: prompt
        lookup's proposal, drafted without a forward (`row` is None); else the token comes from `row`, the
        logits the forward just computed (a feature draft may still look up here)."""
        s = c.s
        subset = getattr(self.model, "vocab_subset", None)  # not None: `row` is compact (advance)
        deferred = looked is not None
        if looked is None and not c.looked_ahead and self._lookup_applies(s):
            looked = self._propose_lookup(s, s.tokens)
        c.looked_ahead = False
        probs = None
        if looked is not None:  # proposed with certainty: q is one-hot, exact at any temperature
            x = looked[0]
            xr = self._row_index(x, subset) if c.want_features and not deferred else None
            c.qs.append(SparseDist(ids=torch.tensor([x]), probs=torch.ones(1)))
            self.looked_up_tokens += 1
        elif s.params.greedy and not adjusts(s.params) and s.grammar is None:  # argmax: logits_to_probs' one-hot
            xr = int(row.argmax())  # the subset is sorted, so ties resolve as on the full row
            x = xr if subset is None else int(subset[xr])
            c.qs.append(SparseDist(ids=torch.tensor([x]), probs=torch.ones(1)))
        else:
            full = row if subset is None else self.model.expand_logits(row)
            if adjusts(s.params):  # the target's penalties and bias on this position's history: accepted more often
                full = adjust_logits(full[None], s.tokens, s.output_start, [], s.params)[0]
            if s.grammar is not None:  # the target's grammar mask (specdec/grammar.py): accepted more often
                full = self._grammar_masked(s, full)
            if bool(torch.isneginf(full).all()):  # the constraints leave nothing (the target says so): draft freely
                full = row if subset is None else self.model.expand_logits(row)
            if s.params.greedy:
                x = int(full.argmax())
                xr = self._row_index(x, subset)
                c.qs.append(SparseDist(ids=torch.tensor([x]), probs=torch.ones(1)))
            else:
                probs = truncate_top_k(logits_to_probs(full, s.params), self.q_top_k)
                x = sample(probs, keyed_generator(s.params.seed, c.pos, Purpose.DRAFT, stream=c.start + 1))
                c.qs.append(SparseDist.from_dense(probs))
        c.toks.append(x)
        c.looked.append(looked is not None)
        if deferred:  # fed with the next forward, which also gives its features (_fill_deferred)
            c.feed = c.feed + [x]
            c.deferred += 1
        else:
            c.feed = [x]
        if c.want_features:  # pre-verifier features; at T=0 q is one-hot: confidence from the untempered softmax
            if deferred:
                logq, ent = 0.0, 0.0
            elif probs is None:
                logq, ent = self._confidence(row, xr)
            else:
                lq = probs.clamp_min(1e-30).log()
                logq, ent = float(lq[x]), float(torch.special.entr(lq.exp()).sum())
            if c.want_hidden:
                c.hids.append(None if deferred else row_hidden.float())
            c.logq.append(logq)
            c.ent.append(ent)
            if c.want_margin and deferred:
                c.margin.append(0.0)
            elif c.want_margin:  # top-1 - top-2 of the untempered row (head_stats' margin)
                top = row.topk(2).values.float()
                c.margin.append(min(float(top[0] - top[1]), 30.0))
        n = len(c.toks)
        block_done = n - c.block_start >= c.block_size
        # greedy sessions only: the score reads the block's drafted tokens, so discarding a sampled block for a low
        # score keeps blocks by their own draws, and the verified ones are no longer q's samples (biased: session 28)
        skip_below = getattr(c.stop, "skip_below", 0.0) if (c.block_start == 0 and c.want_features
                                                            and s.params.greedy) else 0.0
        if n == c.gamma_max and not skip_below:
            return self._close(c, "gamma_max", None)
        if not block_done and n < c.gamma_max:
            return None if s.epoch == c.epoch else self._close(c, "cancelled", None)
        if all(c.looked[c.block_start:]):
            # a block prompt lookup proposed: the pre-verifier scores the draft model's own proposals, and it reads
            # a looked-up token the draft disagrees with as a likely rejection, where such tokens are accepted far
            # more often. Their predicted acceptance is lookup's measured precision (PromptLookup.accept_prob).
            # The pre-verifier does not run: its round scorer scores these tokens with the next block it scores,
            # by which time a forward has given their features (_fill_deferred)
            score = getattr(self.lookup, "accept_prob", FORCED_ACCEPT_PROB) ** (n - c.block_start)
            stop_now = score < getattr(c.stop, "threshold", 0.0)
        else:
            hidden = torch.stack(c.hids) if c.hids else torch.empty(n, 0)
            feats = DraftFeatures(hidden=hidden, tokens=torch.tensor(c.toks), logq=torch.tensor(c.logq),
                                  entropy=torch.tensor(c.ent), block_start=c.block_start,
                                  margin=torch.tensor(c.margin) if c.margin else None) if c.want_features else None
            stop_now = c.stop.should_stop(feats)
            score = getattr(c.stop, "last_score", None)
        if skip_below and score is not None and score < skip_below:
            del c.toks[:], c.qs[:], c.looked[:]  # draft length 0: the target takes a plain one-row step
            return self._close(c, "preverifier", score)
        if n == c.gamma_max:
            return self._close(c, "gamma_max", score)
        if stop_now:
            return self._close(c, "preverifier", score)
        if s.epoch != c.epoch:
            return self._close(c, "cancelled", score)
        block = DraftBlock(c.toks[c.block_start:], c.qs[c.block_start:], "", 0, final=False, score=score,
                           looked_up=sum(c.looked[c.block_start:]))
        c.block_start = n
        return block

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
                          score=blocks[-1].score, looked_up=sum(b.looked_up for b in blocks))
