"""Structured output: the target's distribution restricted to a grammar (JSON schema, regex, choices, Lark), exact
under speculation. The grammar engine is llguidance (the one vLLM and SGLang use); this module turns a request's
form into its grammar, and keeps one matcher per session in step with the session's output.

Lossless as penalties are (specdec/decoding/penalties.py): p, the distribution the output must follow, is the target's
row with the tokens the grammar forbids after that row's history set to -inf (vLLM's and OpenAI's structured
output: the masked, renormalized target). A verify masks each of its rows by the grammar state after the output so
far plus the draft tokens before that row (`GrammarState.mask_rows`); q is whatever the draft sampled from. A draft
token the grammar forbids has p = 0 and is rejected with certainty, so the rows after it are never read. The draft
masks its own rows the same way only to be accepted more often: with draft == target every token is accepted.

Forced tokens: where the grammar admits one continuation only (a JSON key, `": "`), `GrammarState.forced` gives
its tokens, and the draft proposes them without a forward, with q one-hot, as it does prompt lookup's tokens
(specdec/workers/proposers/forced.py).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from tokenizers import Tokenizer

from specdec.common.errors import InvalidRequestError
from specdec.text.tokenizer import eos_token_ids

log = logging.getLogger(__name__)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
GRAMMAR_CACHE = 64  # compiled grammars kept per vocabulary


@dataclass(frozen=True)
class StructuredOutput:
    """A request's structured-output form: `kind` in KINDS and its `value` (the schema's JSON text, the regex, the
    choices as a JSON list of strings, or a Lark grammar; empty for json_object)."""
    kind: str
    value: str = ""

    def grammar(self) -> str:
        """→ the llguidance grammar (the string SamplingParams.grammar carries to the replicas)."""
        field = f"structured_output.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidRequestError("structured_output", f"unknown kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(field, f"is {len(self.value)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if not self.value.strip():
            raise InvalidRequestError(field, "is empty")
        return _GRAMMAR_OF[self.kind](field, self.value)


def _json_schema_grammar(field: str, value: str) -> str:
    """A JSON schema's text → its grammar; InvalidRequestError where it is not JSON or not a schema (an object, or
    true/false)."""
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise InvalidRequestError(field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(field, "must be a JSON object (a JSON schema)")
    return LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {})


def _regex_grammar(field: str, value: str) -> str:
    return LLMatcher.grammar_from_regex(value)


def _choice_grammar(field: str, value: str) -> str:
    """A JSON list of non-empty strings (at most MAX_CHOICES) → the grammar of exactly one of them, each literal."""
    try:
        choices = json.loads(value)
    except ValueError as e:
        raise InvalidRequestError(field, f"is not a JSON list of strings: {e}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(field, f"has {len(choices)} choices; at most {MAX_CHOICES}")
    return LLMatcher.grammar_from_regex("|".join(_escape(c) for c in choices))


def _lark_grammar(field: str, value: str) -> str:
    return LLMatcher.grammar_from_lark(value)


# each kind with a value (all but json_object) → the function building its grammar from (field name, value)
_GRAMMAR_OF = {"json_schema": _json_schema_grammar, "regex": _regex_grammar, "choice": _choice_grammar,
               "grammar": _lark_grammar}


def _escape(text: str) -> str:
    """`text` as a literal in llguidance's (Rust) regex syntax: every ASCII punctuation escaped, as it accepts."""
    return re.sub(r"([!-/:-@\[-`{-~])", r"\\\1", text)


class _TokenBytes:
    """llguidance's TokenizerWrapper protocol over a `tokenizers` Tokenizer whose decoder llguidance does not read
    (e.g. word-level vocabularies): each id's bytes are its decoding alone."""

    def __init__(self, tk, n_vocab: int, eos: int, special: Iterable[int]):
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = sorted(special)
        self.tokens = [tk.decode([i], skip_special_tokens=False).encode() if i < tk.get_vocab_size(True) else b""
                       for i in range(n_vocab)]
        self._tk = tk

    def __call__(self, text) -> list[int]:
        return self._tk.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"),
                               add_special_tokens=False).ids


def _eos_ids(d: pathlib.Path, tk) -> set[int]:
    """EOS ids a model directory names (its configs' eos_token_id, tokenizer_config.json's eos_token), read without
    transformers (which a replica would otherwise import for this alone: ~130 MB)."""
    out: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        if (d / name).is_file():
            out |= eos_token_ids(json.loads((d / name).read_text()))
    if (d / "tokenizer_config.json").is_file():
        eos = json.loads((d / "tokenizer_config.json").read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        tid = tk.token_to_id(eos) if isinstance(eos, str) else None
        out |= {tid} if tid is not None else set()
    return out


class GrammarVocab:
    """One model's vocabulary as llguidance sees it (token bytes, EOS ids): checks grammars and makes matchers.
    `vocab_size` is the model's logits width (it may pad past the tokenizer's); `parsed`: tokenizer_json as a
    `tokenizers.Tokenizer`, if the caller has it already."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], parsed=None):
        eos = sorted(int(t) for t in eos_ids)
        if not eos:
            raise ValueError("structured output needs the model's EOS token id(s)")
        tk = parsed or Tokenizer.from_str(tokenizer_json)
        n_vocab = max(vocab_size, tk.get_vocab_size(True))
        try:
            self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
        except ValueError:  # a decoder llguidance does not read: give it each token's bytes
            special = set(tk.get_added_tokens_decoder()) | set(eos)
            self.tokenizer = LLTokenizer(TokenizerWrapper(_TokenBytes(tk, n_vocab, eos[0], special)),
                                         n_vocab=n_vocab, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos_ids = eos
        self.words = (n_vocab + 31) // 32  # the bitmask's int32 words
        self._bit = (1 << torch.arange(8, dtype=torch.uint8))
        self.eos_words = torch.zeros(self.words, dtype=torch.int32)  # the bitmask allowing EOS alone
        for t in eos:
            self.eos_words.view(torch.uint8)[t // 8] |= 1 << (t % 8)
        self._compiled: OrderedDict[str, object] = OrderedDict()  # grammar -> an unused LLMatcher (`state`)
        self._lock = threading.Lock()  # the coordinator checks grammars on worker threads

    @classmethod
    def from_dir(cls, path: os.PathLike | str, vocab_size: int) -> "GrammarVocab | None":
        """The vocabulary of a model directory with a tokenizer.json, else None (structured output refused)."""
        d = pathlib.Path(path)
        if not (d / "tokenizer.json").is_file():
            return None
        try:
            text = (d / "tokenizer.json").read_text()
            tk = Tokenizer.from_str(text)
            return cls(text, vocab_size, _eos_ids(d, tk), parsed=tk)
        except Exception as e:  # noqa: BLE001 - the replica still serves every other request
            log.warning("structured output is off for %s: %s", d, e)
            return None

    def check(self, grammar: str) -> None:
        """Raises InvalidRequestError, with llguidance's reason, if `grammar` does not compile."""
        self._compiled_matcher(grammar)

    def state(self, grammar: str) -> "GrammarState":
        """A fresh matcher of `grammar`: a copy of its compiled one."""
        pristine = self._compiled_matcher(grammar)
        with self._lock:  # copies are taken under the lock: a matcher is not shared across threads while in use
            return GrammarState(self, pristine.deep_copy())

    def _compiled_matcher(self, grammar: str):
        """`grammar`'s unused LLMatcher. Compiled grammars are kept (LRU, GRAMMAR_CACHE): a schema that many requests
        share compiles once (compiling a large schema can take 100 ms or more)."""
        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
                return pristine
        pristine = LLMatcher(self.tokenizer, grammar, log_level=0)  # outside the lock: it may take a while
        if pristine.is_error():
            raise InvalidRequestError("structured_output", f"the grammar does not compile: "
                                                           f"{pristine.get_error()[:500]}")
        with self._lock:
            self._compiled[grammar] = pristine
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return pristine

    def unpack(self, words: torch.Tensor) -> torch.Tensor:
        """int32 bitmask words [n, W] → allowed [n, vocab_size] (bool)."""
        b = words.view(torch.uint8)  # little-endian: token t is bit t % 8 of byte t // 8
        return ((b[..., None] & self._bit) != 0).flatten(-2)[..., :self.vocab_size]


class GrammarState:
    """A session's matcher, advanced to the tokens it was last synced with (`consumed`): a verify or a draft step
    syncs it to its history (rolling back what the history no longer holds) instead of tracking every call.

    EOS is never fed to the matcher (rolling back across a fed EOS does not restore it): an EOS the grammar
    allows ends the output, and EOS alone may follow it (`ended`)."""

    def __init__(self, vocab: GrammarVocab, matcher):
        self.vocab, self.matcher = vocab, matcher
        self.consumed: list[int] = []
        self.ended = False  # the synced output holds an EOS after `consumed`

    def sync(self, output: Sequence[int]) -> bool:
        """Advance (or roll back) the matcher to `output`; False if the output leaves the grammar. Called on every
        draft step and verify: the usual case, `output` extending what was consumed, costs one list comparison."""
        eos = self.vocab.eos_ids
        c = self.consumed
        n = len(c)
        if len(output) < n or list(output[:n]) != c:  # a rollback: keep the common prefix (it holds no EOS)
            n, limit = 0, min(len(c), len(output))
            while n < limit and c[n] == output[n]:
                n += 1
        if n < len(c):
            self.matcher.rollback(len(c) - n)
            del c[n:]
        end = next((i for i in range(n, len(output)) if output[i] in eos), len(output))
        rest = list(output[n:end])
        if rest:
            ok = self.matcher.validate_tokens(rest)
            if ok:
                self.matcher.consume_tokens(rest[:ok])
                c.extend(rest[:ok])
            if ok < len(rest):
                return False
        self.ended = end < len(output)
        if self.ended and (not self.matcher.is_accepting() or any(t not in eos for t in output[end:])):
            return False
        return not self.matcher.is_error()

    def mask_rows(self, rows: torch.Tensor, output: Sequence[int], appended: Sequence[int]) -> torch.Tensor:
        """rows [n, V]: row i predicts the token after `output` + appended[:i] (output: the tokens generated so far).
        → the rows in fp32 with every token the grammar forbids there at -inf. Raises InvalidRequestError if the
        output itself leaves the grammar."""
        if not self.sync(output):
            raise InvalidRequestError("structured_output", f"the output so far leaves the grammar at token "
                                                           f"{len(self.consumed)}: {self.matcher.get_error()[:300]}")
        n = rows.shape[0]
        words = torch.zeros((n, self.vocab.words), dtype=torch.int32)
        ok = self.matcher.validate_tokens(list(appended[:n - 1])) if n > 1 and not self.ended else 0
        fed, ended = 0, self.ended
        for i in range(n):
            if i > ok:  # appended[ok] is forbidden (row ok rejects it: later rows are never read) or follows an
                words[i] = words[ok]  # EOS (EOS alone may)
            elif ended:
                words[i] = self.vocab.eos_words
            else:
                self.matcher.unsafe_compute_mask_ptr(words[i].data_ptr(), words.shape[1] * 4)
                if i < ok and appended[i] in self.vocab.eos_ids:
                    ended = True
                elif i < ok:
                    self.matcher.consume_token(int(appended[i]))
                    fed += 1
        if fed:
            self.matcher.rollback(fed)
        allowed = self.vocab.unpack(words)
        dead = ~allowed.any(1)
        if dead.any():  # a broken matcher (it allows nothing): EOS ends the output
            allowed[dead.nonzero()[:, 0][:, None], torch.tensor(self.vocab.eos_ids)] = True
        return rows.float().masked_fill(~allowed, float("-inf"))

    def allows(self, output: Sequence[int], token: int) -> bool:
        """Whether the grammar allows `token` after `output`."""
        if not self.sync(output):
            return False
        if self.ended:
            return token in self.vocab.eos_ids
        return self.matcher.validate_tokens([int(token)]) == 1

    def forced(self, output: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after `output` (one continuation only); [] if the output leaves
        the grammar or has ended."""
        if limit <= 0 or not self.sync(output) or self.ended:
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]
