"""The HTTP API's structured-output forms → GenerateRequest.structured_output (specdec/text/grammar.py): OpenAI's
`response_format`, vLLM's `structured_outputs`, and tool calls with a forced choice.

Tool calls (OpenAI's `tools` + `tool_choice`): with `"required"` or a named function the answer is constrained to
the tools' argument schemas, as vLLM does it, so it always parses: a named function's answer is its arguments
object; "required" answers a JSON array of `{"name", "parameters"}` calls, one or more. The answer comes back as
the message's `tool_calls`. With `"auto"` (the default when tools are sent) the model answers freely and a parser
of its family's tool-call text (coordinator/grpc_api/tool_parsers.py, the coordinator's `tool_call_parser`) reads the
calls it chose to make out of the answer.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from coordinator.grpc_api.tool_parsers import AutoToolReader, call_entry, parse_whole
from specdec_rpc.pb import generation_pb2

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_output_pb(so: dict[str, Any] | None,
                         guided: dict[str, Any] | None = None) -> generation_pb2.StructuredOutput | None:
    """vLLM's `structured_outputs` body field, or its older `guided_*` fields (`guided`: {"json": guided_json, ...}),
    → StructuredOutput (None: not set)."""
    picked = _structured_entry(so, guided)
    if picked is None:
        return None
    key, value = picked
    out = generation_pb2.StructuredOutput()
    _STRUCTURED_SETTERS.get(key, _set_text)(out, key, value)
    return out


def _structured_entry(so: dict[str, Any] | None, guided: dict[str, Any] | None) -> tuple[str, Any] | None:
    """The one (key, value) set in `structured_outputs` or the `guided_*` fields (None: neither is set)."""
    guided = {k: v for k, v in (guided or {}).items() if v is not None}
    if guided and so:
        raise ValueError("structured_outputs: send it or the guided_* fields, not both")
    so = so or guided
    if not so:
        return None
    given = {k: v for k, v in so.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(_STRUCTURED_KEYS))
    if unknown:
        raise ValueError(f"structured_outputs: unknown key {unknown[0]!r}; use one of {', '.join(_STRUCTURED_KEYS)}")
    if len(given) != 1:
        raise ValueError(f"structured_outputs: set exactly one of {', '.join(_STRUCTURED_KEYS)}")
    (key, value), = given.items()
    return key, value


def _set_json(out: generation_pb2.StructuredOutput, key: str, value: Any) -> None:
    out.json_schema = value if isinstance(value, str) else json.dumps(value)


def _set_json_object(out: generation_pb2.StructuredOutput, key: str, value: Any) -> None:
    if value is not True:
        raise ValueError("structured_outputs.json_object: true (a JSON boolean)")
    out.json_object = True


def _set_choice(out: generation_pb2.StructuredOutput, key: str, value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise ValueError("structured_outputs.choice: a list of strings")
    out.choice.choices.extend(value)


def _set_text(out: generation_pb2.StructuredOutput, key: str, value: Any) -> None:
    """`regex` or `grammar`: a string, set as the field of the same name."""
    if not isinstance(value, str):
        raise ValueError(f"structured_outputs.{key}: a string")
    setattr(out, key, value)


# structured_outputs key → its setter on StructuredOutput; the rest (regex, grammar) take _set_text
_STRUCTURED_SETTERS = {"json": _set_json, "json_object": _set_json_object, "choice": _set_choice}


def response_format_pb(fmt: dict[str, Any] | None) -> generation_pb2.StructuredOutput | None:
    """OpenAI's `response_format` → StructuredOutput (None: text)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return generation_pb2.StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format: type {kind!r} is not supported; use text, json_object or json_schema")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format: json_schema needs {'name': ..., 'schema': {...}}")
    return generation_pb2.StructuredOutput(json_schema=json.dumps(schema))


_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128


@dataclass
class ToolChoice:
    """A tool choice: forced, `name` (one function) or every tool ("required"), or the model's own (`auto`, read by
    the `parser` the front door sets); `params` name → arguments schema."""
    params: dict[str, dict]
    name: str = ""
    parallel: bool = True  # OpenAI's parallel_tool_calls: False allows "required" one call only
    auto: bool = False
    parser: str = ""  # auto: coordinator/grpc_api/tool_parsers.py's PARSERS key

    def reader(self):
        """A streamed choice's reader: its text deltas → chat deltas (`feed(text)`, `end(finish)`)."""
        if self.auto:
            return AutoToolReader(self.parser)
        return _NamedCall(self.name) if self.name else _HeldAnswer(self)

    def structured(self) -> generation_pb2.StructuredOutput:
        """The answer's schema, written as json.dumps writes (`{"a": 1, "b": 2}`, no other whitespace): a model left
        free to add whitespace may add it until max_tokens, and a tool call's arguments are read by a program."""
        if self.name:
            schema = dict(self.params[self.name])
        else:
            calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for n, p in self.params.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
        schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return generation_pb2.StructuredOutput(json_schema=json.dumps(schema))

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The answer's text → (assistant message, finish_reason). A named function's answer is its arguments as
        written (cut short at "length", as OpenAI's); a "required" answer cut short does not parse and comes back
        as content."""
        if self.auto:
            content, calls = parse_whole(self.parser, text)
            if not calls:
                return {"role": "assistant", "content": text}, finish
            return ({"role": "assistant", "content": content,
                     "tool_calls": [call_entry(c.name, c.arguments) for c in calls]},
                    "tool_calls" if finish == "stop" else finish)
        if self.name:  # OpenAI's finish_reason for a named function: "stop"
            return ({"role": "assistant", "content": None, "tool_calls": [call_entry(self.name, text)]},
                    "stop" if finish in ("stop", "tool_calls") else finish)
        try:
            value = json.loads(text)
        except ValueError:
            return {"role": "assistant", "content": text}, finish
        calls = [(c["name"], c["parameters"]) for c in value]
        tool_calls = [call_entry(n, json.dumps(args)) for n, args in calls]
        return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"


class _NamedCall:
    """A streamed named function's call: its arguments stream as the model writes them (OpenAI's deltas: the first
    carries the call's id and name)."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def _deltas(self, text: str) -> list[dict]:
        if self.started:
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        self.started = True
        return [{"tool_calls": [{"index": 0, **call_entry(self.name, text)}]}]

    def feed(self, text: str) -> list[dict]:
        return self._deltas(text) if text else []

    def end(self, finish: str) -> tuple[list[dict], str]:
        return ([] if self.started else self._deltas("")), "stop" if finish in ("stop", "tool_calls") else finish


class _HeldAnswer:
    """A streamed "required" choice: its text is held, and its calls come whole in one chunk when it ends."""

    def __init__(self, tool: ToolChoice):
        self.tool, self.held = tool, []

    def feed(self, text: str) -> list[dict]:
        self.held.append(text)
        return []

    def end(self, finish: str) -> tuple[list[dict], str]:
        message, finish = self.tool.message("".join(self.held), finish)
        calls = [{"index": k, **c} for k, c in enumerate(message.get("tool_calls") or [])]
        return [{"tool_calls": calls} if calls else {"content": message["content"]}], finish


def tool_choice(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None,
                parallel: bool | None = None) -> ToolChoice | None:
    """OpenAI's `tools` and `tool_choice` → the forced choice (None: no tool call). Raises ValueError naming the
    field."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None
    params = _tool_params(tools)
    if choice == "none":
        return None
    if choice == "required":
        return ToolChoice(params, parallel=parallel is not False)
    if isinstance(choice, dict):
        return ToolChoice(params, _named_tool(params, choice))
    if choice in (None, "auto"):  # the model's own choice: the front door checks it has a parser
        return ToolChoice(params, auto=True)
    raise ValueError(f"tool_choice: {choice!r} is none of 'auto', 'none', 'required' or {{'type': 'function', "
                     f"'function': {{'name': ...}}}}")


def _tool_params(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """OpenAI's `tools` → each function's name → its arguments schema (no schema: an object with no properties)."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS} (OpenAI's limit), got {len(tools)}")
    params = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise ValueError(f"tools: tool {i} must be {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}} with a name of 1-64 letters, digits, _ or -")
        if fn["name"] in params:
            raise ValueError(f"tools: two tools are named {fn['name']!r}")
        p = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(p, dict):
            raise ValueError(f"tools: tool {i}'s parameters must be a JSON schema object")
        params[fn["name"]] = p
    return params


def _named_tool(params: dict[str, dict], choice: dict[str, Any]) -> str:
    """A `{"type": "function", "function": {"name": ...}}` tool_choice → the name of the tool it forces."""
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in params:
        raise ValueError(f"tool_choice: names no tool of tools ({', '.join(params)})")
    return name
