"""The messages a process receives, as the core's types, checked where the process's door needs it (a replica
reads its calls by these, the coordinator its request's sampling message): what they give, the code behind a door
trusts. The other direction, and the wire layouts and tables both share, is specdec_rpc/encode.py.
"""
from __future__ import annotations

import json
import math

import msgpack
import numpy as np
import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams, TokenLogprobs
from specdec.decoding.verify import SparseDist
from specdec.scheduling.field_rules import check_sampling
from specdec.scheduling.request import (MODE_PAIRS, PEARL_OVERLAP, DraftStop, GenerationRequest, GenerationStats,
                                        Overlap, Speculation, mode_pair)
from specdec.state.feature_state import TargetFeatures
from specdec.text.grammar import StructuredOutput
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import VerifyOutcome
from specdec_rpc.encode import DRAFT_STOP, DTYPE_PB, LE_F32, LE_I32, OPTIONAL_SPECULATION, OVERLAP, VERIFY_METHOD
from specdec_rpc.pb import common_pb2, draft_pb2, target_pb2

_FROM_PB = {v: k for k, v in DTYPE_PB.items()}


def tensor_from_proto(msg: common_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    if msg.dtype not in _FROM_PB:
        raise InvalidRequestError(f"{field}.dtype", "is unspecified or unknown; set a DType")
    dtype = _FROM_PB[msg.dtype]
    shape = list(msg.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"{field}.shape", f"has a negative dimension {shape}")
    numel = math.prod(shape)  # Python ints: a shape like [2**40, 2**40] must not wrap around
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != numel * itemsize:
        raise InvalidRequestError(f"{field}.data", f"has {len(msg.data)} bytes but shape {shape} of "
                                  f"{dtype} needs {numel * itemsize}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=dtype).reshape(shape)


def decode_q(data: bytes, field: str = "q", check: bool = True) -> list:
    """msgpack bytes (sparse-q v1) -> list[SparseDist]; malformed input is INVALID_ARGUMENT. `check`: also the
    rows' values (`_check_rows`, all rows at once), where q comes from a client (the target's Verify); the
    coordinator reading its own draft replica's answers skips it."""
    if not data:
        return []
    try:
        rows = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise InvalidRequestError(field, f"is not msgpack sparse-q v1 ({exc})") from None
    if not isinstance(rows, list):
        raise InvalidRequestError(field, "must be a msgpack array of [ids, probs] pairs")
    for i, row in enumerate(rows):
        if (not isinstance(row, (list, tuple)) or len(row) != 2 or not isinstance(row[0], bytes)
                or not isinstance(row[1], bytes) or len(row[0]) != len(row[1]) or len(row[0]) % 4):
            raise InvalidRequestError(f"{field}[{i}]", "must be [ids: bin int32 LE, probs: bin float32 LE] "
                                      "of equal length")
    if not rows:
        return []
    # one buffer per column: the rows are views into it (one allocation and one conversion per call)
    ids = torch.from_numpy(np.frombuffer(b"".join(r[0] for r in rows), dtype=LE_I32).astype(np.int64))
    probs = torch.from_numpy(np.frombuffer(b"".join(r[1] for r in rows), dtype=LE_F32).astype(np.float32))
    lengths = [len(r[0]) // 4 for r in rows]
    if check:
        _check_rows(ids, probs, lengths, field)
    return [SparseDist(ids=i, probs=p) for i, p in zip(ids.split(lengths), probs.split(lengths))]


def _check_rows(ids: torch.Tensor, probs: torch.Tensor, lengths: list[int], field: str) -> None:
    """Draft distribution rows (concatenated; `lengths` per row) as verification needs them: finite, non-negative
    probabilities summing to at most 1 (float32 rounding aside), each token once per row. A handful of vector
    operations for all rows together; the error names the first row that breaks a rule."""
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    bad = ~torch.isfinite(probs) | (probs < 0)
    if bool(bad.any()):
        raise InvalidRequestError(f"{field}[{int(row[bad][0])}]", "probabilities must be finite and >= 0")
    sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, row, probs.double())
    over = sums > 1.0 + 1e-3
    if bool(over.any()):
        i = int(over.nonzero()[0])
        raise InvalidRequestError(f"{field}[{i}]", f"probabilities sum to {float(sums[i]):.6g}; a distribution "
                                                   f"sums to at most 1")
    if len(ids) > 1:
        lo, span = int(ids.min()), int(ids.max()) - int(ids.min()) + 1
        key = (row * span + (ids - lo)).sort().values  # (row, id) as one sortable key
        twice = key[1:] == key[:-1]
        if bool(twice.any()):
            raise InvalidRequestError(f"{field}[{int(key[1:][twice][0]) // span}]", "names a token id more than once")


def dense_q_to_sparse(q: torch.Tensor, field: str = "q_dense") -> list:
    """[g, vocab] float rows -> list[SparseDist] keeping the nonzero entries (exactly the same q)."""
    if q.dim() != 2:
        raise InvalidRequestError(field, f"must have shape [len(draft_ids), vocab], got {list(q.shape)}")
    q = q.float()
    rows, ids = torch.nonzero(q != 0, as_tuple=True)  # NaN, inf and negative entries too: `_check_rows` refuses them
    probs = q[rows, ids]
    lengths = torch.bincount(rows, minlength=q.shape[0]).tolist()
    _check_rows(ids, probs, lengths, field)
    return [SparseDist(ids=i, probs=p) for i, p in zip(ids.split(lengths), probs.split(lengths))]


def sampling_from_proto(msg: common_pb2.SamplingParams):
    """The core's SamplingParams a message carries; they keep the message (`source`), which `sampling_to_proto`
    gives back: every process reads the request's sampling message once and forwards it as it came."""
    params = SamplingParams(temperature=float(msg.temperature), top_k=int(msg.top_k),
                          top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0, seed=int(msg.seed),
                          logprobs=int(msg.logprobs) if msg.HasField("logprobs") else -1,
                          prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else -1,
                          cache_salt=msg.cache_salt, presence_penalty=float(msg.presence_penalty),
                          frequency_penalty=float(msg.frequency_penalty),
                          repetition_penalty=(float(msg.repetition_penalty) if msg.HasField("repetition_penalty")
                                              else 1.0),
                          logit_bias=tuple(sorted((int(k), float(v)) for k, v in msg.logit_bias.items())),
                          grammar=msg.grammar, min_p=float(msg.min_p), min_tokens=int(msg.min_tokens),
                          stop_ids=tuple(int(t) for t in msg.stop_ids),
                          allowed_token_ids=tuple(int(t) for t in msg.allowed_token_ids),
                          bad_words=tuple(tuple(int(t) for t in w.ids) for w in msg.bad_words))
    object.__setattr__(params, "source", msg)  # frozen: set once, here
    return params


def read_sampling(msg: common_pb2.SamplingParams):
    """The SamplingParams a replica was sent, checked by the field table (specdec/scheduling/field_rules.py): a
    replica's door checks what it receives, and the workers behind it trust it."""
    params = sampling_from_proto(msg)
    check_sampling(params)
    return params


def logprobs_from_proto(msg: common_pb2.TokenLogprobs):
    return TokenLogprobs(int(msg.position), list(msg.token_ids), list(msg.logprobs), [list(t.ids) for t in msg.top],
                         [list(t.logprobs) for t in msg.top])


def features_from_proto(msgs, field: str = "features") -> list:
    """repeated Features -> list[TargetFeatures]; shape and dtype are checked here, positions by the worker."""
    out = []
    for i, m in enumerate(msgs):
        rows = tensor_from_proto(m.rows, f"{field}[{i}].rows")
        if rows.ndim != 2 or not rows.is_floating_point():
            raise InvalidRequestError(f"{field}[{i}].rows", f"must be a 2-D float tensor [n, hidden], got "
                                      f"{rows.dtype} {list(rows.shape)}")
        out.append(TargetFeatures(int(m.start), rows))
    return out


_STOP_REASON = {draft_pb2.STOP_REASON_GAMMA_MAX: "gamma_max", draft_pb2.STOP_REASON_PREVERIFIER: "preverifier",
                draft_pb2.STOP_REASON_CANCELLED: "cancelled"}


def draft_block(r, tokens: list[int] | None = None, q: list | None = None):
    """A DraftResponse / DraftStreamResponse as a DraftBlock (`tokens`/`q`: override, e.g. a resumed stream's
    undelivered part)."""
    return DraftBlock(tokens=list(r.token_ids) if tokens is None else tokens,
                      q=decode_q(r.q, check=False) if q is None else q, stop_reason=_STOP_REASON.get(r.stop_reason, ""),
                      draft_ns=r.draft_ns, final=getattr(r, "last", True), block_size=r.block_size)


def verify_outcome(r: target_pb2.VerifyResponse) -> VerifyOutcome:
    """A VerifyResponse as the schedule's VerifyOutcome (a chained verify's caller adds what it committed)."""
    return VerifyOutcome(r.num_accepted, r.next_token if r.HasField("next_token") else None,
                         forward_ns=r.forward_ns, verify_ns=r.verify_ns, forwarded=r.forward_ns > 0,
                         batch_size=r.batch_size,
                         features=features_from_proto([r.features])[0] if r.HasField("features") else None,
                         logprobs=logprobs_from_proto(r.logprobs) if r.HasField("logprobs") else None)


def enum_member(table: dict, value: int, name: str):
    """The core's value of a speculation enum (`table`: DRAFT_STOP, OVERLAP or VERIFY_METHOD); None for unset (0);
    INVALID_ARGUMENT naming `name` for a number the table does not know."""
    if value == 0:
        return None
    if value not in table:
        choices = ", ".join(f"{k} ({v.name if hasattr(v, 'name') else v})" for k, v in table.items())
        raise InvalidRequestError(name, f"unknown value {value}; use one of {choices}")
    return table[value]


def speculation_from_proto(msg: common_pb2.Speculation, mode: str = "", pearl_overlap: str = "") -> Speculation:
    """A Speculation message as the core's. A half of the mode left unset is the one of `mode` (the deprecated
    string sent beside it, with `pearl_overlap`); with neither, draft_stop is refused and overlap is OFF. An unset
    verify_method is block (greedy at temperature 0 whatever it is)."""
    stop, overlap = mode_pair(mode, pearl_overlap if pearl_overlap in PEARL_OVERLAP else "auto") \
        if mode in MODE_PAIRS else (None, Overlap.OFF)
    stop = enum_member(DRAFT_STOP, msg.draft_stop, "speculation.draft_stop") or stop
    if stop is None:
        raise InvalidRequestError("speculation.draft_stop", "set it: how a round's draft ends (FIXED or "
                                                            "PREVERIFIER)")
    overlap = enum_member(OVERLAP, msg.overlap, "speculation.overlap") or \
        (Overlap.OFF if stop is DraftStop.NONE else overlap)
    if stop is DraftStop.NONE and overlap is not Overlap.OFF:
        raise InvalidRequestError("speculation.overlap", "a request that drafts nothing (ar) has no draft to overlap")
    kw = {name: getattr(msg, name) for name in OPTIONAL_SPECULATION if msg.HasField(name)}
    method = enum_member(VERIFY_METHOD, msg.verify_method, "speculation.verify_method") or "block"
    return Speculation(stop, overlap, verify_method=method, **kw)


def _flat_speculation(msg: draft_pb2.SpeculateRequest) -> dict:
    """The deprecated flat fields a SpeculateRequest sets, as GenerationRequest's keyword arguments."""
    kw = {name: getattr(msg, name) for name in OPTIONAL_SPECULATION if msg.HasField(name)}
    kw.update((name, getattr(msg, name)) for name in ("mode", "verify_method", "pearl_overlap") if getattr(msg, name))
    return kw


def _speculation_fields(msg: draft_pb2.SpeculateRequest) -> dict:
    """GenerationRequest's speculation arguments: from `speculation` where it is set (the flat fields a caller also
    sends must say the same), else from the deprecated flat fields (a coordinator of the last release)."""
    flat = _flat_speculation(msg)
    if not msg.HasField("speculation"):
        return {"verify_method": "block", "pearl_overlap": "auto", "mode": "", **flat}
    typed = speculation_from_proto(msg.speculation, msg.mode, msg.pearl_overlap).request_fields()
    if typed["mode"] in ("sd", "pacer", "ar"):
        flat.pop("pearl_overlap", None)  # PEARL's setting: a sequential mode's says nothing
    for name, old in flat.items():
        new = typed[name]
        if old != new and not (old != old and new != new):  # NaN: the schedule's rules refuse it
            raise InvalidRequestError(f"speculation.{name}", f"{new!r} differs from {name} = {old!r}, the deprecated "
                                                             f"field of the same setting; send only speculation")
    return typed


def request_from_speculate(msg: draft_pb2.SpeculateRequest) -> GenerationRequest:
    """The GenerationRequest a SpeculateRequest carries (validated by the schedule)."""
    return GenerationRequest(prompt_ids=list(msg.prompt_ids), max_new_tokens=int(msg.max_new_tokens),
                             params=sampling_from_proto(msg.params), eos_token_ids=tuple(msg.eos_token_ids),
                             priority=int(msg.priority), session_id=msg.session_id, **_speculation_fields(msg))


def stats_from_proto(msg: draft_pb2.SpeculateResponse, mode: str) -> tuple[GenerationStats, dict[str, float]]:
    """→ (the GenerationStats, the numbers that are not its fields: the link and queue times)."""
    known = {f for f in GenerationStats.__dataclass_fields__}
    ints = {f for f, v in GenerationStats().to_dict().items() if isinstance(v, int) and not isinstance(v, bool)}
    st = GenerationStats(mode=mode, accepted_per_position=list(msg.accepted_per_position))
    extra = {}
    for k, v in msg.stats.items():
        if k in known:
            setattr(st, k, int(v) if k in ints else float(v))
        else:
            extra[k] = float(v)
    return st, extra


def logprobs_rows_from_proto(msg: common_pb2.TokenLogprobs) -> list[tuple[float, list[int], list[float]]]:
    return [(float(lp), list(t.ids), list(t.logprobs)) for lp, t in zip(msg.logprobs, msg.top)]


def structured_from_proto(msg):
    """GenerateRequest.structured_output → specdec.text.grammar.StructuredOutput."""
    kind = msg.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise InvalidRequestError("structured_output", "set one of json_schema, json_object (true), regex, choice, "
                                                       "grammar")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(msg.choice.choices)))
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(msg, kind))
