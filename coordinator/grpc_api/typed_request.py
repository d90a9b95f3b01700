"""A GenerateRequest's sampling and speculation settings, read and checked once.

A request sends each setting in `sampling` (SamplingParams) and `speculation` (Speculation: the mode as a pair of
enums), or in the deprecated flat field of the same name (`mode`, `verify_method` and `pearl_overlap` as strings),
which still work; a request that sends a setting both ways with different values is refused, naming both fields.
`read` gives, in one call:

- `sampling`: the request's own SamplingParams message, completed with the flat fields it sent instead. It stays a
  message: the coordinator adds what it derives (the grammar, stop ids, bad words as token ids), reads the core's
  SamplingParams from it (specdec_rpc.decode.sampling_from_proto), and the replicas receive this message as it
  is, whichever process forwards it.
- `speculation`: the core's Speculation, with the coordinator's defaults for what the request leaves unset.

Every value is checked by specdec/scheduling/field_rules.py's table where it lies, in the messages (`MessageFields`),
under the name the request sent it by (`sampling.temperature`, or `temperature`). The speculation enums' values are
specdec_rpc/encode.py's tables, which the draft replica reads a SpeculateRequest's `speculation` by too. Pure: no
grpc.
"""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field

from specdec.common.errors import InvalidRequestError
from specdec.scheduling.field_rules import REQUEST_RULES, check
from specdec.scheduling.request import (DEFAULT_GAMMA, MODE_PAIRS, PEARL_OVERLAP, DraftStop, Overlap, Speculation,
                                        mode_name, mode_pair)
from specdec_rpc.decode import enum_member
from specdec_rpc.encode import DRAFT_STOP, OVERLAP, VERIFY_METHOD
from specdec_rpc.pb import common_pb2

# SamplingParams' fields a request sets (the deprecated flat fields of GenerateRequest have the same names)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs", "cache_salt",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
                   "allowed_token_ids")
# SamplingParams' fields the coordinator fills for the replicas, from the request's other fields
DERIVED_SAMPLING = {"grammar": "structured_output", "stop_ids": "stop_token_ids", "bad_words": "bad_words"}
SPECULATION_FIELDS = ("gamma", "block_size", "pacer_threshold", "pacer_skip_below", "pacer_post_threshold",
                      "pearl_first_block", "spec_off_batch")



def _set(message, name: str):
    """A field's value where the message sets it (a proto3 optional field sent, another not at its default);
    None where it does not, or has no such field."""
    f = message.DESCRIPTOR.fields_by_name.get(name)
    if f is None:
        return None
    if f.has_presence:
        return getattr(message, name) if message.HasField(name) else None
    v = getattr(message, name)
    return v if v else None


class MessageFields(Mapping):
    """The fields the messages set, by name, read in place; the first message that sets a name answers."""

    def __init__(self, *messages):
        self.messages = messages

    def __getitem__(self, name: str):
        for m in self.messages:
            v = _set(m, name)
            if v is not None:
                return v
        raise KeyError(name)

    def __iter__(self):
        return iter(dict.fromkeys(f.name for m in self.messages for f, _ in m.ListFields()))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Settings:
    """The request's settings by the field rules' names (only those it sets), and the name it sent each by where
    that is not the rule's own (`sampling.temperature`, `speculation.draft_stop`)."""
    values: dict = field(default_factory=dict)  # speculation's and the mode's, by name
    names: dict = field(default_factory=dict)
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)  # completed (see above)
    speculation: Speculation | None = None  # with the coordinator's defaults (`read`)
    stop: DraftStop | None = None  # speculation.draft_stop (None: unset)
    overlap: Overlap | None = None  # speculation.overlap (None: unset)

    def take(self, name: str, value, sent_as: str | None = None) -> None:
        self.values[name] = value
        if sent_as is not None:
            self.names[name] = sent_as

    def get(self, name: str, default=None):
        return self.values.get(name, default)

    def pair(self, default_mode: str) -> tuple[DraftStop, Overlap] | None:
        """The mode's (draft stop, overlap) pair: each half as sent, else the deprecated mode's, else
        `default_mode`'s (a request that drafts nothing overlaps nothing). None: a mode string the table refuses."""
        mode, setting = self.values.get("mode") or default_mode, self.values.get("pearl_overlap") or "auto"
        if mode not in MODE_PAIRS:
            return None
        stop, overlap = mode_pair(mode, setting if setting in PEARL_OVERLAP else "auto")
        stop = self.stop or stop
        overlap = self.overlap or (Overlap.OFF if stop is DraftStop.NONE else overlap)
        if stop is DraftStop.NONE and overlap is not Overlap.OFF:
            raise InvalidRequestError("speculation.overlap", "a request that drafts nothing (ar) has no draft to "
                                                             "overlap; leave overlap unset or set draft_stop")
        return stop, overlap

    def mode(self, default_mode: str) -> str | None:
        pair = self.pair(default_mode)
        return mode_name(*pair) if pair is not None else None


def _plain(v):
    """A field's value as a comparable Python value (maps and repeated fields as dicts and lists)."""
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    return dict(v) if hasattr(v, "items") else list(v)


def _show(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)


def _conflict(nested: str, flat: str, new, old) -> InvalidRequestError:
    return InvalidRequestError(nested, f"{_show(new)} differs from {flat} = {_show(old)}, the deprecated field of the "
                                       f"same setting; send only {nested}")


def _conflicts(r, part: str, names: tuple[str, ...]) -> list[str]:
    """The settings of `names` the request sends in `r.<part>` (the typed form), after refusing any its deprecated
    flat field gives another value; the flat fields it sends instead are the others."""
    typed, sent = getattr(r, part), []
    for name in names:
        old, new = _plain(_set(r, name)), _plain(_set(typed, name))
        if old is not None and new is not None and old != new and not (old != old and new != new):  # NaN: the table's
            raise _conflict(f"{part}.{name}", name, new, old)
        if new is not None:
            sent.append(name)
    return sent


def _pairs(r, part: str, names: tuple[str, ...], out: Settings) -> None:
    """Each setting of `names` from `r.<part>` (the typed form) or from the flat field (deprecated)."""
    for name in _conflicts(r, part, names):
        out.take(name, getattr(getattr(r, part), name), f"{part}.{name}")
    for name in names:
        if name not in out.values and (flat := _set(r, name)) is not None:
            out.take(name, flat)


def _sampling(r, out: Settings) -> None:
    """The request's SamplingParams message, completed with the deprecated flat fields it sends instead."""
    out.sampling.CopyFrom(r.sampling)
    for name in _conflicts(r, "sampling", SAMPLING_FIELDS):
        out.names[name] = f"sampling.{name}"
    for name in SAMPLING_FIELDS:
        if _set(r, name) is not None and _set(out.sampling, name) is None:
            value = getattr(r, name)
            if name == "logit_bias":
                out.sampling.logit_bias.update(value)
            elif name == "allowed_token_ids":
                out.sampling.allowed_token_ids.extend(value)
            else:
                setattr(out.sampling, name, value)


def _mode(r, out: Settings) -> None:
    """The mode's halves as sent: speculation's draft_stop and overlap, and the deprecated strings mode and
    pearl_overlap (left to the table's rules, which name the strings they know). A half sent both ways must agree."""
    sp = r.speculation
    out.stop = enum_member(DRAFT_STOP, sp.draft_stop, "speculation.draft_stop")
    out.overlap = enum_member(OVERLAP, sp.overlap, "speculation.overlap")
    for name in ("mode", "pearl_overlap"):
        if getattr(r, name):
            out.take(name, getattr(r, name))
    if r.mode in MODE_PAIRS:
        stop, overlapped = MODE_PAIRS[r.mode]
        if out.stop not in (None, stop):
            raise _conflict("speculation.draft_stop", "mode", out.stop.name, r.mode)
        if out.overlap is not None and (out.overlap is not Overlap.OFF) != overlapped:
            raise _conflict("speculation.overlap", "mode", out.overlap.name, r.mode)
    if r.pearl_overlap and out.overlap not in (None, Overlap.OFF) and out.overlap.value != r.pearl_overlap:
        raise _conflict("speculation.overlap", "pearl_overlap", out.overlap.name, r.pearl_overlap)


def _verify_method(r, out: Settings) -> None:
    method = enum_member(VERIFY_METHOD, r.speculation.verify_method, "speculation.verify_method")
    if method is None:
        if r.verify_method:
            out.take("verify_method", r.verify_method)
        return
    if r.verify_method and r.verify_method != method:
        raise _conflict("speculation.verify_method", "verify_method", method, r.verify_method)
    out.take("verify_method", method, "speculation.verify_method")


def read_settings(r) -> Settings:
    """The request's sampling and speculation settings, one value each (see the module's docstring)."""
    for name, instead in DERIVED_SAMPLING.items():
        if _set(r.sampling, name) is not None:
            raise InvalidRequestError(f"sampling.{name}", f"the coordinator fills it from the request's {instead}; "
                                                          f"leave it unset")
    out = Settings()
    _sampling(r, out)
    _pairs(r, "speculation", SPECULATION_FIELDS, out)
    _mode(r, out)
    _verify_method(r, out)
    return out


def speculation(s: Settings, defaults: dict) -> Speculation:
    """The core's Speculation: the request's settings, else `defaults` (the coordinator's: mode, verify_method,
    gamma, pacer_threshold, spec_off_batch, pacer_post_threshold; None: the mode's or the replica's own)."""
    stop, overlap = s.pair(defaults["mode"])
    kw = {name: s.get(name, defaults.get(name)) for name in SPECULATION_FIELDS}
    return Speculation(stop, overlap, verify_method=s.get("verify_method") or defaults["verify_method"], **kw)


def read(r, defaults: dict, **bounds) -> Settings:
    """The request's settings (`read_settings`), checked by the field table where they lie (`bounds`: the
    coordinator's cap, max_new_tokens, the tokenizer's vocabulary; gamma is the request's, else the coordinator's,
    else its mode's), with its Speculation under the coordinator's `defaults` (see `speculation`)."""
    out = read_settings(r)
    mode = out.mode(defaults["mode"])  # None: a mode string the table refuses
    gamma = out.values["gamma"] if "gamma" in out.values else defaults.get("gamma") or DEFAULT_GAMMA.get(mode)
    check(REQUEST_RULES, ChainMap(out.values, MessageFields(out.sampling, r)), names=out.names, gamma=gamma, **bounds)
    out.speculation = speculation(out, defaults)
    return out
