"""GenerationService (the public front door): validation, prompt encoding, events → responses (the text:
coordinator/grpc_api/text_output.py).

Runs in the driver process. Everything per round happens in a pipeline (in-process or a Ray actor); this class
only turns a GenerateRequest into a token-id request, forwards it, and turns the pipeline's events back into text.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

import grpc

from coordinator.grpc_api.chat_prompt import REQUEST_ID, chat_message, log_failure, log_request, template_options
from coordinator.grpc_api.output_constraints import OutputConstraints
from coordinator.grpc_api.prompt_work import PromptWork, least_prompt_tokens, longest_token_bytes, prompt_bytes
from coordinator.grpc_api.reasoning import ReasoningSplitter, ReasoningStart, reasoning_tokens
from coordinator.grpc_api.text_output import TextAssembler
from specdec.errors import ContextOverflowError, InvalidRequestError
from specdec_rpc.pb import common_pb2, generation_pb2, generation_pb2_grpc
from specdec.request import MAX_SPEC_OFF_BATCH, MODES, PEARL_OVERLAP
from specdec.sampling import MAX_TOP_LOGPROBS

MAX_STOP_TOKEN_IDS = 64

FINISH = {"length": generation_pb2.FINISH_REASON_LENGTH, "stop": generation_pb2.FINISH_REASON_STOP,
          "cancelled": generation_pb2.FINISH_REASON_CANCELLED}
FINISH_NAME = {v: k for k, v in FINISH.items()}
VERIFY_METHODS = ("token", "block", "greedy")
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


def stats_pb(stats: dict) -> generation_pb2.GenerationStats:
    fields = generation_pb2.GenerationStats.DESCRIPTOR.fields_by_name
    return generation_pb2.GenerationStats(**{k: v for k, v in stats.items() if k in fields})


@dataclass
class Prepared:
    request: dict
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
        given = [n for n, ok in (("prompt", r.HasField("prompt")), ("messages", len(r.messages) > 0),
                                 ("prompt_token_ids", len(r.prompt_token_ids) > 0)) if ok]
        if not given:
            raise InvalidRequestError("prompt", "send one of prompt (text), messages (chat) or prompt_token_ids")
        if len(given) > 1:
            raise InvalidRequestError(given[-1], f"send only one of prompt, messages, prompt_token_ids "
                                                 f"(got {' and '.join(given)})")
        mode = r.mode or self.default_mode
        if mode not in MODES:
            raise InvalidRequestError("mode", f"unknown mode {r.mode!r}; use one of {', '.join(MODES)}")
        if not r.temperature >= 0.0:
            raise InvalidRequestError("temperature", f"must be >= 0 (0 is greedy), got {r.temperature}")
        to_context = r.max_new_tokens_to_context and not r.HasField("max_new_tokens") and self.context_len > 0
        max_new = (r.max_new_tokens if r.HasField("max_new_tokens") else
                   self.cap if to_context else min(DEFAULT_MAX_NEW_TOKENS, self.cap))
        if not 0 < max_new <= self.cap:
            raise InvalidRequestError("max_new_tokens", f"must be in [1, {self.cap}] (the coordinator's cap), "
                                                        f"got {max_new}")
        method = r.verify_method or self.verify_method
        if method not in VERIFY_METHODS:
            raise InvalidRequestError("verify_method", f"unknown {r.verify_method!r}; use token or block")
        if r.HasField("pacer_threshold") and not 0.0 <= r.pacer_threshold <= 1.0:
            raise InvalidRequestError("pacer_threshold", f"must be in [0, 1], got {r.pacer_threshold}")
        if r.HasField("pacer_skip_below") and not 0.0 <= r.pacer_skip_below <= 1.0:
            raise InvalidRequestError("pacer_skip_below", f"must be in [0, 1], got {r.pacer_skip_below}")
        if r.HasField("pacer_post_threshold") and not 0.0 <= r.pacer_post_threshold <= 1.0:
            raise InvalidRequestError("pacer_post_threshold", f"must be in [0, 1], got {r.pacer_post_threshold}")
        if r.HasField("pearl_first_block") and not 0 <= r.pearl_first_block <= 64:
            raise InvalidRequestError("pearl_first_block", f"must be in [0, gamma] (0: PEARL pre-verify), "
                                                           f"got {r.pearl_first_block}")
        if r.HasField("spec_off_batch") and not 0 <= r.spec_off_batch <= MAX_SPEC_OFF_BATCH:
            raise InvalidRequestError("spec_off_batch", f"must be in [0, {MAX_SPEC_OFF_BATCH}] (0: always speculate), "
                                                        f"got {r.spec_off_batch}")
        if r.pearl_overlap and r.pearl_overlap not in PEARL_OVERLAP:
            raise InvalidRequestError("pearl_overlap", f"use one of {', '.join(PEARL_OVERLAP)} (empty: auto), "
                                                       f"got {r.pearl_overlap!r}")
        if r.HasField("gamma") and not 1 <= r.gamma <= 64:
            raise InvalidRequestError("gamma", f"must be in [1, 64], got {r.gamma}")
        if r.HasField("block_size") and r.block_size < 1:
            raise InvalidRequestError("block_size", f"must be >= 1, got {r.block_size}")
        if r.HasField("top_p") and not 0.0 < r.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1] (1 disables it), got {r.top_p}")
        if r.raw_prompt and not r.HasField("prompt"):
            raise InvalidRequestError("raw_prompt", "applies to prompt (text) only; leave it unset with "
                                                    f"{given[0]}")
        for name in ("logprobs", "prompt_logprobs"):
            if r.HasField(name) and not 0 <= getattr(r, name) <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(name, f"top alternatives per token must be in [0, {MAX_TOP_LOGPROBS}] "
                                                f"(unset: no logprobs), got {getattr(r, name)}")
        if r.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {r.top_k}")
        if not 0.0 <= r.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1] (0 disables it), got {r.min_p}")
        if not 0 <= r.min_tokens <= max_new:
            raise InvalidRequestError("min_tokens", f"must be in [0, max_new_tokens={max_new}], got {r.min_tokens}")
        if len(r.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in r.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"send at most {MAX_STOP_TOKEN_IDS} token ids, each >= 0")
        if self.tok is not None and (bad := next((t for t in r.stop_token_ids if t >= len(self.tok)), None)) is not None:
            raise InvalidRequestError("stop_token_ids", f"id {bad} is outside the vocabulary [0, {len(self.tok)})")
        if r.prompt_token_ids:
            template_options(r)  # refuses the chat template's fields: token ids go in as they are
            ids = list(r.prompt_token_ids)
            if any(t < 0 for t in ids):
                raise InvalidRequestError("prompt_token_ids", "token ids must be >= 0")
        else:
            if self.tok is None:
                raise InvalidRequestError(given[0], "this coordinator has no tokenizer (its model has none); "
                                                    "send prompt_token_ids")
            from specdec.tokenizer import encode_prompt

            tools, template = template_options(r)
            try:
                ids = (encode_prompt(self.tok, prompt=r.prompt, raw=r.raw_prompt) if r.HasField("prompt") else
                       encode_prompt(self.tok, messages=[chat_message(m) for m in r.messages], tools=tools,
                                     template=template))
            except InvalidRequestError:
                raise
            except ValueError as e:
                raise InvalidRequestError(given[0], str(e)) from None
            if not ids:
                raise InvalidRequestError(given[0], "encodes to no tokens; send a non-empty prompt")
        if r.HasField("truncate_prompt_tokens"):
            if r.truncate_prompt_tokens < 1:
                raise InvalidRequestError("truncate_prompt_tokens", "keep at least 1 token (unset: the whole "
                                                                    f"prompt), got {r.truncate_prompt_tokens}")
            ids = ids[-r.truncate_prompt_tokens:]
        if r.request_id and not REQUEST_ID.fullmatch(r.request_id):
            raise InvalidRequestError("request_id", "at most 64 letters, digits and . _ : - (X-Request-Id over "
                                                    "HTTP)")
        if self.context_len and len(ids) >= self.context_len:  # refused here, not after shipping it to a replica
            raise self._overflow(len(ids))
        rid = f"{r.request_id}-{uuid.uuid4().hex[:12]}" if r.request_id else uuid.uuid4().hex
        reasoning = self.output.reasoning_start(r, ids)
        if to_context:  # what the context leaves (a prompt that leaves too little: OUT_OF_RANGE from the replica)
            max_new = max(min(self.cap, self.context_len - len(ids)), r.min_tokens, 1)
        req = {"request_id": rid, "prompt_ids": ids, "max_new_tokens": max_new,
               "temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p if r.HasField("top_p") else 1.0,
               "seed": r.seed, "mode": mode, "verify_method": method,
               "gamma": r.gamma if r.HasField("gamma") else self.gamma,
               "block_size": r.block_size if r.HasField("block_size") else None,
               "pacer_threshold": r.pacer_threshold if r.HasField("pacer_threshold") else self.pacer_threshold,
               "pacer_skip_below": r.pacer_skip_below if r.HasField("pacer_skip_below") else None,
               "pearl_first_block": r.pearl_first_block if r.HasField("pearl_first_block") else None,
               "spec_off_batch": r.spec_off_batch if r.HasField("spec_off_batch") else self.spec_off_batch,
               "pacer_post_threshold": (r.pacer_post_threshold if r.HasField("pacer_post_threshold")
                                        else self.pacer_post_threshold),
               "pearl_overlap": r.pearl_overlap or None,
               "eos_token_ids": sorted(set(() if r.ignore_eos else self.eos) | set(r.stop_token_ids)),
               "logprobs": r.logprobs if r.HasField("logprobs") else -1,
               "prompt_logprobs": r.prompt_logprobs if r.HasField("prompt_logprobs") else -1,
               "cache_salt": r.cache_salt, "priority": r.priority, "presence_penalty": r.presence_penalty,
               "frequency_penalty": r.frequency_penalty,
               "repetition_penalty": r.repetition_penalty if r.HasField("repetition_penalty") else 1.0,
               "logit_bias": sorted((int(k), float(v)) for k, v in r.logit_bias.items()),
               "grammar": self.output.grammar(r, reasoning), "min_p": r.min_p, "min_tokens": r.min_tokens,
               "allowed_token_ids": sorted(set(r.allowed_token_ids)), "bad_words": self.output.bad_words(r),
               "draft_fallback": self.draft_fallback}
        eos = set(() if r.ignore_eos else self.eos)
        asm = TextAssembler(self.tok, ids, list(r.stop), r.min_tokens, stop_token_ids=req["eos_token_ids"],
                            user_stop_token_ids=set(r.stop_token_ids) - eos,
                            include_stop=r.include_stop_str_in_output,
                            skip_special_tokens=not r.HasField("skip_special_tokens") or r.skip_special_tokens)
        return Prepared(req, asm, reasoning)

    # -- events → responses ---------------------------------------------------------------------------------
    def respond(self, r, context, incremental: bool = True):
        """Yields GenerateStreamResponse; the last one carries finish_reason and stats. `incremental=False`
        (a unary call without stop strings: nothing to send or check before the end): the pipeline sends no
        per-round events, only the final one, which carries every token. Both front doors call it (gRPC here, HTTP
        in coordinator/http_api/app.py); `context` needs `abort(code, message)` and `invocation_metadata()`. With a
        tracer, the generation is one span (coordinator/tracing.py); without one, nothing wraps the responses."""
        if self.tracer is None:
            return self._respond(r, context, incremental, None)
        return self._traced(r, context, incremental)

    async def _traced(self, r, context, incremental: bool):
        from coordinator.tracing import RequestTrace

        trace = RequestTrace(self.tracer, context.invocation_metadata())
        try:
            async with contextlib.aclosing(self._respond(r, context, incremental, trace)) as responses:
                async for resp in responses:
                    yield resp
        except BaseException as e:
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

    async def _respond(self, r, context, incremental: bool, trace):
        t0, first, ttft, m = time.perf_counter(), True, None, self.metrics
        rid, asm = r.request_id or "-", None
        self.in_flight += 1
        outcome = None  # ("error", status name) once an error event came; "done" once the answer went out
        served: dict = {}  # what the request holds (prompt tokens, replicas), for the log line of an abort
        try:
            if r.max_new_tokens_to_context and not r.HasField("max_new_tokens"):
                await self._context_len()
            await self.check_size(r)
            p = await self.work.run(self.prepare, r)  # tokenizing, the chat template: off the loop
            if trace is not None:
                trace.request = p.request
            if p.request["grammar"]:
                await self.work.run(self.output.check_grammar, p.request["grammar"])
            asm, rid = p.assembler, p.request["request_id"]
            split = ReasoningSplitter(p.reasoning) if p.reasoning is not None else None
            n_prompt = len(p.request["prompt_ids"])
            p.request["final_only"] = not (incremental or asm.stop)
            served["prompt_tokens"] = n_prompt
            async with contextlib.aclosing(self.router.stream(p.request)) as events:
                async for ev in events:
                    served.update(ev.get("served") or ())
                    if "tokens" in ev:
                        was_stopped = asm.stopped
                        text, ids = asm.push(ev["tokens"])
                        if asm.stopped and not was_stopped:
                            await self.router.stop(rid)  # finish after this round; the rest is dropped
                        thought = ""
                        if split is not None:
                            thought, text = split.feed(text)
                        if text or thought or ids:
                            if first and m:
                                ttft = time.perf_counter() - t0
                                m.ttft.observe(ttft)
                            if first and trace is not None:
                                trace.first_token()
                            first = False
                            lps = ev.get("logprobs")
                            yield generation_pb2.GenerateStreamResponse(
                                text_delta=text, token_ids=ids, reasoning_delta=thought, prompt_tokens=n_prompt,
                                logprobs=logprobs_pb(lps[:len(ids)] if lps else None))
                    elif "error" in ev:
                        code = getattr(grpc.StatusCode, ev["error"]["code"], grpc.StatusCode.INTERNAL)
                        outcome = ("error", code.name, ev["error"]["message"])
                        if trace is not None:
                            trace.error = f"{code.name}: {ev['error']['message']}"
                        await context.abort(code, ev["error"]["message"])
                    elif ev.get("done"):
                        done = len(asm.token_ids)
                        rest = ev["token_ids"][done:]  # what no per-round event carried
                        text, ids = asm.push(rest) if rest and not asm.stopped else ("", [])
                        lps = ev.get("logprobs")
                        finish = "stop" if asm.stopped else ev["finish_reason"]
                        tail, thought = text + asm.finish(), ""
                        stats = dict(ev["stats"], completion_tokens=len(asm.token_ids), request_id=rid)
                        if split is not None:
                            thought, tail = split.feed(tail)
                            more_thought, more = split.end()
                            thought, tail = thought + more_thought, tail + more
                            stats["reasoning_tokens"] = reasoning_tokens(p.reasoning, asm.token_ids, self.output.tags)
                        log_request(stats, finish, time.perf_counter() - t0)
                        if trace is not None:
                            if asm.token_ids:
                                trace.first_token()  # a whole answer's first token reaches the client now
                            trace.end(p.request, stats, finish)
                        if m:
                            if first and asm.token_ids:  # a whole answer: its first token reaches the client now
                                m.ttft.observe(time.perf_counter() - t0)
                            m.finished(stats, finish, len(asm.token_ids), time.perf_counter() - t0, ttft)
                        outcome = "done"
                        yield generation_pb2.GenerateStreamResponse(
                            text_delta=tail, token_ids=ids, finish_reason=FINISH[finish], stats=stats_pb(stats),
                            reasoning_delta=thought, prompt_tokens=n_prompt,
                            logprobs=logprobs_pb(lps[done:done + len(ids)] if lps is not None else None),
                            prompt_logprobs=logprobs_pb(ev.get("prompt_logprobs")),
                            **stop_reason_fields(asm.stop_reason if finish == "stop" else None))
                        return
        except BaseException as e:
            if outcome is None:
                outcome = ("abort",) if isinstance(e, (GeneratorExit, asyncio.CancelledError)) else \
                    ("error",) + failure_status(e)
            raise
        finally:
            self.in_flight -= 1
            if isinstance(outcome, tuple):
                sent = len(asm.token_ids) if asm is not None else 0
                self._ended(outcome, {**served, "request_id": rid, "mode": r.mode or self.default_mode,
                                      "completion_tokens": sent}, time.perf_counter() - t0)

    def _ended(self, outcome: tuple, stats: dict, wall_s: float) -> None:
        """A request that did not generate to its end: counted and logged once (the client went away: "abort", as
        vLLM's finish_reason; or it failed, by status)."""
        if outcome[0] == "abort":
            log_request(stats, "abort", wall_s)
            if self.metrics:
                self.metrics.requests.labels("abort").inc()
                self.metrics.e2e.observe(wall_s)
            return
        _, code, message = outcome
        log_failure(stats["request_id"], code, message, wall_s)
        if self.metrics:
            self.metrics.errors.labels(code).inc()

    async def GenerateStream(self, request, context):
        async for resp in self.respond(request, context):
            yield resp

    async def Generate(self, request, context) -> generation_pb2.GenerateResponse:
        out = generation_pb2.GenerateResponse()
        text, reasoning = [], []
        async for resp in self.respond(request, context, incremental=False):
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
            self._ended(("error", "RESOURCE_EXHAUSTED", message), {"request_id": out.stats.request_id},
                        out.stats.wall_s)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return out


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
