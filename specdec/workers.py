"""Draft and target workers: one model each, per-session KV slots, the absolute-position protocol.

Pure core (torch only); the gRPC servicers and the in-process engine both drive these. A worker is not
thread-safe: its owner runs every call on one thread (only `cancel` may be called from elsewhere).

Protocol (docs/ARCHITECTURE.md): every mutating call names `base_position` — "truncate what you have fed to this
many tokens, then feed these". Truncation is free (the KV cache is written by position), a retry of the same call
replays exactly (keyed randomness), and a `base_position` beyond what the session holds is refused.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specdec.errors import (CapacityError, ContextOverflowError, InvalidRequestError, SessionNotFoundError,
                            StalePositionError)
from specdec.model import CausalLM
from specdec.sampling import (Purpose, SamplingParams, keyed_generator, logits_to_probs, sample, truncate_top_k)
from specdec.stop import DraftFeatures, FixedLength, StopRule
from specdec.verify import SparseDist, verify

PAD_SLACK = 64  # extra KV positions per slot for padded rows of batched forwards


@dataclass
class Session:
    slot: int
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache, in order
    last_row: torch.Tensor | None = None  # logits predicting position len(tokens) (target only)
    last_used: float = field(default_factory=time.monotonic)
    epoch: int = 0  # bumped by cancel(); a draft loop stops when it changes


class _Worker:
    def __init__(self, model: CausalLM, max_sessions: int = 8, max_context: int | None = None,
                 session_ttl_s: float = 600.0):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.max_context = min(max_context or model.config.max_position_embeddings,
                               model.config.max_position_embeddings)
        self.max_sessions = max_sessions
        self.session_ttl_s = session_ttl_s
        self.kv = model.new_kv_slots(max_sessions, self.max_context + PAD_SLACK)
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self.free_slots = list(range(max_sessions - 1, -1, -1))

    # ---- sessions -------------------------------------------------------------------------------------------
    def evict_expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [sid for sid, s in self.sessions.items() if now - s.last_used > self.session_ttl_s]
        for sid in expired:
            self.end_session(sid)
        return expired

    def _get(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise SessionNotFoundError(f"session {session_id!r} is unknown or expired; start a new session")
        s.last_used = time.monotonic()
        self.sessions.move_to_end(session_id)
        return s

    def _check_tokens(self, field_name: str, ids: list[int]) -> None:
        for t in ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequestError(field_name, f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def _check_context(self, length: int, what: str) -> None:
        if length > self.max_context:
            raise ContextOverflowError(f"{what} needs {length} positions but the context holds {self.max_context}; "
                                       f"shorten the prompt or lower max_new_tokens / gamma")

    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not session_id:
            raise InvalidRequestError("session_id", "must be a non-empty string")
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids", "the prompt is empty; send at least one token")
        self._check_tokens("prompt_ids", prompt_ids)
        self._check_context(len(prompt_ids), "the prompt")
        params.validate()
        if session_id in self.sessions:  # idempotent restart: same id → fresh state
            self.end_session(session_id)
        if not self.free_slots:
            self.evict_expired()
        if not self.free_slots:
            raise CapacityError(f"all {self.max_sessions} session slots are busy; retry later, end idle sessions, "
                                f"or raise max_sessions")
        s = Session(slot=self.free_slots.pop(), params=params)
        self.sessions[session_id] = s
        if len(prompt_ids) > 1:
            self._feed(s, 0, prompt_ids[:-1])

    def end_session(self, session_id: str) -> bool:
        s = self.sessions.pop(session_id, None)
        if s is None:
            return False
        s.epoch += 1
        self.free_slots.append(s.slot)
        return True

    def cancel(self, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is not None:
            s.epoch += 1

    def rollback(self, session_id: str, position: int) -> int:
        """Forget everything fed at or after `position`; returns the new length."""
        s = self._get(session_id)
        self._truncate(s, position)
        return len(s.tokens)

    def session_length(self, session_id: str) -> int:
        return len(self._get(session_id).tokens)

    # ---- forward --------------------------------------------------------------------------------------------
    def _truncate(self, s: Session, base: int) -> None:
        if base < 0 or base > len(s.tokens):
            raise StalePositionError(f"base_position {base} is beyond the {len(s.tokens)} tokens this session holds; "
                                     f"resend from position {len(s.tokens)} or earlier")
        if base < len(s.tokens):
            del s.tokens[base:]
            s.last_row = None

    def _feed(self, s: Session, base: int, ids: list[int]):
        """Forward `ids` at positions base.. → (logits [m, V] fp32, hidden [m, D])."""
        dev = self.model.device
        tokens = torch.tensor([ids], device=dev)
        positions = torch.arange(base, base + len(ids), device=dev)[None]
        logits, hidden = self.model(tokens, positions, torch.tensor([s.slot], device=dev), self.kv)
        s.tokens.extend(ids)
        return logits[0], hidden[0]


# ================================================================================================================
@dataclass
class DraftBlock:
    tokens: list[int]  # drafted token ids of this block
    q: list[SparseDist]  # the exact distribution each token was sampled from
    stop_reason: str = ""  # on the final block: gamma_max | preverifier | cancelled
    draft_ns: int = 0  # compute time spent on this block
    final: bool = True  # last block of the call
    score: float | None = None  # pre-verifier's P(block accepted), when one ran


class DraftWorker(_Worker):
    """Hosts the draft model (and, through its stop rules, the pre-verifier)."""

    def __init__(self, model: CausalLM, preverifier=None, q_top_k: int = 64, **kw):
        super().__init__(model, **kw)
        self.preverifier = preverifier
        self.q_top_k = q_top_k  # proposal truncation: q is exactly sparse on the wire (still lossless)

    def draft_blocks(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                     stop: StopRule | None = None, block_size: int = 0) -> Iterator[DraftBlock]:
        """Truncate, feed `append`, then draft up to `gamma_max` tokens, yielding a block every `block_size`."""
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
        want = getattr(stop, "needs_features", True)  # skip the feature work for rules that never read it
        epoch = s.epoch
        t0 = time.perf_counter_ns()
        self._truncate(s, base_position)
        logits, hidden = self._feed(s, base_position, append)
        row, row_hidden = logits[-1], hidden[-1]
        pos = base_position + len(append)
        toks, qs, hids, logq, ent = [], [], [], [], []
        block_start = 0
        for t in range(gamma_max):
            probs = logits_to_probs(row, s.params)
            if s.params.greedy:
                x = int(probs.argmax())
                qs.append(SparseDist(ids=torch.tensor([x]), probs=torch.ones(1)))
            else:
                probs = truncate_top_k(probs, self.q_top_k)
                x = sample(probs, keyed_generator(s.params.seed, pos + t, Purpose.DRAFT))
                qs.append(SparseDist.from_dense(probs))
            toks.append(x)
            if want:  # pre-verifier features: at T=0 q is one-hot, so confidence comes from the untempered softmax
                hids.append(row_hidden.float())
                lq = torch.log_softmax(row.float(), -1) if s.params.greedy else probs.clamp_min(1e-30).log()
                logq.append(float(lq[x]))
                ent.append(float(torch.special.entr(lq.exp()).sum()))
            done = t + 1 == gamma_max
            reason, score = ("gamma_max" if done else ""), None
            if not done and (t + 1 - block_start) == block_size:
                feats = DraftFeatures(hidden=torch.stack(hids), tokens=torch.tensor(toks), logq=torch.tensor(logq),
                                      entropy=torch.tensor(ent), block_start=block_start) if want else None
                if stop.should_stop(feats):
                    done, reason = True, "preverifier"
                score = getattr(stop, "last_score", None)
            if not done and s.epoch != epoch:
                done, reason = True, "cancelled"
            if done or (t + 1 - block_start) == block_size:
                now = time.perf_counter_ns()
                yield DraftBlock(toks[block_start:], qs[block_start:], reason, now - t0, final=done, score=score)
                t0 = time.perf_counter_ns()
                block_start = t + 1
            if done:
                return
            logits, hidden = self._feed(s, pos + t, [x])
            row, row_hidden = logits[-1], hidden[-1]

    def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
              stop: StopRule | None = None, block_size: int = 0) -> DraftBlock:
        blocks = list(self.draft_blocks(session_id, base_position, append, gamma_max, stop, block_size))
        return DraftBlock(tokens=[t for b in blocks for t in b.tokens], q=[d for b in blocks for d in b.q],
                          stop_reason=blocks[-1].stop_reason, draft_ns=sum(b.draft_ns for b in blocks),
                          score=blocks[-1].score)


# ================================================================================================================
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


@dataclass
class VerifyOutcome:
    num_accepted: int
    next_token: int | None  # recovered or bonus token (None: all accepted and no bonus asked)
    forward_ns: int = 0
    verify_ns: int = 0
    forwarded: bool = True  # False when the check used the stored row only (no forward)
    batch_size: int = 1


class TargetWorker(_Worker):
    """Hosts the target model: verifies draft blocks, batching sessions into one forward."""

    def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
               q: list[SparseDist] | None = None, method: str = "greedy", feed_draft: bool = True,
               sample_bonus: bool = True) -> VerifyOutcome:
        out = self.verify_batch([VerifyArgs(session_id, base_position, feed, draft, q, method, feed_draft,
                                            sample_bonus)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def _prepare(self, a: VerifyArgs) -> tuple[Session, list[int]]:
        s = self._get(a.session_id)
        self._check_tokens("feed", a.feed)
        self._check_tokens("draft_tokens", a.draft)
        if not a.feed_draft and len(a.draft) > 1:
            raise InvalidRequestError("feed_draft", "a check-only verify takes at most one draft token")
        if not s.params.greedy and a.draft and (a.q is None or len(a.q) != len(a.draft)):
            raise InvalidRequestError("draft_q", f"send one draft distribution per draft token ({len(a.draft)})")
        ids = a.feed + (a.draft if a.feed_draft else [])
        self._check_context(a.base_position + len(ids) + (0 if a.feed_draft else 1), "this verify")
        if a.base_position > len(s.tokens) or a.base_position < 0:
            self._truncate(s, a.base_position)  # raises StalePositionError
        if not a.feed and a.draft and (a.base_position != len(s.tokens) or s.last_row is None):
            raise StalePositionError(f"no stored target row at position {a.base_position}; send the pending token "
                                     f"in feed")
        if not ids and not a.draft:
            raise InvalidRequestError("feed", "nothing to verify: send the pending token and/or draft tokens")
        return s, ids

    def verify_batch(self, batch: list[VerifyArgs]) -> list[VerifyOutcome | Exception]:
        """Verify many sessions with one padded forward. Results equal those of separate calls."""
        results: list[VerifyOutcome | Exception | None] = [None] * len(batch)
        prepared = []
        for i, a in enumerate(batch):
            try:
                prepared.append((i, a, *self._prepare(a)))
            except Exception as e:  # noqa: BLE001 - reported per item; the shell maps it to a status
                results[i] = e
        t0 = time.perf_counter_ns()
        rows_by_item = self._forward_batch([(a, s, ids) for _, a, s, ids in prepared])
        fwd_ns = time.perf_counter_ns() - t0
        n_fwd = sum(1 for _, _, _, ids in prepared if ids)
        for (i, a, s, ids), logits in zip(prepared, rows_by_item):
            t1 = time.perf_counter_ns()
            try:
                out = self._finish(a, s, logits)
            except Exception as e:  # noqa: BLE001
                results[i] = e
                continue
            out.forward_ns = fwd_ns if ids else 0
            out.forwarded = bool(ids)
            out.batch_size = n_fwd
            out.verify_ns = time.perf_counter_ns() - t1
            results[i] = out
        return results  # type: ignore[return-value]

    def _forward_batch(self, items) -> list[torch.Tensor | None]:
        todo = [(j, a, s, ids) for j, (a, s, ids) in enumerate(items) if ids]
        out: list[torch.Tensor | None] = [None] * len(items)
        for _, a, s, _ in todo:
            self._truncate(s, a.base_position)
        if len(todo) == 1:
            j, a, s, ids = todo[0]
            out[j] = self._feed(s, a.base_position, ids)[0]
        elif todo:
            dev = self.model.device
            width = max(len(ids) for *_, ids in todo)
            tokens = torch.zeros((len(todo), width), dtype=torch.long, device=dev)
            positions = torch.zeros((len(todo), width), dtype=torch.long, device=dev)
            for r, (_, a, _, ids) in enumerate(todo):
                tokens[r, :len(ids)] = torch.tensor(ids, device=dev)
                positions[r] = torch.arange(a.base_position, a.base_position + width, device=dev)
            slots = torch.tensor([s.slot for _, _, s, _ in todo], device=dev)
            logits, _ = self.model(tokens, positions, slots, self.kv)
            for r, (j, _, s, ids) in enumerate(todo):
                s.tokens.extend(ids)
                out[j] = logits[r, :len(ids)]
        return out

    def _finish(self, a: VerifyArgs, s: Session, logits: torch.Tensor | None) -> VerifyOutcome:
        # rows[i] predicts the token after (feed + draft)[:i] ... assemble the rows that check each draft token
        nf = len(a.feed)
        prev = s.last_row if nf == 0 else None
        parts = ([prev[None]] if prev is not None else []) + ([logits] if logits is not None else [])
        rows = torch.cat(parts) if parts else torch.empty(0, self.vocab_size)
        start = 0 if nf == 0 else nf - 1  # row index that predicts draft[0]
        rows = rows[start:]
        g = len(a.draft)
        sample_bonus = a.sample_bonus and (a.feed_draft or g == 0)
        p = logits_to_probs(rows[: g + (1 if sample_bonus else 0)], s.params)
        q = None
        if not s.params.greedy and g:
            q = torch.stack([d.to_dense(self.vocab_size) for d in a.q])
        pos0 = a.base_position + nf
        res = verify(a.method, a.draft, q, p, s.params, pos0, sample_bonus)
        if a.feed_draft:
            keep = a.base_position + nf + res.num_accepted
            del s.tokens[keep:]
            s.last_row = rows[res.num_accepted] if rows.shape[0] > res.num_accepted else None
        else:
            s.last_row = rows[0] if rows.shape[0] else s.last_row
        return VerifyOutcome(res.num_accepted, res.next_token)


def kv_bytes_per_session(model: CausalLM, max_context: int) -> int:
    cfg = model.config
    per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    return per_pos * (max_context + PAD_SLACK)


__all__ = ["DraftWorker", "TargetWorker", "DraftBlock", "VerifyOutcome", "VerifyArgs", "Session",
           "kv_bytes_per_session", "math"]
