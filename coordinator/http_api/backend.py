"""The OpenAI door's errors and its backend: each request is a GenerateRequest, run by the generation service's one
method (`GenerationServicer.generate`, which the gRPC door calls too) in process; failures become OpenAI-shaped
errors (coordinator/http_api/app.py serves them)."""
from __future__ import annotations

import json
import logging

import grpc
from fastapi.responses import JSONResponse

from coordinator.grpc_api.chat_prompt import chat_message, template_options
from coordinator.grpc_api.service import GenerationFailed
from coordinator.http_api import schema
from coordinator.http_api.schema import template_fields
from specdec.text.tokenizer import encode_prompt
from specdec_rpc.interceptor import status_for
from specdec_rpc.pb import generation_pb2

log = logging.getLogger("coordinator.http_api.app")

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
               grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499,
               grpc.StatusCode.UNIMPLEMENTED: 501, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}
CLIENT_CLOSED = 499  # nginx's code: the client went away before the answer


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_grpc(cls, code: grpc.StatusCode, message: str) -> ApiError:
        # an unexpected failure's message starts with its exception's type, which is no field
        param = param_of(message) if code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else None
        head = message.split(":", 1)[0]
        if param and head != param:  # "max_new_tokens: ..." reads "max_tokens: ..." here
            message = param + message[len(head):]
        message = message.replace("max_new_tokens", "max_tokens")  # an OpenAI client knows it by that name
        if code == grpc.StatusCode.OUT_OF_RANGE:  # OpenAI's code, which clients (LangChain, LiteLLM) map to their
            return cls(400, message, param, "context_length_exceeded")  # context-window errors
        return cls(HTTP_STATUS.get(code, 500), message, param, code.name.lower())

    def body(self) -> dict:
        kind = ("invalid_request_error" if self.status < 429 or self.status == CLIENT_CLOSED else
                "rate_limit_error" if self.status == 429 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def param_of(message: str) -> str | None:
    """The field a "field: what to change" message names, as an OpenAI client knows it."""
    head = message.split(":", 1)[0] if ":" in message else ""
    if not head or " " in head:
        return None
    root, dot, rest = head.partition(".")  # "structured_output.choice" reads "structured_outputs.choice"
    return schema.PARAM_NAMES.get(head) or schema.PARAM_NAMES.get(root, root) + dot + rest


class ServicerBackend:
    """Runs requests on the coordinator's generation service in this process; failures become ApiError."""

    def __init__(self, servicer):
        self.servicer = servicer
        self.tok = getattr(servicer, "tok", None)  # None: token-id prompts only

    async def off_loop(self, fn, *args):
        """`fn(*args)` in the servicer's prompt-work pool (coordinator/grpc_api/prompt_work.py): tokenizing and
        decoding long texts must not hold up the streams this event loop serves."""
        work = getattr(self.servicer, "work", None)
        return await work.run(fn, *args) if work is not None else fn(*args)

    async def max_model_len(self) -> int:
        """vLLM's max_model_len: positions a target session holds, the least over the healthy target replicas (0:
        not known yet)."""
        router = self.servicer.router
        try:
            return int(await router.max_model_len()) if hasattr(router, "max_model_len") else 0
        except Exception:  # noqa: BLE001 - a model listing must not fail on it
            return 0

    def encode(self, text: str) -> list[int]:
        """A completion prompt's token ids, as the servicer encodes it (raw: no chat template)."""
        tok = self.tok
        if tok is None:
            raise ApiError(400, "prompt: this coordinator has no tokenizer; send token ids", "prompt")
        try:
            return encode_prompt(tok, prompt=text, raw=True)
        except ValueError as e:
            raise ApiError(400, str(e), "prompt") from None

    def tokenize(self, body: schema.TokenizeRequest) -> list[int]:
        """The ids the chat (messages) or completions (prompt) route would generate from."""
        if body.prompt is not None:
            return self.encode(body.prompt)
        if self.tok is None:
            raise ApiError(400, "messages: this coordinator has no tokenizer", "messages")

        pb = generation_pb2.GenerateRequest()
        for m in body.messages:  # as the chat route: through GenerateRequest.messages
            m.add_to(pb.messages)
        template_fields(body, pb)
        if body.tools:
            pb.tools = json.dumps(body.tools)
        try:
            tools, template = template_options(pb)
            return encode_prompt(self.tok, messages=[chat_message(m) for m in pb.messages], tools=tools,
                                 template=template)
        except ValueError as e:
            raise ApiError(400, str(e), getattr(e, "field", "messages")) from None

    def detokenize(self, ids: list[int]) -> str:
        if self.tok is None:
            raise ApiError(400, "tokens: this coordinator has no tokenizer", "tokens")
        bad = next((t for t in ids if not 0 <= t < len(self.tok)), None)
        if bad is not None:
            raise ApiError(400, f"tokens: id {bad} is outside the vocabulary [0, {len(self.tok)})", "tokens")
        return self.tok.decode(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self.tok is not None else "".join(f"<{t}>" for t in ids)

    def token_text(self, token_id: int) -> str:
        """A token's text (logprobs entries); `<id>` where the coordinator has no tokenizer."""
        return self.tok.decode([token_id]) if self.tok is not None else f"<{token_id}>"

    async def events(self, request, incremental: bool = True, metadata=()):
        """The generation service's responses to `request`; `metadata`: (key, value) pairs a gRPC call would carry
        (the HTTP request's trace headers)."""
        try:
            async for resp in self.servicer.generate(request, incremental, metadata):
                yield resp
        except GenerationFailed as e:
            raise ApiError.from_grpc(e.code, e.message) from None
        except Exception as e:  # noqa: BLE001 - the mapping point, as the gRPC interceptor's
            code, message = status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("HTTP request failed")
            raise ApiError.from_grpc(code, message) from None
