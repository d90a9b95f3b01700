import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec_train.distill.bench import cost_ratio, per_token_decode_s
from specdec_train.distill.data import is_heldout, split
from specdec_train.distill.draft_model import (FullVocabDraft, build_from_target, frequency_subset, full_to_compact_map,
                                         load_draft, save_draft)
from specdec_train.distill.evaluate import greedy_agreement
from specdec_train.distill.teacher import run_teacher, teacher_topk
from specdec_train.distill.train import train

V = 96


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def rows(target):
    rng = random.Random(0)
    out = []
    for i in range(40):
        p = [1] + [rng.randrange(3, V // 2) for _ in range(rng.randrange(3, 8))]
        with torch.no_grad():
            g = target.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        out.append({"prompt_ids": p, "completion_ids": g[0, len(p):].tolist(), "temperature": 0.0})
    return out


def test_split_is_by_prompt(rows):
    tr, he = split(rows + rows, frac=0.3)
    keys = {json.dumps(r["prompt_ids"]) for r in he}
    assert not any(json.dumps(r["prompt_ids"]) in keys for r in tr)
    assert all(is_heldout(r, 0.3) for r in he)


def test_subset_and_roundtrip(tmp_path, target, rows):
    torch.set_num_threads(1)
    subset = frequency_subset(rows, 40)
    assert len(subset) == 40 and {0, 1, 2} <= set(subset.tolist())
    assert torch.all(subset[1:] > subset[:-1])
    oov = int((subset == 0).nonzero()[0, 0])
    m = full_to_compact_map(subset, V, oov)
    assert torch.equal(subset[m[subset]], subset)
    draft = build_from_target(target, subset, layers=(0, 2)).eval()
    assert draft.config.vocab_size == 40 and draft.config.num_hidden_layers == 2
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight[subset])
    save_draft(draft, subset, tmp_path / "d", full_vocab=V, dtype=torch.float32)
    loaded = load_draft(tmp_path / "d")
    assert isinstance(loaded, FullVocabDraft)
    x = torch.tensor([[1, 5, 7, 90, 3]])
    with torch.no_grad():
        full = loaded(input_ids=x).logits
        comp = draft(input_ids=m[x]).logits
    assert full.shape == (1, 5, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[subset] = False
    assert torch.isinf(full[..., outside]).all() and (full[..., outside] < 0).all()
    torch.testing.assert_close(full[..., subset], comp)
    assert torch.equal(subset[comp.argmax(-1)], full.argmax(-1))
    # agreement computed through the wrapper (full ids) equals the compact computation
    a1 = greedy_agreement(loaded, rows[:8], None, None)
    a2 = greedy_agreement(draft, rows[:8], subset, m)
    assert a1 == a2 and 0 <= a1["agreement"] <= 1
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["specdec_vocab_subset"] == "vocab_subset.safetensors" and cfg["tie_word_embeddings"] is False


def test_teacher_topk_matches_full_forward(target, rows):
    res = teacher_topk(target, rows[:5], k=4, batch_size=3)
    for r, t in zip(rows[:5], res):
        x = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(target(x).logits[0], -1)
        P, C = len(r["prompt_ids"]), len(r["completion_ids"])
        assert t["idx"].shape == (C, 4)
        torch.testing.assert_close(t["logp"].float(), lp[P - 1:P - 1 + C].topk(4).values, atol=2e-2, rtol=0)


def test_train_resume_and_improves(tmp_path, target, rows):
    torch.set_num_threads(1)
    run_teacher_dir = tmp_path / "teacher"
    # run_teacher loads from a directory: save the tiny target
    target.save_pretrained(tmp_path / "tgt")
    run_teacher(tmp_path / "tgt", rows, run_teacher_dir, k=8, shard_size=16, progress=False)
    assert len(list(run_teacher_dir.glob("shard_*.pt"))) == 3
    subset = frequency_subset(rows, 64)
    oov = int((subset == 0).nonzero()[0, 0])
    m = full_to_compact_map(subset, V, oov)
    torch.manual_seed(0)
    draft = build_from_target(target, subset, layers=(0,), copy_layers=False)
    with torch.no_grad():  # start far from the target so that learning is visible
        for p in draft.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.02)
    before = greedy_agreement(draft.eval(), rows, subset, m)["agreement"]
    res = train(draft, rows, run_teacher_dir, m, oov, tmp_path / "run", steps=30, batch_size=8, lr=3e-3,
                k_soft=8, ckpt_every=10, progress=False, bf16=False, log=lambda *_: None)
    assert res["soft_rows"] == len(rows) and res["steps"] == 30
    after = greedy_agreement(draft, rows, subset, m)["agreement"]
    assert after > before
    # resume: a finished run does no more steps
    res2 = train(draft, rows, run_teacher_dir, m, oov, tmp_path / "run", steps=30, progress=False, bf16=False,
                 log=lambda *_: None)
    assert res2["steps"] == 30


def test_cost_measure(target):
    t = per_token_decode_s(target, prompt_len=4, steps=3, repeats=2)
    assert t > 0
    r = cost_ratio(target, target, rounds=1, prompt_len=4, steps=2, repeats=1)
    assert r["ratio"] > 0 and r["threads"] == 1


def test_fp16_storage_loads_as_fp32(tmp_path, target, rows):
    subset = frequency_subset(rows, 40)
    draft = build_from_target(target, subset, layers=(1,)).eval()
    save_draft(draft, subset, tmp_path / "d", full_vocab=V)  # default: float16 on disk
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
        assert f.get_tensor("lm_head.weight").shape == (40, 32)
    loaded = load_draft(tmp_path / "d")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    with torch.no_grad():
        out = loaded(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert out.logits.shape == (1, 3, V) and out.past_key_values is not None


def test_top1_term_is_the_argmax_cross_entropy():
    from specdec_train.distill.train import kd_loss
    torch.manual_seed(0)
    logits = torch.randn(1, 3, 10)
    sidx = torch.tensor([[[4, 1], [2, 7], [0, 3]]])
    sp = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.0, 1.0]]])  # row 2: the target's top-1 is outside the subset
    smask = torch.ones(1, 3, dtype=torch.bool)
    hard = torch.full((1, 3), -100)
    base, _, _ = kd_loss(logits, hard, sidx, sp, smask)
    with_top1, _, _ = kd_loss(logits, hard, sidx, sp, smask, top1_weight=0.5)
    logq = torch.log_softmax(logits, -1)[0]
    extra = -(logq[0, 4] + logq[1, 2]) * 0.5 / 3  # row 2 adds nothing
    assert torch.allclose(with_top1 - base, extra, atol=1e-6)


def test_served_cost_measures_specdec_models():
    from specdec_train.distill.bench import served_cost_ratio
    from tests.helpers_models import build_tiny_model

    big, small = build_tiny_model(vocab_size=64, hidden_size=64, num_layers=4), build_tiny_model(vocab_size=64)
    r = served_cost_ratio(small, big, rounds=3, context=16, steps=4)
    assert r["draft_ms"] > 0 and r["target_ms"] > 0 and r["ratio"] == pytest.approx(r["draft_ms"] / r["target_ms"])
    assert r["draft_weights"] == "none" and r["draft_dtype"] == "float32"


def test_warm_start_grows_depth_as_identity(target, rows):
    """A deeper draft warm-started from a shallower checkpoint computes exactly the checkpoint's function at step 0,
    and its added layers still learn (their zeroed output projections get gradients)."""
    from specdec_train.distill.train import warm_start

    subset = frequency_subset(rows, 48)
    torch.manual_seed(0)
    small = build_from_target(target, subset, (0,))
    torch.nn.init.normal_(small.model.layers[0].mlp.down_proj.weight, std=0.05)
    deep = build_from_target(target, subset, (0, 1))
    assert warm_start(deep, small.state_dict()) == [1]
    x = torch.randint(0, len(subset), (2, 9))
    torch.testing.assert_close(deep(input_ids=x).logits, small(input_ids=x).logits, rtol=0, atol=1e-6)
    deep(input_ids=x).logits.logsumexp(-1).sum().backward()
    assert deep.model.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="shallower"):
        warm_start(build_from_target(target, subset, (0,)), deep.state_dict())


def test_code_prompts_leave_out_the_benchmark_tasks():
    """`generate --style code/chatcode`: stubs never use an excluded (HumanEval) function name; chatcode asks for
    the same stubs in a user turn."""
    import random

    from specdec_train.distill.code_prompts import ASKS, TASKS, chat_code_prompts, code_prompts

    banned = {TASKS[0][0], TASKS[1][0]}
    stubs = code_prompts(random.Random(0), 200, banned)
    assert all(f"def {name}(" not in s for s in stubs for name in banned)
    turns = chat_code_prompts(random.Random(0), 50, banned)
    assert all(any(t.startswith(a) for a in ASKS) and "def " in t for t in turns)
    assert all(f"def {name}(" not in t for t in turns for name in banned)
