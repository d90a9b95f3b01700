"""Tool calls a model chose to make (OpenAI's `tool_choice: "auto"`): parsers of each model family's tool-call text,
whole and incremental, as vLLM's `--tool-call-parser` names them. Pure: no web framework.

- `hermes` (Qwen2.5, Hermes 2/3, SmolLM3, most templates that render tools): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text around the calls is the message's content.
- `llama3_json` (Llama 3.1-3.3): an answer that starts with `{` (or Llama's `<|python_tag|>`) is one or more
  `{"name": ..., "parameters": {...}}` objects, separated by `;`; any other answer is content.
- `pythonic` (Llama 3.2 and 4): an answer that is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Paris")]`.
- `mistral` (Mistral, Mixtral, Ministral): content, then the special token `[TOOL_CALLS]` and the calls (a JSON list
  of them, or `name[ARGS]{json}` per call); its requests keep special tokens in their text to see it.

A call whose text does not parse (bad JSON, no name, arguments that are not an object) stays in the content as the
model wrote it: nothing the model said is lost. Streamed, content flows as it is verified (less any text that may
still become a call's opening tag) and each call comes whole, in one delta, once its text has closed.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


def call_entry(name: str, arguments: str) -> dict:
    """OpenAI's tool_calls entry for a call, with a fresh id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as json.dumps writes it

    def delta(self, index: int) -> dict:
        """The entry as a streamed delta carries it (`index`: its place among the choice's calls)."""
        return {"index": index, **call_entry(self.name, self.arguments)}


def _call(obj, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A parsed JSON value → ToolCall, or None when it is not {"name": str, <args key>: object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(args)) if isinstance(args, dict) else None


def split_tail(text: str, tag: str) -> tuple[str, str]:
    """`text` → (what can be shown now, the tail that may still become `tag`)."""
    keep = next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)
    return text[:len(text) - keep], text[len(text) - keep:]


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks; text outside them is content."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.pending, self.in_call = "", False

    @classmethod
    def body(cls, text: str) -> ToolCall | None:
        try:
            return _call(json.loads(text), ("arguments", "parameters"))
        except ValueError:
            return None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """More text → (content that can be shown now, calls that closed)."""
        self.pending += text
        content, calls = [], []
        while True:
            if not self.in_call:
                at = self.pending.find(self.OPEN)
                if at < 0:  # keep a tail that may still become the opening tag
                    shown, self.pending = split_tail(self.pending, self.OPEN)
                    content.append(shown)
                    break
                content.append(self.pending[:at])
                self.pending, self.in_call = self.pending[at + len(self.OPEN):], True
            else:
                at = self.pending.find(self.CLOSE)
                if at < 0:
                    break
                raw, self.pending, self.in_call = self.pending[:at], self.pending[at + len(self.CLOSE):], False
                call = self.body(raw)
                if call is None:  # not a call: the model's text stays content
                    content.append(self.OPEN + raw + self.CLOSE)
                else:
                    calls.append(call)
        return "".join(content), calls

    def end(self) -> tuple[str, list[ToolCall]]:
        """The output ended: an unclosed call that parses still counts (a model may end at EOS before the tag)."""
        rest, self.pending = self.pending, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        call = self.body(rest)
        return ("", [call]) if call is not None else (self.OPEN + rest, [])


class WholeAnswerParser:
    """Formats where an answer is either all calls or all content, told by how it starts (`OPENER`, or the model's
    `TAG`): content flows as it comes; calls are parsed whole when the answer ends (`parse`)."""
    TAG, OPENER = "", ""

    def __init__(self):
        self.pending, self.calls_mode = "", None  # None: undecided (only whitespace or a prefix of TAG seen)

    @classmethod
    def parse(cls, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        if self.calls_mode is None:
            head = self.pending.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return "", []
            self.calls_mode = head.startswith((self.OPENER, self.TAG))
        if self.calls_mode:
            return "", []  # calls are parsed whole when the answer ends
        out, self.pending = self.pending, ""
        return out, []

    def end(self) -> tuple[str, list[ToolCall]]:
        text, self.pending = self.pending, ""
        if not self.calls_mode:
            return text, []
        calls = self.parse(text)
        return ("", calls) if calls else (text, [])


class Llama3JsonParser(WholeAnswerParser):
    """An answer that starts with `{` or `<|python_tag|>` is `;`-separated call objects; any other is content."""
    TAG, OPENER = "<|python_tag|>", "{"

    @classmethod
    def parse(cls, text: str) -> list[ToolCall]:
        """Every call in `text`, or [] when any part of it is not one."""
        rest = text.strip().removeprefix(cls.TAG).strip()
        decoder, calls = json.JSONDecoder(), []
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                return []
        return calls


class PythonicParser(WholeAnswerParser):
    """An answer that is a Python list of calls, `[get_weather(city="Paris"), now()]` (Llama 3.2 and 4's
    pythonic format, optionally inside Llama 4's `<|python_start|>`/`<|python_end|>`): keyword arguments whose
    values are literals. Any other answer is content."""
    TAG, OPENER, END = "<|python_start|>", "[", "<|python_end|>"

    @classmethod
    def parse(cls, text: str) -> list[ToolCall]:
        """Every call in `text`, or [] when it is not a list of calls with literal keyword arguments."""
        import ast

        src = text.strip().removeprefix(cls.TAG).removesuffix(cls.END).strip()
        try:
            tree = ast.parse(src, mode="eval")
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return []
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return []
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return []
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                arguments = json.dumps(args)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return []
            if len(args) != len(node.keywords):  # **kwargs
                return []
            calls.append(ToolCall(ast.unparse(node.func), arguments))
        return calls


class MistralParser:
    """Mistral's `[TOOL_CALLS]` special token, then the calls: a JSON list of `{"name", "arguments"}` objects
    (v3 tokenizers) or `name{json}` / `name[ARGS]{json}`, one per `[TOOL_CALLS]` (v11+). Text before the first
    `[TOOL_CALLS]` is content. The token is special: requests under this parser are detokenized with special tokens
    (`needs_special_tokens`)."""
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True

    def __init__(self):
        self.pending, self.in_calls = "", False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        if self.in_calls:
            return "", []
        at = self.pending.find(self.TAG)
        if at >= 0:
            content, self.pending, self.in_calls = self.pending[:at], self.pending[at:], True
            return content, []
        content, self.pending = split_tail(self.pending, self.TAG)
        return content, []

    def end(self) -> tuple[str, list[ToolCall]]:
        text, self.pending = self.pending, ""
        if not self.in_calls:
            return text, []
        calls = self.parse(text)
        return ("", calls) if calls else (text, [])

    @classmethod
    def parse(cls, text: str) -> list[ToolCall]:
        """The calls after `[TOOL_CALLS]`, or [] when any part is not one."""
        parts = [p.strip() for p in text.split(cls.TAG) if p.strip()]
        if not parts:
            return []
        calls = []
        for part in parts:
            if part.startswith("["):  # v3: a JSON list of calls
                try:
                    objs = json.loads(part)
                except ValueError:
                    return []
                got = [_call(o, ("arguments", "parameters")) for o in (objs if isinstance(objs, list) else [])]
                if not got or None in got:
                    return []
                calls += got
                continue
            name, sep, args = part.partition(cls.ARGS)
            if not sep:
                brace = part.find("{")
                name, args = (part[:brace], part[brace:]) if brace > 0 else (part, "")
            try:
                call = _call({"name": name.strip(), "arguments": json.loads(args)}, ("arguments",))
            except ValueError:
                return []
            if call is None:
                return []
            calls.append(call)
        return calls


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser,
           "mistral": MistralParser}


def needs_special_tokens(parser: str) -> bool:
    """Whether this parser reads special tokens (its requests keep them in their text)."""
    return getattr(PARSERS.get(parser), "needs_special_tokens", False)


def parse_whole(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer → (content, or None when it is only calls and whitespace; the calls)."""
    p = PARSERS[parser]()
    content, calls = p.feed(text)
    more, last = p.end()
    content += more
    calls += last
    return (content.rstrip() or None, calls) if calls else (content, calls)


class AutoToolReader:
    """One streamed choice under tool_choice "auto": its text deltas → chat deltas (`content`, `tool_calls`).
    Trailing whitespace waits for what follows it (the newlines around a model's calls are not content), so the
    streamed content is what `parse_whole` answers."""

    def __init__(self, parser: str):
        self.parser, self.calls, self.blank = PARSERS[parser](), 0, ""

    def _deltas(self, content: str, calls: list[ToolCall], last: bool = False) -> list[dict]:
        out = []
        content = self.blank + content
        shown = content if last and not self.calls and not calls else content.rstrip()
        if shown:
            out.append({"content": shown})
        self.blank = content[len(shown):]
        if calls:
            out.append({"tool_calls": [c.delta(self.calls + k) for k, c in enumerate(calls)]})
            self.calls += len(calls)
        return out

    def feed(self, text: str) -> list[dict]:
        return self._deltas(*self.parser.feed(text))

    def end(self, finish: str) -> tuple[list[dict], str]:
        """The choice ended with `finish` → (last deltas, finish_reason: "tool_calls" when it called a tool and
        stopped by itself)."""
        deltas = self._deltas(*self.parser.end(), last=True)
        return deltas, "tool_calls" if self.calls and finish == "stop" else finish
