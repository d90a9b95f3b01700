"""Tokenizer helpers: loading, prompt encoding (chat template) and incremental detokenization.

Prompt choice: a plain ``prompt`` string given to a model whose tokenizer has a chat template is wrapped as ONE
user message and the chat template is applied with ``add_generation_prompt=True`` (instruct models such as
SmolLM2-Instruct answer badly to raw text). Pass ``raw=True`` to ``encode_prompt`` to tokenize the string as is.
Models without a tokenizer (tiny test models) work with token-id prompts only.
"""
from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specdec.errors import InvalidRequestError

__all__ = ["load_tokenizer", "encode_prompt", "IncrementalDetokenizer", "eos_token_ids", "decode"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_dir: os.PathLike | str):
    """Return the HF tokenizer saved in ``model_dir``, or None when the directory has none."""
    d = pathlib.Path(model_dir)
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer  # lazy: transformers is heavy (~1 s) and the replicas never need it

    return AutoTokenizer.from_pretrained(str(d))


# apply_chat_template's own arguments and what templates are given anyway: not settable by chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                       "truncation", "max_length", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token"})


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template renders messages (vLLM's request fields): `add_generation_prompt` opens the
    assistant's turn; `continue_final_message` continues the last message instead (a prefilled answer);
    `kwargs`: more template variables."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)

    def check(self, messages: Sequence[dict]) -> None:
        """Raises InvalidRequestError naming the field that cannot apply."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message", "needs add_generation_prompt false (one opens a new "
                                                                "assistant turn, the other continues the last message)")
        if self.continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise InvalidRequestError("continue_final_message", "the last message must be the assistant's (the "
                                                                "answer to continue)")
        reserved = sorted(set(self.kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequestError("chat_template_kwargs", f"{reserved[0]!r} is an argument of its own; send it "
                                                              f"as a request field, not a template variable")


def encode_prompt(tok, prompt: str | None = None, messages: Sequence[dict] | None = None,
                  raw: bool = False, tools: list[dict] | None = None,
                  template: TemplateOptions | None = None) -> list[int]:
    """Token ids for a prompt string or a list of chat messages ``[{"role": ..., "content": ...}]``.

    Chat messages go through the chat template (with the generation prompt, unless `template` says otherwise). A
    plain string is wrapped as one user message when the tokenizer has a chat template (unless ``raw``), else
    tokenized as is (with the tokenizer's special tokens, e.g. BOS, if it adds any).
    """
    if tok is None:
        raise ValueError("this model has no tokenizer: pass token ids instead of text")
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt= or messages=")
    if prompt is not None and not prompt.strip():
        raise InvalidRequestError("prompt", "the prompt is empty; send some text")
    if messages is not None and not any(str(m.get("content", "")).strip() for m in messages):
        raise InvalidRequestError("messages", "every message is empty; send some text")
    has_template = bool(getattr(tok, "chat_template", None))
    if messages is None and has_template and not raw:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        if not has_template:
            raise ValueError("this tokenizer has no chat template: pass prompt= instead of messages=")
        template = template or TemplateOptions()
        template.check(messages)
        kw = {"tools": tools} if tools else {}  # OpenAI's tool definitions, for templates that render them
        messages = template_tool_calls(messages, "tool_calls" in str(tok.chat_template))
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=template.add_generation_prompt,
                                          continue_final_message=template.continue_final_message, tokenize=True,
                                          **template.kwargs, **kw)
        except Exception as e:  # a template's own error (jinja's raise_exception, a bad variable): the request's
            raise InvalidRequestError("messages", f"the chat template failed: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tok(prompt)["input_ids"]]


def template_tool_calls(messages: Sequence[dict], renders_calls: bool) -> list[dict]:
    """Earlier turns' tool calls (OpenAI's `tool_calls`) as chat templates take them: a template that renders
    tool calls gets each call's arguments as an object (as Hugging Face's templates expect), any other the calls'
    JSON as the turn's content, so that the model still sees what it called."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(dict(m))
            continue
        m = {k: v for k, v in m.items() if k != "tool_calls"}
        functions = [c.get("function", c) for c in calls]
        if not renders_calls:
            m["content"] = m.get("content") or json.dumps(functions)
            out.append(m)
            continue
        m["tool_calls"] = []
        for call, fn in zip(calls, functions):
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass  # the template gets the string as sent
            m["tool_calls"].append({**call, "type": "function", "function": {**fn, "arguments": args}})
        out.append(m)
    return out


def decode(tok, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    return tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text for a growing token sequence.

    ``push(ids)`` returns only newly completed text. Text is held back while the decoded tail ends in U+FFFD
    (an incomplete multi-byte character split across byte-level tokens), so a broken character is never
    emitted. ``flush()`` returns whatever is left (including a genuinely invalid tail). Decoding uses a small
    window of previous tokens as context so that tokenizers which drop/merge leading spaces stay correct.
    """

    def __init__(self, tok, skip_special_tokens: bool = True, prefix_ids: Sequence[int] = ()):
        self.tok = tok
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prefix_ids)
        # [prefix_offset, read_offset): context tokens already emitted; read_offset..: pending
        self.prefix_offset = max(0, len(self.ids) - 6)
        self.read_offset = len(self.ids)

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: int | Iterable[int]) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.ids.extend(int(t) for t in token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd") or not full.startswith(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if full.startswith(prefix) else full


def eos_token_ids(tok_or_config: Any) -> set[int]:
    """All EOS ids of a tokenizer, an HF config / generation config, a model dir path, or a dict."""
    x = tok_or_config
    if isinstance(x, (str, os.PathLike)):
        d = pathlib.Path(x)
        out: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            if (d / name).is_file():
                out |= eos_token_ids(json.loads((d / name).read_text()))
        tok = load_tokenizer(d)
        if tok is not None:
            out |= eos_token_ids(tok)
        return out
    if isinstance(x, dict):
        v = x.get("eos_token_id")
    else:
        v = getattr(x, "eos_token_id", None)
        if v is None and hasattr(x, "generation_config"):
            v = getattr(x.generation_config, "eos_token_id", None)
    if v is None:
        return set()
    if isinstance(v, (list, tuple, set)):
        return {int(t) for t in v}
    return {int(v)}
