"""A Llama-family causal LM with a slot-addressed KV cache, in plain torch (gpt-fast style).

Loads Hugging Face checkpoints of `LlamaForCausalLM` (SmolLM2, Llama 1/2/3.x, TinyLlama...), `Qwen2ForCausalLM`
(q/k/v bias), `Qwen3ForCausalLM` (per-head q/k RMSNorm) and `MistralForCausalLM`, with every RoPE type transformers
defines (specdec/modeling/rope.py); a config that cannot be served exactly is refused at load, naming the field
(docs/guide/models.md). Parameter names match Hugging Face's, so a safetensors state dict loads as is; the loader
then stacks q/k/v and gate/up into one GEMM each (`specdec/modeling/fusion.py`).

The KV cache is preallocated per *slot* (one slot = one session) and written by absolute position, so rolling a
session back is free: positions past its length are simply overwritten by the next forward, and causal masking by
position means they are never read before that (gpt-fast's `KVCache.update` idea). A batched forward takes one row
per slot, each with its own positions; padded rows write past their session's end and are masked out.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from specdec.modeling import native, rope

from specdec.common import settings
from specdec.modeling.attention import SMALL_BLOCK_ROWS, attention
from specdec.modeling.dtypes import resolve_dtype
from specdec.modeling.fusion import fuse_projections_, unfused_state
from specdec.modeling.hub import resolve_model
from specdec.state.kv_slots import KVSlots
from specdec.modeling.linear import (ROW_CLASSES, Linear, prepack_linears, release_stream_weights, row_class,
                            row_invariance_enabled, set_row_invariant, tune_linears, tuning_enabled)
from specdec.modeling.quant import quantize_int8_, resolve_quant

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' defaults for the fields a config.json may leave out, per family (tests/test_families.py holds them to
# transformers' config classes). num_key_value_heads None: one per attention head; head_dim None: hidden / heads
FAMILY_DEFAULTS = {
    "LlamaForCausalLM": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, num_key_value_heads=None,
                             head_dim=None, sliding_window=None),
    "Qwen2ForCausalLM": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32,
                             head_dim=None, sliding_window=4096, max_window_layers=28),
    "Qwen3ForCausalLM": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32,
                             head_dim=128, sliding_window=4096, max_window_layers=28),
    "MistralForCausalLM": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, num_key_value_heads=8,
                               head_dim=None, sliding_window=4096),
}


NATIVE_MARGIN = 0.05  # CausalLM.tune_native_layers moves a row class only where it measured at least this much faster


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before RoPE (Qwen3)
    # a scaled RoPE: transformers' standardized RoPE parameters (rope_type, rope_theta, factor, ...), whose
    # frequencies come from transformers' init functions (specdec/modeling/rope.py); None: plain RoPE at rope_theta
    rope_parameters: dict | None = None
    # sliding-window attention (Mistral; Qwen2/3 with use_sliding_window): served up to the window, where it equals
    # full causal attention (`context_limit`)
    sliding_window: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architecture: str = "LlamaForCausalLM"
    # feature draft (EAGLE-style, docs/design/feature_draft.md): the input at position t is fc([embed(x_t); f_{t-1}]),
    # f_{t-1} = the target's final (post-norm) hidden state at t-1, of width `feature_size`
    feature_size: int = 0
    feature_scale: float = 1.0  # features are multiplied by this before fc (brings them to the embeddings' scale)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """A config.json → ModelConfig, with transformers' defaults for the family. Raises ValueError, one line
        naming the field and its value, for a config that cannot be served exactly."""
        arch = _served_architecture(cfg)
        d = FAMILY_DEFAULTS[arch]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim", d["head_dim"]) or cfg["hidden_size"] // heads
        rope_theta = _rope_theta(cfg)
        rope_parameters = rope.read_rope_parameters(cfg, arch, head_dim, float(rope_theta))
        out = cls(
            vocab_size=cfg.get("specdec_full_vocab_size", cfg["vocab_size"]),
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", d["num_key_value_heads"]) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", d["rms_norm_eps"]),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", d["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "Qwen2ForCausalLM",  # Qwen2: q/k/v always; the others none (refused at load)
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_parameters=rope_parameters,
            sliding_window=_sliding_window(cfg, arch),
            eos_token_id=_eos_ids(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            architecture=arch,
            feature_size=int(cfg.get("specdec_feature_size", 0)),
            feature_scale=float(cfg.get("specdec_feature_scale", 1.0)),
        )
        if rope_parameters is not None:  # transformers' defaults filled in; its init function runs once here
            out.rope_parameters = rope.standardized(out)
            _check_rope_frequencies(out)
        return out


def _refuse_attention_bias(cfg: dict, arch: str) -> None:
    """Llama and Qwen3 put a bias on o_proj too when attention_bias is set, which the layers here do not carry."""
    if cfg.get("attention_bias"):
        raise ValueError(f"attention_bias=True is not supported for {arch} (a bias on o_proj too)")


def _refuse_mlp_bias(cfg: dict, arch: str) -> None:
    if cfg.get("mlp_bias"):
        raise ValueError(f"mlp_bias=True is not supported for {arch}")


# each family's config.json switches the layers here cannot serve, checked in this order (ModelConfig.from_hf)
_FAMILY_REFUSALS = {
    "LlamaForCausalLM": (_refuse_attention_bias, _refuse_mlp_bias),
    "Qwen2ForCausalLM": (),  # q/k/v bias always, o_proj never: what Attention builds
    "Qwen3ForCausalLM": (_refuse_attention_bias,),
    "MistralForCausalLM": (),
}


def _served_architecture(cfg: dict) -> str:
    """The config.json's architecture, once its family, required fields, activation and family switches are ones
    served exactly; else ValueError naming the first field that is not."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architectures={arch!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    for key in REQUIRED_FIELDS:
        if cfg.get(key) is None:
            raise ValueError(f"config.json has no {key!r} (required for {arch})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported for {arch}; only 'silu'")
    for refuse in _FAMILY_REFUSALS[arch]:
        refuse(cfg, arch)
    return arch


def _rope_theta(cfg: dict):
    """RoPE's base as the config.json gives it: in its RoPE parameters (rope_scaling winning over rope_parameters),
    else at the top level, else 10000."""
    rope_src = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return ((rope_src.get("rope_theta") if isinstance(rope_src, dict) else None) or cfg.get("rope_theta")
            or 10000.0)


def _eos_ids(cfg: dict) -> list[int]:
    """config.json's eos_token_id (absent, one id or a list) as a list."""
    eos = cfg.get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _check_rope_frequencies(cfg: ModelConfig) -> None:
    """Run a scaled RoPE's init function once at load: ValueError naming rope_parameters where it fails or gives
    other than head_dim // 2 finite frequencies."""
    try:
        inv, _ = rope.inv_freq(cfg)
    except (ArithmeticError, TypeError, KeyError, RuntimeError) as e:  # e.g. a factor that is not a number
        raise ValueError(f"rope_parameters={cfg.rope_parameters!r}: {e}") from None
    if inv.shape != (cfg.head_dim // 2,) or not bool(torch.isfinite(inv).all()):
        raise ValueError(f"rope_parameters={cfg.rope_parameters!r} give no finite frequencies for "
                         f"head_dim {cfg.head_dim}")


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The attention window of a config.json as transformers reads it: Mistral's `sliding_window` on every layer;
    Qwen2/3's only with use_sliding_window and on the layers layer_types (or max_window_layers) makes sliding."""
    d = FAMILY_DEFAULTS[arch]
    if arch == "MistralForCausalLM":
        return cfg.get("sliding_window", d["sliding_window"])
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window", d["sliding_window"])
        first = cfg.get("max_window_layers", d["max_window_layers"])
        kinds = cfg.get("layer_types") or ["sliding_attention" if window is not None and i >= first
                                           else "full_attention" for i in range(cfg["num_hidden_layers"])]
        return window if "sliding_attention" in kinds else None
    return None


def context_limit(cfg) -> tuple[int, str]:
    """(positions a session may hold, the config field that bounds them): max_position_embeddings, or less where the
    model's attention or RoPE would change past it (sliding_window, longrope's original_max_position_embeddings).
    Any model config: a test double's may carry max_position_embeddings only."""
    limit, field_name = cfg.max_position_embeddings, "max_position_embeddings"
    for bound in (rope.context_bound(cfg), (getattr(cfg, "sliding_window", None), "sliding_window")):
        if bound and bound[0] is not None and bound[0] < limit:
            limit, field_name = bound
    return limit, field_name


def rope_tables(cfg: ModelConfig, n: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin tables [n, head_dim] for positions 0..n-1, as transformers' rotary embedding computes them: a
    scaled RoPE's frequencies and cos/sin scaling from transformers' init function (specdec/modeling/rope.py)."""
    scaling = 1.0
    if getattr(cfg, "rope_parameters", None):
        inv, scaling = rope.inv_freq(cfg)
    else:
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:  # yarn's and longrope's attention factor
        cos, sin = cos * scaling, sin * scaling
    return cos.to(device, dtype), sin.to(device, dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with `residual`: (x + residual, norm(x + residual)), the add as the model would run it."""
        # one C pass, not ~7 small ops (specdec/modeling/native.py)
        if native.rms_norm_supported(x, self.weight, residual):
            return native.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return x, self(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, h * hd, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, kv * hd, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, kv * hd, bias=cfg.attention_bias)
        self.o_proj = Linear(h * hd, cfg.hidden_size, bias=False)
        self.qkv_proj: Linear | None = None  # set by fuse_projections_, which drops q/k/v_proj
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, kv: KVSlots, slots, positions, mask, kv_len: int, visible=None):
        # x: [B, S, D]; cos/sin: [B, S, hd]; slots: [B]; positions: [B, S]; mask: [B, 1, S, kv_len] | None;
        # kv_len: int for B == 1, else [(slot, kv_len)] per row; visible: [B, S] keys per query row, set where the
        # native kernel runs the attention (CausalLM.forward)
        B, S, _ = x.shape
        cfg = self.cfg
        h, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.qkv_proj is not None:  # one GEMM for q, k and v (fuse_projections_)
            qkv = self.qkv_proj(x)
            qk, v = qkv[..., :(h + kvh) * hd], qkv[..., (h + kvh) * hd:]
        else:
            qk, v = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1), self.v_proj(x)
        qk, v = qk.view(B, S, h + kvh, hd), v.view(B, S, kvh, hd)
        if self.cfg.qk_norm:  # Qwen3: each head of q and of k normalized on its own
            qk = torch.cat((self.q_norm(qk[:, :, :h].contiguous()), self.k_norm(qk[:, :, h:].contiguous())), dim=2)
        # RoPE on q and k at once; `sin` carries rotate_half's sign, so rotate_half(x) * sin = roll(x) * sin_signed
        qk = qk * cos.unsqueeze(2) + qk.roll(hd // 2, dims=-1) * sin.unsqueeze(2)
        q, k = qk.split((h, kvh), dim=2)
        kc, vc = kv.k[layer], kv.v[layer]
        if B == 1:
            s, p0 = int(slots[0]), int(positions[0, 0])
            kc[s, p0:p0 + S] = k[0]
            vc[s, p0:p0 + S] = v[0]
        else:
            kc[slots[:, None], positions] = k
            vc[slots[:, None], positions] = v
        if visible is not None:  # every row of the batch in one native call, the cache read in place
            return self.o_proj(native.decode_attention(q, kc, vc, slots, visible).to(x.dtype).view(B, S, -1))
        if B > 1:
            return self.o_proj(self._per_row(q, kc, vc, mask, kv_len).transpose(1, 2).reshape(B, S, -1))
        q, keys, values = q.transpose(1, 2), kc[s:s + 1, :kv_len].transpose(1, 2), vc[s:s + 1, :kv_len].transpose(1, 2)
        out = attention(q, keys, values, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))

    def _per_row(self, q, kc, vc, mask, rows_kv):
        """Attention of a batch, row by row on views of each row's own slot: no gather of every slot up to the
        longest row (a copy that cost a third of an 8-session verify), and each row reads only its own length.
        rows_kv: [(slot, kv_len)] per row. With one query per row every key up to kv_len is visible: no mask."""
        q = q.transpose(1, 2)
        outs = []
        for b, (s, n) in enumerate(rows_kv):
            m = None if q.shape[2] == 1 else mask[b:b + 1, :, :, :n]
            outs.append(attention(q[b:b + 1], kc[s:s + 1, :n].transpose(1, 2), vc[s:s + 1, :n].transpose(1, 2), m))
        return torch.cat(outs)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: Linear | None = None  # set by fuse_projections_, which drops gate/up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def runs_natively(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether a forward of `rows` rows (all sessions of a step or verify) with native attention may run as one
        native call (`specdec.modeling.native.decoder_layer`): every linear of the layer runs on the streaming kernel
        for that many rows (`Linear.streams`: hosts without native bf16 GEMMs), projections fused, no q/k norm, norms
        of the model's dtype. The call runs the same kernels in the same order, without ~25 torch ops between them."""
        a, m = self.self_attn, self.mlp
        return (a.qkv_proj is not None and m.gate_up_proj is not None and not a.cfg.qk_norm
                and a.o_proj.bias is None and m.gate_up_proj.bias is None and m.down_proj.bias is None
                and self.input_layernorm.weight.dtype is dtype and self.post_attention_layernorm.weight.dtype is dtype
                and all(lin.streams(rows, dtype) for lin in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)))

    def native_weights(self) -> tuple[int, ...]:
        """The layer's weights as `specdec.modeling.native.decoder_layer` takes them (valid while `runs_natively` holds
        and the weights stay where they are: `CausalLM` checks both at every forward)."""
        a, m = self.self_attn, self.mlp
        return native.tensor_args(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                                  a.qkv_proj.stream_weight(), a.qkv_proj.bias, a.o_proj.stream_weight(),
                                  m.gate_up_proj.stream_weight(), m.down_proj.stream_weight())

    def forward(self, x, cos, sin, layer, kv, slots, positions, mask, kv_len, visible=None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, layer, kv, slots, positions, mask, kv_len, visible)
        x, h = self.post_attention_layernorm(x, attn)  # the residual add and the norm in one pass
        return x + self.mlp(h)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, embed_rows: int | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(embed_rows or cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama-family decoder. `forward` returns (logits fp32 [B, S, V], final hidden [B, S, D])."""

    def __init__(self, cfg: ModelConfig, vocab_subset: torch.Tensor | None = None, oov_compact_id: int = 0):
        super().__init__()
        self.config = cfg
        # Compact-vocabulary drafts (docs/design/distillation.md) embed and predict only a frequency-ranked subset of
        # the target's vocabulary: input ids map full → compact (others to an OOV row) and logits are -inf outside the
        # subset, so the draft distribution is exactly zero there (still lossless: q is what was sampled).
        rows = cfg.vocab_size if vocab_subset is None else len(vocab_subset)
        self.model = Backbone(cfg, rows)
        self.lm_head = Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings:  # a compact-vocabulary draft ties its subset rows the same way
            self.lm_head.weight = self.model.embed_tokens.weight
        to_compact = None
        self.oov_compact_id = oov_compact_id  # the row an id outside the subset embeds as (specdec/text/vocab.py too)
        if vocab_subset is not None:
            to_compact = torch.full((cfg.vocab_size,), oov_compact_id, dtype=torch.long)
            to_compact[vocab_subset] = torch.arange(len(vocab_subset))
        # a feature draft mixes the token embedding with the target's feature of the previous position
        self.fc = Linear(cfg.hidden_size + cfg.feature_size, cfg.hidden_size) if cfg.feature_size else None
        self.register_buffer("vocab_subset", vocab_subset, persistent=False)
        self.register_buffer("to_compact", to_compact, persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._routing_parts: list | None = None  # _native_layers' memo and what its key reads
        self._native_memo: dict = {}

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_kv_slots(self, num_slots: int, max_len: int) -> KVSlots:
        return KVSlots(self.config, num_slots, max_len, self.device, self.dtype)

    def _rope(self, positions: torch.Tensor):
        need = int(positions.max()) + 1
        if self._rope_cache is None or self._rope_cache[0].shape[0] < need:
            have = self._rope_cache[0].shape[0] if self._rope_cache else 0
            n = max(need, self.config.max_position_embeddings, 2 * have)
            cos, sin = rope_tables(self.config, n, self.device, self.dtype)
            half = self.config.head_dim // 2  # rotate_half negates the first half: fold that sign into sin
            self._rope_cache = (cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        cos, sin_signed = self._rope_cache
        return cos[positions], sin_signed[positions]

    def _native_layers(self, rows: int, dtype: torch.dtype) -> list[tuple[int, ...]] | None:
        """Each layer's weights for `specdec.modeling.native.decoder_layer` if every layer runs natively for `rows` rows
        of `dtype` (`DecoderLayer.runs_natively`), else None. Memoized per (rows, dtype) under a key of everything the
        answer depends on (each linear's plan, padding and row invariance, every weight's address, version and dtype:
        a weight changed in place is packed again for the streaming kernel), which costs ~100 µs a forward against
        ~1.5 ms to ask each layer."""
        if self._routing_parts is None:
            mods = list(self.model.layers.modules())
            self._routing_parts = ([m for m in mods if isinstance(m, Linear)],
                                   [m for m in mods if isinstance(m, (Linear, RMSNorm))])
        linears, weighted = self._routing_parts
        # read each weight anew: `.to()` replaces a buffer (an Int8Linear's weight) by a new tensor
        tensors = [m.weight for m in weighted] + [m.bias for m in linears if m.bias is not None]
        # ... and each streaming kernel's packed copy (`Linear.stream_weight`): the memo holds their addresses, and
        # a copy dropped (`release_stream_weights`) and made again must not be read at its old address
        packed = tuple([m._streamed[2].data_ptr() if m._streamed is not None else 0 for m in linears])
        key = (tuple([(m.plan, m.pad_to, m.row_invariant) for m in linears]),
               tuple([(t.data_ptr(), t._version) for t in tensors]), tuple([t.dtype for t in tensors]), packed)
        memo = self._native_memo.get((rows, dtype))
        if memo is not None and memo[0] == key:
            return memo[1]
        layers = self.model.layers
        weights = [layer.native_weights() for layer in layers] \
            if native.stream_linear_supported() and all(layer.runs_natively(rows, dtype) for layer in layers) else None
        self._native_memo[(rows, dtype)] = (key, weights)
        return weights

    def tune_native_layers(self, context: int = 128, budget_s: float = 1.5) -> list[int]:
        """Where it measures faster, run a draft's decode steps and small blocks as native layers
        (`specdec.modeling.native.decoder_layer`) on hosts whose tuning chose other kernels (oneDNN, int8): per row
        class (1, 4 and 8 rows), a forward with every layer's linears on `stream` against one as tuned, interleaved,
        medians; the class moves to `stream` (unpadded) where that is at least NATIVE_MARGIN faster. Only for
        models whose rows need not round alike alone and batched (a draft): a row-invariant model (the target)
        keeps one kernel family for every row count (specdec/modeling/linear.py). A prefill keeps its kernel. Call after
        `tune_linears` (`tune_model` does both). → the row counts moved."""
        linears = [m for m in self.model.layers.modules() if isinstance(m, Linear)]
        dtype = self.dtype
        if not self._native_tuning_applies(linears):
            return []
        kv = self.new_kv_slots(1, context + max(ROW_CLASSES) + 1)
        vocab = self.config.vocab_size
        gen = torch.Generator().manual_seed(0)

        def run(rows: int, start: int = context) -> float:
            """One forward of `rows` random tokens at positions start.. of the scratch cache; → its seconds."""
            tokens = torch.randint(0, vocab, (1, rows), generator=gen)
            feats = torch.zeros(1, rows, self.config.feature_size) if self.fc is not None else None
            t = time.perf_counter()
            self(tokens, torch.arange(start, start + rows)[None], torch.zeros(1, dtype=torch.long), kv,
                 features=feats)
            return time.perf_counter() - t

        def use(plans: list[tuple]) -> None:
            for m, (plan, pad) in zip(linears, plans):
                m.plan, m.pad_to = plan, pad

        run(context, start=0)  # the cached positions the timed forwards attend to
        moved = []
        for cls, rows in enumerate(ROW_CLASSES):
            tuned = [(m.plan, m.pad_to) for m in linears]
            stream = _stream_plans(linears, cls)
            use(stream)
            if self._native_layers(rows, dtype) is None:  # a layer of another shape or kind: nothing to gain
                use(tuned)
                continue
            faster = _stream_is_faster(run, use, rows, tuned, stream, budget_s)
            use(stream if faster else tuned)
            if faster:
                moved.append(rows)
        release_stream_weights(self)  # the packed copies of a trial that did not pay
        return moved

    def _native_tuning_applies(self, linears: list[Linear]) -> bool:
        """Whether `tune_native_layers` has anything to try: tuning and native layers on, a bf16 model on a CPU
        with the streaming kernel built, and linears none of which is row-invariant."""
        return bool(tuning_enabled() and settings.get().native and settings.get().native_layers and linears
                    and self.device.type == "cpu" and self.dtype is torch.bfloat16 and native.stream_linear_supported()
                    and not any(m.row_invariant for m in linears))

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.expand_logits(self.lm_head(hidden).float())

    def expand_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A compact head's logits (one per vocabulary-subset entry) → full-vocabulary logits, -inf outside the
        subset. Without a subset: unchanged."""
        if self.vocab_subset is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.config.vocab_size), -math.inf, device=logits.device)
        full[..., self.vocab_subset] = logits
        return full

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVSlots,
                logits_rows: slice | None = None, features: torch.Tensor | None = None, compact_logits: bool = False):
        # tokens/positions: [B, S] (rows padded to S; padding positions lie past each row's real end); slots: [B];
        # features: [B, S, feature_size], a feature draft's f_{t-1} per row (required iff config.feature_size).
        # compact_logits: a compact-head model returns its head's logits as they are (one per subset entry, in
        # vocab_subset order; expand_logits maps them), sparing the full-vocabulary expansion.
        B, S = tokens.shape
        cos, sin = self._rope(positions)
        kv_len = int(positions.max()) + 1
        if kv_len > kv.max_len:
            raise ValueError(f"position {kv_len - 1} is beyond the KV cache ({kv.max_len} positions)")
        visible, slots, mask, kv_len = self._attention_inputs(tokens, positions, slots, kv, kv_len)
        x = self._embed(tokens, features)
        native_weights = None
        if visible is not None and settings.get().native_layers and kv.k[0].dtype is x.dtype:
            native_weights = self._native_layers(B * S, x.dtype)
        if native_weights is not None:
            x = self._native_decoder_layers(x, cos, sin, native_weights, kv, slots, visible)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, i, kv, slots, positions, mask, kv_len, visible)
        hidden = self.model.norm(x)
        rows = hidden if logits_rows is None else hidden[:, logits_rows]
        if compact_logits:
            return self.lm_head(rows).float(), hidden
        return self.full_logits(rows), hidden

    def _attention_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVSlots,
                          kv_len: int):
        """What `forward`'s attention reads: (visible, slots, mask, kv_len).

        A decode step or verify block on the native decode attention: visible [B, S] int64, row s of sequence b
        seeing positions 0..positions[b, s] of its slot, slots as contiguous int64, no mask, kv_len as given.
        Otherwise visible None, slots as given, the causal mask by position [B, 1, S, kv_len] (None for one query
        row), and for a batch kv_len per row as [(slot, its own kv length)] (attention row by row:
        Attention._per_row)."""
        B, S = tokens.shape
        if S <= SMALL_BLOCK_ROWS and settings.get().decode_attention and native.supports(kv.k[0]):
            if int(positions.min()) < 0 or int(slots.min()) < 0 or int(slots.max()) >= kv.num_slots:
                raise ValueError(f"slots must lie in [0, {kv.num_slots}) and positions be >= 0")
            return (positions + 1).to(torch.int64).contiguous(), slots.to(torch.int64).contiguous(), None, kv_len
        mask = None
        if S > 1:
            key_pos = torch.arange(kv_len, device=tokens.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None]).unsqueeze(1)  # [B, 1, S, kv_len]
        if B > 1:
            kv_len = list(zip(slots.tolist(), (positions.max(dim=1).values + 1).tolist()))
        return None, slots, mask, kv_len

    def _embed(self, tokens: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input [B, S, D]: the tokens' embeddings (through `to_compact` for a compact
        vocabulary); a feature draft's mixed with each position's target feature by `fc`."""
        x = self.model.embed_tokens(tokens if self.to_compact is None else self.to_compact[tokens])
        if self.fc is not None:
            if features is None or features.shape[:2] != tokens.shape:
                raise ValueError("a feature draft needs one target feature per input token")
            x = self.fc(torch.cat((x, features.to(x.dtype) * self.config.feature_scale), dim=-1))
        return x

    def _native_decoder_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native_weights: list,
                               kv: KVSlots, slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """`forward`'s layers where every one runs natively (`_native_layers`): each layer one native call
        (specdec/modeling/csrc/decoder_layer.c) that updates the hidden states in place. → the last layer's output."""
        cfg = self.config
        x, cos, sin = x.contiguous(), cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        for i, weights in enumerate(native_weights):
            native.decoder_layer(x, weights, cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads,
                                 cfg.intermediate_size, cos, sin, kv.k[i], kv.v[i], slots, visible)
        return x


def _stream_plans(linears: list[Linear], cls: int) -> list[tuple]:
    """Each linear's (plan, pad_to) with row class `cls` moved to the streaming kernel, unpadded; the other classes
    as they are (`CausalLM.tune_native_layers`)."""
    in_class = [r for r in range(1, max(ROW_CLASSES) + 1) if row_class(r) == cls]
    return [(tuple("stream" if i == cls else k for i, k in enumerate(m.plan or m.default_plan())),
             None if m.pad_to is None else tuple(r if r in in_class else p for r, p in enumerate(m.pad_to, 1)))
            for m in linears]


def _stream_is_faster(run, use, rows: int, tuned: list[tuple], stream: list[tuple], budget_s: float) -> bool:
    """Time forwards of `rows` rows under the tuned plans and the streaming ones, interleaved (5 to 15 pairs, more
    while within `budget_s`): whether the streaming median is at least NATIVE_MARGIN below the tuned one.
    `run(rows)`: one forward's seconds; `use(plans)`: sets the linears' plans."""
    times: dict[str, list[float]] = {"tuned": [], "stream": []}
    start = time.perf_counter()
    while len(times["stream"]) < 15 and (len(times["stream"]) < 5 or time.perf_counter() - start < budget_s):
        for name, plans in (("tuned", tuned), ("stream", stream)):
            use(plans)
            run(rows)  # the first of each pair warms the caches for the second
            times[name].append(run(rows))
    return statistics.median(times["stream"]) < (1 - NATIVE_MARGIN) * statistics.median(times["tuned"])


# ----------------------------------------------------------------------------------------------------------------
# loading

def tune_model(model: nn.Module) -> None:
    """`tune_linears`, then, for a `CausalLM`, `tune_native_layers` (call where the model will run: both are per
    thread count)."""
    tune_linears(model)
    if isinstance(model, CausalLM):
        model.tune_native_layers()


def load_model_dir(path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
                   role: str = "target", quant: str = "auto") -> CausalLM:
    """Load a Hugging Face-style directory (config.json + *.safetensors). `role` matters for dtype and quant `auto`
    (`specdec.modeling.quant.resolve_quant`: a draft gets int8 weights on a bf16 CPU; a target never unless asked)."""
    settings.prepare_process()  # oneDNN's cache sizes, before this process's first oneDNN call
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    subset_file = raw.get("specdec_vocab_subset")  # compact-vocabulary draft (docs/design/distillation.md)
    subset = load_file(str(path / subset_file))["vocab_subset"].long() if subset_file else None
    files = [f for f in sorted(path.glob("*.safetensors")) if f.name != subset_file]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    state = {k: v.float() for f in files for k, v in load_file(str(f)).items()}  # fp16-stored weights load as fp32
    model = CausalLM(cfg, vocab_subset=subset, oov_compact_id=int(raw.get("specdec_oov_compact_id", 0)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")
    dtype = resolve_dtype(dtype, device, role)
    model = model.to(device=device, dtype=dtype).eval()
    model.source_dir = path  # its tokenizer.json, for structured output (specdec/text/grammar.py)
    if settings.get().fuse:  # off (SPECDEC_FUSE=0): the checkpoint's layout (for A/B runs)
        fuse_projections_(model)
    if resolve_quant(quant, role, device, dtype) == "int8":
        # a pre-verifier names its draft by the stored weights; keep that name across the quantization
        model.weights_fingerprint = draft_fingerprint(model)
        quantize_int8_(model)
    if role == "target" and row_invariance_enabled():
        # the output is the target's: a row must not round differently alone than batched (specdec.modeling.linear)
        set_row_invariant(model)
    prepack_linears(model)  # bf16 on a CPU: the packed kernel skips oneDNN's per-call weight reorder
    # each layer shape takes this host's fastest kernel per row count (specdec.modeling.linear), a draft
    tune_model(model)
    # its native layers where they are faster
    if model.device.type == "cpu":
        native.available()  # builds the native kernels now (once per host and CPU), not in the first request
    return model


def load_model(spec: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32",
               role: str = "target", quant: str = "auto") -> CausalLM:
    """Resolve a model spec (local dir, .gguf, hub id, default-target/default-draft) and load it."""
    return load_model_dir(resolve_model(str(spec)), device=device, dtype=dtype, role=role, quant=quant)


def draft_fingerprint(draft_model: nn.Module) -> str:
    """sha256 over the draft's decoder layers and final norm (names, shapes, bf16-rounded bytes): identifies the
    space of its hidden states, independently of how a loader lays out a compact vocabulary (embeddings / head) and
    of the dtype it was loaded in (fp32, fp16 or bf16 copies of the same stored weights hash alike). A model
    quantized at load time (specdec.modeling.quant) carries the fingerprint of the weights it was loaded from."""
    if getattr(draft_model, "weights_fingerprint", None):
        return draft_model.weights_fingerprint

    h = hashlib.sha256()
    state = unfused_state(draft_model) if hasattr(draft_model, "config") else draft_model.state_dict()
    for name, p in sorted(state.items()):
        if not torch.is_tensor(p) or not (".layers." in name or name.endswith("norm.weight")):
            continue
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(p.detach().to("cpu", torch.float32).to(torch.bfloat16).contiguous().view(torch.int16).numpy()
                 .tobytes())
    return h.hexdigest()
