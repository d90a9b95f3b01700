"""OpenAI's Responses API (`POST /v1/responses`), as the chat route serves it: a body is translated to a chat
request (coordinator/http_api/schema.py), generated the same way, and answered as a `response` object or as
Responses stream events. Pure: pydantic, no web framework.

- `input` is a string or a list of items: messages (`role` + `content`, a string or `input_text` / `output_text`
  parts), `function_call` items (earlier tool calls) and `function_call_output` items (their results).
  `instructions` is a system message before them.
- `tools` are function tools (`{"type": "function", "name", "parameters"}`); `tool_choice` as the chat route's
  (`"auto"` needs the coordinator's tool-call parser). `text.format` is `text`, `json_object` or `json_schema`.
- Responses are stored in the coordinator's memory unless `store: false` (coordinator/http_api/response_store.py), and
  `previous_response_id` continues a stored one's conversation. `background` is refused.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from coordinator.http_api.bodies import stats_dict
from coordinator.http_api.response_store import as_items
from coordinator.http_api.schema import ChatCompletionRequest, Int32, SpecDecKnobs, ruled

_PART_TYPES = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content is a string or a list of text parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _PART_TYPES or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}: part {i}: only text parts (input_text, output_text) are supported, got "
                             f"{kind!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def input_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict]:
    """`instructions` + `input` → chat messages (consecutive function_call items become one assistant turn's
    tool_calls; a function_call_output item a tool message; a reasoning item, as an earlier response returned it,
    the next assistant turn's `reasoning`)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    thought = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input: item {i} is not an object")
        kind = item.get("type", "message")
        add = _INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if add is None:
            raise ValueError(f"input: item {i}: type {kind!r} is not supported; send messages, function_call, "
                             f"function_call_output and reasoning items")
        thought = add(messages, item, i, thought)
    if not messages:
        raise ValueError("input: empty; send a string or at least one message")
    return messages


# Each input item kind's reader: (messages so far, the item, its index, the pending reasoning) → appends the item's
# chat form to the messages and returns the reasoning still pending for the next assistant turn.

def _reasoning_input(messages: list[dict], item: dict, i: int, thought: str | None) -> str | None:
    content, summary = item.get("content") or [], item.get("summary") or []
    if not isinstance(content, list) or not isinstance(summary, list):
        raise ValueError(f"input: item {i}: a reasoning item's content and summary are lists of text parts")
    parts = [p for p in content + summary if isinstance(p, dict)]
    return "\n".join(p["text"] for p in parts if isinstance(p.get("text"), str)) or None


def _message_input(messages: list[dict], item: dict, i: int, thought: str | None) -> str | None:
    if item.get("role") not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"input: item {i}: role is one of user, assistant, system, developer")
    messages.append({"role": item["role"], "content": _text(item.get("content"), f"input: item {i}")})
    if item["role"] == "assistant" and thought:
        messages[-1]["reasoning"], thought = thought, None
    return thought


def _function_call_input(messages: list[dict], item: dict, i: int, thought: str | None) -> str | None:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise ValueError(f"input: item {i}: a function_call has call_id, name and arguments (strings)")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = messages[-1] if messages else None
    if last and last["role"] == "assistant" and last.get("tool_calls") is not None and not last["content"]:
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if thought:
            messages[-1]["reasoning"], thought = thought, None
    return thought


def _function_call_output_input(messages: list[dict], item: dict, i: int, thought: str | None) -> str | None:
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
        raise ValueError(f"input: item {i}: a function_call_output has call_id and output (strings)")
    messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return thought


_INPUT_ITEMS = {"reasoning": _reasoning_input, "message": _message_input, "function_call": _function_call_input,
                "function_call_output": _function_call_output_input}


class ResponsesRequest(SpecDecKnobs):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    # ranges: the servicer's field rules answer them, with the same messages as every other route (schema.py)
    max_output_tokens: Int32 | None = None
    temperature: float = ruled(1.0, "temperature")
    top_p: float = ruled(1.0, "top_p")
    top_k: Int32 = 0  # vLLM's, as seed: -1 is 0 (off)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # unset: stored where the coordinator keeps responses (OpenAI's default: true)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # as `user`: accepted, not used
    prompt_cache_key: str | None = None  # OpenAI's routing hint: prefix-aware routing needs none
    service_tier: Literal["auto", "default"] | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate on a private server
    truncation: Literal["disabled"] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = None  # "message.output_text.logprobs": the target's logprobs of the text
    reasoning: dict[str, Any] | None = None
    top_logprobs: Int32 | None = ruled(None, "logprobs")
    max_tool_calls: int | None = None
    _chat: Any = None

    @model_validator(mode="after")
    def _translate(self):
        _refuse_unsupported(self)
        tools = _chat_tools(self.tools)
        choice = _chat_tool_choice(self.tool_choice)
        fmt = _chat_format(self.text)
        knobs = self.model_dump(include=set(SpecDecKnobs.model_fields), exclude_unset=True)
        self._chat = ChatCompletionRequest(
            model=self.model, messages=input_messages(self.instructions, self.input),
            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stream=self.stream, tools=tools or None, tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls, response_format=fmt, user=self.user,
            logprobs=self.logprobs or None, top_logprobs=self.top_logprobs if self.logprobs else None, **knobs)
        return self

    def continued(self, history: list[dict[str, Any]]) -> "ResponsesRequest":
        """This request after `history` (a stored response's conversation): its input items follow it."""
        return type(self).model_validate({**self.model_dump(exclude_unset=True),
                                          "input": history + as_items(self.input)})

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    @property
    def chat(self) -> ChatCompletionRequest:
        return self._chat


def _refuse_unsupported(body: ResponsesRequest) -> None:
    """Raises ValueError naming the first field set that the route does not serve."""
    for name, bad, why in (("background", body.background, "not supported; leave it out and wait, or stream"),
                           ("include", set(body.include or ()) - {LOGPROBS},
                            f"only {LOGPROBS!r} is supported"),
                           ("reasoning", body.reasoning, "effort and summaries cannot be set here; leave it out "
                            "(with COORDINATOR_REASONING_PARSER a reasoning model's thinking comes back as a "
                            "reasoning item)"),
                           ("top_logprobs", body.top_logprobs and not body.logprobs,
                            f"needs include: [{LOGPROBS!r}]"),
                           ("max_tool_calls", body.max_tool_calls is not None, "not supported; leave it out")):
        if bad:
            raise ValueError(f"{name}: {why}")


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict]:
    """Responses function tools (`{"type": "function", "name", ...}`) → chat tools (`{"type": "function",
    "function": {"name", ...}}`)."""
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ValueError(f"tools: tool {i}: only function tools ({{'type': 'function', 'name': ..., "
                             f"'parameters': {{...}}}}) are supported")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A Responses tool_choice → chat's: a named function `{"type": "function", "name"}` moves its name under
    `function`."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format` → chat's response_format (json_schema's name and schema move under `json_schema`)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise ValueError("text.format: an object, {'type': 'text'}, {'type': 'json_object'} or {'type': "
                         "'json_schema', 'name': ..., 'schema': {...}}")
    fmt = dict(fmt)
    if fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "answer"),
                                                      "schema": fmt.get("schema")}}
    return fmt


def output_items(message: dict, finish: str, logprobs: list[dict] | None = None) -> list[dict]:
    """A chat answer (assistant message) → the response's output items: a reasoning item with its `reasoning`, a
    message item with its text (and its tokens' logprobs: chat's `content` entries), then one function_call item
    per tool call."""
    status = "incomplete" if finish == "length" else "completed"
    items = [reasoning_item(message["reasoning"], status)] if message.get("reasoning") else []
    if message.get("content") is not None:
        items.append(message_item(message["content"], status, logprobs=logprobs))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call, status))
    return items


def message_item(text: str, status: str, item_id: str | None = None, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict, status: str = "completed") -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def response_object(body: ResponsesRequest, rid: str, created: int, model: str, output: list[dict],
                    finish: str | None, stats=None, stored: bool = False) -> dict:
    """The `response` object; `finish` None: still in progress (the stream's first events)."""
    status = "in_progress" if finish is None else ("incomplete" if finish == "length" else "completed")
    usage = None
    if stats is not None:
        usage = {"input_tokens": stats.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": stats.cached_prompt_tokens, "cache_write_tokens": 0},
                 "output_tokens": stats.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": stats.reasoning_tokens},
                 "total_tokens": stats.prompt_tokens + stats.completion_tokens}
    out = {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
           "output": output, "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
           "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
           "top_p": body.top_p, "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
           "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "store": stored,
           "previous_response_id": body.previous_response_id, "metadata": body.metadata or {},
           "truncation": "disabled", "usage": usage}
    if stats is not None:
        out["stats"] = stats_dict(stats)
    return out


def dumps(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponseEvents:
    """One answer's chat deltas (`reasoning`, `content`, `tool_calls`) → Responses stream events, numbered: a
    reasoning item holds the reasoning, a message item opens at its first text and closes before the first call;
    each tool call is one function_call item."""

    def __init__(self, body: ResponsesRequest, rid: str, created: int, model: str, stored: bool = False):
        self.body, self.rid, self.created, self.model, self.stored = body, rid, created, model, stored
        self.seq, self.output, self.text = 0, [], None  # self.text: the open message item's text pieces
        self.args: list[str] | None = None  # the open function_call item's argument pieces
        self.logprobs: list[dict] = []  # the open message item's tokens' logprobs
        self.thought: list[str] | None = None  # the open reasoning item's text pieces
        self.final: dict | None = None  # the finished response

    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return dumps(event)

    def _response(self, finish: str | None = None, stats=None) -> dict:
        return response_object(self.body, self.rid, self.created, self.model, self.output, finish, stats,
                               self.stored)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self._response()),
                self._event("response.in_progress", response=self._response())]

    def _close_message(self, status: str) -> list[str]:
        if self.text is None:
            return []
        item, index, text = self.output[-1], len(self.output) - 1, "".join(self.text)
        item.update(message_item(text, status, item["id"], self.logprobs))
        part = item["content"][0]
        self.text, self.logprobs = None, []
        ids = {"item_id": item["id"], "output_index": index}
        return [self._event("response.output_text.done", **ids, content_index=0, text=text,
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _reasoning(self, text: str) -> list[str]:
        out = []
        if self.thought is None:
            self.output.append(dict(reasoning_item("", "in_progress"), content=[]))
            self.thought = []
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=dict(self.output[-1])))
        self.thought.append(text)
        return out + [self._event("response.reasoning_text.delta", item_id=self.output[-1]["id"],
                                  output_index=len(self.output) - 1, content_index=0, delta=text)]

    def _close_reasoning(self, status: str) -> list[str]:
        if self.thought is None:
            return []
        item, index, text = self.output[-1], len(self.output) - 1, "".join(self.thought)
        item.update(reasoning_item(text, status, item["id"]))
        self.thought = None
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _open_message(self) -> list[str]:
        if self.text is not None:
            return []
        out = self._close_reasoning("completed") + self._close_call("completed")
        item = message_item("", "in_progress")
        item["content"] = []
        self.output.append(item)
        self.text = []
        index = len(self.output) - 1
        return out + [self._event("response.output_item.added", output_index=index, item=dict(item, content=[])),
                      self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []})]

    def delta(self, delta: dict) -> list[str]:
        if delta.get("reasoning"):
            return self._reasoning(delta["reasoning"])
        out = []
        text, lps = delta.get("content"), delta.get("logprobs") or []
        if text or lps:  # logprobs alone: tokens with no text of their own (EOS), kept for the item's done event
            out += self._open_message()
            self.logprobs += lps
        if text:
            self.text.append(text)
            out.append(self._event("response.output_text.delta", item_id=self.output[-1]["id"],
                                   output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=lps))
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call begins (whole, or its arguments follow in later deltas)
                out += self._close_reasoning("completed") + self._close_message("completed")
                out += self._close_call("completed")
                item = call_item(call)
                self.output.append(dict(item, arguments="", status="in_progress"))
                self.args = []
                out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                       item=dict(self.output[-1])))
            pieces = call.get("function", {}).get("arguments", "")
            if pieces and self.args is not None:
                self.args.append(pieces)
                out.append(self._event("response.function_call_arguments.delta", item_id=self.output[-1]["id"],
                                       output_index=len(self.output) - 1, delta=pieces))
        return out

    def _close_call(self, status: str) -> list[str]:
        if self.args is None:
            return []
        item, index = self.output[-1], len(self.output) - 1
        item.update(arguments="".join(self.args), status=status)
        self.args = None
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def finish(self, finish: str, stats) -> list[str]:
        status = "incomplete" if finish == "length" else "completed"
        out = self._close_reasoning(status)  # an answer that never got past its reasoning
        if all(item["type"] == "reasoning" for item in self.output):  # an empty answer is an empty message, as
            out += self._open_message()  # whole
        out += self._close_message(status) + self._close_call(status)
        kind = "response.incomplete" if finish == "length" else "response.completed"
        self.final = self._response(finish, stats)
        return out + [self._event(kind, response=self.final)]

    def error(self, body: dict) -> str:
        err = body["error"]
        return self._event("error", code=err.get("code"), message=err["message"], param=err.get("param"))


class TextReader:
    """A streamed answer without tools: its text deltas are content, each with the logprobs of the tokens verified
    since the last one (a token whose text is held back, a partial character, joins the next piece)."""

    def __init__(self):
        self.pending: list[dict] = []

    def feed(self, text: str, logprobs: list[dict] | None = None) -> list[dict]:
        self.pending += logprobs or []
        if not text:
            return []
        delta, self.pending = {"content": text, "logprobs": self.pending}, []
        return [delta]

    def end(self, finish: str) -> tuple[list[dict], str]:
        rest, self.pending = self.pending, []
        return ([{"content": "", "logprobs": rest}] if rest else []), finish
