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
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specdec.common.errors import InvalidRequestError

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
    _check_prompt(tok, prompt, messages)
    has_template = bool(getattr(tok, "chat_template", None))
    if messages is None and has_template and not raw:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        if not has_template:
            raise ValueError("this tokenizer has no chat template: pass prompt= instead of messages=")
        return _apply_chat_template(tok, messages, tools, template or TemplateOptions())
    return [int(t) for t in tok(prompt)["input_ids"]]


def _check_prompt(tok, prompt: str | None, messages: Sequence[dict] | None) -> None:
    """ValueError without a tokenizer or without exactly one of prompt and messages; InvalidRequestError where the
    text is empty."""
    if tok is None:
        raise ValueError("this model has no tokenizer: pass token ids instead of text")
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt= or messages=")
    if prompt is not None and not prompt.strip():
        raise InvalidRequestError("prompt", "the prompt is empty; send some text")
    if messages is not None and not any(str(m.get("content", "")).strip() for m in messages):
        raise InvalidRequestError("messages", "every message is empty; send some text")


def _apply_chat_template(tok, messages: Sequence[dict], tools: list[dict] | None,
                         template: TemplateOptions) -> list[int]:
    """Chat messages → token ids through the tokenizer's chat template, rendered as `template` says;
    InvalidRequestError where the options do not apply or the template itself fails."""
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


# tokens of the prompt decoded with the first generated ones, so that their first text is as in context (a
# tokenizer that strips the first token's leading space would drop the space that separates them from the prompt)
_CONTEXT_TOKENS = 6


def _stream_backend(tok):
    """The `tokenizers.Tokenizer` whose `decode` is exactly `tok.decode` (what `DecodeStream` steps with), or None:
    a slow (Python) tokenizer, a class that decodes its own way, or one whose transformers decode post-processes
    the text (clean_up_tokenization_spaces, which transformers applies to any model but BPE)."""
    from tokenizers import Tokenizer  # lazy: a tokenizer is loaded, so this is too

    if isinstance(tok, Tokenizer):
        return tok
    backend = getattr(tok, "backend_tokenizer", None)
    fast = sys.modules.get("transformers.tokenization_utils_tokenizers")
    if not isinstance(backend, Tokenizer) or fast is None or not isinstance(tok, fast.TokenizersBackend):
        return None
    base, cls = fast.TokenizersBackend, type(tok)
    if cls._decode is not base._decode or cls.decode is not base.decode:
        return None
    if getattr(tok, "clean_up_tokenization_spaces", False) and (
            type(backend.model).__name__ != "BPE"
            or getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True)):
        return None
    return backend


class IncrementalDetokenizer:
    """Streams text for a growing token sequence.

    ``push(ids)`` returns only newly completed text. Text is held back while the decoded tail ends in U+FFFD
    (an incomplete multi-byte character split across byte-level tokens), so a broken character is never
    emitted. ``flush()`` returns whatever is left (including a genuinely invalid tail). Each decode covers the
    tokens of the last text returned plus those pending (and, at the start, the last prompt tokens of
    ``prefix_ids``), so that tokenizers which drop or merge leading spaces stay correct; text that would rewrite
    what was already returned is held back the same way.

    A fast tokenizer steps a ``tokenizers.decoders.DecodeStream`` (the same windows, decoded in Rust, one decode
    per token); a slow one, or one whose ``decode`` is not its backend's, decodes the windows with ``tok.decode``.
    Both return the same text in the same pieces.
    """

    def __init__(self, tok, skip_special_tokens: bool = True, prefix_ids: Sequence[int] = ()):
        self.tok = tok
        self.skip = skip_special_tokens
        # the window: ids[:read_offset] gave the text last returned (the context), ids[read_offset:] are pending
        self.ids: list[int] = [int(t) for t in list(prefix_ids)[-_CONTEXT_TOKENS:]]
        self.read_offset = len(self.ids)
        self._backend = _stream_backend(tok)
        self._stream = None
        # a context that ends mid-character would not be taken as context by DecodeStream (its text would be
        # returned as the first piece): those requests decode their windows here
        if self._backend is not None and not self._backend.decode(self.ids, self.skip).endswith("\ufffd"):
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(self.ids, skip_special_tokens=self.skip)

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: int | Iterable[int]) -> str:
        new = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        if not new:
            return ""
        self.ids.extend(new)
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, new)
            except Exception as e:  # the window's text no longer starts with the context's: hold, as below
                if not str(e).startswith("Invalid prefix"):
                    raise
                return ""
            if text is None:
                return ""
        else:
            prefix = self._decode(self.ids[:self.read_offset])
            full = self._decode(self.ids)
            if len(full) <= len(prefix) or full.endswith("\ufffd") or not full.startswith(prefix):
                return ""
            text = full[len(prefix):]
        del self.ids[:self.read_offset]
        self.read_offset = len(self.ids)
        return text

    def flush(self) -> str:
        prefix = self._decode(self.ids[:self.read_offset])
        full = self._decode(self.ids)
        self.ids.clear()
        self.read_offset = 0
        if self._stream is not None:  # tokens pushed after a flush decode without context, as the first ones do
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self.skip)
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
