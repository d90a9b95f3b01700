"""Drafts distilled from targets of every family the services load (Llama, Qwen2, Qwen3, Mistral): the draft is the
target's family, so copied layers keep their q/k/v biases and q/k norms; both loaders read it alike; a vocabulary
subset keeps the target's special tokens whatever its size; and `online` distils, writes and serves a Qwen2 draft
end to end (its subset made from the rows, since the shipped subset indexes another tokenizer)."""
import json
import re

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from specdec_train.distill.draft_model import (build_from_target, frequency_subset, load_draft, save_draft,
                                         special_ids)
from specdec.engine import Engine
from specdec.modeling.model import load_model_dir
from specdec.scheduling.request import GenerationRequest
from specdec_train.distill.online import load_draft_weights
from tests.helpers_models import TOKENIZER_CHARS, save_tiny_tokenizer

V = 40  # past the tiny tokenizer's 32 ids, as real vocabularies run past their tokenizers'
EOS = TOKENIZER_CHARS.index("?")
SHAPE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=None,
             eos_token_id=EOS, pad_token_id=None)
FAMILIES = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=True)),  # q/k/v biases
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=True)),  # per-head q/k RMSNorm
    "mistral": (MistralConfig, dict(tie_word_embeddings=False, sliding_window=None)),
}


def random_target(family: str):
    from transformers import AutoModelForCausalLM

    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**SHAPE, **extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # ones and zeros at init: make a lost one show
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_draft_is_the_targets_family_and_both_loaders_read_it(tmp_path, family):
    target = random_target(family)
    tie = FAMILIES[family][1]["tie_word_embeddings"]
    subset = torch.tensor([0] + list(range(3, V, 2)))
    draft = build_from_target(target, subset, (0, 2), tie=tie).eval()
    assert type(draft).__name__ == type(target).__name__ and draft.config.num_hidden_layers == 2
    for j, li in enumerate((0, 2)):  # every weight of the copied layers, biases and q/k norms included
        mine, theirs = draft.model.layers[j].state_dict(), target.model.layers[li].state_dict()
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    save_draft(draft, subset, tmp_path / "d", full_vocab=V, dtype=torch.float32)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == [type(target).__name__] and cfg["model_type"] == family
    assert cfg["num_hidden_layers"] == 2 and len(cfg.get("layer_types") or [0, 0]) == 2
    hf = load_draft(tmp_path / "d")
    ours = load_model_dir(tmp_path / "d", dtype="float32", role="draft", quant="none")
    x = torch.tensor([[1, 5, 7, 9, 3, V - 2]])
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        got, _ = ours(x, torch.arange(6)[None], torch.tensor([0]), ours.new_kv_slots(1, 16))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.isinf(got[..., 4]).all()  # outside the subset
    fresh = build_from_target(target, subset, (1, 2), tie=tie)  # a warm start reads it back
    load_draft_weights(fresh, tmp_path / "d")
    assert torch.equal(fresh.model.layers[0].self_attn.q_proj.weight, draft.model.layers[0].self_attn.q_proj.weight)


def test_subset_keeps_special_tokens_of_a_large_vocabulary():
    """Qwen's 151,936 ids (beyond the 2^17 the counter once held), its EOS rarer than any text token."""
    cfg = Qwen2Config(vocab_size=151_936, eos_token_id=[151_645, 151_643], bos_token_id=None, pad_token_id=151_643)
    assert special_ids(cfg) == (0, 151_643, 151_645)
    rows = [{"prompt_ids": [150_001, 150_002] * 3, "completion_ids": [140_000, 150_001, 7]}] * 4
    subset = frequency_subset(rows, 5, always=special_ids(cfg), vocab_size=cfg.vocab_size)
    assert subset.tolist() == [0, 150_001, 150_002, 151_643, 151_645]
    # 7 and 140,000 tie (4 each): the lower id wins
    assert frequency_subset(rows, 6, always=special_ids(cfg), vocab_size=cfg.vocab_size).tolist() == [
        0, 7, 150_001, 150_002, 151_643, 151_645]


def test_online_distils_and_serves_a_qwen2_draft(tmp_path):
    from specdec_train.distill.__main__ import main

    target = random_target("qwen2")
    tdir = tmp_path / "target"
    target.save_pretrained(tdir)
    save_tiny_tokenizer(tdir)
    cfg = json.loads((tdir / "tokenizer_config.json").read_text())
    cfg.update(eos_token="?", chat_template="{% for m in messages %}{{ m['content'] }}.{% endfor %}"
               "{% if add_generation_prompt %} {% endif %}")
    (tdir / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "draft"
    main(["--target", str(tdir), "--work", str(tmp_path / "work"), "online", "--gen-seconds", "2", "--gen-batch",
          "4", "--max-new-tokens", "12", "--mix", "template=1", "--steps", "4", "--batch-size", "2", "--warmup",
          "1", "--init-layers", "0", "--eval-every", "1000", "--vocab-subset", "16", "--out", str(out)])
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["Qwen2ForCausalLM"] and saved["specdec_full_vocab_size"] == V
    log = (tmp_path / "work" / "online" / "online" / "log.txt").read_text()
    # "online: 340 training rows" holds "0 training rows" too: the count is matched whole (it varies with the
    # time-bounded generation, so the substring check failed whenever the count ended in 0)
    assert "vocabulary subset from the training rows" in log and not re.search(r"\b0 training rows", log)
    from safetensors.torch import load_file

    subset = load_file(str(out / "vocab_subset.safetensors"))["vocab_subset"].tolist()
    assert len(subset) == 16 and {0, EOS} <= set(subset)  # the EOS kept, however rare
    served_target = load_model_dir(tdir, dtype="float32", quant="none")
    served_draft = load_model_dir(out, dtype="float32", role="draft", quant="none")
    eng = Engine(served_target, served_draft)
    try:
        prompt = [3, 9, 12, 5, 20]
        ref = eng.generate(GenerationRequest(prompt, 16, mode="ar")).token_ids
        for mode in ("sd", "pearl"):
            assert eng.generate(GenerationRequest(prompt, 16, mode=mode, gamma=3)).token_ids == ref, mode
    finally:
        eng.close()
