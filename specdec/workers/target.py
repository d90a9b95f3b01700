"""TargetWorker: hosts the target model and verifies draft blocks, batching sessions into one forward. Torch only."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.common.errors import InvalidRequestError, StalePositionError
from specdec.decoding.lookup import PromptLookup
from specdec.decoding.penalties import adjust_logits, adjusts, live_rows
from specdec.decoding.sampling import SamplingParams, TokenLogprobs, concat_logprobs, logits_to_probs, target_logprobs
from specdec.decoding.verify import SparseDist, verify
from specdec.modeling.attention import SMALL_BLOCK_ROWS
from specdec.state.feature_state import TargetFeatures
from specdec.workers.base import TargetSession, Worker


@dataclass
class VerifyArgs:
    session_id: str
    base_position: int
    feed: list[int]
    draft: list[int]
    q: list[SparseDist] | None = None
    method: str = "greedy"
    feed_draft: bool = True
    sample_bonus: bool = True
    # a verify sent without waiting for the session's earlier ones: feed + draft are what the caller assumes follows
    # its first `base_position` committed tokens; the target reconciles that with what it committed (`_chain`)
    chained: bool = False
    # a chained verify: the caller's newer chained verifies already waiting behind it, as (base_position, feed +
    # draft) each; one that no longer applies is skipped where one of these applies, else a target step (`_chain`)
    waiting: list[tuple[int, list[int]]] = field(default_factory=list)


@dataclass
class VerifyOutcome:
    num_accepted: int
    next_token: int | None  # recovered or bonus token (None: all accepted and no bonus asked)
    forward_ns: int = 0
    verify_ns: int = 0
    forwarded: bool = True  # False when the check used the stored row only (no forward)
    batch_size: int = 1
    # the target's final hidden states at the positions this call committed (fed and kept), for a feature draft;
    # only when the session asked for them
    features: TargetFeatures | None = None
    # the committed tokens' (accepted, then next_token) target logprobs; only when the session asked for them
    logprobs: TokenLogprobs | None = None
    # a chained verify: the tokens it committed (proposals accepted, then next_token), from position `committed_from`
    committed: list[int] | None = None
    committed_from: int = 0
    proposed: int = 0  # a chained verify: how many of its tokens were checked as new proposals (0: a target step)


# a chained verify that turns into a target step proposes up to this many tokens of the session's own prompt
# lookup (TargetWorker.step_lookup): as many as a chained block carries
STEP_LOOKUP_TOKENS = 4

PROMPT_LOGPROBS_CHUNK = 256  # prompt positions per prefill forward with logprobs, where prefill_chunk is 0 (whole)


def _past_committed(committed: list[int], base: int, assumed: list[int]) -> list[int]:
    """The tokens of a chained verify (`assumed` after the first `base` committed tokens) past what is committed,
    where it agrees with everything committed since `base`; else [] (it no longer applies)."""
    since = committed[base:]
    if not 0 <= base <= len(committed) or len(since) >= len(assumed) or assumed[:len(since)] != since:
        return []
    return assumed[len(since):]


class TargetWorker(Worker):
    """Hosts the target model: verifies draft blocks, batching sessions into one forward."""
    rebuild_rows = SMALL_BLOCK_ROWS  # Worker.rebuild_rows: the most rows a verify-sized forward may have (the
    # decode attention's, up to which check_row_invariance checks the linears)
    session_type = TargetSession

    def __init__(self, model, *args, step_lookup: PromptLookup | None = None, **kwargs):
        """`step_lookup`: the prompt lookup a chained verify's target step proposes with (`_chain`); None: a step
        checks no proposals."""
        super().__init__(model, *args, **kwargs)
        self.step_lookup = step_lookup

    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                      want_features: bool = False, output_start: int = 0) -> TargetFeatures | None:
        """Prefill prompt_ids[:-1]; with `want_features`, return their features and every verify's too.
        `output_start`: where the output begins in prompt_ids (a session rebuilt from a request's history; 0: at
        its end), for the penalties that count the output."""
        # prompt logprobs and features need the prefill's rows of every prompt position: nothing is reused for them
        reuse = params.prompt_logprobs < 0 and not want_features
        s = self.open_session(session_id, prompt_ids, params, reuse=reuse, output_start=output_start)
        s.want_features = want_features
        if params.prompt_logprobs >= 0:
            hidden = self._prefill_with_logprobs(s, prompt_ids, params.prompt_logprobs)
        else:
            hidden = self._hidden(self._prefill(s, prompt_ids))
        return TargetFeatures(0, hidden) if want_features else None

    def take_prompt_logprobs(self, session_id: str) -> TokenLogprobs | None:
        """The session's prompt logprobs from its prefill, handed out once."""
        s = self.sessions.get(session_id)
        if s is None:
            return None
        out, s.prompt_logprobs = s.prompt_logprobs, None
        return out

    def _prefill_with_logprobs(self, s: TargetSession, prompt_ids: list[int], top: int) -> torch.Tensor:
        """Prefill (in the same chunks as any prefill, so its K/V is the same) with every row's logits: those give
        the logprobs of prompt_ids[1:] (s.prompt_logprobs). → the hidden states of prompt_ids[:-1]."""
        rows = self._prefill(s, prompt_ids, logits_rows=slice(None), step=PROMPT_LOGPROBS_CHUNK)
        parts, at = [], 0
        for logits, _ in rows:
            parts.append(target_logprobs(logits, prompt_ids[at + 1:at + 1 + logits.shape[0]], at + 1, top))
            at += logits.shape[0]
        # a one-token prompt has no token after its first: no logprobs, and nothing to prefill before its last
        s.prompt_logprobs = concat_logprobs(parts) if parts else TokenLogprobs(1, [], [], [], [])
        return self._hidden(rows)

    def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
               q: list[SparseDist] | None = None, method: str = "greedy", feed_draft: bool = True,
               sample_bonus: bool = True) -> VerifyOutcome:
        out = self.verify_batch([VerifyArgs(session_id, base_position, feed, draft, q, method, feed_draft,
                                            sample_bonus)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def _chain(self, a: VerifyArgs, s: TargetSession) -> VerifyArgs | None:
        """A chained verify as the plain verify it amounts to. Its caller sent it without waiting for its earlier
        verifies, assuming they accepted everything: `feed + draft` are the tokens it expects after its first
        `base_position` committed ones. Compared with what this session committed since (`tokens + unfed`):

        - they agree and go on past it: those further tokens are verified as draft tokens, after the unfed ones;
        - they disagree, or end within it (an earlier verify rejected part of what they build on): one target step
          from the committed tokens instead, so the target never idles while its caller catches up; or, where a
          newer verify of the caller that does apply already waits (`waiting`), nothing: → None, the call is skipped
          (a step would delay it, and commit a token it may not have guessed). With a `step_lookup`,
          the step checks what prompt lookup finds after the committed tokens (up to STEP_LOOKUP_TOKENS, each
          looked up after the ones before): where the session repeats itself a step commits several tokens, and
          otherwise costs a few rows of the same forward.

        Either way the call commits tokens the target chose, exactly as a greedy verify or step would (greedy
        sessions only: for sampled ones, which proposal is verified at a position must not depend on timing)."""
        if not s.params.greedy:
            raise InvalidRequestError("chained", "chained verifies are for greedy sessions (temperature 0); send a "
                                                 "sampled session's verifies one at a time")
        committed = s.tokens + s.unfed
        if not 0 <= a.base_position <= len(committed):
            raise StalePositionError(f"chained verify at position {a.base_position}, but session {a.session_id!r} "
                                     f"has committed {len(committed)} tokens; send a position <= {len(committed)}")
        proposals = _past_committed(committed, a.base_position, a.feed + a.draft)
        step = not proposals
        if step:
            if any(_past_committed(committed, base, tokens) for base, tokens in a.waiting):
                return None
            proposals = self._looked_up(committed)
        return VerifyArgs(a.session_id, len(s.tokens), list(s.unfed), proposals, None, "greedy", True,
                          a.sample_bonus or step, chained=True)

    def _looked_up(self, committed: list[int]) -> list[int]:
        """A target step's proposals: the tokens `step_lookup` finds after `committed`, each after the ones before."""
        found: list[int] = []
        if self.step_lookup is None:
            return found
        context = list(committed)
        most = min(STEP_LOOKUP_TOKENS, self.max_context - len(committed))  # the context's room
        while len(found) < most and (hit := self.step_lookup.propose(context)) is not None:
            found.append(hit[0])
            context.append(hit[0])
        return found

    def _prepare(self, a: VerifyArgs) -> tuple[VerifyArgs | None, TargetSession, list[int]]:
        """→ (the verify to run, its session, the tokens to feed); a skipped chained verify: (None, session, [])."""
        s = self._get(a.session_id)
        if a.chained:
            self._check_tokens("feed", a.feed)
            self._check_tokens("draft_tokens", a.draft)
            a = self._chain(a, s)
            if a is None:
                return None, s, []
        self._check_tokens("feed", a.feed)
        self._check_tokens("draft_tokens", a.draft)
        _check_draft(a, s)
        ids = a.feed + (a.draft if a.feed_draft else [])
        self._check_context(a.base_position + len(ids) + (0 if a.feed_draft else 1), "this verify")
        if a.base_position > len(s.tokens) or a.base_position < 0:
            self._truncate(s, a.base_position)  # raises StalePositionError
        _check_readable(a, s, ids)
        return a, s, ids

    def verify_batch(self, batch: list[VerifyArgs]) -> list[VerifyOutcome | Exception]:
        """Verify many sessions with one padded forward. Results equal those of separate calls."""
        results: list[VerifyOutcome | Exception | None] = [None] * len(batch)
        prepared = []
        for i, a in enumerate(batch):
            try:
                run, s, ids = self._prepare(a)
            except Exception as e:  # noqa: BLE001 - reported per item; the shell maps it to a status
                results[i] = e
                continue
            if run is None:  # a skipped chained verify: it commits nothing
                results[i] = VerifyOutcome(0, None, forwarded=False, committed=[],
                                           committed_from=len(s.tokens) + len(s.unfed))
            else:
                prepared.append((i, run, s, ids))
        t0 = time.perf_counter_ns()
        rows_by_item = self._forward_batch([(a, s, ids) for _, a, s, ids in prepared])
        fwd_ns = time.perf_counter_ns() - t0
        n_fwd = sum(1 for _, _, _, ids in prepared if ids)
        for (i, a, s, ids), (logits, hidden) in zip(prepared, rows_by_item):
            t1 = time.perf_counter_ns()
            try:
                out = self._finish(a, s, logits)
                if s.want_features and hidden is not None:
                    kept = len(a.feed) + (out.num_accepted if a.feed_draft else 0)
                    out.features = TargetFeatures(a.base_position, hidden[:kept])
            except Exception as e:  # noqa: BLE001
                results[i] = e
                continue
            out.forward_ns = fwd_ns if ids else 0
            out.forwarded = bool(ids)
            out.batch_size = n_fwd
            out.verify_ns = time.perf_counter_ns() - t1
            results[i] = out
        return results  # type: ignore[return-value]

    def _forward_batch(self, items) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        todo = [(j, a, s, ids) for j, (a, s, ids) in enumerate(items) if ids]
        out: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * len(items)
        for _, a, s, _ in todo:
            s.cut(a.base_position)  # `_prepare` checked the position
        rows = self._feed_many([(s, a.base_position, ids) for _, a, s, ids in todo]) if todo else []
        for (j, *_), logits_hidden in zip(todo, rows):
            out[j] = logits_hidden
        return out

    def _finish(self, a: VerifyArgs, s: TargetSession, logits: torch.Tensor | None) -> VerifyOutcome:
        rows = self._draft_rows(a, s, logits)
        g = len(a.draft)
        sample_bonus = a.sample_bonus and (a.feed_draft or g == 0)
        p = _target_p(a, s, rows[: g + (1 if sample_bonus else 0)])
        q = None
        if not s.params.greedy and g:
            q = torch.stack([d.to_dense(self.vocab_size) for d in a.q])
        pos0 = a.base_position + len(a.feed)
        res = verify(a.method, a.draft, q, p, s.params, pos0, sample_bonus)
        committed = _commit(a, s, rows, res)
        out = VerifyOutcome(res.num_accepted, res.next_token)
        if a.chained:
            out.committed, out.committed_from, out.proposed = committed, pos0, g
        if s.params.logprobs >= 0 and committed:  # rows[i] decided committed[i]
            out.logprobs = target_logprobs(rows, committed, pos0, s.params.logprobs)
        return out

    def _draft_rows(self, a: VerifyArgs, s: TargetSession, logits: torch.Tensor | None) -> torch.Tensor:
        """The target's rows from the one that predicts draft[0] on: rows[i] predicts the token after
        (feed + draft)[:i]. With nothing fed, the row stored by the call that fed the last token comes first."""
        nf = len(a.feed)
        prev = s.last_row if nf == 0 else None
        parts = ([prev[None]] if prev is not None else []) + ([logits] if logits is not None else [])
        rows = torch.cat(parts) if parts else torch.empty(0, self.vocab_size)
        start = 0 if nf == 0 else nf - 1  # row index that predicts draft[0]
        return rows[start:]


def _check_draft(a: VerifyArgs, s: TargetSession) -> None:
    """InvalidRequestError for a draft block the verify cannot check: more than one token to check without feeding
    it, or a sampled session's draft without one distribution per token."""
    if not a.feed_draft and len(a.draft) > 1:
        raise InvalidRequestError("feed_draft", "a check-only verify takes at most one draft token")
    if not s.params.greedy and a.draft and (a.q is None or len(a.q) != len(a.draft)):
        raise InvalidRequestError("draft_q", f"send one draft distribution per draft token ({len(a.draft)})")


def _check_readable(a: VerifyArgs, s: TargetSession, ids: list[int]) -> None:
    """InvalidRequestError for a verify that asks nothing; StalePositionError for one that feeds nothing where no
    stored row is there to read."""
    if not ids and not a.draft and not a.sample_bonus:
        raise InvalidRequestError("feed", "nothing to verify: send the pending token and/or draft tokens, or "
                                          "ask for the bonus token")
    # Nothing fed: the draft tokens, or the next token alone, are read off the row stored by the call that fed
    # the last token (a post-verify that accepted its whole block without a bonus, then a target-only step).
    if not a.feed and (a.base_position != len(s.tokens) or s.last_row is None):
        raise StalePositionError(f"no stored target row at position {a.base_position}; send the pending token "
                                 f"in feed")


def _target_p(a: VerifyArgs, s: TargetSession, checked: torch.Tensor) -> torch.Tensor:
    """The distribution the output must follow at each checked row: the target's logits with the session's
    penalties and grammar applied, as they are for a greedy session (verification reads each row's argmax), else
    as probabilities."""
    nf, adjusted = len(a.feed), adjusts(s.params)
    if checked.device.type != "cpu" and not (s.params.greedy and not adjusted and s.grammar is None):
        # sampling (keyed CPU generators, the draft's q), penalties and grammars run on the host: one copy of
        # the checked rows per verify. A plain greedy verify reads argmaxes on the device (one sync)
        checked = checked.cpu()
    if adjusted:  # penalties and logit_bias: p is the adjusted target (specdec/decoding/penalties.py)
        checked = adjust_logits(checked, s.tokens[:a.base_position + nf], s.output_start, list(a.draft),
                                s.params)
    if s.grammar is not None:  # structured output: p is the target masked by the grammar (specdec/text/grammar.py)
        checked = s.grammar.mask_rows(checked, s.tokens[s.output_start:a.base_position + nf], a.draft)
    if s.grammar is not None or adjusted:
        checked = live_rows(checked, a.draft, a.base_position + nf - s.output_start)
    # greedy verification reads only each row's argmax: that of the logits is that of logits_to_probs' one-hot
    # (first index among ties in both), without building a [rows, V] tensor per session per step
    return checked if s.params.greedy else logits_to_probs(checked, s.params)


def _commit(a: VerifyArgs, s: TargetSession, rows: torch.Tensor, res) -> list[int]:
    """The session after verify's result `res`: its tokens past the accepted ones dropped (a fed block), the row
    the next check reads stored, and `unfed` set to what is committed but not fed (a check-only verify's accepted
    token, then the next token). → the committed tokens: the accepted ones, then the next token."""
    if a.feed_draft:
        keep = a.base_position + len(a.feed) + res.num_accepted
        del s.tokens[keep:]
        s.last_row = rows[res.num_accepted] if rows.shape[0] > res.num_accepted else None
    else:
        s.last_row = rows[0] if rows.shape[0] else s.last_row
    committed = list(a.draft[:res.num_accepted]) + ([res.next_token] if res.next_token is not None else [])
    s.unfed = (list(a.draft[:res.num_accepted]) if not a.feed_draft else []) + committed[res.num_accepted:]
    return committed
