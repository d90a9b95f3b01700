"""GenerationService (the public front door): validation, prompt encoding, events → responses (the text:
coordinator/grpc_api/text_output.py).

Runs in the driver process. Everything per round happens in a pipeline (in-process or a Ray actor); this class
only turns a GenerateRequest into a token-id request, forwards it, and turns the pipeline's events back into text.

Both doors call one method, `generate` (a GenerateRequest in, GenerateStreamResponses out, a failure raised as
`GenerationFailed` or a specdec error): the gRPC handlers below, and the HTTP door (coordinator/http_api/backend.py),
which maps each body onto a GenerateRequest.

Validation: the request's sampling and speculation settings are read once (coordinator/grpc_api/typed_request.py:
the typed `sampling` and `speculation`, or the deprecated flat fields), then every field's range or choices is
specdec/scheduling/field_rules.py's table, which `prepare` applies with this coordinator's bounds (its cap on
max_new_tokens, the request's gamma and max_new_tokens, the tokenizer's vocabulary), so a bad field gets the same
message through either door. What `prepare` checks itself is what no single field's range says: one prompt kind,
raw_prompt only with text, a prompt that encodes to tokens and fits the context. It hands the pipeline a typed
`specdec.scheduling.request.PipelineRequest`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import asdict, dataclass, replace

import grpc

from coordinator.grpc_api.chat_prompt import chat_message, log_failure, log_request, template_options
from coordinator.grpc_api.output_constraints import OutputConstraints
from coordinator.grpc_api.prompt_work import PromptWork, least_prompt_tokens, longest_token_bytes, prompt_bytes
from coordinator.grpc_api.reasoning import ReasoningSplitter, ReasoningStart, reasoning_tokens
from coordinator.grpc_api.text_output import TextAssembler
from coordinator.grpc_api.typed_request import Settings, read
from coordinator.events import DoneEvent, ErrorEvent, RequestStats, Served, ServedEvent, TokensEvent
from specdec.common.errors import ContextOverflowError, InvalidRequestError
from specdec.scheduling.request import GenerationRequest, PipelineRequest
from specdec_rpc.decode import sampling_from_proto
from specdec_rpc.pb import common_pb2, generation_pb2, generation_pb2_grpc

FINISH = {"length": generation_pb2.FINISH_REASON_LENGTH, "stop": generation_pb2.FINISH_REASON_STOP,
          "cancelled": generation_pb2.FINISH_REASON_CANCELLED}
FINISH_NAME = {v: k for k, v in FINISH.items()}
DEFAULT_MAX_NEW_TOKENS = 128
CONTEXT_REFRESH_S = 30.0
SIZE_CHECK_BYTES = 16 * 1024  # text this long is checked against the context before it is tokenized
SIZE_CHECK_IDS = 1024  # as many token ids: checked against the context before the request goes on


def logprobs_pb(entries: list | None) -> generation_pb2.GeneratedLogprobs | None:
    """(logprob, top ids, top logprobs) per token → the response's logprobs (None: not asked)."""
    if entries is None:
        return None
    return generation_pb2.GeneratedLogprobs(logprobs=[e[0] for e in entries],
                                            top=[common_pb2.TopLogprobs(ids=e[1], logprobs=e[2]) for e in entries])


def stop_reason_fields(reason: str | int | None) -> dict:
    """A response's stop_reason oneof: a stop string or a stop token id (none for EOS)."""
    if reason is None:
        return {}
    return {"stop_string": reason} if isinstance(reason, str) else {"stop_token_id": reason}


def failure_status(e: BaseException) -> tuple[str, str]:
    """(gRPC status name, message) an exception becomes (specdec_rpc/interceptor.py's mapping)."""
    from specdec_rpc.interceptor import status_for

    code, message = status_for(e)
    return code.name, message


def stats_pb(stats: RequestStats) -> generation_pb2.GenerationStats:
    """A request's stats → the response's GenerationStats: every field the message has of the same name."""
    fields = generation_pb2.GenerationStats.DESCRIPTOR.fields_by_name
    return generation_pb2.GenerationStats(**{k: v for k, v in stats.to_dict().items() if k in fields})


def prompt_kind(r: generation_pb2.GenerateRequest) -> str:
    """The one prompt field the request sets: prompt (text), messages (chat) or prompt_token_ids."""
    given = [n for n, ok in (("prompt", r.HasField("prompt")), ("messages", len(r.messages) > 0),
                             ("prompt_token_ids", len(r.prompt_token_ids) > 0)) if ok]
    if not given:
        raise InvalidRequestError("prompt", "send one of prompt (text), messages (chat) or prompt_token_ids")
    if len(given) > 1:
        raise InvalidRequestError(given[-1], f"send only one of prompt, messages, prompt_token_ids "
                                             f"(got {' and '.join(given)})")
    return given[0]


class GenerationFailed(Exception):
    """A generation ended by a status that is not a specdec error: a replica's or the pipeline's error event, or an
    answer over the message limit. The gRPC door answers it with the status, the HTTP door with its mapping."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Prepared:
    request: PipelineRequest
    assembler: TextAssembler
    reasoning: ReasoningStart | None = None  # separate_reasoning: where the answer starts (grpc_api/reasoning.py)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, router, tokenizer=None, eos_token_ids=(), max_new_tokens_cap: int = 4096, metrics=None,
                 spec_off_batch: int = 0, pacer_post_threshold: float | None = None, default_mode: str = "sd",
                 gamma: int = 0, verify_method: str = "block", pacer_threshold: float | None = None):
        self.router, self.tok, self.eos = router, tokenizer, tuple(sorted(eos_token_ids))
        self.output = OutputConstraints(tokenizer, self.eos)  # bad words, structured output, separate reasoning
        self.cap, self.metrics = max_new_tokens_cap, metrics
        self.spec_off_batch = spec_off_batch  # defaults for requests that leave them unset
        self.pacer_post_threshold = pacer_post_threshold
        self.default_mode = default_mode
        self.gamma = gamma or None  # the server-wide speculation settings (0 / None: the mode's own)
        self.verify_method, self.pacer_threshold = verify_method, pacer_threshold
        self.tracer = None  # an OpenTelemetry tracer (COORDINATOR_OTLP_TRACES_ENDPOINT): one span per generation
        self.draft_fallback = True  # no draft replica reachable: run target-only (COORDINATOR_DRAFT_FALLBACK)
        self.context_len, self._context_at = 0, -1e9  # the target pool's max_model_len (0: unknown), and when read
        self._context_read: asyncio.Future | None = None
        self.in_flight = 0  # requests between arrival and end, both doors (running + waiting for sessions)
        self.max_message_bytes = 0  # the gRPC send limit a whole answer must fit (0: unchecked)
        self.work = PromptWork()  # tokenizing, chat templates, grammars: off the event loop (grpc_api/prompt_work.py)
        self._longest_token: int | None = None  # the bytes one token covers at most (0: unknown), read on first use

    @property
    def reasoning_parser(self) -> str:
        """separate_reasoning's parser (COORDINATOR_REASONING_PARSER; "": refused), which `output` applies."""
        return self.output.reasoning_parser

    @reasoning_parser.setter
    def reasoning_parser(self, name: str) -> None:
        self.output.reasoning_parser = name

    # -- request → token ids --------------------------------------------------------------------------------
    def prepare(self, r: generation_pb2.GenerateRequest) -> Prepared:
        """The request checked (specdec/scheduling/field_rules.py's table, then what spans fields), its prompt encoded,
        and the token-id request the pipeline runs."""
        given = prompt_kind(r)
        to_context = r.max_new_tokens_to_context and not r.HasField("max_new_tokens") and self.context_len > 0
        max_new = (r.max_new_tokens if r.HasField("max_new_tokens") else
                   self.cap if to_context else min(DEFAULT_MAX_NEW_TOKENS, self.cap))
        settings = read(r, self._defaults(), cap=self.cap, max_new_tokens=max_new,
                        vocab=len(self.tok) if self.tok is not None else None)
        if r.raw_prompt and not r.HasField("prompt"):
            raise InvalidRequestError("raw_prompt", f"applies to prompt (text) only; leave it unset with {given}")
        ids = self._prompt_ids(r, given)
        if self.context_len and len(ids) >= self.context_len:  # refused here, not after shipping it to a replica
            raise self._overflow(len(ids))
        reasoning = self.output.derive(r, ids, settings.sampling)  # the grammar and bad words, into the message
        if to_context:  # what the context leaves (a prompt that leaves too little: OUT_OF_RANGE from the replica)
            max_new = max(min(self.cap, self.context_len - len(ids)), settings.sampling.min_tokens, 1)
        req = self._request(r, settings, ids, max_new)
        return Prepared(req, self._assembler(r, ids, req.generation), reasoning)

    def _prompt_ids(self, r: generation_pb2.GenerateRequest, given: str) -> list[int]:
        """The prompt's token ids: as sent, or the text or messages encoded (the chat template applied to
        messages, and to text unless raw_prompt); the last truncate_prompt_tokens of them where it is set."""
        if r.prompt_token_ids:
            template_options(r)  # refuses the chat template's fields: token ids go in as they are
            ids = list(r.prompt_token_ids)
        else:
            ids = self._encode(r, given)
        return ids[-r.truncate_prompt_tokens:] if r.HasField("truncate_prompt_tokens") else ids

    def _encode(self, r: generation_pb2.GenerateRequest, given: str) -> list[int]:
        if self.tok is None:
            raise InvalidRequestError(given, "this coordinator has no tokenizer (its model has none); send "
                                             "prompt_token_ids")
        from specdec.text.tokenizer import encode_prompt

        tools, template = template_options(r)
        try:
            ids = (encode_prompt(self.tok, prompt=r.prompt, raw=r.raw_prompt) if r.HasField("prompt") else
                   encode_prompt(self.tok, messages=[chat_message(m) for m in r.messages], tools=tools,
                                 template=template))
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(given, str(e)) from None
        if not ids:
            raise InvalidRequestError(given, "encodes to no tokens; send a non-empty prompt")
        return ids

    def _defaults(self) -> dict:
        """The speculation settings a request leaves unset take these (None: the mode's or the replica's own)."""
        return {"mode": self.default_mode, "verify_method": self.verify_method, "gamma": self.gamma,
                "pacer_threshold": self.pacer_threshold, "spec_off_batch": self.spec_off_batch,
                "pacer_post_threshold": self.pacer_post_threshold}

    def _request(self, r: generation_pb2.GenerateRequest, settings: Settings, ids: list[int],
                 max_new: int) -> PipelineRequest:
        """The pipeline's request, typed; unset settings take this coordinator's defaults."""
        rid = f"{r.request_id}-{uuid.uuid4().hex[:12]}" if r.request_id else uuid.uuid4().hex
        eos = sorted(set(() if r.ignore_eos else self.eos) | set(r.stop_token_ids))
        sampling = settings.sampling  # the request's message: completed here, then sent to the replicas as it is
        sampling.stop_ids[:] = eos if sampling.min_tokens else ()
        sampling.allowed_token_ids[:] = sorted(set(sampling.allowed_token_ids))
        generation = GenerationRequest(prompt_ids=ids, max_new_tokens=max_new, params=sampling_from_proto(sampling),
                                       eos_token_ids=tuple(eos), priority=r.priority, session_id=rid,
                                       **settings.speculation.request_fields())
        return PipelineRequest(generation, draft_fallback=self.draft_fallback)

    def _assembler(self, r: generation_pb2.GenerateRequest, ids: list[int], req: GenerationRequest) -> TextAssembler:
        eos = set(() if r.ignore_eos else self.eos)
        return TextAssembler(self.tok, ids, list(r.stop), req.params.min_tokens, stop_token_ids=list(req.eos_token_ids),
                             user_stop_token_ids=set(r.stop_token_ids) - eos,
                             include_stop=r.include_stop_str_in_output,
                             skip_special_tokens=not r.HasField("skip_special_tokens") or r.skip_special_tokens)

    # -- events → responses ---------------------------------------------------------------------------------
    async def generate(self, r: generation_pb2.GenerateRequest, incremental: bool = True, metadata=()):
        """The generation service's one method, which both front doors call (gRPC below, HTTP in
        coordinator/http_api/backend.py): yields GenerateStreamResponses, the last one with finish_reason and stats;
        a failure is raised (GenerationFailed, or a specdec error such as InvalidRequestError). `incremental=False`
        (a whole answer without stop strings: nothing to send or check before the end): the pipeline sends no
        per-round events, only the final one, which carries every token. `metadata`: the (key, value) pairs of the
        call (gRPC metadata, or the HTTP request's trace headers). With a tracer, the generation is one span
        (coordinator/tracing.py), ended with the error that ended the generation, if one did."""
        trace = None
        if self.tracer is not None:
            from coordinator.tracing import RequestTrace

            trace = RequestTrace(self.tracer, metadata)
        try:
            async with contextlib.aclosing(self._respond(r, incremental, trace)) as responses:
                async for resp in responses:
                    yield resp
        except BaseException as e:
            if trace is not None:
                trace.end(trace.request, error=trace.error or (
                    "the client went away" if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else
                    f"{type(e).__name__}: {e}"))
            raise

    async def _context_len(self) -> None:
        """Refresh `context_len` (the target replicas' session context) every CONTEXT_REFRESH_S, for requests whose
        max_new_tokens defaults to what the context leaves."""
        if not hasattr(self.router, "max_model_len"):
            return
        read = self._context_read
        if read is None or (read.done() and time.monotonic() - self._context_at >= CONTEXT_REFRESH_S):
            self._context_at = time.monotonic()
            read = self._context_read = asyncio.ensure_future(self._read_context_len())
        await asyncio.shield(read)  # requests arriving meanwhile wait for the same read, not for nothing

    async def _read_context_len(self) -> None:
        with contextlib.suppress(Exception):  # unknown: the request falls back to the fixed default
            self.context_len = int(await self.router.max_model_len())
        if not self.context_len:
            self._context_at = -1e9  # ask again on the next such request

    async def check_size(self, r: generation_pb2.GenerateRequest) -> None:
        """OUT_OF_RANGE for a prompt longer than the context could hold, before tokenizing it: token ids past the
        context, or a text whose fewest possible tokens (grpc_api/prompt_work.py) leave no position to generate
        in. Cheap, and on the loop: a refusal does not wait behind the prompt work in the pool."""
        n_ids = len(r.prompt_token_ids)
        text = self.tok is not None and prompt_bytes(r) >= SIZE_CHECK_BYTES
        if r.HasField("truncate_prompt_tokens") or not (text or n_ids >= SIZE_CHECK_IDS):
            return
        await self._context_len()
        if not self.context_len:
            return
        if n_ids >= self.context_len:
            raise self._overflow(n_ids)
        if not text:
            return
        if self._longest_token is None:
            self._longest_token = await self.work.run(longest_token_bytes, self.tok)
        least = least_prompt_tokens(r, self._longest_token)
        if least >= self.context_len:
            raise ContextOverflowError(
                f"This model's maximum context length is {self.context_len} tokens. However, the prompt has "
                f"{prompt_bytes(r)} bytes of text, at least {least} tokens (a token covers at most "
                f"{self._longest_token} bytes); shorten it, or send truncate_prompt_tokens")

    def _overflow(self, n_prompt: int) -> ContextOverflowError:
        """A prompt of `n_prompt` tokens leaves no position to generate in (the replicas' words for it)."""
        return ContextOverflowError(f"This model's maximum context length is {self.context_len} tokens. However, "
                                    f"the prompt alone has {n_prompt} tokens: shorten it by at least "
                                    f"{n_prompt - self.context_len + 1}, or send truncate_prompt_tokens")

    async def _prepared(self, r, trace) -> Prepared:
        if r.max_new_tokens_to_context and not r.HasField("max_new_tokens"):
            await self._context_len()
        await self.check_size(r)
        p = await self.work.run(self.prepare, r)  # tokenizing, the chat template: off the loop
        if trace is not None:
            trace.request = p.request  # with its trace headers: the replicas' spans are the request span's children
        grammar = p.request.generation.params.grammar
        if grammar:
            await self.work.run(self.output.check_grammar, grammar)
        return p

    async def _respond(self, r, incremental: bool, trace):
        call = _Call(self, r, trace)
        self.in_flight += 1
        try:
            call.start(await self._prepared(r, trace), incremental)
            # the pipeline takes the typed request as it is (pickled whole where it crosses to a Ray actor)
            async with contextlib.aclosing(self.router.stream(call.p.request)) as events:
                async for ev in events:
                    match ev:
                        case TokensEvent():
                            call.served = ev.served or call.served
                            if (resp := await call.tokens(ev)) is not None:
                                yield resp
                        case ServedEvent():
                            call.served = ev.served
                        case ErrorEvent():
                            call.error(ev)
                        case DoneEvent():
                            yield call.done(ev)
                            return
        except BaseException as e:
            call.failed(e)
            raise
        finally:
            self.in_flight -= 1
            call.ended()

    def _ended(self, outcome: tuple, stats: RequestStats, wall_s: float) -> None:
        """A request that did not generate to its end: counted and logged once (the client went away: "abort", as
        vLLM's finish_reason; or it failed, by status)."""
        if outcome[0] == "abort":
            log_request(stats, "abort", wall_s)
            if self.metrics:
                self.metrics.requests.labels("abort").inc()
                self.metrics.e2e.observe(wall_s)
            return
        _, code, message = outcome
        log_failure(stats.request_id, code, message, wall_s)
        if self.metrics:
            self.metrics.errors.labels(code).inc()

    async def GenerateStream(self, request, context):
        try:
            async with contextlib.aclosing(self.generate(request, metadata=context.invocation_metadata())) as out:
                async for resp in out:
                    yield resp
        except GenerationFailed as e:
            await context.abort(e.code, e.message)

    async def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        try:
            return await self.whole(request, context.invocation_metadata())
        except GenerationFailed as e:
            await context.abort(e.code, e.message)

    async def whole(self, request, metadata=()) -> generation_pb2.GenerateResponse:
        """`generate`'s responses as one GenerateResponse (the unary Generate)."""
        out = generation_pb2.GenerateResponse()
        text, reasoning = [], []
        async for resp in self.generate(request, incremental=False, metadata=metadata):
            text.append(resp.text_delta)
            reasoning.append(resp.reasoning_delta)
            out.token_ids.extend(resp.token_ids)
            if resp.HasField("logprobs"):
                out.logprobs.logprobs.extend(resp.logprobs.logprobs)
                out.logprobs.top.extend(resp.logprobs.top)
            if resp.HasField("prompt_logprobs"):
                out.prompt_logprobs.CopyFrom(resp.prompt_logprobs)
            if resp.finish_reason:
                out.finish_reason = resp.finish_reason
                out.stats.CopyFrom(resp.stats)
                if (which := resp.WhichOneof("stop_reason")) is not None:
                    setattr(out, which, getattr(resp, which))
        out.text, out.reasoning = "".join(text), "".join(reasoning)
        size = out.ByteSize()
        if self.max_message_bytes and size > self.max_message_bytes:  # gRPC's own refusal names no setting
            message = (f"the answer is {size} bytes, over the coordinator's message limit of {self.max_message_bytes} "
                       f"(COORDINATOR_MAX_MESSAGE_BYTES): use GenerateStream (a message per round), ask for fewer "
                       f"tokens or logprobs, or raise the limit")
            self._ended(("error", "RESOURCE_EXHAUSTED", message), RequestStats(request_id=out.stats.request_id),
                        out.stats.wall_s)
            raise GenerationFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return out


class _Call:
    """One generation between the pipeline's events and the responses (`GenerationServicer._respond`): its text so
    far, its first token's time, and how it ended, for the logs, the trace and the metrics."""

    def __init__(self, servicer: GenerationServicer, r, trace):
        self.s, self.r, self.trace = servicer, r, trace
        self.t0, self.first, self.ttft = time.perf_counter(), True, None
        self.rid, self.asm, self.p, self.split, self.n_prompt = r.request_id or "-", None, None, None, 0
        # ("error", status name, message) once an error event came; "done" once the answer went out
        self.outcome = None
        self.served = Served()  # what the request holds (prompt tokens, replicas), for the log line of an abort

    def start(self, p: Prepared, incremental: bool) -> None:
        self.p, self.asm, self.rid = p, p.assembler, p.request.request_id
        self.split = ReasoningSplitter(p.reasoning) if p.reasoning is not None else None
        self.n_prompt = len(p.request.generation.prompt_ids)
        p.request.final_only = not (incremental or self.asm.stop)
        self.served = Served(prompt_tokens=self.n_prompt)

    async def tokens(self, ev: TokensEvent) -> generation_pb2.GenerateStreamResponse | None:
        """A round's tokens → the response that carries their text (None: nothing to send yet)."""
        asm = self.asm
        was_stopped = asm.stopped
        text, ids = asm.push(ev.tokens)
        if asm.stopped and not was_stopped:
            await self.s.router.stop(self.rid)  # finish after this round; the rest is dropped
        thought = ""
        if self.split is not None:
            thought, text = self.split.feed(text)
        if not (text or thought or ids):
            return None
        self._first_token()
        lps = ev.logprobs
        return generation_pb2.GenerateStreamResponse(text_delta=text, token_ids=ids, reasoning_delta=thought,
                                                     prompt_tokens=self.n_prompt,
                                                     logprobs=logprobs_pb(lps[:len(ids)] if lps else None))

    def _first_token(self) -> None:
        if self.first:
            if self.s.metrics:
                self.ttft = time.perf_counter() - self.t0
                self.s.metrics.ttft.observe(self.ttft)
            if self.trace is not None:
                self.trace.first_token()
        self.first = False

    def error(self, error: ErrorEvent) -> None:
        code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)
        self.outcome = ("error", code.name, error.message)
        if self.trace is not None:
            self.trace.error = f"{code.name}: {error.message}"
        raise GenerationFailed(code, error.message)

    def done(self, ev: DoneEvent) -> generation_pb2.GenerateStreamResponse:
        """The final event → the last response: the text no round's event carried, finish_reason and stats."""
        asm = self.asm
        done = len(asm.token_ids)
        rest = ev.token_ids[done:]  # what no per-round event carried
        text, ids = asm.push(rest) if rest and not asm.stopped else ("", [])
        lps = ev.logprobs
        finish = "stop" if asm.stopped else ev.finish_reason
        tail, thought = text + asm.finish(), ""
        stats = replace(ev.stats, completion_tokens=len(asm.token_ids), request_id=self.rid)
        if self.split is not None:
            thought, tail, stats.reasoning_tokens = self._end_reasoning(tail)
        self._finished(stats, finish)
        self.outcome = "done"
        return generation_pb2.GenerateStreamResponse(
            text_delta=tail, token_ids=ids, finish_reason=FINISH[finish], stats=stats_pb(stats),
            reasoning_delta=thought, prompt_tokens=self.n_prompt,
            logprobs=logprobs_pb(lps[done:done + len(ids)] if lps is not None else None),
            prompt_logprobs=logprobs_pb(ev.prompt_logprobs),
            **stop_reason_fields(asm.stop_reason if finish == "stop" else None))

    def _end_reasoning(self, tail: str) -> tuple[str, str, int]:
        """The last text split into (reasoning, answer), and the answer's reasoning_tokens."""
        thought, tail = self.split.feed(tail)
        more_thought, more = self.split.end()
        n = reasoning_tokens(self.p.reasoning, self.asm.token_ids, self.s.output.tags)
        return thought + more_thought, tail + more, n

    def _finished(self, stats: RequestStats, finish: str) -> None:
        """An answer generated to its end: its log line, its trace's end, its metrics."""
        log_request(stats, finish, time.perf_counter() - self.t0)
        if self.trace is not None:
            if self.asm.token_ids:
                self.trace.first_token()  # a whole answer's first token reaches the client now
            self.trace.end(self.trace.request, stats, finish)
        m = self.s.metrics
        if m:
            if self.first and self.asm.token_ids:  # a whole answer: its first token reaches the client now
                m.ttft.observe(time.perf_counter() - self.t0)
            m.finished(stats, finish, len(self.asm.token_ids), time.perf_counter() - self.t0, self.ttft)

    def failed(self, e: BaseException) -> None:
        if self.outcome is None:
            self.outcome = ("abort",) if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else \
                ("error",) + failure_status(e)

    @property
    def mode(self) -> str:
        return self.p.request.generation.mode if self.p is not None else self.r.mode or self.s.default_mode

    def ended(self) -> None:
        """A request that did not generate to its end is counted and logged once (GenerationServicer._ended)."""
        if isinstance(self.outcome, tuple):
            sent = len(self.asm.token_ids) if self.asm is not None else 0
            stats = RequestStats(request_id=self.rid, mode=self.mode, completion_tokens=sent, **asdict(self.served))
            self.s._ended(self.outcome, stats, time.perf_counter() - self.t0)


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
