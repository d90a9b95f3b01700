"""In-process engine: draft and target workers behind the schedule's backend protocols.

Each worker runs on its own single thread (torch releases the GIL inside ops), so PEARL's overlap is real here
too: the draft and the target compute at the same time, one core each when `threads_per_model=1`.

A schedule that never overlaps the two (`ar`, `sd`, `pacer`) gains nothing from those threads and pays for every
hand-off: a thread that slept through a 20 ms verify takes ~0.5 ms to wake on a virtualised CPU, and it wakes on
cold caches (docs/benchmarks.md, "Thread hand-offs"). So with one torch thread per model such a request runs its
worker calls inline on the caller's thread, whenever the worker's own thread has nothing queued (`inline=None`,
the default; a worker is only ever driven by one thread at a time either way).
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import AsyncIterator

import torch

from specdec.common.threads import ModelThread
from specdec.decoding.lookup import PromptLookup
from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stop import StopSpec, make_stop_rule
from specdec.decoding.verify import SparseDist
from specdec.modeling.model import tune_model
from specdec.scheduling.field_rules import validate_request
from specdec.scheduling.request import GenerationRequest, GenerationResult
from specdec.scheduling.schedule import generate
from specdec.state.feature_state import TargetFeatures
from specdec.text.pairing import check_pair
from specdec.text.vocab import fit_draft_vocabulary
from specdec.workers.base import PREFILL_CHUNK
from specdec.workers.draft import DraftWorker
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import TargetWorker, VerifyOutcome

SEQUENTIAL_MODES = ("ar", "sd", "pacer")  # schedules whose draft and target never compute at the same time

# set per request by Engine.agenerate: this request's worker calls may run on the caller's thread
_INLINE_OK: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_inline_ok", default=False)


class _LocalWorker:
    """A worker and its model thread. A call runs on the thread, or inline on the event loop: always
    (`inline=True`: no overlap; the same schedule logic, used by the many-run statistical tests), or for a request
    that allows it (`_INLINE_OK`) while the thread is idle (specdec/common/threads.py: the model is never driven from
    two threads at once)."""

    def __init__(self, worker, name: str, threads: int | None, inline: bool = False):
        self.worker = worker
        self.inline = inline
        self.thread = ModelThread(name, threads or 0)
        self.thread.submit(tune_model, worker.model)  # the plans for the thread count it runs with

    def runs_inline(self) -> bool:
        return self.inline or (_INLINE_OK.get() and self.thread.idle())

    async def call(self, fn, *args, **kw):
        if self.runs_inline():
            return fn(*args, **kw)
        return await self.thread.run(fn, *args, **kw)


class LocalDraft(_LocalWorker):
    def __init__(self, worker: DraftWorker, threads: int | None = None, inline: bool = False):
        super().__init__(worker, "draft", threads, inline)
        self.reads_features = worker.reads_features

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    features: list[TargetFeatures] | None = None) -> None:
        await self.call(self.worker.start_session, session_id, prompt_ids, params, features)

    async def draft_stream(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                           stop: StopSpec, block_size: int,
                           features: list[TargetFeatures] | None = None) -> AsyncIterator[DraftBlock]:
        rule = make_stop_rule(stop, self.worker.preverifier)
        args = (session_id, base_position, append, gamma_max, rule, block_size, features)
        if self.runs_inline():
            for blk in self.worker.draft_blocks(*args):
                yield blk
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def produce():
            try:
                for blk in self.worker.draft_blocks(*args):
                    loop.call_soon_threadsafe(queue.put_nowait, blk)
            except Exception as e:  # noqa: BLE001 - re-raised on the consumer side
                loop.call_soon_threadsafe(queue.put_nowait, e)
            loop.call_soon_threadsafe(queue.put_nowait, None)

        self.thread.post(produce)
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    async def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int, stop: StopSpec,
                    block_size: int, features: list[TargetFeatures] | None = None) -> DraftBlock:
        rule = make_stop_rule(stop, self.worker.preverifier)
        return await self.call(self.worker.draft, session_id, base_position, append, gamma_max, rule, block_size,
                               features)

    async def cancel(self, session_id: str) -> None:
        self.worker.cancel(session_id)  # only bumps an epoch: safe from the event-loop thread

    async def end(self, session_id: str) -> None:
        await self.call(self.worker.end_session, session_id)


class LocalTarget(_LocalWorker):
    chain_window = 1  # one verify at a time: in process there is no link to hide

    def __init__(self, worker: TargetWorker, threads: int | None = None, inline: bool = False):
        super().__init__(worker, "target", threads, inline)
        self.prompt_logprobs: dict[str, object] = {}  # session id -> its prompt's TokenLogprobs, until generate ends
        self.cached_tokens: dict[str, int] = {}  # session id -> prompt positions reused from the prefix cache

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    want_features: bool = False) -> TargetFeatures | None:
        out = await self.call(self.worker.start_session, session_id, prompt_ids, params, want_features)
        self.cached_tokens[session_id] = self.worker.sessions[session_id].cached_tokens
        if params.prompt_logprobs >= 0:
            self.prompt_logprobs[session_id] = self.worker.take_prompt_logprobs(session_id)
        return out

    async def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
                     q: list[SparseDist] | None, method: str, feed_draft: bool = True,
                     sample_bonus: bool = True) -> VerifyOutcome:
        return await self.call(self.worker.verify, session_id, base_position, feed, draft, q, method, feed_draft,
                               sample_bonus)

    async def end(self, session_id: str) -> None:
        await self.call(self.worker.end_session, session_id)


class Engine:
    """Speculative decoding in one process: `Engine(target_model, draft_model).generate(request)`."""

    def __init__(self, target_model, draft_model=None, preverifier=None, max_sessions: int = 4,
                 max_context: int | None = None, threads_per_model: int | None = None, q_top_k: int = 64,
                 inline: bool | None = None, lookup: PromptLookup | None = None, prefix_cache: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK):
        """`inline`: True runs every call on the caller's thread (no overlap at all); False always uses the worker
        threads; None (default) lets `ar` / `sd` / `pacer` requests run inline when `threads_per_model` is 1 and
        the caller's thread computes with 1 torch thread too (module docstring)."""
        self.threads_per_model = threads_per_model
        self.auto_inline = inline is None
        inline = bool(inline)
        # both workers (specdec/state/prefix_cache.py)
        cache = {"prefix_cache": prefix_cache, "prefill_chunk": prefill_chunk}
        self.target_worker = TargetWorker(target_model, max_sessions=max_sessions, max_context=max_context, **cache)
        self.target = LocalTarget(self.target_worker, threads_per_model, inline)
        self.draft_worker = self.draft = None
        if draft_model is not None:
            # a draft of another tokenizer is refused (PairError naming both models, specdec/text/pairing.py); a draft
            # checkpoint padded to fewer rows than its target's (Qwen2.5-0.5B for -7B) takes and proposes the
            # target's ids (specdec/text/vocab.py)
            check_pair(draft_model, target_model)
            fit_draft_vocabulary(draft_model, target_model.config.vocab_size, preverifier)
            self.draft_worker = DraftWorker(draft_model, preverifier=preverifier, q_top_k=q_top_k, lookup=lookup,
                                            max_sessions=max_sessions, max_context=max_context, **cache)
            self.draft = LocalDraft(self.draft_worker, threads_per_model, inline)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def may_inline(self, req: GenerationRequest) -> bool:
        """Whether this request's worker calls may run on the calling thread (see the module docstring)."""
        return (self.auto_inline and req.mode in SEQUENTIAL_MODES and self.threads_per_model == 1
                and torch.get_num_threads() == 1)

    async def agenerate(self, req: GenerationRequest, on_tokens=None) -> GenerationResult:
        validate_request(req)
        need = len(req.prompt_ids) + req.max_new_tokens  # refused before any work, as the replicas do
        for worker in (self.target_worker, self.draft_worker if req.mode != "ar" else None):
            if worker is not None:
                worker.check_reserve(need)
        token = _INLINE_OK.set(self.may_inline(req))
        try:
            res = await generate(req, self.draft, self.target, on_tokens)
        finally:
            prompt_logprobs = self.target.prompt_logprobs.pop(req.session_id, None)
            cached = self.target.cached_tokens.pop(req.session_id, 0)
            _INLINE_OK.reset(token)
        res.prompt_logprobs = prompt_logprobs
        res.stats.cached_prompt_tokens = cached
        return res

    def generate(self, req: GenerationRequest, on_tokens=None) -> GenerationResult:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(self.agenerate(req, on_tokens))

    def close(self) -> None:
        self.target.thread.close(wait=False)
        if self.draft is not None:
            self.draft.thread.close(wait=False)
        if self._loop is not None:
            self._loop.close()
            self._loop = None
