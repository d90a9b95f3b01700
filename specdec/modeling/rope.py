"""RoPE parameters and inverse frequencies for every RoPE type transformers defines (docs/guide/models.md).

A config.json names its RoPE in transformers 5's `rope_parameters` or in the older `rope_scaling` (+ `rope_theta`).
`read_rope_parameters` reads either and refuses what cannot be served exactly with one line naming the field and
its value; `standardized` fills in transformers' defaults (the original length of llama3, yarn and longrope). The
frequencies of a scaled RoPE come from
transformers' own init functions (`ROPE_INIT_FUNCTIONS`), called with the family's config class, so they are
transformers' numbers by construction; plain RoPE is computed here (specdec.modeling.model.rope_tables) and needs no
transformers import.

Two types change their frequencies with the sequence's length in transformers, which a cache of keys rotated once
cannot follow; each is served where it is one fixed table:
* `dynamic` (NTK): equal to plain RoPE up to `max_position_embeddings`, which already bounds the context;
* `longrope`: the short factors up to `original_max_position_embeddings`, which then bounds the context
  (`context_bound`); past it transformers switches every position to the long factors.
"""
from __future__ import annotations

import copy

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# keys each type needs that transformers does not default (original_max_position_embeddings defaults to
# max_position_embeddings)
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "longrope": ("short_factor", "long_factor"), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
_ORIGINAL_MAX = ("llama3", "yarn", "longrope")  # the types that read original_max_position_embeddings


def rope_type(params: dict | None) -> str:
    return (params or {}).get("rope_type", "default")


def read_rope_parameters(raw: dict, arch: str, head_dim: int, rope_theta: float) -> dict | None:
    """The RoPE of a config.json: None for plain RoPE (its theta is `rope_theta`), else its parameters (rope_type,
    rope_theta, factor, ...). Raises ValueError naming the field for what is not served."""
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = _declared_parameters(raw, field, arch)
    kind = params["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"{field}.rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported for {arch} (RoPE over the whole head)")
    params.pop("partial_rotary_factor", None)
    params.setdefault("rope_theta", rope_theta)
    if kind == "default":
        return None
    _complete_scaled(params, raw, field, head_dim)
    return params


def _declared_parameters(raw: dict, field: str, arch: str) -> dict:
    """The config.json's RoPE parameters as one flat dict (rope_scaling winning over rope_parameters, as in
    transformers), the older `type` key read as `rope_type` (default "default"); per-layer parameters refused."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}  # transformers: rope_scaling wins
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{field}={params!r}: per-layer RoPE parameters are not supported for {arch}")
    return {k: v for k, v in params.items() if k != "type"} | {"rope_type": params.get("rope_type",
                                                                                    params.get("type", "default"))}


def _complete_scaled(params: dict, raw: dict, field: str, head_dim: int) -> None:
    """A scaled RoPE's parameters checked for the keys its type needs (and longrope's factor counts), with a
    top-level original_max_position_embeddings taken in, in place; ValueError naming the field otherwise."""
    kind = params["rope_type"]
    for key in _REQUIRED[kind]:
        if params.get(key) is None:
            raise ValueError(f"{field} has rope_type {kind!r} but no {key!r}")
    if kind in _ORIGINAL_MAX and raw.get("original_max_position_embeddings") is not None:
        # Phi-3 style: the top-level value wins over the one in the RoPE parameters, as in transformers
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != head_dim // 2:
                raise ValueError(f"{field}.{key} has {len(params[key])} values; head_dim {head_dim} needs "
                                 f"{head_dim // 2}")


def _hf_config(cfg):
    """A config of the family's transformers class carrying what the RoPE init functions read."""
    import transformers  # lazy: heavy, and only a scaled RoPE needs it

    cls = getattr(transformers, cfg.architecture.replace("ForCausalLM", "Config"), transformers.LlamaConfig)
    try:
        return cls(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                   num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                   max_position_embeddings=cfg.max_position_embeddings,
                   rope_parameters=copy.deepcopy(cfg.rope_parameters))
    except (KeyError, TypeError) as e:  # transformers' checks of the RoPE keys
        raise ValueError(f"rope_parameters={cfg.rope_parameters!r}: {e.args[0] if e.args else e}") from None


def standardized(cfg) -> dict:
    """`cfg.rope_parameters` as transformers standardizes them (defaults filled in, e.g. the original length)."""
    return dict(_hf_config(cfg).rope_parameters)


def inv_freq(cfg) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] fp32, attention scaling of cos/sin) of a scaled RoPE, from
    transformers' init function for its type, at the length its rotary embedding starts with."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type(cfg.rope_parameters)](_hf_config(cfg), torch.device("cpu"))
    return inv.float(), float(scaling)


def context_bound(cfg) -> tuple[int, str] | None:
    """(positions, field) where a RoPE stops being one fixed table before max_position_embeddings: longrope's
    original length. None for every other type."""
    params = getattr(cfg, "rope_parameters", None)
    if rope_type(params) != "longrope":
        return None
    n = params.get("original_max_position_embeddings", cfg.max_position_embeddings)
    return int(n), "original_max_position_embeddings"
