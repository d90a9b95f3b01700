"""What the draft and target workers share: the session table, per-session KV slots, prefill, and the
absolute-position protocol (specdec/workers/__init__.py). DraftWorker (workers/draft.py) and TargetWorker
(workers/target.py) build on `Worker`. Torch only."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specdec.common.errors import ContextOverflowError, InvalidRequestError, SessionNotFoundError, StalePositionError
from specdec.decoding.sampling import SamplingParams, TokenLogprobs
from specdec.modeling import cuda_graphs
from specdec.modeling.model import CausalLM, context_limit
from specdec.state.feature_state import FeatureState
from specdec.state.prefix_cache import SlotPrefixes
from specdec.state.sessions import SessionTable
from specdec.text.grammar import GrammarState, GrammarVocab


PAD_SLACK = 64  # extra KV positions per slot for padded rows of batched forwards
PREFILL_CHUNK = 128  # positions per prefill forward, aligned to absolute positions (specdec/state/prefix_cache.py)
# a prefill's logits are never read (the prompt's last token is fed by the first verify or draft call): the head,
# a fifth of the default target's weights, runs on the last row only instead of every prompt position
PREFILL_LOGITS = slice(-1, None)


def feature_size(model) -> int:
    """Width of the target features a feature draft reads; 0 for every other model."""
    return int(getattr(model.config, "feature_size", 0) or 0)


def kv_bytes_per_session(model: CausalLM, max_context: int) -> int:
    """The KV cache bytes of one session slot of a worker of this model."""
    cfg = model.config
    per_pos = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    return per_pos * (max_context + PAD_SLACK)


@dataclass
class Session:
    """What both workers keep of a session; its draft-only and target-only state: `DraftSession`, `TargetSession`."""
    slot: int
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the cache, in order
    epoch: int = 0  # bumped by cancel(); a draft loop stops when it changes
    cached_tokens: int = 0  # prompt positions whose K/V came from the prefix cache instead of the prefill
    chunked: int = 0  # positions [0, chunked) hold K/V from whole aligned prefill chunks: reusable by others
    sid: str = ""
    output_start: int = 0  # position of the first output token: the prompt's length (penalties count the output)
    grammar: GrammarState | None = None  # structured output: the matcher of params.grammar (specdec/text/grammar.py)

    @classmethod
    def opened(cls, prompt_ids: list[int], **common) -> Session:
        """A session of `prompt_ids` as `Worker.open_session` opens it (`common`: the fields above)."""
        return cls(**common)

    def length(self) -> int:
        """Positions the session holds: fed, or known and fed by its next forward (`DraftSession.pending`)."""
        return len(self.tokens)

    def cut(self, base: int) -> None:
        """Forget the positions from `base` on (0 <= base <= length(), checked by `Worker._truncate`)."""
        if base < len(self.tokens):
            del self.tokens[base:]
            self.chunked = min(self.chunked, base)  # fed again there by decode steps, not prefill chunks


@dataclass
class DraftSession(Session):
    """A draft worker's session (workers/draft.py)."""
    feats: FeatureState | None = None  # a feature draft's per-position inputs (proposers/features.py)
    # tokens known to follow `tokens` but not fed yet (looked-up tokens drafted without a forward); the session
    # holds them as it holds `tokens`, and the next forward feeds them
    pending: list[int] = field(default_factory=list)

    def length(self) -> int:
        return len(self.tokens) + len(self.pending)

    def cut(self, base: int) -> None:
        n = len(self.tokens)
        if base > n:  # inside the known, unfed tokens: keep those before base
            del self.pending[base - n:]
            return
        self.pending.clear()
        super().cut(base)


@dataclass
class TargetSession(Session):
    """A target worker's session (workers/target.py)."""
    last_row: torch.Tensor | None = None  # logits predicting position len(tokens)
    want_features: bool = False  # return features with each result (a feature draft reads them)
    # the committed tokens after `tokens` not fed yet (the pending token): `tokens + unfed` is the session's
    # committed sequence, which a chained verify is reconciled with (workers/target.py)
    unfed: list[int] = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = None  # the prefill's TokenLogprobs (params.prompt_logprobs), until read

    @classmethod
    def opened(cls, prompt_ids: list[int], **common) -> TargetSession:
        return cls(unfed=list(prompt_ids[-1:]), **common)

    def cut(self, base: int) -> None:
        if base < len(self.tokens):
            self.last_row = None
        super().cut(base)


class Worker:
    """One model, its KV slots and its sessions (specdec/workers/__init__.py: the position protocol)."""

    # A rebuilt session (its history re-sent after a failover or a preemption: prompt + output, `output_start`)
    # feeds its output positions in blocks of this many rows, as the verifies that first wrote them did, so that
    # they get bitwise the same K/V (row invariance: specdec/modeling/linear.py, the decode attention) and a greedy
    # answer goes on as it would have; 0: they are prefilled with the prompt (a draft: its K/V only move acceptance).
    rebuild_rows = 0
    session_type: type[Session] = Session  # the worker's sessions: DraftSession, TargetSession

    def __init__(self, model: CausalLM, max_sessions: int = 8, max_context: int | None = None,
                 session_ttl_s: float = 600.0, prefix_cache: bool = True, prefill_chunk: int = PREFILL_CHUNK):
        self.model = model
        self.vocab_size = model.config.vocab_size
        # the model's own bound (max_position_embeddings, or a sliding window / longrope's original length where
        # its numerics would change past it: specdec/modeling/model.py), or less where the operator asks (--max-context)
        limit, bound = context_limit(model.config)
        self.max_context = min(max_context or limit, limit)
        self.context_bound = f"the model's {bound}" if self.max_context == limit else "--max-context"
        self.max_sessions = max_sessions
        # a CUDA model replays its decode steps and verify blocks as CUDA graphs (specdec/modeling/cuda_graphs.py);
        # their padded rows write a scratch slot past the sessions' slots. Elsewhere (CPU) nothing changes
        graphs = (model.device.type == "cuda" and cuda_graphs.graphs_enabled()
                  and cuda_graphs.supports_model(model))
        self.kv = model.new_kv_slots(max_sessions + graphs, self.max_context + PAD_SLACK)
        self.graphs = cuda_graphs.GraphRunner(model, self.kv, scratch_slot=max_sessions) if graphs else None
        # one KV slot per session. A session idle past `session_ttl_s` is refused and freed when a start makes room;
        # a full table refuses a start. A replica's host table decides expiry and eviction (specdec_rpc/host.py)
        # and ends the sessions it drops here
        self.sessions: SessionTable[Session] = SessionTable(max_sessions, session_ttl_s, lru_min_idle_s=None)
        # free slots, oldest released first, with the tokens whose K/V each still holds (specdec/state/prefix_cache.py)
        self.free_slots = SlotPrefixes(max_sessions)
        # a prefill runs in aligned chunks of `prefill_chunk` positions (0: the whole prompt in one forward), and a
        # new session reuses the longest run of whole chunks of its prompt that some slot holds. A feature draft's
        # K/V also depends on the target's features, so it never reuses any
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache and prefill_chunk > 0 and not feature_size(model)
        self.prefix_queries = 0  # prompt positions a prefill would feed, since start (metrics)
        self.prefix_hits = 0  # of those, positions reused from the prefix cache
        self._grammar_vocab: GrammarVocab | None | bool = False  # built on first use (`grammar_vocab`)
        self.grammar_required = True  # False (drafts): a grammar this worker cannot read is ignored

    @property
    def grammar_vocab(self) -> GrammarVocab | None:
        """The vocabulary structured output reads (the model directory's tokenizer.json), built on first use;
        None: the model has none, and requests with a grammar are refused."""
        if self._grammar_vocab is False:
            src = getattr(self.model, "source_dir", None)
            self._grammar_vocab = GrammarVocab.from_dir(src, self.vocab_size) if src else None
        return self._grammar_vocab  # type: ignore[return-value]

    @grammar_vocab.setter
    def grammar_vocab(self, vocab: GrammarVocab | None) -> None:
        self._grammar_vocab = vocab

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        if not params.grammar:
            return None
        if self.grammar_vocab is None:
            if not self.grammar_required:  # a draft's masks only raise acceptance: it drafts unmasked
                return None
            raise InvalidRequestError("structured_output", "this replica's model directory has no usable "
                                                           "tokenizer.json, which structured output reads; serve a "
                                                           "model with one, or leave structured output out")
        return self.grammar_vocab.state(params.grammar)

    # ---- sessions -------------------------------------------------------------------------------------------
    def _get(self, session_id: str) -> Session:
        """A call's session (its last use now); NOT_FOUND if unknown or expired."""
        return self.sessions.touch(session_id)

    def _check_tokens(self, field_name: str, ids: list[int]) -> None:
        for t in ids:
            if not (0 <= t < self.vocab_size):
                raise InvalidRequestError(field_name, f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def _in_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """Stop ids and bad words without the ids past the vocabulary (a tokenizer's may run past the model's):
        such a token is never sampled, so a stop on it never fires and a bad word holding it never completes."""
        stops = tuple(t for t in params.stop_ids if t < self.vocab_size)
        bad = tuple(w for w in params.bad_words if max(w) < self.vocab_size)
        if stops == params.stop_ids and bad == params.bad_words:
            return params
        return dataclasses.replace(params, stop_ids=stops, bad_words=bad)

    def _check_context(self, length: int, what: str) -> None:
        if length > self.max_context:
            raise ContextOverflowError(f"{what} needs {length} positions but the context holds {self.max_context} "
                                       f"({self.context_bound}); shorten the prompt or lower max_new_tokens / gamma")

    def check_reserve(self, positions: int, prompt_len: int = 0) -> None:
        """Refuse up front a session that will need more positions than the context holds (StartSession's
        reserve_positions: prompt + max_new_tokens), rather than fail it when it gets there."""
        if positions > self.max_context:
            fix = (f"the prompt alone has {prompt_len} tokens: shorten it by at least "
                   f"{prompt_len - self.max_context + 1}" if prompt_len >= self.max_context else
                   f"lower max_new_tokens by {positions - self.max_context} or shorten the prompt")
            raise ContextOverflowError(f"This model's maximum context length is {self.max_context} tokens "
                                       f"({self.context_bound}). However, the request needs up to {positions} "
                                       f"positions (prompt + max_new_tokens); {fix}")

    def start_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Session:
        s = self.open_session(session_id, prompt_ids, params)
        self._prefill(s, prompt_ids)
        return s

    def start_steps(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    output_start: int = 0) -> Iterator[tuple[Session, int]]:
        """`start_session` in steps a caller runs apart, other sessions' forwards between them (SessionHost): the
        first opens the session, each next one runs one forward of its prefill; each yields the session and the
        forwards still to run. A session ended or restarted between steps is refused (NOT_FOUND)."""
        s = self.open_session(session_id, prompt_ids, params, output_start=output_start)
        ranges = self.prefill_ranges(s, prompt_ids)
        yield s, len(ranges)
        for done, (start, end) in enumerate(ranges, 1):
            self.prefill_chunk_of(s, prompt_ids, start, end)
            yield s, len(ranges) - done

    def _prefill(self, s: Session, prompt_ids: list[int], logits_rows: slice | None = PREFILL_LOGITS,
                 step: int | None = None):
        """Feed prompt_ids[:-1] after the reused prefix, in aligned chunks (the last prompt token is fed by the
        session's first verify or draft call; `step` bounds a chunk where prefill_chunk is 0). → [(logits,
        hidden)] per chunk forward (none when all was reused)."""
        ranges = self.prefill_ranges(s, prompt_ids, step)
        return [self.prefill_chunk_of(s, prompt_ids, a, b, logits_rows) for a, b in ranges]

    def prefill_cut(self, n: int, output_start: int) -> int:
        """Of a session opened with n tokens, the positions its prefill chunks write: all but the last token, or
        (`rebuild_rows`) the prompt's, where a rebuilt session's output follows (`Session.output_start`)."""
        return min(n, output_start) - 1 if self.rebuild_rows and 0 < output_start else n - 1

    def prefill_ranges(self, s: Session, prompt_ids: list[int], step: int | None = None) -> list[tuple[int, int]]:
        """The [start, end) positions of each prefill forward of the session: aligned chunks after the reuse, then
        a rebuilt session's output in blocks of `rebuild_rows`."""
        fed, cut = len(prompt_ids) - 1, self.prefill_cut(len(prompt_ids), s.output_start)
        step = self.prefill_chunk or step or max(cut, 1)
        ranges = [(at, min(at + step, cut)) for at in range(s.cached_tokens, cut, step)]
        rows = self.rebuild_rows or 1
        return ranges + [(at, min(at + rows, fed)) for at in range(max(s.cached_tokens, cut), fed, rows)]

    def prefill_chunk_of(self, s: Session, prompt_ids: list[int], start: int, end: int,
                         logits_rows: slice | None = PREFILL_LOGITS):
        """One prefill forward: positions [start, end) of prompt_ids. → (logits, hidden). A caller that runs the
        chunks as separate calls (SessionHost, between other sessions' steps) passes the Session it opened: a
        session ended or restarted meanwhile is refused."""
        if self.sessions.get(s.sid) is not s:
            raise SessionNotFoundError("the session was ended or restarted during its prefill; start it again")
        out = self._feed(s, start, prompt_ids[start:end], logits_rows=logits_rows)
        if self.prefill_chunk:  # whole aligned chunks a prefill wrote: other sessions may reuse them
            end = min(end, self.prefill_cut(len(prompt_ids), s.output_start))
            s.chunked = max(s.chunked, end // self.prefill_chunk * self.prefill_chunk)
        return out

    def _hidden(self, rows) -> torch.Tensor:
        """The hidden states [m, D] of `_prefill`'s chunks, in order."""
        if not rows:
            return torch.zeros((0, self.model.config.hidden_size), device=self.model.device, dtype=self.model.dtype)
        return torch.cat([h for _, h in rows])

    def open_session(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                     reuse: bool = True, output_start: int = 0) -> Session:
        """A session in a free slot, holding (`Session.cached_tokens`) the longest prefix of prompt_ids[:-1]
        that some slot's K/V holds, unless the prefix cache is off or `reuse` is False (the caller needs the
        prefill's rows of every position: prompt logprobs, features)."""
        self.sessions.check_id(session_id)
        if not prompt_ids:
            raise InvalidRequestError("prompt_ids", "the prompt is empty; send at least one token")
        self._check_tokens("prompt_ids", prompt_ids)
        self._check_context(len(prompt_ids), "the prompt")
        self._check_tokens("logit_bias", [t for t, _ in params.logit_bias])
        self._check_tokens("allowed_token_ids", list(params.allowed_token_ids))
        params = self._in_vocabulary(params)
        if not 0 <= output_start <= len(prompt_ids):
            raise InvalidRequestError("output_start", f"must be in [0, {len(prompt_ids)}] (0: the prompt's end), got "
                                                      f"{output_start}")
        grammar = self._grammar_state(params)
        if session_id in self.sessions:  # idempotent restart: same id → fresh state
            self.end_session(session_id)
        for _, gone in self.sessions.make_room(session_id):  # expired sessions go; a full table: CapacityError
            self._release(gone)
        want = prompt_ids[:self.prefill_cut(len(prompt_ids), output_start)] if reuse and self.prefix_cache else None
        live = {o.slot: (o.params.cache_salt, o.tokens[:o.chunked]) for o in self.sessions.values()} if want else {}
        got = self.free_slots.take(want, live, align=self.prefill_chunk or 1, salt=params.cache_salt)
        if got.copy:
            self.kv.copy_prefix(got.source, got.slot, got.tokens)
        s = self.session_type.opened(prompt_ids, slot=got.slot, params=params, tokens=list(prompt_ids[:got.tokens]),
                                     cached_tokens=got.tokens, chunked=got.tokens, sid=session_id,
                                     output_start=output_start or len(prompt_ids), grammar=grammar)
        self.sessions.add(session_id, s)
        self.prefix_queries += len(prompt_ids) - 1
        self.prefix_hits += got.tokens
        return s

    def end_session(self, session_id: str) -> bool:
        s = self.sessions.remove(session_id)
        if s is None:
            return False
        self._release(s)
        return True

    def _release(self, s: Session) -> None:
        """Stop the session's calls and free its slot (its whole chunks stay reusable: prefix_cache.py)."""
        s.epoch += 1
        self.free_slots.release(s.slot, s.tokens[:s.chunked], s.params.cache_salt)

    def cancel(self, session_id: str) -> None:
        s = self.sessions.get(session_id)
        if s is not None:
            s.epoch += 1

    def rollback(self, session_id: str, position: int) -> int:
        """Forget everything held at or after `position`; returns the new length."""
        s = self._get(session_id)
        self._truncate(s, position, "position")
        return s.length()

    def session_length(self, session_id: str) -> int:
        """Positions the session holds: fed, or known and fed by its next forward (`Session.length`)."""
        return self._get(session_id).length()

    # ---- forward --------------------------------------------------------------------------------------------
    def _truncate(self, s: Session, base: int, field: str = "base_position") -> None:
        if base < 0:
            raise StalePositionError(f"{field} {base} is negative; positions count from 0")
        held = s.length()
        if base > held:
            raise StalePositionError(f"{field} {base} is beyond the {held} tokens this session holds; resend from "
                                     f"position {held} or earlier")
        s.cut(base)

    # feature drafts (workers/draft.py) supply each fed token's input feature and record what they computed
    def _input_features(self, s: Session, base: int, ids: list[int]) -> torch.Tensor | None:
        return None

    def _after_feed(self, s: Session, base: int, hidden: torch.Tensor) -> None:
        pass

    def _replay(self, tokens, positions, slots, kv_len: int, compact: bool):
        """A CUDA graph's (logits, hidden) for this forward where one serves its shape
        (specdec/modeling/cuda_graphs.py), copied out of the graph's buffers; None: run the model eagerly (CPU models,
        other shapes)."""
        if self.graphs is None:
            return None
        out = self.graphs.try_forward(tokens, positions, slots, kv_len, compact)
        return None if out is None else (out[0].clone(), out[1].clone())

    def _feed(self, s: Session, base: int, ids: list[int], compact: bool = False, logits_rows: slice | None = None):
        """Forward `ids` at positions base.. → (logits [m, V] fp32, hidden [m, D]). `compact`: a compact-head
        model's logits stay compact ([m, len(vocab_subset)], `CausalLM.forward`'s compact_logits).
        `logits_rows`: only these rows get logits (a prefill's are unused: PREFILL_LOGITS)."""
        dev = self.model.device
        tokens = torch.tensor([ids], device=dev)
        positions = torch.arange(base, base + len(ids), device=dev)[None]
        feats = self._input_features(s, base, ids)
        kw = {} if feats is None else {"features": feats[None]}
        if compact:
            kw["compact_logits"] = True
        if logits_rows is not None:
            kw["logits_rows"] = logits_rows
        slots = torch.tensor([s.slot], device=dev)
        out = self._replay(tokens, positions, slots, base + len(ids), compact) if logits_rows is None else None
        logits, hidden = out if out is not None else self.model(tokens, positions, slots, self.kv, **kw)
        s.tokens.extend(ids)
        self._after_feed(s, base, hidden[0])
        return logits[0], hidden[0]

    def _feed_many(self, items: list[tuple[Session, int, list[int]]],
                   compact: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Forward every (session, base, ids) in one padded forward → (logits [m, V], hidden [m, D]) per item.

        Padding positions lie past each session's end (overwritten by its next forward, masked meanwhile); they
        are clamped into the slot's slack so a session near the end of its context cannot overflow the cache."""
        if len(items) == 1:
            return [self._feed(*items[0], compact=compact)]
        dev = self.model.device
        width = max(len(ids) for _, _, ids in items)
        tokens = torch.zeros((len(items), width), dtype=torch.long, device=dev)
        positions = torch.empty((len(items), width), dtype=torch.long, device=dev)
        for r, (_, base, ids) in enumerate(items):
            tokens[r, :len(ids)] = torch.tensor(ids, device=dev)
            positions[r] = torch.arange(base, base + width, device=dev).clamp_max(self.kv.max_len - 1)
        slots = torch.tensor([s.slot for s, _, _ in items], device=dev)
        kw = {}
        if feature_size(self.model):
            feats = torch.zeros((len(items), width, feature_size(self.model)), device=dev, dtype=self.model.dtype)
            for r, (s, base, ids) in enumerate(items):
                feats[r, :len(ids)] = self._input_features(s, base, ids)
            kw["features"] = feats
        if compact:
            kw["compact_logits"] = True
        kv_len = min(max(base for _, base, _ in items) + width, self.kv.max_len)
        out = self._replay(tokens, positions, slots, kv_len, compact) if "features" not in kw else None
        logits, hidden = out if out is not None else self.model(tokens, positions, slots, self.kv, **kw)
        out = []
        for r, (s, base, ids) in enumerate(items):
            s.tokens.extend(ids)
            self._after_feed(s, base, hidden[r, :len(ids)])
            out.append((logits[r, :len(ids)], hidden[r, :len(ids)]))
        return out
