"""OpenAI-compatible request bodies (`/v1/chat/completions`, `/v1/completions`, `/tokenize`, `/detokenize`) and
their translation to GenerateRequests (the response bodies: coordinator/http_api/bodies.py). Pure: pydantic and
the generated proto, no web framework.

- Fields OpenAI defines that specdec does not implement are accepted at their neutral values (no tools, no
  suffix) and refused otherwise, with a message saying what to send instead.
- Unknown fields are refused: a misspelt knob should fail, not silently change nothing.
- specdec's own knobs ride along as extra body fields (the openai client's `extra_body`): `mode`, `gamma`,
  `verify_method`, `top_k` and `ignore_eos` (as in vLLM; top_k 0 or -1 disables it), and the rest of
  GenerateRequest's.
- Sampling defaults are OpenAI's: temperature 1.0, and a request without `seed` draws a fresh random one (on the
  gRPC API an unset seed is 0).
- Ranges: a field of GenerateRequest has no range here, only what its wire type needs (int32, uint64). The servicer
  checks every field by specdec/scheduling/field_rules.py's table, so a bad value gets the same message (a 400 here,
  INVALID_ARGUMENT on gRPC) through either door; `ruled` shows the table's range in the OpenAPI document. Chat's
  `top_logprobs`, which becomes GenerateRequest.logprobs, is checked here by the same row under its own name. What
  only this door has (`n`, prompts × n, `max_tokens: 0` with `echo`, logit_bias keys as strings of digits) is
  checked here.
"""
from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from coordinator.http_api.json_text import lone_surrogate_at
from coordinator.http_api.structured import ToolChoice, response_format_pb, structured_output_pb, tool_choice
from coordinator.grpc_api.tool_parsers import needs_special_tokens
from specdec.scheduling import field_rules
from specdec.scheduling.request import Overlap, mode_pair
from specdec_rpc.encode import DRAFT_STOP_PB, OVERLAP_PB, VERIFY_METHOD_PB
from specdec_rpc.pb import common_pb2, generation_pb2

MAX_N = 16  # choices per request: each is its own generation (they batch on the target like separate requests)
MAX_GENERATIONS = 64  # prompts × n per request (/v1/completions takes a list of prompts)
_SAMPLING_SET = ("cache_salt", "allowed_token_ids")  # GenerateRequest.sampling's, sent where set
_SPECULATION_SET = ("gamma", "block_size", "pacer_threshold", "pacer_skip_below", "pearl_first_block", "spec_off_batch",
                    "pacer_post_threshold")  # GenerateRequest.speculation's, sent where set
# GenerateRequest's field names in the servicer's messages, as an OpenAI client knows them: a body's sampling and
# speculation fields are flat, and its mode, pearl_overlap and verify_method strings are speculation's enums
PARAM_NAMES = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt", "structured_output": "structured_outputs",
               "speculation.draft_stop": "mode", "speculation.overlap": "pearl_overlap",
               **{f"speculation.{n}": n for n in (*_SPECULATION_SET, "verify_method")},
               **{f"sampling.{n}": n for n in ("temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs",
                                               "presence_penalty", "frequency_penalty", "repetition_penalty",
                                               "logit_bias", "min_p", "min_tokens", *_SAMPLING_SET)}}


INT32_MAX = 2**31 - 1  # GenerateRequest's integers are int32
Int32 = Annotated[int, Field(ge=-2**31, le=INT32_MAX)]
# GenerateRequest's own fields sent as they are where set (None: unset), and the fields (GenerateRequest's and its
# sampling's) sent only where they differ from their neutral value (unset means it); any other value is sent, for
# the servicer's table to judge
_SENT_WHERE_SET = ("stop_token_ids", "bad_words", "truncate_prompt_tokens")
_SENT_WHERE_NOT = {"skip_special_tokens": True}
_SAMPLING_WHERE_NOT = {"top_p": 1.0, "repetition_penalty": 1.0}


def ruled(default, name: str):
    """A body field that GenerateRequest's `name` carries: no range here (the servicer answers a value out of range
    with specdec/scheduling/field_rules.py's message), the table's range shown in the OpenAPI document."""
    return Field(default, json_schema_extra=field_rules.json_schema(name))


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data):
        """OpenAI's fields may be sent as null, meaning unset (the openai client and frameworks forward them so)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None}


class _Request(_Body):
    """A whole request body. Its strings are checked here, once (the models nested in it are parts of it)."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if isinstance(data, dict) and (where := lone_surrogate_at(data)):
            raise ValueError(f"{where}: holds a lone surrogate (\\ud800-\\udfff), which is not text; send UTF-8 "
                             f"text")
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class SpecDecKnobs(_Request):
    """GenerateRequest's specdec fields (proto/specdec/v1/generation.proto documents each); unset: its default."""

    mode: str | None = None
    gamma: Int32 | None = ruled(None, "gamma")
    verify_method: str | None = None
    block_size: Int32 | None = ruled(None, "block_size")
    pacer_threshold: float | None = ruled(None, "pacer_threshold")
    pacer_skip_below: float | None = ruled(None, "pacer_skip_below")
    pearl_first_block: Int32 | None = ruled(None, "pearl_first_block")
    spec_off_batch: Int32 | None = ruled(None, "spec_off_batch")
    pacer_post_threshold: float | None = ruled(None, "pacer_post_threshold")
    pearl_overlap: str | None = None
    ignore_eos: bool = False
    cache_salt: str | None = ruled(None, "cache_salt")  # vLLM's: prefix caching only among the same salt
    priority: int = Field(0, ge=-2**31, lt=2**31)  # vLLM's: a full pool serves lower values first
    stop_token_ids: list[Int32] | None = ruled(None, "stop_token_ids")  # vLLM's: more tokens that end it as EOS does

    @field_validator("mode", "verify_method", "pearl_overlap")
    @classmethod
    def _named(cls, v, info):
        """The strings GenerateRequest.speculation carries as enums: the table's rule, with its message."""
        field_rules.check([field_rules.RULE[info.field_name]], {info.field_name: v})
        return v

    def speculation(self) -> common_pb2.Speculation:
        """The body's speculation settings as GenerateRequest.speculation (a mode string is the enum pair it
        names; pearl_overlap without a mode overlaps the coordinator's default mode's drafting)."""
        sp = common_pb2.Speculation(**{n: v for n in _SPECULATION_SET if (v := getattr(self, n)) is not None})
        if self.mode is not None:
            stop, overlap = mode_pair(self.mode, self.pearl_overlap or "auto")
            sp.draft_stop, sp.overlap = DRAFT_STOP_PB[stop], OVERLAP_PB[overlap]
        elif self.pearl_overlap is not None:
            sp.overlap = OVERLAP_PB[Overlap(self.pearl_overlap)]
        if self.verify_method is not None:
            sp.verify_method = VERIFY_METHOD_PB[self.verify_method]
        return sp


class _Sampling(SpecDecKnobs):
    model: str | None = None
    max_tokens: Int32 | None = None  # 0: completions with echo only (the prompt's logprobs)
    temperature: float = ruled(1.0, "temperature")
    top_p: float = ruled(1.0, "top_p")
    top_k: Int32 = 0  # vLLM's -1 is 0 (off)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = ruled(0.0, "presence_penalty")
    frequency_penalty: float = ruled(0.0, "frequency_penalty")
    repetition_penalty: float = ruled(1.0, "repetition_penalty")  # vLLM's, as the next three
    min_p: float = ruled(0.0, "min_p")
    min_tokens: Int32 = 0
    logit_bias: dict[str, float] | None = ruled(None, "logit_bias")  # OpenAI's: token id (as a string) -> bias
    # vLLM's: exactly one of json (a schema), regex, choice (a list of strings), grammar (Lark), json_object (true)
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older names for structured_outputs' json, regex, choice and grammar
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's (chat); vLLM takes it on completions too
    allowed_token_ids: list[Int32] | None = ruled(None, "allowed_token_ids")  # vLLM's, as bad_words
    bad_words: list[str] | None = ruled(None, "bad_words")
    user: str | None = None
    # vLLM's output controls: the stop string (or stop token's text) kept in the text; special tokens shown; only
    # the prompt's last k tokens; logprobs' tokens as "token_id:<id>"
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Int32 | None = ruled(None, "truncate_prompt_tokens")
    return_tokens_as_token_ids: bool = False
    _structured: Any = PrivateAttr(default=None)  # the StructuredOutput the validators made

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else list(v or [])

    @model_validator(mode="after")
    def _neutral(self):
        bias = self.logit_bias or {}
        unsupported = [("stream_options", self.stream_options is not None and not self.stream,
                        "stream_options needs stream: true"),
                       ("logit_bias", any(not (k.isascii() and k.isdigit() and int(k) <= INT32_MAX) for k in bias),
                        "keys are token ids, as strings of digits ('50256')")]
        for name, bad, why in unsupported:
            if bad:
                raise ValueError(f"{name}: {why}")
        self._structured = structured_output_pb(self.structured_outputs, {
            k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")})
        fmt = response_format_pb(self.response_format)
        if fmt is not None and self._structured is not None:
            raise ValueError("response_format: send it or structured_outputs, not both")
        self._structured = fmt if fmt is not None else self._structured
        return self

    def sampling(self) -> common_pb2.SamplingParams:
        """The body's sampling settings as GenerateRequest.sampling (logprobs: the route's own, set by to_proto)."""
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_k=0 if self.top_k == -1 else self.top_k,
            seed=secrets.randbits(63) if self.seed is None else self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_p=self.min_p, min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            **{name: value for name in _SAMPLING_SET if (value := getattr(self, name)) is not None},
            **{name: value for name, neutral in _SAMPLING_WHERE_NOT.items() if (value := getattr(self, name)) != neutral})

    def generate_request(self, max_tokens: int | None) -> generation_pb2.GenerateRequest:
        r = generation_pb2.GenerateRequest(
            sampling=self.sampling(), speculation=self.speculation(), stop=self.stop, ignore_eos=self.ignore_eos,
            priority=self.priority, include_stop_str_in_output=self.include_stop_str_in_output,
            **{name: value for name in _SENT_WHERE_SET if (value := getattr(self, name)) is not None},
            **{name: value for name, neutral in _SENT_WHERE_NOT.items() if (value := getattr(self, name)) != neutral})
        if max_tokens is not None:
            r.max_new_tokens = max_tokens
        if self._structured is not None:
            r.structured_output.CopyFrom(self._structured)
        return r

    def prompt_protos(self) -> list[generation_pb2.GenerateRequest]:
        """One GenerateRequest per prompt (chat: one)."""
        return [self.to_proto()]

    def choices(self) -> list[generation_pb2.GenerateRequest]:
        """One GenerateRequest per choice, prompt by prompt (choice index = prompt index × n + i, OpenAI's order):
        with a seed, choice i of every prompt samples with seed + i; without, each draws its own."""
        out = []
        for first in self.prompt_protos():
            out.append(first)
            for i in range(1, self.n):
                r = generation_pb2.GenerateRequest()
                r.CopyFrom(first)
                r.sampling.seed = (first.sampling.seed + i) % 2**64 if self.seed is not None else secrets.randbits(63)
                out.append(r)
        return out


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None: an assistant message with tool_calls
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an earlier assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant turn's reasoning, as this API returned it (vLLM's name)
    reasoning_content: str | None = None  # the same, by its older name (DeepSeek's API, vLLM before 0.11)
    annotations: list[dict[str, Any]] | None = None  # an answer sent back as the client got it: not used

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: needed (only an assistant message with tool_calls may leave it out)")
        return self

    def add_to(self, messages) -> None:
        """Append this message to a GenerateRequest's `messages`. OpenAI's `developer` is the templates' `system`."""
        messages.add(role="system" if self.role == "developer" else self.role, content=self.content or "",
                     tool_calls=json.dumps(self.tool_calls) if self.tool_calls else "",
                     tool_call_id=self.tool_call_id or "", name=self.name or "",
                     reasoning=self.reasoning or self.reasoning_content or "")

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if v is None or isinstance(v, str):
            return v
        parts = []
        for i, part in enumerate(v):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                                 f"got type {part.get('type')!r}")
            parts.append(part["text"])
        return "\n".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = ruled(None, "logprobs")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template controls (a prefilled answer: continue_final_message with add_generation_prompt false)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning (COORDINATOR_REASONING_PARSER) out
    # OpenAI's, accepted at what this server does: nothing is stored, one service tier, text out
    store: bool | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # OpenAI's routing hint: prefix-aware routing needs none
    safety_identifier: str | None = None  # as `user`: accepted, not used
    _tool: Any = PrivateAttr(default=None)  # the forced tool choice (coordinator/http_api/structured.py)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        """GenerateRequest.logprobs' rule (specdec/scheduling/field_rules.py), under the name chat's clients send it by.
        """
        field_rules.check([field_rules.RULE["logprobs"]], {"logprobs": v}, names={"logprobs": "top_logprobs"})
        return v

    @model_validator(mode="after")
    def _chat_neutral(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.store:
            raise ValueError("store: chat completions are not stored here; leave it out (the Responses API, "
                             "/v1/responses, stores responses)")
        self._tool = tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self._tool is not None and not self._tool.auto:
            if self._structured is not None:
                raise ValueError("tool_choice: a forced tool call fixes the answer's form already; leave "
                                 "response_format and structured_outputs out")
            self._structured = self._tool.structured()
        return self

    @property
    def tool(self) -> ToolChoice | None:
        return self._tool

    def to_proto(self) -> generation_pb2.GenerateRequest:
        # 0 too goes on: the servicer refuses it with the table's message, as on gRPC
        r = self.generate_request(self.max_tokens if self.max_completion_tokens is None else
                                  self.max_completion_tokens)
        r.max_new_tokens_to_context = not r.HasField("max_new_tokens")  # OpenAI's and vLLM's default: the rest
        if self.logprobs:
            r.sampling.logprobs = self.top_logprobs or 0
        for m in self.messages:
            m.add_to(r.messages)
        if self.tools and self.tool_choice != "none":  # the chat template shows them to the model
            r.tools = json.dumps(self.tools)
        if self._tool is not None and self._tool.auto and needs_special_tokens(self._tool.parser):
            r.skip_special_tokens = False  # the parser reads a special token (mistral's [TOOL_CALLS])
        template_fields(self, r)
        return r


def template_fields(body, r: generation_pb2.GenerateRequest) -> None:
    """The body's chat-template controls → GenerateRequest (only where they differ from the defaults)."""
    if not body.add_generation_prompt:
        r.add_generation_prompt = False
    r.continue_final_message = body.continue_final_message
    if body.chat_template_kwargs:
        r.chat_template_kwargs = json.dumps(body.chat_template_kwargs)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int32] | list[list[Int32]]  # token ids: the servicer checks them
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: Int32 | None = ruled(None, "logprobs")

    _prompts: list = PrivateAttr(default_factory=list)  # str (text) or list[int] (token ids), one per prompt

    @model_validator(mode="after")
    def _completion_neutral(self):
        p = self.prompt
        if isinstance(p, list) and not p:
            raise ValueError("prompt: empty; send a string, a list of token ids, or a list of either")
        self._prompts = list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]
        if len(self._prompts) * self.n > MAX_GENERATIONS:
            raise ValueError(f"prompt: {len(self._prompts)} prompts × n = {self.n} are {len(self._prompts) * self.n} "
                             f"generations; at most {MAX_GENERATIONS} per request: split the prompts over requests")
        if any(isinstance(x, list) and not x for x in self._prompts):
            raise ValueError("prompt: an empty list of token ids")
        for name, bad in (("suffix", self.suffix), ("best_of", self.best_of not in (None, 1)),
                          ("echo", self.echo and self.stream)):
            if bad:
                raise ValueError(f"{name}: not supported{' with stream' if name == 'echo' else ''}; leave it out")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 only with echo: the prompt's logprobs alone)")
        return self

    @property
    def prompts(self) -> list:
        return self._prompts

    def prompt_protos(self) -> list[generation_pb2.GenerateRequest]:
        return [self.to_proto(p) for p in self._prompts]

    def to_proto(self, prompt: str | list[int] | None = None) -> generation_pb2.GenerateRequest:
        """The GenerateRequest of one prompt (default: the first)."""
        prompt = self._prompts[0] if prompt is None else prompt
        # max_tokens 0 (echo): one token is generated and dropped (a request generates at least one)
        r = self.generate_request(self.max_tokens or (1 if self.max_tokens == 0 else None))
        if self.logprobs is not None:
            r.sampling.logprobs = self.logprobs
            if self.echo:
                r.sampling.prompt_logprobs = self.logprobs
        if isinstance(prompt, str):
            r.prompt, r.raw_prompt = prompt, True  # a completion continues the text as is: no chat template
        else:
            r.prompt_token_ids.extend(prompt)
        return r


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize: the ids a prompt becomes, as the chat (`messages`) or completions (`prompt`) route
    encodes it."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # as the chat route shows them to the chat template
    add_generation_prompt: bool = True  # the chat route's controls, as there
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True  # what the completions route does; False is refused

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: send exactly one of prompt (as /v1/completions) or messages (as "
                             "/v1/chat/completions)")
        if not self.add_special_tokens:
            raise ValueError("add_special_tokens: only true is supported (what the completions route does); leave "
                             "it out")
        return self


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize."""
    model: str | None = None
    tokens: list[int] = Field(min_length=1)
