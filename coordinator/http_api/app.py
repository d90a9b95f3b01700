"""The OpenAI-compatible HTTP front door, beside the gRPC one (`COORDINATOR_HTTP_PORT`, `specdec serve --http-port`).

    POST /v1/chat/completions   chat (chat template applied), whole or streamed as server-sent events
    POST /v1/completions        a plain completion of the prompt text (no chat template), or of token ids
    POST /v1/responses          OpenAI's Responses API over the chat route (coordinator/http_api/responses_api.py)
    GET, DELETE /v1/responses/{id}, GET .../input_items   a stored response (coordinator/http_api/response_store.py)
    GET  /v1/models             the one model served
    POST /tokenize, /detokenize vLLM's: a prompt's token ids (as either route encodes it), or the text of ids
    GET  /version               vLLM's: the server's version
    GET  /health                200 while serving, 503 while draining
    GET  /metrics               the coordinator's Prometheus metrics (also on COORDINATOR_METRICS_PORT)
    GET  /openapi.json, /docs   the OpenAPI 3 document of these routes (coordinator/http_api/openapi.py), rendered

A thin shell: a body is validated (coordinator/http_api/schema.py), turned into a GenerateRequest and handed to the
same GenerationServicer the gRPC API uses, in process. Errors come back in OpenAI's shape, `{"error": {"message",
"type", "param", "code"}}`, with the HTTP status of the gRPC code (INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, ...). A client that disconnects cancels its generation, streamed or not.
"""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.http_api import bodies as responses
from coordinator.http_api import schema
from coordinator.http_api import responses_api
from coordinator.http_api.backend import ApiError, ServicerBackend, param_of
from coordinator.http_api.limits import OPEN_PATHS, Limits
from coordinator.http_api.openapi import openapi_document
from coordinator.http_api.response_store import ResponseStore, as_items, items_page
from coordinator.http_api.streams import (first_responses, gather_all, merged, sse, sse_response, trace_metadata,
                                      until_disconnected)
from specdec import __version__
from specdec_rpc.pb import generation_pb2


class OpenAIFrontDoor:
    def __init__(self, backend: ServicerBackend, model_name: str | tuple[str, ...], api_key: str = "",
                 max_body_bytes: int = 1 << 24,
                 is_draining=lambda: False, registry=None, max_in_flight: int = 1024, tool_call_parser: str = "",
                 reasoning_parser: str = "", store: ResponseStore | None = None, client_timeout_s: float = 30.0):
        # the ids a request may name; the first is the one listed and answered with
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        self.backend, self.model_name, self.api_key = backend, self.model_names[0], api_key
        self.store = store if store is not None else ResponseStore(0, 1.0)  # the Responses API's stored responses
        self.tool_call_parser = tool_call_parser  # tool_choice "auto": coordinator/grpc_api/tool_parsers.py (''; refused)
        self.reasoning_parser = reasoning_parser  # chat: <think>...</think> as `reasoning` (coordinator/grpc_api/reasoning.py)
        self.max_body_bytes, self.is_draining = max_body_bytes, is_draining
        self.max_in_flight, self.in_flight = max_in_flight, 0  # POSTs being answered (streams until their end)
        self.client_timeout_s = client_timeout_s  # for a body to arrive, and for a stream's reader to take data
        self.requests, self.registry = None, registry
        if registry is not None:
            self.requests = Counter("specdec_http_requests", "OpenAI-compatible HTTP requests",
                                    ["route", "status"], registry=registry)

            Gauge("specdec_responses_stored", "Responses API responses kept for previous_response_id",
                  registry=registry).set_function(lambda: len(self.store))
            Gauge("specdec_responses_stored_bytes", "their JSON's size", registry=registry).set_function(
                lambda: self.store.bytes)

    # -- one generation ---------------------------------------------------------------------------------------
    def _check(self, request: Request, body) -> None:
        """The body names this server's model, if any (the API key is checked before, by `Limits`)."""
        if body is not None and body.model is not None and body.model not in self.model_names:
            raise ApiError(404, f"the model {body.model!r} does not exist here; this server serves "
                                f"{' or '.join(map(repr, self.model_names))} (GET /v1/models)", "model",
                           "model_not_found")

    def _auto_tools(self, body) -> None:
        """tool_choice "auto": the server's tool-call parser reads the calls, or the request is refused."""
        if body.tool is not None and body.tool.auto:
            if not self.tool_call_parser:
                raise ApiError(400, "tool_choice: 'auto' (the default with tools) needs the server started with a "
                                    "parser of this model's tool-call text (COORDINATOR_TOOL_CALL_PARSER, e.g. "
                                    "hermes); send 'required', {'type': 'function', 'function': {'name': ...}} or "
                                    "'none'", "tool_choice")
            body.tool.parser = self.tool_call_parser

    async def _whole(self, request: Request, proto) -> tuple[str, list[int], object, object, str]:
        """A whole answer: (its text, token ids, logprobs (None unless asked), the last response: finish, stats;
        the reasoning)."""
        text, ids, last, reasoning = [], [], None, []
        lps = generation_pb2.GeneratedLogprobs() if proto.sampling.HasField("logprobs") else None
        async for resp in self.backend.events(proto, incremental=False, metadata=trace_metadata(request)):
            text.append(resp.text_delta)
            reasoning.append(resp.reasoning_delta)
            ids.extend(resp.token_ids)
            if lps is not None:
                lps.MergeFrom(resp.logprobs)
            last = resp
        return "".join(text), ids, lps, last, "".join(reasoning)

    def _separate_reasoning(self, protos) -> bool:
        """Chat with the server's reasoning parser: each choice's thinking comes apart from its answer."""
        for p in protos:
            p.separate_reasoning = bool(self.reasoning_parser)
        return bool(self.reasoning_parser)

    async def generate(self, request: Request, body, chat: bool):
        self._check(request, body)
        if chat:
            self._auto_tools(body)
        echo = not chat and body.echo
        echo_texts = await self._echo_prompts(body) if echo else []
        protos = body.choices()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.state.request_id}"
        for p in protos:
            p.request_id = request.state.request_id
        thinks = chat and self._separate_reasoning(protos)
        shown = thinks and body.include_reasoning  # vLLM's include_reasoning: false leaves it out
        created = int(time.time())
        token_text = responses.token_id_text if body.return_tokens_as_token_ids else self.backend.token_text
        if not body.stream:
            answers = await self._whole_answers(request, body, chat, protos, token_text, thinks, shown, echo,
                                                echo_texts)
            return responses.completion_body(chat, rid, created, self.model_name, answers, body.tool if chat else None,
                                             body.n)
        return await self._open_stream(request, body, chat, rid, created, protos, token_text,
                                       shown if thinks else None)

    async def _echo_prompts(self, body) -> list[str | None]:
        """Completions' echo: the prompts' own tokens come back, so text prompts are encoded here, as the servicer
        would (raw). Each prompt's text to echo (None: its tokens', decoded)."""
        echo_texts = [p if isinstance(p, str) else None for p in body.prompts]
        body.prompts[:] = [await self.backend.off_loop(self.backend.encode, p) if isinstance(p, str) else p
                           for p in body.prompts]
        if (keep := body.truncate_prompt_tokens) is not None:  # the kept tokens come back, as vLLM's echo
            body.prompts[:] = [p[-keep:] for p in body.prompts]
            echo_texts = [None] * len(body.prompts)
        return echo_texts

    async def _whole_answers(self, request: Request, body, chat: bool, protos, token_text, thinks, shown,
                             echo: bool, echo_texts: list[str | None]) -> list[tuple]:
        """Each choice's whole answer, as completion_body takes them, generated together; a dropped client cancels
        them all."""
        n = body.n

        async def whole(k, proto):
            text, ids, lps, last, reasoning = await self._whole(request, proto)
            finish, stats = responses.FINISH_REASON.get(last.finish_reason, "stop"), last.stats
            reason = responses.stop_reason(last)
            if not echo:
                return (text, finish, stats, responses.logprobs_body(chat, ids, lps, token_text), reason,
                        (reasoning or None) if shown else "" if thinks else None)
            if body.max_tokens == 0:  # the prompt alone: drop the one token generated
                text, ids, finish = "", [], "length"
                lps = generation_pb2.GeneratedLogprobs() if lps is not None else None
                stats = generation_pb2.GenerationStats(prompt_tokens=stats.prompt_tokens, mode=stats.mode,
                                                       cached_prompt_tokens=stats.cached_prompt_tokens)
            prompt = list(proto.prompt_token_ids)
            echo_text = echo_texts[k // n]
            prefix = (echo_text if echo_text is not None else
                      await self.backend.off_loop(self.backend.decode, prompt))
            return (prefix + text, finish, stats,
                    responses.echo_logprobs_body(prompt, last.prompt_logprobs if lps is not None else None, ids,
                                                 lps, token_text), reason, None)

        return await until_disconnected(request, gather_all(whole(k, p) for k, p in enumerate(protos)))

    async def _open_stream(self, request: Request, body, chat: bool, rid, created, protos, token_text,
                           reasoning: bool | None):
        """The streamed answer: its choices' first responses awaited (an error before any comes back whole), then
        their chunks as server-sent events."""
        streams = [self.backend.events(p, metadata=trace_metadata(request)) for p in protos]
        firsts = await first_responses(request, streams)
        usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = usage and body.stream_options.continuous_usage_stats
        return sse_response(self._stream(chat, rid, created, firsts, streams, usage, body.tool if chat else None,
                                         body.n, token_text, reasoning, continuous))

    async def _stream(self, chat, rid, created, firsts, streams, with_usage, tool=None, n=1, token_text=None,
                      reasoning: bool | None = None, continuous: bool = False):
        """`tool`: a tool choice, whose reader turns each choice's text into content and tool_calls deltas;
        `reasoning`: None not separated, True send each choice's reasoning deltas (chat's `reasoning`), False
        leave them out (include_reasoning: false); `continuous`: every chunk carries its choice's usage so far
        (vLLM's continuous_usage_stats)."""
        chunks = _Chunks(chat, rid, created, self.model_name, firsts, len(streams), with_usage, continuous, tool,
                         token_text, self.backend, reasoning)
        try:
            if chat:
                for i in range(len(streams)):
                    yield sse(chunks.chunk(None, None, role=True, index=i))
            async for i, resp in merged(firsts, streams):  # a dropped client cancels here, and with it every choice
                for event in chunks.response(i, resp):
                    yield event
            if with_usage:
                yield sse(responses.usage_chunk(chat, rid, created, self.model_name, chunks.stats, n,
                                                reasoning is not None))
        except ApiError as e:  # after the headers: the error travels as an event, as OpenAI's does
            yield sse(e.body())
        yield sse("[DONE]")

    # -- the Responses API (coordinator/http_api/responses_api.py) ---------------------------------------------------------
    async def respond(self, request: Request, body: responses_api.ResponsesRequest):
        self._check(request, body)
        if body.store and not self.store.enabled:
            raise ApiError(400, "store: this coordinator keeps no responses (COORDINATOR_RESPONSES_STORE=0); leave "
                                "it out, or send store: false", "store")
        if body.previous_response_id is not None:
            body = body.continued(self.stored(body.previous_response_id, "previous_response_id").conversation)
        chat, stored = body.chat, body.store is not False and self.store.enabled
        self._auto_tools(chat)
        (proto,) = chat.choices()
        proto.request_id = request.state.request_id
        self._separate_reasoning([proto])
        rid, created, tool = f"resp_{request.state.request_id}", int(time.time()), chat.tool
        if not body.stream:
            text, ids, lps, last, reasoning = await until_disconnected(request, self._whole(request, proto))
            finish, stats = responses.FINISH_REASON.get(last.finish_reason, "stop"), last.stats
            entries = (responses.logprobs_body(True, ids, lps, self.backend.token_text)["content"]
                       if lps is not None else None)
            message, finish = tool.message(text, finish) if tool else ({"content": text}, finish)
            message["reasoning"] = reasoning
            output = responses_api.output_items(message, finish, entries)
            out = responses_api.response_object(body, rid, created, self.model_name, output, finish, stats, stored)
            if stored:
                out["store"] = self.store.put(rid, out, as_items(body.input), output)  # False: too large
            return out
        events = self.backend.events(proto, metadata=trace_metadata(request))
        firsts = await first_responses(request, [events])
        return sse_response(self._respond_stream(body, rid, created, firsts, events, stored))

    def stored(self, rid: str, param: str | None = None):
        found = self.store.get(rid)
        if found is None:
            raise ApiError(404, f"{param + ': ' if param else ''}no stored response {rid!r}: "
                                f"{self.store.describe()}", param, "response_not_found" if not param else
                           "previous_response_not_found")
        return found

    async def _respond_stream(self, body, rid, created, firsts, events, stored: bool):
        out = responses_api.ResponseEvents(body, rid, created, self.model_name, stored)
        answer = _AnswerDeltas(body.chat.tool, self.backend)
        for event in out.start():
            yield event
        try:
            async for _, resp in merged(firsts, [events]):  # a dropped client cancels here
                finish = responses.FINISH_REASON.get(resp.finish_reason) if resp.finish_reason else None
                if resp.reasoning_delta:
                    for event in out.delta({"reasoning": resp.reasoning_delta}):
                        yield event
                deltas, finish = answer.deltas(resp, finish, out)
                for delta in deltas:
                    for event in out.delta(delta):
                        yield event
                if finish:
                    for event in out.finish(finish, resp.stats):
                        yield event
                    if stored:
                        self.store.put(rid, out.final, as_items(body.input), out.output)
        except ApiError as e:  # after the headers: the error travels as an event
            yield out.error(e.body())

    # -- the app ----------------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title="specdec (OpenAI-compatible)", version=__version__, docs_url="/docs", redoc_url=None,
                      openapi_url="/openapi.json", swagger_ui_oauth2_redirect_url=None)

        def openapi() -> dict:
            if app.openapi_schema is None:
                app.openapi_schema = openapi_document(app, OPEN_PATHS, bool(self.api_key))
            return app.openapi_schema
        app.openapi = openapi

        @app.exception_handler(ApiError)
        async def api_error(_request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def invalid(_request, exc: RequestValidationError):
            errs = exc.errors()
            parts = []
            if any(e.get("type") == "json_invalid" for e in errs):
                return ApiError(400, "the body is not valid JSON: send a JSON object").response()
            for e in errs:
                loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
                msg = e.get("msg", "invalid").removeprefix("Value error, ")
                parts.append(f"{loc}: {msg}" if loc and not msg.startswith(f"{loc}:") else msg)
            param = next((str(e["loc"][1]) for e in errs if len(e.get("loc", ())) > 1), None)
            param = param or param_of(parts[0] if parts else "")
            return ApiError(400, "; ".join(parts) or "invalid request body", param, "invalid_request").response()

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request, exc: StarletteHTTPException):
            return ApiError(exc.status_code, str(exc.detail)).response()

        @app.post("/v1/chat/completions")
        async def chat_completions(body: schema.ChatCompletionRequest, request: Request):
            out = await self.generate(request, body, chat=True)
            return out if isinstance(out, Response) else JSONResponse(out)

        @app.post("/v1/completions")
        async def completions(body: schema.CompletionRequest, request: Request):
            out = await self.generate(request, body, chat=False)
            return out if isinstance(out, Response) else JSONResponse(out)

        @app.post("/v1/responses")
        async def create_response(body: responses_api.ResponsesRequest, request: Request):
            try:
                out = await self.respond(request, body)
            except ApiError as e:  # the chat route's names, as this route's client knows them
                if e.param == "max_tokens":
                    e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
                raise
            return out if isinstance(out, Response) else JSONResponse(out)

        @app.get("/v1/responses/{rid}")
        async def get_response(rid: str, request: Request):
            self._check(request, None)
            return self.stored(rid).response

        @app.get("/v1/responses/{rid}/input_items")
        async def input_items(rid: str, request: Request, order: str = "desc", after: str | None = None,
                              limit: int = 20):
            self._check(request, None)
            if order not in ("asc", "desc") or not 1 <= limit <= 100:
                raise ApiError(400, "order is asc or desc, limit from 1 to 100", "order" if order not in
                               ("asc", "desc") else "limit")
            try:
                return items_page(self.stored(rid).input_items, order=order, after=after, limit=limit)
            except KeyError:
                raise ApiError(400, f"after: {after!r} is not an input item of {rid!r}", "after") from None

        @app.delete("/v1/responses/{rid}")
        async def delete_response(rid: str, request: Request):
            self._check(request, None)
            self.stored(rid)
            self.store.delete(rid)
            return {"id": rid, "object": "response", "deleted": True}

        async def model_card() -> dict:
            model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "specdec",
                     "root": self.model_name, "parent": None}
            if max_len := await self.backend.max_model_len():  # vLLM's: what a prompt + its output may hold
                model["max_model_len"] = max_len
            return model

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [await model_card()]}

        @app.get("/v1/models/{model:path}")
        async def model(model: str):
            if model not in self.model_names:
                raise ApiError(404, f"the model {model!r} does not exist here; this server serves "
                                    f"{' or '.join(map(repr, self.model_names))}", "model", "model_not_found")
            return await model_card()

        @app.post("/tokenize")
        async def tokenize(body: schema.TokenizeRequest, request: Request):
            self._check(request, body)
            ids = await self.backend.off_loop(self.backend.tokenize, body)
            return {"count": len(ids), "tokens": ids}

        @app.post("/detokenize")
        async def detokenize(body: schema.DetokenizeRequest, request: Request):
            self._check(request, body)
            return {"prompt": await self.backend.off_loop(self.backend.detokenize, body.tokens)}

        @app.get("/version")
        async def version():
            return {"version": __version__}

        @app.get("/health")
        async def health():
            if self.is_draining():
                return JSONResponse({"status": "draining"}, status_code=503)
            return {"status": "serving"}

        if self.registry is not None:  # the coordinator's metrics here too, as vLLM serves them on its API port
            @app.get("/metrics")
            async def metrics():
                return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
        app.add_middleware(Limits, door=self)
        return app


class _Chunks:
    """A streamed chat or completion's choices: each response → its chunks as server-sent events, with each
    choice's token count (continuous usage), logprobs text offset (completions) and final stats kept."""

    def __init__(self, chat, rid, created, name, firsts, choices: int, with_usage, continuous: bool, tool, token_text,
                 backend, reasoning: bool | None):
        self.chat, self.rid, self.created, self.name, self.firsts = chat, rid, created, name, firsts
        self.with_usage, self.continuous, self.reasoning = with_usage, continuous, reasoning
        self.token_text, self.backend = token_text, backend  # token_text None: the backend's
        self.counts = [0] * choices  # each choice's tokens so far
        self.chars = [0] * choices  # each choice's logprobs tokens' characters so far (completions' text_offset)
        self.stats = [None] * choices
        self.readers = [tool.reader() for _ in range(choices)] if tool is not None else []

    def chunk(self, *args, index: int = 0, **kw) -> dict:
        body = responses.chunk_body(self.chat, self.rid, self.created, self.name, *args, with_usage=self.with_usage,
                                    index=index, **kw)
        if self.continuous:
            prompt = self.firsts[index].prompt_tokens
            body["usage"] = {"prompt_tokens": prompt, "completion_tokens": self.counts[index],
                             "total_tokens": prompt + self.counts[index]}
        return body

    def response(self, i: int, resp):
        """Choice `i`'s response → its events: reasoning, text (or a tool reader's deltas) with logprobs, finish."""
        finish = responses.FINISH_REASON.get(resp.finish_reason) if resp.finish_reason else None
        self.counts[i] += len(resp.token_ids)
        if self.reasoning and resp.reasoning_delta:
            yield sse(self.chunk(None, None, index=i, delta={"reasoning": resp.reasoning_delta}))
        lps = self._logprobs(i, resp)
        if self.readers:
            deltas, finish = self._read(i, resp.text_delta, lps, finish)
            for k, delta in enumerate(deltas):
                yield sse(self.chunk(None, None, index=i, delta=delta, logprobs=lps if k == 0 else None))
        elif lps is not None:
            yield sse(self.chunk(resp.text_delta, None, index=i, logprobs=lps))
        elif resp.text_delta:
            yield sse(self.chunk(resp.text_delta, None, index=i))
        if finish:
            self.stats[i] = resp.stats
            yield sse(self.chunk(None, finish, index=i, stats=resp.stats, reason=responses.stop_reason(resp)))

    def _logprobs(self, i: int, resp) -> dict | None:
        """The response's tokens' logprobs object (None: not asked, or no tokens), their text possibly held back."""
        if not (resp.HasField("logprobs") and resp.token_ids):
            return None
        lps = responses.logprobs_body(self.chat, resp.token_ids, resp.logprobs,
                                      self.token_text or self.backend.token_text, offset=self.chars[i])
        self.chars[i] += 0 if self.chat else sum(len(t) for t in lps["tokens"])
        return lps

    def _read(self, i: int, text: str, lps: dict | None, finish: str | None) -> tuple[list[dict], str | None]:
        """Choice `i`'s tool reader's deltas of `text` (and its last ones at the finish), and the finish reason."""
        deltas = self.readers[i].feed(text)
        if finish:
            more, finish = self.readers[i].end(finish)
            deltas += more
        if lps is not None and not deltas:  # text held back by the reader: the logprobs go now
            deltas = [{}]
        return deltas, finish


class _AnswerDeltas:
    """A streamed Responses answer's text → chat deltas for ResponseEvents, read as text or by the tool choice's
    reader; with a tool reader the logprobs wait to ride on the message's text, as in a whole response."""

    def __init__(self, tool, backend):
        self.reader = tool.reader() if tool else responses_api.TextReader()
        self.backend = backend
        self.pending: list[dict] = []  # with a tool reader: logprobs not yet sent with text

    def deltas(self, resp, finish: str | None, out: responses_api.ResponseEvents) -> tuple[list[dict], str | None]:
        """The response's deltas, and the finish reason (the reader's at the finish); `out`: the events so far."""
        lps = (responses.logprobs_body(True, resp.token_ids, resp.logprobs, self.backend.token_text)["content"]
               if resp.HasField("logprobs") and resp.token_ids else [])
        if isinstance(self.reader, responses_api.TextReader):
            deltas = self.reader.feed(resp.text_delta, lps)
        else:
            self.pending += lps
            deltas = self.reader.feed(resp.text_delta)
        if finish:
            more, finish = self.reader.end(finish)
            deltas += more
        for k, delta in enumerate(deltas):
            if self.pending and delta.get("content"):
                deltas[k], self.pending = {**delta, "logprobs": self.pending}, []
        if finish and self.pending and (out.text is not None or any(d.get("content") for d in deltas)):
            deltas.append({"content": "", "logprobs": self.pending})
        return deltas, finish
