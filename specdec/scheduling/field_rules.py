"""Every request field's rule, in one table: the range or choices its value must fall in, and the message a value
outside them gets (`InvalidRequestError`: INVALID_ARGUMENT on gRPC, a 400 on HTTP, `field: message` either way).

Who applies the table: each door a request comes in by, once; what runs the request behind a door trusts it.

- The coordinator, to every GenerateRequest (`typed_request.read`, coordinator/grpc_api/typed_request.py, called by
  `GenerationServicer.prepare`), on the values where they lie in the request's messages, with the per-request
  bounds it knows: its cap on max_new_tokens, the request's gamma and max_new_tokens, the tokenizer's vocabulary.
  The HTTP door maps each body onto a GenerateRequest and calls the same service method; its chat and completions
  bodies (coordinator/http_api/schema.py) keep only what the wire types need (int32, uint64), never a range of their
  own, so a bad value gets this table's message through either door. The HTTP door names a field as its clients
  know it: `max_tokens` for max_new_tokens, `prompt` for prompt_token_ids, `top_logprobs` for chat's logprobs
  (checked by this table's row as the body is read).
- The core's own doors: `validate_request`, for a request built in process (`Engine.generate`, `specdec bench`) or
  received whole (a draft replica's `Speculate`), and `check_sampling`, for the SamplingParams a replica is sent
  (specdec_rpc.decode.read_sampling). They apply `REQUEST_RULES` to the fields the core carries (without the
  coordinator's bounds: the core knows no cap), and `REPLICA_RULES` to what only the replicas' protocol carries
  (stop ids with the EOS ids among them, bad words as token sequences, the compiled grammar).

A field that is unset (absent from the values, or None; in a GenerateRequest, a proto3 optional field not sent or
an empty string or list) is not checked. Rows are checked in table order; the first broken one answers.

Where the places that checked a field disagreed, the rule chosen:

- temperature in [0, 2], OpenAI's range. The core samples correctly at any temperature up to 100 (it checked
  [0, 100]), the gRPC door checked only >= 0 and the HTTP door [0, 2]. Above 2 a model's distribution is close to
  uniform noise and no OpenAI client sends more, so the range both doors and the core accept is OpenAI's.
- top_k >= 0 (0: off). The HTTP door also takes vLLM's -1 for off, and sends 0.
- pearl_first_block in [0, gamma], the request's gamma (its own, else the coordinator's, else the mode's default),
  where the gRPC door checked a fixed [0, 64] and only the core the request's gamma.
- pacer_threshold in [0, 1] in the core too, which did not check it.
- stop: at most 16 strings on both doors; the HTTP door refused more, the gRPC door took any number (each is
  searched for in every round's text).
- logprobs and prompt_logprobs in [0, 20]; the core's -1 means unset, as an unset field on the wire.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Iterable, Mapping

from specdec.common.errors import InvalidRequestError
from specdec.scheduling.request import MAX_SPEC_OFF_BATCH, MODES, PEARL_OVERLAP, GenerationRequest
from specdec.decoding.sampling import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS as MAX_BAD_WORD_SEQUENCES, MAX_CACHE_SALT,
                              MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_STOP_IDS, MAX_TOP_LOGPROBS)
from specdec.decoding.verify import METHODS

MAX_TEMPERATURE = 2.0
MAX_GAMMA = 64
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 128  # words; each becomes up to two token sequences (as is and after a space)
REQUEST_ID = r"[A-Za-z0-9._:-]{1,64}"  # + "-" + 12 hex digits: a replica session id (those allow 128 characters)


def _num(v) -> str:
    """A number as a message shows it: a float32 off the wire reads as it was sent (2.1, not 2.0999999)."""
    return f"{v:.6g}" if isinstance(v, float) else str(v)


@dataclass(frozen=True)
class Bound:
    """A bound the caller supplies with each check (`bounds[key]`); absent or None, it does not limit."""
    key: str
    doc: str  # how the docs' table shows it
    named: bool = True  # a message shows `key=value` (a field of the request); False: the value alone
    note: str = ""  # what the bound is, in a message that shows it

    def show(self, value) -> str:
        return f"{self.key}={_num(value)}" if self.named else _num(value)


CAP = Bound("cap", "`COORDINATOR_MAX_NEW_TOKENS_CAP`", named=False, note="the coordinator's cap")
GAMMA = Bound("gamma", "`gamma`")
MAX_NEW_TOKENS = Bound("max_new_tokens", "`max_new_tokens`")


def _bound(b, bounds: Mapping):
    return bounds.get(b.key) if isinstance(b, Bound) else b


def _note(note: str) -> str:
    return f" ({note})" if note else ""


@dataclass(frozen=True)
class Range:
    """A number in [lo, hi] ((lo, hi] with `open_lo`); hi None: no upper limit. NaN is never in range."""
    field: str
    lo: float
    hi: float | Bound | None = None
    note: str = ""  # what a value means at the edges, or unset
    open_lo: bool = False

    def _interval(self, hi: str | None) -> str:
        if hi is None:
            return f"{'>' if self.open_lo else '>='} {_num(self.lo)}"
        return f"in {'(' if self.open_lo else '['}{_num(self.lo)}, {hi}]"

    def problem(self, v, bounds: Mapping) -> str | None:
        hi = _bound(self.hi, bounds)
        if (self.lo < v if self.open_lo else self.lo <= v) and (hi is None or v <= hi):
            return None
        bound = self.hi if isinstance(self.hi, Bound) and hi is not None else None
        shown = None if hi is None else bound.show(hi) if bound else _num(hi)
        note = "; ".join(n for n in (bound.note if bound else "", self.note) if n)
        return f"must be {self._interval(shown)}{_note(note)}, got {_num(v)}"

    def rule(self) -> str:
        hi = self.hi.doc if isinstance(self.hi, Bound) else None if self.hi is None else _num(self.hi)
        return self._interval(hi).removeprefix("in ")

    def json_schema(self) -> dict:
        out = {"exclusiveMinimum" if self.open_lo else "minimum": self.lo}
        return out | ({"maximum": self.hi} if isinstance(self.hi, (int, float)) else {})


@dataclass(frozen=True)
class OneOf:
    """One of a fixed set of names."""
    field: str
    choices: tuple[str, ...]
    noun: str  # what a value is, in "unknown <noun> 'x'"
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        if v in self.choices:
            return None
        return f"unknown {self.noun} {v!r}; use one of {', '.join(self.choices)}{_note(self.note)}"

    def rule(self) -> str:
        return ", ".join(f"`{c}`" for c in self.choices)

    def json_schema(self) -> dict:
        return {}


@dataclass(frozen=True)
class TokenIds:
    """A list of token ids: at most `most`, each >= 0, and with `vocab` below the `vocab` bound where supplied."""
    field: str
    most: int | None = None
    vocab: bool = False
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        if self.most is not None and len(v) > self.most:
            return f"send at most {self.most} token ids, got {len(v)}"
        if (bad := next((t for t in v if t < 0), None)) is not None:
            return f"token ids are >= 0, got {bad}"
        n = bounds.get("vocab") if self.vocab else None
        if n and (bad := next((t for t in v if t >= n), None)) is not None:
            return f"id {bad} is outside the vocabulary [0, {n})"
        return None

    def rule(self) -> str:
        each = "in [0, vocabulary)" if self.vocab else ">= 0"
        return f"at most {self.most} ids, each {each}" if self.most is not None else f"ids, each {each}"

    def json_schema(self) -> dict:
        return {"maxItems": self.most} if self.most is not None else {}


@dataclass(frozen=True)
class Strings:
    """A list of at most `most` strings; `nonblank`: none of them empty or only white space."""
    field: str
    most: int
    noun: str
    nonblank: bool = False
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        if len(v) > self.most:
            return f"send at most {self.most} {self.noun}, got {len(v)}"
        if self.nonblank and (bad := next((s for s in v if not s.strip()), None)) is not None:
            return f"send non-empty {self.noun}, got {bad!r}"
        return None

    def rule(self) -> str:
        return f"at most {self.most} {self.noun}{', none blank' if self.nonblank else ''}"

    def json_schema(self) -> dict:
        return {"maxItems": self.most}


@dataclass(frozen=True)
class Sequences:
    """A list of at most `most` non-empty token id sequences, each id >= 0."""
    field: str
    most: int
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        if len(v) > self.most or any(not w or any(t < 0 for t in w) for w in v):
            return f"send at most {self.most} non-empty token sequences, ids >= 0"
        return None

    def rule(self) -> str:
        return f"at most {self.most} non-empty sequences, ids >= 0"


@dataclass(frozen=True)
class Biases:
    """Token id → bias: at most `most` entries, ids >= 0, each bias in [-limit, limit]."""
    field: str
    most: int
    limit: float
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        pairs = list(v.items() if hasattr(v, "items") else v)
        if len(pairs) > self.most:
            return f"has {len(pairs)} entries; at most {self.most}"
        for tok, bias in pairs:
            if not -self.limit <= bias <= self.limit or tok < 0:
                return (f"token {tok}: a bias must be in [-{_num(self.limit)}, {_num(self.limit)}] for a token id "
                        f">= 0, got {_num(bias)}")
        return None

    def rule(self) -> str:
        return f"at most {self.most} entries: token id >= 0 → bias in [-{_num(self.limit)}, {_num(self.limit)}]"

    def json_schema(self) -> dict:
        return {"maxProperties": self.most}


@dataclass(frozen=True)
class Length:
    """A text of at most `most` characters."""
    field: str
    most: int
    what: str = "is"  # the message's start, before the length
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        if len(v) <= self.most:
            return None
        return f"{self.what} {len(v)} characters; use at most {self.most}{_note(self.note)}"

    def rule(self) -> str:
        return f"at most {self.most} characters"

    def json_schema(self) -> dict:
        return {"maxLength": self.most}


@dataclass(frozen=True)
class Pattern:
    """A text that matches a regular expression whole; `what` says it in words."""
    field: str
    pattern: str
    what: str
    note: str = ""

    def problem(self, v, bounds: Mapping) -> str | None:
        return None if re.fullmatch(self.pattern, v) else self.what

    def rule(self) -> str:
        return self.what

    def json_schema(self) -> dict:
        return {"pattern": f"^{self.pattern}$"}


_PROBABILITY = "a probability"
REQUEST_RULES = (
    OneOf("mode", MODES, "mode", "unset: the coordinator's default mode"),
    Range("temperature", 0, MAX_TEMPERATURE, "0 is greedy"),
    Range("max_new_tokens", 1, CAP),
    OneOf("verify_method", METHODS, "method", "temperature 0 is always greedy"),
    Range("pacer_threshold", 0, 1, _PROBABILITY),
    Range("pacer_skip_below", 0, 1, _PROBABILITY),
    Range("pacer_post_threshold", 0, 1, _PROBABILITY),
    Range("gamma", 1, MAX_GAMMA),
    Range("pearl_first_block", 0, GAMMA, "0: PEARL pre-verify"),
    Range("spec_off_batch", 0, MAX_SPEC_OFF_BATCH, "0: always speculate"),
    OneOf("pearl_overlap", PEARL_OVERLAP, "setting", "unset: auto"),
    Range("block_size", 1, None, "unset: the pre-verifier's trained block size"),
    Range("top_p", 0, 1, "1 disables it", open_lo=True),
    Range("top_k", 0, None, "0 disables it"),
    Range("min_p", 0, 1, "0 disables it"),
    Range("presence_penalty", -2, 2, "0 disables it"),
    Range("frequency_penalty", -2, 2, "0 disables it"),
    Range("repetition_penalty", 0, 10, "1 disables it", open_lo=True),
    Biases("logit_bias", MAX_LOGIT_BIAS, 100),
    Range("logprobs", 0, MAX_TOP_LOGPROBS, "top alternatives per token; unset: no logprobs"),
    Range("prompt_logprobs", 0, MAX_TOP_LOGPROBS, "top alternatives per token; unset: no logprobs"),
    Range("min_tokens", 0, MAX_NEW_TOKENS),
    Strings("stop", MAX_STOP_STRINGS, "stop strings"),
    TokenIds("stop_token_ids", MAX_STOP_TOKEN_IDS, vocab=True),
    TokenIds("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS, note="the target replica checks them against its "
                                                              "vocabulary"),
    Strings("bad_words", MAX_BAD_WORDS, "words", nonblank=True),
    Length("cache_salt", MAX_CACHE_SALT, note="e.g. a hash of the tenant's id"),
    TokenIds("prompt_token_ids", note="the target replica checks them against its vocabulary"),
    Range("truncate_prompt_tokens", 1, None, "unset: the whole prompt"),
    Pattern("request_id", REQUEST_ID, "at most 64 letters, digits and . _ : -"),
)
# what only the replicas' protocol carries: the coordinator derives them from the request's fields
REPLICA_RULES = (
    TokenIds("stop_ids", MAX_STOP_IDS),  # EOS ids and stop_token_ids
    Sequences("bad_words", MAX_BAD_WORD_SEQUENCES),  # bad_words, tokenized
    Length("structured_output", MAX_GRAMMAR_CHARS, "the grammar is"),  # the compiled grammar
)
RULE = {r.field: r for r in REQUEST_RULES}


def check(rules: Iterable, values: Mapping, names: Mapping[str, str] | None = None, **bounds) -> None:
    """Raise InvalidRequestError for the first of `rules` a value of `values` breaks. `values`: field → value, unset
    fields absent or None; `bounds`: the `Bound`s' values (cap, gamma, max_new_tokens, vocab); `names`: the name a
    door knows a field by, for the message."""
    for rule in rules:
        value = values.get(rule.field)
        if value is None:
            continue
        problem = rule.problem(value, bounds)
        if problem is not None:
            raise InvalidRequestError((names or {}).get(rule.field, rule.field), problem)


_CORE_REQUEST = ("mode", "max_new_tokens", "verify_method", "pacer_threshold", "pacer_skip_below",
                 "pacer_post_threshold", "gamma", "pearl_first_block", "spec_off_batch", "pearl_overlap", "block_size")
_CORE_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "logit_bias", "min_tokens", "allowed_token_ids", "cache_salt")


def validate_request(req: GenerationRequest) -> GenerationRequest:
    """A door's check of a request built in process (`Engine.generate`) or received whole (a draft replica's
    `Speculate`): its unset gamma set to the mode's default, then the table over its fields and its SamplingParams.
    What runs the request (the schedules, the workers) trusts it."""
    if not req.prompt_ids:
        raise InvalidRequestError("prompt", "the prompt is empty; send text, messages or token ids")
    req.resolve_defaults()
    check_request(req)
    check_sampling(req.params)
    return req


class _Attributes(Mapping):
    """An object's attributes `names` as the table reads values, in place; `unset`: the value that means unset."""

    def __init__(self, obj, names: tuple[str, ...], unset: dict | None = None):
        self.obj, self.names, self.unset = obj, names, unset or {}

    def __getitem__(self, name: str):
        if name not in self.names:
            raise KeyError(name)
        v = getattr(self.obj, name)
        if name in self.unset and v == self.unset[name]:
            raise KeyError(name)
        return v

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def check_request(req) -> None:
    """The table over a GenerationRequest's own fields (not its SamplingParams)."""
    check(REQUEST_RULES, _Attributes(req, _CORE_REQUEST), gamma=req.gamma)


def check_sampling(params) -> None:
    """The table over SamplingParams: the request's fields (logprobs -1: unset), then the replicas' own."""
    check(REQUEST_RULES, _Attributes(params, _CORE_SAMPLING + ("logprobs", "prompt_logprobs"),
                                     {"logprobs": -1, "prompt_logprobs": -1}))
    check(REPLICA_RULES, {"stop_ids": params.stop_ids, "bad_words": params.bad_words,
                          "structured_output": params.grammar})


def json_schema(field: str) -> dict:
    """The OpenAPI keywords of a field's rule (minimum, maximum, maxItems, ...), for the HTTP door's document."""
    return RULE[field].json_schema()


def markdown_table() -> str:
    """The table as docs/api/grpc.md shows it (tests/test_field_rules.py keeps the two equal)."""
    rows = ["| field | rule | note |", "|---|---|---|"]
    rows += [f"| `{r.field}` | {r.rule()} | {r.note} |".replace("|  |", "| |") for r in REQUEST_RULES]
    return "\n".join(rows)
