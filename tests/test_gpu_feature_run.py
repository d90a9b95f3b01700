"""The prepared GPU run for a feature draft (specdec_train/distill/gpu_feature_run.py, docs/design/feature_draft.md
"The prepared GPU run"): its training forward is exactly what the served draft computes inside a drafted block;
the simulated greedy sd counts target forwards as the engine does; its CPU dry run (tiny random target and draft
here, so it runs anywhere in seconds) writes a feature draft the services load, a card and metrics, imports
nothing a bare GPU machine lacks, and a rerun resumes."""
import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_train.distill.draft_model import save_draft
from specdec_train.distill.gpu_feature_run import (INIT_DRAFT, build_feature_draft, depth_keep, depth_mask,
                                                   export_feature_draft, sd_rounds)
from tests.test_distill_gpu_dryrun import run_fresh, unpack_draft

REPO = pathlib.Path(__file__).resolve().parents[1]
FULL_VOCAB = 49152  # SmolLM2's: the shipped subset and tokenizer index it
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _llama(vocab, layers, hidden=64, tie=True, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random target with SmolLM2's vocabulary and tokenizer, and a tiny plain draft over the shipped subset."""
    root = tmp_path_factory.mktemp("tiny")
    _llama(FULL_VOCAB, 2, seed=1).save_pretrained(root / "target")
    for f in TOKENIZER:
        shutil.copy(INIT_DRAFT / f, root / "target" / f)
    subset = load_file(str(INIT_DRAFT / "vocab_subset.safetensors"))["vocab_subset"]
    save_draft(_llama(len(subset), 2, seed=2), subset, root / "draft", full_vocab=FULL_VOCAB)
    return root


class _TargetConfig:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 2


def test_training_forward_is_the_served_draft_at_every_block_depth(tiny, tmp_path):
    """Position t drafted at depth k of a block that started at s = t - k: the served draft has fed positions
    0..s with their features and s+1..t with zeros; `depth_hidden` gives the same final hidden state."""
    from specdec.modeling.model import load_model_dir

    d = build_feature_draft(tiny / "draft", 0, 48, 0.0625)
    with torch.no_grad():  # away from the warm start, so that the features matter
        d.fc.weight.normal_(0, 0.3)
        d.fc.bias.normal_(0, 0.1)
        for p in d.model.layers[0].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_feature_draft(d, tiny / "draft", tiny / "target", _TargetConfig, tmp_path / "fd")
    with torch.no_grad():  # as exported (float16 weights)
        for p in d.parameters():
            p.copy_(p.half().float())
    served = load_model_dir(tmp_path / "fd", dtype=torch.float32, role="draft", quant="none")
    assert served.config.feature_size == 48 and served.config.num_hidden_layers == 1
    L, K = 10, 4
    ids = served.vocab_subset[torch.randint(0, len(served.vocab_subset), (1, L))]
    f = torch.randn(1, L, 48) * 2
    f_in = torch.zeros_like(f)
    f_in[:, 1:] = f[:, :-1]
    with torch.no_grad():
        hs = d.depth_hidden(served.to_compact[ids], f_in, K)
    for s in range(L):
        for k in range(min(K, L - s)):
            t = s + k
            feats = f_in[:, :t + 1].clone()
            feats[:, s + 1:] = 0
            _, h = served(ids[:, :t + 1], torch.arange(t + 1)[None], torch.tensor([0]), served.new_kv_slots(1, 32),
                          features=feats)
            torch.testing.assert_close(h[0, t], hs[0, k, t], atol=1e-5, rtol=1e-5)


def test_depth_mask_and_keep():
    m = depth_mask(5, 3).view(3, 5, 10)
    assert torch.equal(m[0, :, :5], torch.ones(5, 5, dtype=torch.bool).tril()) and not m[0, :, 5:].any()
    assert m[2, 4, :3].all() and not m[2, 4, 3:5].any() and m[2, 4, 8:10].all() and not m[2, 4, 5:8].any()
    mask = torch.tensor([[False, True, True, True, False]])  # completion positions 1..3
    keep = depth_keep(mask, 3)
    assert keep[1, 0].tolist() == [False, False, True, True, False] and keep[2, 0].tolist() == [False] * 3 + [True, False]


def test_simulated_sd_counts_target_forwards():
    C = 10
    assert sd_rounds(torch.ones(4, C, dtype=torch.bool), 4) == 2  # 5 tokens a forward
    assert sd_rounds(torch.zeros(4, C, dtype=torch.bool), 4) == C
    corr = torch.ones(4, C, dtype=torch.bool)
    corr[1] = False  # the second token of every block is wrong: 2 tokens a forward
    assert sd_rounds(corr, 4) == 5


def _dry_run(work: pathlib.Path, target, init, *extra: str) -> tuple[dict, list[str], str]:
    args = ["--dry-run", "--target", str(target), "--init-draft", str(init), "--work", str(work), "--out",
            str(work / "out"), "--mix", "template=1", "--gen-batch", "2", "--max-new-tokens", "8", "--eval-max-rows",
            "3", "--budget", "60", "--gen-share", "0.02", "--ckpt-seconds", "0", "--threads", "1", *extra]
    loaded, stdout = run_fresh("specdec_train.distill.gpu_feature_run", args)
    return json.loads((work / "gpu-feature" / "metrics.json").read_text()), loaded, stdout


def test_dry_run_writes_a_served_feature_draft_and_a_rerun_resumes(tiny, tmp_path):
    from specdec.modeling.model import load_model_dir

    m1, loaded, _ = _dry_run(tmp_path, tiny / "target", tiny / "draft", "--max-steps", "2")
    assert loaded == [], f"the run imported what a bare GPU machine lacks: {loaded}"
    assert m1["train"]["steps"] == 2 and m1["generate"]["rows"] > 0
    for when in ("plain", "before", "after"):
        pooled = m1[when]["pooled"]
        assert 0 <= pooled["known"] <= 1 and pooled["positions"] > 0 and pooled["sd4_tokens_per_forward"] >= 1
        assert len(pooled["depth"]) == 6 and m1[when]["online"]["positions"] > 0
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"README.md", "metrics.json", "log.txt", "train_prompts.jsonl.gz", "draft.tar.part-00"} <= names
    back = unpack_draft(out, tmp_path, "feature_draft")
    assert "Greedy agreement" in (back / "README.md").read_text()
    served = load_model_dir(back, dtype=torch.float32, role="draft", quant="none")
    assert served.config.feature_size == 64 and served.lm_head.out_features == 8192  # the compact head, as served
    logits, _ = served(torch.tensor([[1, 504, 3458]]), torch.arange(3)[None], torch.tensor([0]),
                       served.new_kv_slots(1, 8), features=torch.zeros(1, 3, 64))
    assert logits.shape == (1, 3, FULL_VOCAB)
    m2, _, _ = _dry_run(tmp_path, tiny / "target", tiny / "draft", "--max-steps", "4")
    log = (tmp_path / "gpu-feature" / "log.txt").read_text()
    assert "resumed at step 2" in log and "kept the text of the earlier run" in log
    assert m2["train"]["steps"] == 4 and m2["generate"] == m1["generate"]


@pytest.mark.slow
def test_dry_run_with_the_default_target(tmp_path):
    """The dry run as a user runs it: the default target, the shipped draft as the initial draft."""
    from specdec.modeling.hub import resolve_model

    m, loaded, _ = _dry_run(tmp_path, resolve_model("default-target"), INIT_DRAFT, "--max-steps", "2")
    assert loaded == [] and m["train"]["steps"] == 2 and m["plain"]["pooled"]["known"] > 0.3
