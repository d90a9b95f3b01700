"""The core's types as the messages a process sends. With specdec_rpc/decode.py (the other direction, and the checks
a door makes), the only code that knows both the wire layouts and torch.

Sparse q, layout "sparse-q v1" (msgpack, see proto/specdec/v1/draft.proto):
    [[ids_bin, probs_bin], ...]   one pair per drafted position
    ids_bin   little-endian int32 token ids   (k_i of them)
    probs_bin little-endian float32 probs     (k_i of them)
Raw little-endian bytes inside msgpack `bin` cost 8 bytes per entry and decode with one frombuffer.
"""
from __future__ import annotations

import msgpack
import numpy as np
import torch

from specdec.scheduling.request import DraftStop, GenerationRequest, GenerationStats, Overlap, Speculation
from specdec_rpc.pb import common_pb2, draft_pb2

# The tables both directions share (specdec_rpc/decode.py reads by them)
DTYPE_PB = {torch.float32: common_pb2.DTYPE_FLOAT32, torch.float16: common_pb2.DTYPE_FLOAT16,
            torch.bfloat16: common_pb2.DTYPE_BFLOAT16, torch.int32: common_pb2.DTYPE_INT32,
            torch.int64: common_pb2.DTYPE_INT64}
LE_I32, LE_F32 = np.dtype("<i4"), np.dtype("<f4")
# common.proto's speculation enums and the core's values (specdec.scheduling.request): the coordinator's door reads a
# GenerateRequest's `speculation` by them, the coordinator writes a SpeculateRequest's by them, the draft replica
# reads it back (unspecified, 0, is no key: each reader says what an unset value means)
DRAFT_STOP = {common_pb2.DRAFT_STOP_NONE: DraftStop.NONE, common_pb2.DRAFT_STOP_FIXED: DraftStop.FIXED,
              common_pb2.DRAFT_STOP_PREVERIFIER: DraftStop.PREVERIFIER}
OVERLAP = {common_pb2.OVERLAP_OFF: Overlap.OFF, common_pb2.OVERLAP_AUTO: Overlap.AUTO,
           common_pb2.OVERLAP_ALWAYS: Overlap.ALWAYS}
VERIFY_METHOD = {common_pb2.VERIFY_METHOD_GREEDY: "greedy", common_pb2.VERIFY_METHOD_TOKEN: "token",
                 common_pb2.VERIFY_METHOD_BLOCK: "block"}
DRAFT_STOP_PB = {v: k for k, v in DRAFT_STOP.items()}
OVERLAP_PB = {v: k for k, v in OVERLAP.items()}
VERIFY_METHOD_PB = {v: k for k, v in VERIFY_METHOD.items()}
# Speculation's optional settings, the same names in the deprecated flat fields of a SpeculateRequest
OPTIONAL_SPECULATION = ("gamma", "block_size", "pacer_threshold", "pacer_post_threshold", "pacer_skip_below",
                        "pearl_first_block", "spec_off_batch")
# Speculate's trailing metadata: the target replica whose failure ended the call (draft_service/speculate.py)
FAILED_TARGET_KEY = "specdec-failed-target"


def tensor_to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    if t.dtype not in DTYPE_PB:
        raise TypeError(f"unsupported tensor dtype {t.dtype}")
    t = t.detach().contiguous().cpu()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return common_pb2.Tensor(data=raw.numpy().tobytes(), dtype=DTYPE_PB[t.dtype], shape=list(t.shape))


def encode_q(q) -> bytes:
    """list[SparseDist] -> msgpack bytes (sparse-q v1)."""
    return msgpack.packb([[d.ids.to(torch.int32).cpu().numpy().astype(LE_I32, copy=False).tobytes(),
                           d.probs.to(torch.float32).cpu().numpy().astype(LE_F32, copy=False).tobytes()]
                          for d in q], use_bin_type=True)


def verify_q(q, method: str) -> bytes | None:
    """The draft distributions a Verify call carries: none for a greedy verify (it compares tokens and never reads
    q, so encoding, sending and checking q would be pure overhead), else sparse-q v1 bytes."""
    return encode_q(q) if q and method != "greedy" else None


def sampling_to_proto(p) -> common_pb2.SamplingParams:
    """The message of `p`: the one they were read from, else a new one."""
    if p.source is not None:
        return p.source
    msg = common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                                    cache_salt=p.cache_salt, presence_penalty=p.presence_penalty,
                                    frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias),
                                    grammar=p.grammar, min_p=p.min_p, min_tokens=p.min_tokens,
                                    stop_ids=list(p.stop_ids), allowed_token_ids=list(p.allowed_token_ids),
                                    bad_words=[common_pb2.TokenIds(ids=list(w)) for w in p.bad_words])
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.logprobs >= 0:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs >= 0:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprobs_to_proto(lp) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(position=lp.position, token_ids=lp.token_ids, logprobs=lp.logprobs,
                                    top=[common_pb2.TopLogprobs(ids=i, logprobs=v)
                                         for i, v in zip(lp.top_ids, lp.top_logprobs)])


def features_to_proto(f) -> common_pb2.Features:
    """TargetFeatures -> Features (rows travel in the model's dtype, bf16 on CPU targets)."""
    return common_pb2.Features(start=f.start, rows=tensor_to_proto(f.rows))


_STOP_KIND_PB = {"fixed": draft_pb2.STOP_KIND_FIXED, "pacer": draft_pb2.STOP_KIND_PREVERIFIER}


def draft_request(msg, session_id: str, base_position: int, append: list[int], gamma_max: int, stop,
                  block_size: int, features=None):
    """A DraftRequest or DraftStreamRequest (`msg`) from a draft call's arguments (`stop`: a StopSpec)."""
    rule = draft_pb2.StopRule(kind=_STOP_KIND_PB[stop.kind])
    if stop.threshold is not None:
        rule.threshold = stop.threshold
    if stop.skip_below is not None:
        rule.skip_below = stop.skip_below
    return msg(session_id=session_id, base_position=base_position, append_ids=append, gamma_max=gamma_max,
               stop=rule, block_size=block_size, features=[features_to_proto(f) for f in features or []])


def speculation_to_proto(s: Speculation) -> common_pb2.Speculation:
    msg = common_pb2.Speculation(draft_stop=DRAFT_STOP_PB[s.draft_stop], overlap=OVERLAP_PB[s.overlap],
                                 verify_method=VERIFY_METHOD_PB.get(s.verify_method, 0))
    for name in OPTIONAL_SPECULATION:
        if getattr(s, name) is not None:
            setattr(msg, name, getattr(s, name))
    return msg


def speculate_request(req: GenerationRequest, **fields) -> draft_pb2.SpeculateRequest:
    """A GenerationRequest as the SpeculateRequest of the direct data plane (`fields`: its transport fields,
    target_endpoint and the like). The speculation goes as `speculation`, and as the deprecated flat fields too, the
    same settings, for a draft replica of the last release (which knows only those)."""
    msg = draft_pb2.SpeculateRequest(session_id=req.session_id, prompt_ids=req.prompt_ids,
                                     params=sampling_to_proto(req.params), max_new_tokens=req.max_new_tokens,
                                     speculation=speculation_to_proto(req.speculation),
                                     mode=req.mode, verify_method=req.verify_method, pearl_overlap=req.pearl_overlap,
                                     eos_token_ids=list(req.eos_token_ids), priority=req.priority, **fields)
    for name in OPTIONAL_SPECULATION:
        if getattr(req, name) is not None:
            setattr(msg, name, getattr(req, name))
    return msg


def stats_to_proto(stats: GenerationStats, msg: draft_pb2.SpeculateResponse, **extra: float) -> None:
    """A request's GenerationStats into a SpeculateResponse (numeric fields in `stats`, plus `extra`)."""
    for k, v in stats.to_dict().items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            msg.stats[k] = float(v)
    for k, v in extra.items():
        msg.stats[k] = float(v)
    msg.accepted_per_position.extend(stats.accepted_per_position)


def logprobs_rows_to_proto(rows, tokens: list[int]) -> common_pb2.TokenLogprobs:
    """The schedule's per-token logprobs ((logprob, top ids, top logprobs) per committed token) as TokenLogprobs."""
    return common_pb2.TokenLogprobs(token_ids=tokens, logprobs=[r[0] for r in rows],
                                    top=[common_pb2.TopLogprobs(ids=r[1], logprobs=r[2]) for r in rows])
