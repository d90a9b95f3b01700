"""What both servicers share: one worker on its model thread, the session table, metrics, the reaper.

The worker (specdec.workers) owns KV slots and the position protocol; this class adds the shell's session
policy (TTL checked on every call, LRU eviction when full; specdec/state/sessions.py) and keeps every worker call on
the model thread. Servicers translate proto <-> these calls and nothing else.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections import deque
from typing import Awaitable, Callable

from specdec.common.threads import ModelThread
from specdec.decoding.sampling import SamplingParams
from specdec.modeling import native
from specdec.modeling.quant import weight_quant
from specdec.state.sessions import SessionTable
from specdec.text.pairing import TokenizerVocab
from specdec.workers.base import feature_size
from specdec_rpc.aio import cancel_and_wait
from specdec_rpc.interceptor import ServiceDraining
from specdec_rpc.metrics import ServiceMetrics
from specdec_rpc.pb import common_pb2
from specdec_rpc.settings import ServerSettings

log = logging.getLogger(__name__)

# while a per-round stream's request is handled: `await ROUNDS_WAITING.get()()` → the stream's requests waiting
# behind it, oldest first (`rounds`); None outside a per-round stream. Only a handler that asks pays for the look.
ROUNDS_WAITING: contextvars.ContextVar[Callable[[], Awaitable[tuple]] | None] = contextvars.ContextVar(
    "rounds_waiting", default=None)
# event-loop turns a per-round stream gives its reader before saying what waits (`SessionHost.rounds`): a message
# that arrived while the loop was busy needs a turn for gRPC to hand it over and one for the reader to queue it (a
# few microseconds each, against a forward of milliseconds)
READ_AHEAD_TURNS = 3
_END = object()


class SessionHost:
    def __init__(self, worker, runner: ModelThread, settings: ServerSettings, metrics: ServiceMetrics,
                 model_name: str = ""):
        self.worker, self.runner, self.metrics = worker, runner, metrics
        self.table = SessionTable(settings.max_sessions, settings.session_ttl_s, settings.lru_min_idle_s)
        self.info = common_pb2.ModelInfo(
            model=model_name, vocab_size=worker.vocab_size, max_position_embeddings=worker.max_context,
            device=str(worker.model.device), dtype=str(worker.model.dtype).removeprefix("torch."),
            max_sessions=settings.max_sessions, feature_size=feature_size(worker.model),
            weight_quant=weight_quant(worker.model),
            prompt_lookup_min_ngram=getattr(getattr(worker, "lookup", None), "min_ngram", 0),
            attention_kernel="native" if native.supports(worker.kv.k[0]) else "torch")
        # the model directory's tokenizer, read once: the coordinator pairs drafts and targets by its fingerprint
        self.tokenizer = TokenizerVocab.of(worker.model, model_name)
        if self.tokenizer is not None:
            self.info.tokenizer_fingerprint = str(self.tokenizer.fingerprint())
        self._reaper: asyncio.Task | None = None
        self.draining = False  # set when the server starts draining: per-round streams end (UNAVAILABLE)
        self._reap_every = min(30.0, max(0.05, settings.session_ttl_s / 4))
        self.interleave_prefill = settings.interleave_prefill
        # sessions whose StartSession is running (how many calls each): they cannot verify or draft yet
        self.prefilling: dict[str, int] = {}
        self._starts: dict[str, object] = {}  # each session id's latest StartSession call (last writer wins)

    def info_for(self, tokenizer_prefix: int = 0):
        """`info`, its tokenizer fingerprint over the first `tokenizer_prefix` ids only when > 0 (GetInfo)."""
        if tokenizer_prefix <= 0 or self.tokenizer is None:
            return self.info
        info = common_pb2.ModelInfo()
        info.CopyFrom(self.info)
        info.tokenizer_fingerprint = str(self.tokenizer.fingerprint(tokenizer_prefix))
        return info

    # -- sessions ------------------------------------------------------------------------------------------
    async def start_session(self, sid: str, prompt_ids: list[int], params, **kw) -> tuple[int, int, object, int]:
        """Admit (maybe evicting), then prefill on the model thread (`kw` go to the worker's start_session).
        Returns (position, prefill_ns, what start_session returned, positions reused from the prefix cache).

        A plain prefill runs chunk by chunk, each chunk its own model-thread call (`interleave_prefill`): other
        sessions' verify and draft steps queued meanwhile run between the chunks, so a long prompt delays running
        streams by one chunk's forward at a time, not by its whole prefill (vLLM's chunked prefill)."""
        if self.draining:  # the coordinator starts it elsewhere; the sessions already here finish first
            raise ServiceDraining("this replica is draining (shutting down): start the session on another replica")
        vocab = self.worker.grammar_vocab if params.grammar else None
        if vocab is not None:  # compile off the model thread (cached): a large schema must not stall other sessions
            self.table.check_room(sid)  # a start that will be refused compiles nothing
            await asyncio.to_thread(vocab.check, params.grammar)
        evicted = self.table.admit(sid)
        self.prefilling[sid] = self.prefilling.get(sid, 0) + 1
        self._starts[sid] = call = object()
        try:
            # prompt logprobs, features and feature drafts need the worker's own start_session
            plain = not any(v for k, v in kw.items() if k != "output_start")
            if (self.interleave_prefill and plain and params.prompt_logprobs < 0
                    and not feature_size(self.worker.model)):
                out = await self._start_interleaved(sid, evicted, prompt_ids, params, kw.get("output_start", 0))
            else:
                out = await self.runner.run(self._start, sid, evicted, prompt_ids, params, kw)
            self.metrics.prefix_cache_queries.inc(len(prompt_ids) - 1)
            self.metrics.prefix_cache_hits.inc(out[3])
            if log.isEnabledFor(logging.DEBUG):  # JSON logs add the session id (bound by the interceptor)
                log.debug("session %s started: %d prompt positions, %d from the prefix cache, prefill %.1f ms", sid,
                          len(prompt_ids), out[3], out[1] / 1e6, extra={"timings": {"prefill_s": out[1] / 1e9}})
            return out
        except BaseException:
            # a refused, failed or cancelled start leaves no session with this id, KV slot included (a restart
            # stopped between chunks would otherwise leave a half-prefilled one; its next call gets NOT_FOUND and
            # the caller starts it again). Unless a later StartSession of the same id replaced it: that one's.
            if self._starts.get(sid) is call:
                self.table.remove(sid)
                self.runner.post(self.worker.end_session, sid)
            raise
        finally:
            if self._starts.get(sid) is call:
                del self._starts[sid]
            self.prefilling[sid] -= 1
            if not self.prefilling[sid]:
                del self.prefilling[sid]
            self.metrics.sessions_active.set(len(self.table))

    def open_sessions(self):
        """{session id: last use} of the sessions that may call soon: those in the table, less those still in
        StartSession (the target's batcher waits for the former, and must not for a prefill)."""
        last = self.table.last_used()
        return {k: v for k, v in last.items() if k not in self.prefilling} if self.prefilling else last

    def _start(self, sid, evicted, prompt_ids, params, kw):
        for e in evicted:
            self.worker.end_session(e)
        t0 = time.perf_counter_ns()
        out = self.worker.start_session(sid, prompt_ids, params, **kw)
        ns = time.perf_counter_ns() - t0
        return self.worker.session_length(sid), ns, out, self.worker.sessions[sid].cached_tokens

    async def _start_interleaved(self, sid, evicted, prompt_ids, params, output_start: int = 0):
        steps = self.worker.start_steps(sid, prompt_ids, params, output_start=output_start)

        def step(end=()):
            for e in end:
                self.worker.end_session(e)
            t0 = time.perf_counter_ns()
            return next(steps), time.perf_counter_ns() - t0

        (s, left), ns = await self.runner.run(step, evicted)  # the session opened
        while left:
            self.table.touch(sid)  # a long prefill is use: LRU eviction must not pick this session meanwhile
            (s, left), took = await self.runner.run(step)  # one forward of its prefill
            ns += took
        # this call's session, not the id's: a later StartSession of the same id may have replaced it meanwhile
        return s.length(), ns, None, s.cached_tokens

    def begin_drain(self) -> None:
        """The server drains: new sessions are refused and per-round streams end; open sessions go on (`idle`)."""
        self.draining = True

    def idle(self) -> bool:
        """No session is open or starting: a draining server may stop without cutting a request short."""
        return not len(self.table) and not self.prefilling

    async def rounds(self, request_iterator, context, handle, field: str, wrap):
        """Serve a per-round stream: `handle` each request's `field` (the unary handler) and yield
        `wrap(response)`, one per request, in order. Ends with UNAVAILABLE once the server drains, so the
        caller moves its session (or resends the call unary) instead of holding the replica past its grace.
        Requests are read as they arrive; while one is handled, `ROUNDS_WAITING` gives those waiting behind it
        (their `field`): a chained verify that no longer applies is skipped where a newer one that applies waits
        (workers/target.py)."""
        waiting: deque = deque()  # requests read ahead (a caller may send several before reading an answer)
        arrived = asyncio.Event()

        async def read_ahead():
            try:
                async for request in request_iterator:
                    waiting.append(request)
                    arrived.set()
            except Exception as e:  # noqa: BLE001 - the stream broke: raised where the requests are handled
                waiting.append(e)
            finally:
                waiting.append(_END)
                arrived.set()

        async def behind() -> tuple:
            # A forward run on this loop's thread (the batcher's direct dispatch) kept the reader from taking the
            # requests that arrived meanwhile: let it take them before saying what waits.
            for _ in range(READ_AHEAD_TURNS):
                await asyncio.sleep(0)
            return tuple(getattr(w, field) for w in waiting if w is not _END and not isinstance(w, Exception))

        reader = asyncio.ensure_future(read_ahead())
        try:
            while True:
                while not waiting:
                    arrived.clear()
                    await arrived.wait()
                request = waiting.popleft()
                if request is _END:
                    return
                if isinstance(request, Exception):
                    raise request
                if self.draining:
                    raise ServiceDraining("this replica is draining; resend the call as a unary RPC or to another "
                                          "replica")
                token = ROUNDS_WAITING.set(behind)
                try:
                    response = await handle(getattr(request, field), context)
                finally:
                    ROUNDS_WAITING.reset(token)
                yield wrap(response)
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    def touch(self, sid: str) -> None:
        """NOT_FOUND for unknown/expired ids; refreshes LRU order."""
        self.table.touch(sid)

    async def end_session(self, sid: str) -> bool:
        log.debug("session %s ended", sid)
        self.table.check_id(sid)
        self.table.remove(sid)
        self.metrics.sessions_active.set(len(self.table))
        self.worker.cancel(sid)  # stops a draft stream of this session at its next token
        return await self.runner.run(self.worker.end_session, sid)

    # -- background reaper of expired sessions --------------------------------------------------------------
    def start_reaper(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def _reap_loop(self):
        while True:
            await asyncio.sleep(self._reap_every)
            gone = self.table.reap()
            if gone:
                log.info("expired %d idle session(s)", len(gone))
                self.metrics.sessions_active.set(len(self.table))
                await self.runner.run(lambda: [self.worker.end_session(s) for s in gone])

    async def close(self):
        await cancel_and_wait(self._reaper)
        self.runner.close()

    def warmup_sync(self) -> None:
        """One tiny prefill so the first real call skips lazy initialisation. Runs on the model thread; the
        worker holds one slot more than max_sessions, so this never competes with client sessions."""
        self.worker.start_session("__warmup__", [0, 0, 0], SamplingParams())
        self.worker.end_session("__warmup__")
        _ = self.worker.grammar_vocab  # structured output's vocabulary (0.4 s for 49k tokens), not on a request
