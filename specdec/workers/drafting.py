"""The drafting step: how a drafting call proposes its next token, and when it stops. Torch only.

One token, in order (`DraftWorker._draft_token` composes them):
1. proposal source: prompt lookup's token, or the token a grammar forces, proposed with certainty (q one-hot, no
   draft logits needed), else the draft model's logits row at the call's position;
2. logits processing (`process_logits`): the target's penalties and bias, then its grammar mask. Both only make
   the proposal likelier to be accepted; the target's verification is what makes decoding lossless;
3. sampling (`choose_token`): argmax for greedy sessions, else a keyed sample of the tempered distribution
   truncated to its top q_top_k, which is what q says exactly;
4. the pre-verifier's features of the token (`CallFeatures`), where the stop rule reads them: a GPU draft's stay
   on its device until the block ends, then reach the host in one copy (`CallFeatures.block`);
5. the stop rule (`end_of_token`), after each block: gamma_max, the pre-verifier's score (a block prompt lookup
   proposed: lookup's measured precision), the first block's skip, a cancel.

`DraftCall` holds one call's state between steps (specdec/workers/draft.py drives it, one step per forward).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.penalties import adjust_logits, adjusts
from specdec.decoding.sampling import Purpose, keyed_generator, logits_to_probs, sample, truncate_top_k
from specdec.decoding.stop import DraftFeatures, StopRule
from specdec.decoding.verify import SparseDist
from specdec.workers.base import Session

LOGQ_FLOOR = -30.0  # the pre-verifier's log q(x) feature for a token the draft gives no mass (lookup proposals)
FORCED_ACCEPT_PROB = 0.9  # a grammar-forced token's predicted acceptance where prompt lookup (its own figure) is off
MARGIN_CAP = 30.0  # the margin feature's ceiling (head_stats' margin)


@dataclass
class DraftBlock:
    tokens: list[int]  # drafted token ids of this block
    q: list[SparseDist]  # the exact distribution each token was sampled from
    stop_reason: str = ""  # on the final block: gamma_max | preverifier | cancelled
    draft_ns: int = 0  # compute time spent on this block
    final: bool = True  # last block of the call
    score: float | None = None  # pre-verifier's P(block accepted), when one ran
    looked_up: int = 0  # of `tokens`, those prompt lookup proposed
    block_size: int = 0  # tokens per stop-rule decision of the call (PACER's B; its stats judge the decisions)


# ---- one call's state ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureNeeds:
    """Which pre-verifier features the call's stop rule reads; the draft computes only those."""
    features: bool  # any (False: the rule is passed None)
    hidden: bool  # the draft's hidden rows (False: an empty [n, 0] tensor)
    margin: bool  # the top-1 - top-2 margin

    @classmethod
    def of(cls, stop: StopRule) -> FeatureNeeds:
        want = stop.needs_features
        return cls(want, want and stop.needs_hidden, want and stop.needs_margin)


@dataclass
class Drafted:
    """The tokens a call drafted, in order, with the distribution each came from."""
    tokens: list[int] = field(default_factory=list)
    q: list[SparseDist] = field(default_factory=list)
    looked: list[bool] = field(default_factory=list)  # per token: proposed with certainty (lookup, grammar)

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        del self.tokens[:], self.q[:], self.looked[:]


@dataclass
class CallFeatures:
    """The pre-verifier's per-token features of the drafted tokens (a DraftFeatures per block).

    Each value stays where the draft computed it: a CPU draft's are read as they come (floats and host rows), a
    GPU draft's stay on its device as it drafts, so a drafted token costs no host read beyond its own token's.
    `block` brings whatever is still on the device to the host in one copy: the one host synchronisation of the
    features per scored block. The pre-verifier runs on the host (specdec/decoding/preverifier.py)."""
    hidden: list[torch.Tensor | None] = field(default_factory=list)
    logq: list[float | torch.Tensor] = field(default_factory=list)  # a 0-d tensor: on the draft's device
    entropy: list[float | torch.Tensor] = field(default_factory=list)
    margin: list[float | torch.Tensor] = field(default_factory=list)

    def add(self, needs: FeatureNeeds, row: torch.Tensor | None, row_hidden: torch.Tensor | None,
            choice: Choice) -> None:
        """The features of a token just chosen from logits `row` (None: looked up without a forward, its features
        filled in by the next forward: `fill`). At T=0 q is one-hot: confidence from the untempered softmax."""
        if row is None:
            logq, ent = 0.0, 0.0
        elif choice.probs is None:
            logq, ent = confidence(row, choice.row_index)
        else:  # sampled: the confidence of the distribution it was sampled from (on the host: `choose_token`)
            lq = choice.probs.clamp_min(1e-30).log()
            logq, ent = float(lq[choice.token]), float(torch.special.entr(lq.exp()).sum())
        if needs.hidden:
            self.hidden.append(None if row is None else row_hidden.float())
        self.logq.append(logq)
        self.entropy.append(ent)
        if needs.margin:
            self.margin.append(0.0 if row is None else top2_margin(row))

    def fill(self, needs: FeatureNeeds, t: int, row: torch.Tensor, row_hidden: torch.Tensor,
             xr: int | None) -> None:
        """Token t's features, from the forward that fed it (row: the logits that predict it; xr: its index there)."""
        if needs.hidden:
            self.hidden[t] = row_hidden.float()
        self.logq[t], self.entropy[t] = confidence(row, xr)
        if needs.margin:
            self.margin[t] = top2_margin(row)

    def to_host(self) -> None:
        """Every value still on the draft's device, to the host in one device-to-host copy (none on a CPU
        draft): hidden rows as host rows, scalars as floats."""
        cols = (self.hidden, self.logq, self.entropy, self.margin)
        on_dev = [(col, i) for col in cols for i, v in enumerate(col)
                  if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
        if not on_dev:
            return
        flat = torch.cat([col[i].reshape(-1) for col, i in on_dev]).cpu()  # fp32 throughout
        at = 0
        for col, i in on_dev:
            k = col[i].numel()
            col[i] = flat[at:at + k] if col[i].dim() else float(flat[at])
            at += k

    def block(self, drafted: Drafted, block_start: int) -> DraftFeatures:
        """The features of every token drafted so far, as host tensors (`to_host`)."""
        self.to_host()
        n = len(drafted)
        hidden = torch.stack(self.hidden) if self.hidden else torch.empty(n, 0)
        return DraftFeatures(hidden=hidden, tokens=torch.tensor(drafted.tokens), logq=torch.tensor(self.logq),
                             entropy=torch.tensor(self.entropy), block_start=block_start,
                             margin=torch.tensor(self.margin) if self.margin else None)


@dataclass
class BlockShape:
    """How a call splits its tokens into blocks, and where the current block stands."""
    size: int  # tokens per block (the stop rule is asked after each)
    start: int = 0  # index of the current block's first token
    ns: int = 0  # compute time spent on the current block so far


@dataclass
class DraftCall:
    """One session's drafting between batched steps: `DraftWorker.begin`, then `advance` until `done`."""
    s: Session
    epoch: int  # the session's epoch at begin; a change (cancel, end) stops the call
    start: int  # the position at begin: keys the call's samples (specdec/decoding/sampling.py: a new call draws anew)
    gamma_max: int
    stop: StopRule
    needs: FeatureNeeds
    block: BlockShape
    pos: int  # position of feed[0]
    feed: list[int]  # tokens the next forward feeds (the append, then each drafted token)
    drafted: Drafted = field(default_factory=Drafted)
    features: CallFeatures = field(default_factory=CallFeatures)
    deferred: int = 0  # the last `deferred` drafted tokens were looked up without a forward: features pending
    looked_ahead: bool = False  # lookup already found nothing for the next position (no need to ask again)
    done: bool = False

    def add(self, choice: Choice, looked: bool, deferred: bool) -> None:
        """Record the token chosen; `deferred`: looked up without a forward, so the next forward feeds it."""
        self.drafted.tokens.append(choice.token)
        self.drafted.q.append(choice.q)
        self.drafted.looked.append(looked)
        if deferred:  # fed with the next forward, which also gives its features (DraftWorker._fill_deferred)
            self.feed = self.feed + [choice.token]
            self.deferred += 1
        else:
            self.feed = [choice.token]

    def close(self, reason: str, score: float | None) -> DraftBlock:
        """The call's final block: what is left of the current one."""
        self.done = True
        return self._block(reason, score, final=True)

    def emit(self, score: float | None) -> DraftBlock:
        """The current block, complete; the next one starts after it."""
        block = self._block("", score, final=False, ns=0)
        self.block.start = len(self.drafted)
        return block

    def _block(self, reason: str, score: float | None, final: bool, ns: int | None = None) -> DraftBlock:
        b = self.block.start
        return DraftBlock(self.drafted.tokens[b:], self.drafted.q[b:], reason, self.block.ns if ns is None else ns,
                          final=final, score=score, looked_up=sum(self.drafted.looked[b:]),
                          block_size=self.block.size)


# ---- 1. proposal source ------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """The token a step drafts and the exact distribution it was drawn from."""
    token: int
    q: SparseDist
    row_index: int | None = None  # where the token sits in the (compact) logits row, for its confidence feature
    probs: torch.Tensor | None = None  # the dense distribution it was sampled from (None: q is one-hot)


def one_hot(x: int) -> SparseDist:
    return SparseDist(ids=torch.tensor([x]), probs=torch.ones(1))


def certain(x: int, row_index: int | None = None) -> Choice:
    """A token with a one-hot q: one proposed with certainty (prompt lookup, a grammar's forced token; exact at any
    temperature), or a greedy session's argmax."""
    return Choice(x, one_hot(x), row_index)


def grammar_allows(s: Session, context: list[int], x: int) -> bool:
    return s.grammar is None or s.grammar.allows(context[s.output_start:], x)


# ---- 2. logits processing ----------------------------------------------------------------------------------------
def processes_logits(s: Session) -> bool:
    """Whether the session's logits are processed before drafting (penalties, bias, a grammar)."""
    return adjusts(s.params) or s.grammar is not None


def grammar_masked(s: Session, full: torch.Tensor) -> torch.Tensor:
    try:
        return s.grammar.mask_rows(full[None], s.tokens[s.output_start:], [])[0]
    except InvalidRequestError:  # the draft's history left the grammar: propose unmasked, the target decides
        return full


def process_logits(s: Session, full: torch.Tensor) -> torch.Tensor:
    """The full-vocabulary logits row after the target's penalties and bias on this position's history, then its
    grammar mask (specdec/decoding/penalties.py, specdec/text/grammar.py): proposals the target is likelier to accept.
    Where the constraints leave nothing (the target says so when it verifies) the row is drafted from as it is."""
    out = full
    if adjusts(s.params):
        out = adjust_logits(out[None], s.tokens, s.output_start, [], s.params)[0]
    if s.grammar is not None:
        out = grammar_masked(s, out)
    return full if bool(torch.isneginf(out).all()) else out


# ---- 3. sampling -------------------------------------------------------------------------------------------------
def row_index(x: int, subset: torch.Tensor | None) -> int | None:
    """Where token id x sits in a (compact) logits row; None if the compact head lacks it."""
    if subset is None:
        return x
    i = int(torch.searchsorted(subset, x))  # the subset is sorted
    return i if i < subset.numel() and int(subset[i]) == x else None


def choose_token(c: DraftCall, row: torch.Tensor, subset: torch.Tensor | None, expand, q_top_k: int) -> Choice:
    """The token the draft model proposes from its logits `row` (compact where `subset` is set; `expand` maps it
    to the full vocabulary): the argmax for a greedy session, else a sample keyed by the call's position."""
    s = c.s
    if s.params.greedy and not processes_logits(s):  # argmax: logits_to_probs' one-hot
        xr = int(row.argmax())  # the subset is sorted, so ties resolve as on the full row
        return certain(xr if subset is None else int(subset[xr]), xr)
    full = process_logits(s, row if subset is None else expand(row))
    if s.params.greedy:
        x = int(full.argmax())
        return certain(x, row_index(x, subset))
    probs = truncate_top_k(logits_to_probs(full, s.params), q_top_k)
    x = sample(probs, keyed_generator(s.params.seed, c.pos, Purpose.DRAFT, stream=c.start + 1))
    return Choice(x, SparseDist.from_dense(probs), probs=probs)


# ---- 4. features -------------------------------------------------------------------------------------------------
def _read(v: torch.Tensor) -> float | torch.Tensor:
    """A 0-d feature value: a float where it was computed on the host; on a device, the tensor itself (no host
    read per token: `CallFeatures.to_host` reads a block's values together)."""
    return float(v) if v.device.type == "cpu" else v


def confidence(row: torch.Tensor, xr: int | None) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(log q(x), entropy of q) of the untempered softmax of a logits row; xr indexes the row (None: a
    looked-up token the draft's compact head lacks, log q = LOGQ_FLOOR). `advance` feeds a compact-head
    draft's rows compact (its subset's logits, -inf everywhere else in the full row, where q is exactly 0):
    the same two numbers as on the full row at a sixth of the cost (8,192 entries, not 49,152). Floats for a host
    row; a device row's stay on its device (0-d tensors, `_read`)."""
    lq = torch.log_softmax(row.float(), -1)
    ent = _read(torch.special.entr(lq.exp()).sum())
    return (LOGQ_FLOOR if xr is None else _read(lq[xr].clamp_min(LOGQ_FLOOR))), ent


def top2_margin(row: torch.Tensor) -> float | torch.Tensor:
    """Top-1 minus top-2 of the untempered logits row (head_stats' margin), capped; a float for a host row, a
    0-d tensor on a device row's device (`_read`)."""
    top = row.topk(2).values.float()
    return _read((top[0] - top[1]).clamp_max(MARGIN_CAP))


# ---- 5. the stop rule --------------------------------------------------------------------------------------------
def judge_block(c: DraftCall, lookup_accept_prob: float) -> tuple[float | None, bool]:
    """The finished block's score (P(it is all accepted); None: the rule scores nothing) and whether the rule stops
    drafting after it."""
    start, n = c.block.start, len(c.drafted)
    if all(c.drafted.looked[start:]):
        # a block prompt lookup proposed: the pre-verifier scores the draft model's own proposals, and it reads
        # a looked-up token the draft disagrees with as a likely rejection, where such tokens are accepted far
        # more often. Their predicted acceptance is lookup's measured precision (PromptLookup.accept_prob).
        # The pre-verifier does not run: its round scorer scores these tokens with the next block it scores,
        # by which time a forward has given their features (DraftWorker._fill_deferred)
        score = lookup_accept_prob ** (n - start)
        return score, score < c.stop.threshold
    stop_now = c.stop.should_stop(c.features.block(c.drafted, start) if c.needs.features else None)
    return c.stop.last_score, stop_now


def end_of_token(c: DraftCall, lookup_accept_prob: float) -> DraftBlock | None:
    """After a token: the block it completes (the call's last, `final`, when drafting stops), or None while the
    block goes on. `lookup_accept_prob`: a looked-up token's predicted acceptance."""
    s, n, start = c.s, len(c.drafted), c.block.start
    block_done = n - start >= c.block.size
    # greedy sessions only: the score reads the block's drafted tokens, so discarding a sampled block for a low
    # score keeps blocks by their own draws, and the verified ones are no longer q's samples (biased)
    skip_below = c.stop.skip_below if (start == 0 and c.needs.features and s.params.greedy) else 0.0
    if n == c.gamma_max and not skip_below:
        return c.close("gamma_max", None)
    if not block_done and n < c.gamma_max:
        return None if s.epoch == c.epoch else c.close("cancelled", None)
    score, stop_now = judge_block(c, lookup_accept_prob)
    if skip_below and score is not None and score < skip_below:
        c.drafted.clear()  # draft length 0: the target takes a plain one-row step
        return c.close("preverifier", score)
    if n == c.gamma_max:
        return c.close("gamma_max", score)
    if stop_now:
        return c.close("preverifier", score)
    if s.epoch != c.epoch:
        return c.close("cancelled", score)
    return c.emit(score)
