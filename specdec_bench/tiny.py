"""Tiny random Llama-shaped models: the benchmarks that measure the stack rather than the models (the round trip),
and the test suite, build them here. Seeded, so two processes that build one get the same weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.modeling.fusion import unfused_state
from specdec.modeling.model import CausalLM, ModelConfig


def build_tiny_model(vocab_size: int = 32, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, seed: int = 0, max_position_embeddings: int = 256,
                     logit_scale: float = 1.0, feature_size: int = 0) -> CausalLM:
    """A random tiny model. `logit_scale` sharpens (>1) or flattens (<1) its distributions; `feature_size` > 0
    makes it a feature draft reading a target of that width."""
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      max_position_embeddings=max_position_embeddings, feature_size=feature_size)
    gen = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def save_model(model, path: Path) -> Path:
    """config.json + model.safetensors that `specdec.modeling.model.load_model_dir` (and the servers) load."""
    from safetensors.torch import save_file

    c = model.config
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False}))
    save_file({k: v.contiguous() for k, v in unfused_state(model).items()}, str(path / "model.safetensors"))
    return path
