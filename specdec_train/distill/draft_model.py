"""The draft: a few of the target's layers over a compact (frequency-ranked) subset of the target's vocabulary.

It is the target's own family (Llama, Qwen2, Qwen3 or Mistral, so that copied layers keep their biases and
q/k norms; a Llama for any other family). On disk it is a standard HF ``*ForCausalLM`` directory whose
``vocab_size`` is the subset size ``V_s``; it
speaks *compact* ids. ``vocab_subset.safetensors`` holds ``vocab_subset`` (int64 [V_s]): compact id -> full
(target) id, sorted ascending. Loaders map input ids full -> compact (ids outside the subset ->
``config.specdec_oov_compact_id``) and scatter the [.., V_s] logits into a full-vocabulary tensor filled with -inf
(see ``FullVocabDraft``), so the draft's distribution is exactly zero outside the subset (still lossless).
"""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

SUBSET_FILE = "vocab_subset.safetensors"
# families whose layers a draft copies as they are; the served loader (specdec/modeling/model.py) reads each of them
DRAFT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def special_ids(config) -> tuple[int, ...]:
    """Token ids a draft's vocabulary must keep: 0 (the out-of-subset row) and the target's BOS, EOS and PAD, so
    that the draft can propose the end of an answer."""
    ids = {0}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(config, name, None)
        ids.update([v] if isinstance(v, int) else (v or []))
    return tuple(sorted(i for i in ids if 0 <= i < config.vocab_size))


def frequency_subset(rows: list[dict], size: int, always=(0, 1, 2), vocab_size: int | None = None) -> torch.Tensor:
    """Full ids of the ``size`` most frequent completion/prompt tokens (ties broken by id), specials forced in."""
    top = max([max(r["completion_ids"] + r["prompt_ids"], default=0) for r in rows] + list(always))
    counts = torch.zeros(max(vocab_size or 0, top + 1), dtype=torch.long)
    for r in rows:
        t = torch.tensor(r["completion_ids"] + r["prompt_ids"])
        counts.index_add_(0, t, torch.ones_like(t))
    for a in always:
        counts[a] = counts.max() + 1
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    ids = [i for i in order[:size]]
    return torch.tensor(sorted(ids), dtype=torch.long)


def full_to_compact_map(subset: torch.Tensor, full_vocab: int, oov_compact: int) -> torch.Tensor:
    m = torch.full((full_vocab,), oov_compact, dtype=torch.long)
    m[subset] = torch.arange(len(subset))
    return m


def draft_config(tc, vocab: int, layers, intermediate: int | None = None, tie: bool = False):
    """The draft's config: the target's, cut to ``layers`` and the subset's ``vocab``, for the families in
    ``DRAFT_FAMILIES`` (their attention biases, q/k norms and RoPE settings carry over); a Llama of the target's
    shape for any other."""
    common = dict(vocab_size=vocab, intermediate_size=intermediate or tc.intermediate_size,
                  num_hidden_layers=len(layers), tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if getattr(tc, "model_type", None) not in DRAFT_FAMILIES:
        return LlamaConfig(hidden_size=tc.hidden_size, num_attention_heads=tc.num_attention_heads,
                           num_key_value_heads=tc.num_key_value_heads, head_dim=getattr(tc, "head_dim", None),
                           max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                           rope_parameters=getattr(tc, "rope_parameters", None), **common)
    skip = ("architectures", "_name_or_path", "auto_map", "quantization_config")  # the draft is stored unquantized
    d = {k: v for k, v in tc.to_dict().items() if k not in skip}
    d.update(common)
    if d.get("layer_types"):  # per-layer attention kinds (Qwen2/3): the copied layers' own
        d["layer_types"] = [tc.layer_types[i] for i in layers]
    if "max_window_layers" in d:
        d["max_window_layers"] = min(d["max_window_layers"], len(layers))
    return type(tc).from_dict(d)


def build_from_target(target, subset: torch.Tensor, layers=(0, 29), intermediate: int | None = None,
                      copy_layers: bool = True, tie: bool = False) -> PreTrainedModel:
    """A draft with the target's width and family, ``len(layers)`` decoder layers copied from the target (if
    ``copy_layers``), embeddings and output head = the target's (tied) embedding rows of the subset; ``tie``
    keeps the draft's head tied to its input embedding, as the target's is."""
    tc = target.config
    cfg = draft_config(tc, len(subset), layers, intermediate, tie)
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        E = target.model.embed_tokens.weight[subset]
        draft.model.embed_tokens.weight.copy_(E)
        if tie:
            draft.tie_weights()
        else:
            draft.lm_head.weight.copy_(target.lm_head.weight[subset])
        draft.model.norm.weight.copy_(target.model.norm.weight)
        if copy_layers and (intermediate is None or intermediate == tc.intermediate_size):
            for j, li in enumerate(layers):
                draft.model.layers[j].load_state_dict(target.model.layers[li].state_dict())
    return draft


def save_draft(draft: PreTrainedModel, subset: torch.Tensor, out_dir, full_vocab: int, oov_full_id: int = 0,
               dtype=torch.float16, extra_config: dict | None = None) -> None:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in draft.state_dict().items()}
    if draft.config.tie_word_embeddings:  # a tied head is the input embedding: stored once
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file({"vocab_subset": subset.to(torch.int64).contiguous()}, str(out / SUBSET_FILE))
    cfg = draft.config.to_dict()
    cfg.update({"architectures": [type(draft).__name__], "dtype": "float32", "torch_dtype": "float32",
                "specdec_vocab_subset": SUBSET_FILE, "specdec_full_vocab_size": int(full_vocab),
                "specdec_oov_compact_id": int((subset == oov_full_id).nonzero()[0, 0]),
                "specdec_weights_dtype": str(dtype).replace("torch.", "")})
    cfg.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


class FullVocabDraft(torch.nn.Module):
    """Wraps a compact-vocab draft: full ids in, full-vocabulary logits out (-inf outside the subset)."""

    def __init__(self, model: PreTrainedModel, subset: torch.Tensor, full_vocab: int, oov_compact: int):
        super().__init__()
        self.model = model
        self.config = model.config
        self.register_buffer("subset", subset.long(), persistent=False)
        self.register_buffer("to_compact", full_to_compact_map(subset.long(), full_vocab, oov_compact),
                             persistent=False)
        self.full_vocab = full_vocab

    def forward(self, input_ids, full_logits: bool = True, **kw):
        out = self.model(input_ids=self.to_compact[input_ids], **kw)
        if full_logits:
            lg = out.logits
            full = lg.new_full((*lg.shape[:-1], self.full_vocab), float("-inf"))
            full[..., self.subset] = lg
            out.logits = full
        return out


def load_draft(model_dir, dtype=torch.float32) -> FullVocabDraft | PreTrainedModel:
    """Load a draft directory; a vocab-subset draft comes back wrapped in ``FullVocabDraft``."""
    d = pathlib.Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).eval()
    if "specdec_vocab_subset" not in cfg:
        return model
    subset = load_file(str(d / cfg["specdec_vocab_subset"]))["vocab_subset"]
    return FullVocabDraft(model, subset, cfg["specdec_full_vocab_size"], cfg["specdec_oov_compact_id"]).eval()
