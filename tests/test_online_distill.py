"""Online distillation (specdec_train/distill/online.py): the loss, the batches, resumable training, the text it writes,
and tied compact-vocabulary drafts as both loaders read them."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdec.modeling.model import load_model_dir
from specdec_train.distill.data import is_heldout
from specdec_train.distill.draft_model import build_from_target, full_to_compact_map, load_draft, save_draft
from specdec_train.distill.generate import self_instruct
from specdec_train.distill.online import batch_tensors, distill, generate_rows, load_draft_weights, subset_kl
from tests.helpers_models import save_tiny_tokenizer

V = 32


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def subset():
    return torch.tensor([0, 1, 2] + list(range(4, V, 2)))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    t = PreTrainedTokenizerFast.from_pretrained(str(d))
    t.chat_template = ("{% for m in messages %}u {{ m['content'] }}.{% endfor %}"
                       "{% if add_generation_prompt %} a {% endif %}")
    t.pad_token, t.eos_token, t.padding_side = "<unk>", "!", "left"
    return t


def test_subset_kl_is_the_restricted_forward_kl(subset):
    torch.manual_seed(1)
    tl, dl = torch.randn(2, 5, V), torch.randn(2, 5, len(subset))
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    kl, agree = subset_kl(dl, tl, subset, mask)
    p = tl[mask][:, subset].softmax(-1)
    q = dl[mask].softmax(-1)
    torch.testing.assert_close(kl, (p * (p.log() - q.log())).sum(-1).mean())
    assert agree == (subset[q.argmax(-1)] == tl[mask].argmax(-1)).float().mean()
    zero, _ = subset_kl(tl[..., subset].clone(), tl, subset, mask)  # the draft equal to p_S: no loss
    assert abs(zero.item()) < 1e-6


def test_batch_marks_exactly_the_positions_that_predict_completion_tokens(subset):
    to_c = full_to_compact_map(subset, V, 0)
    rows = [{"prompt_ids": [1, 5, 7], "completion_ids": [9, 3]}, {"prompt_ids": [4], "completion_ids": [6, 8, 10]}]
    ids, cids, mask = batch_tensors(rows, to_c, "cpu")
    assert ids.tolist() == [[1, 5, 7, 9, 3], [4, 6, 8, 10, 0]]
    assert mask.tolist() == [[False, False, True, True, False], [True, True, True, False, False]]
    assert torch.equal(cids, to_c[ids]) and cids[0, 4] == 0  # 3 is outside the subset: the OOV row


def test_distill_lowers_the_loss_and_resumes(tmp_path, target, subset):
    torch.manual_seed(0)
    rows = []
    for i in range(24):
        p = torch.randint(3, V, (4,)).tolist()
        g = target.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        rows.append({"prompt_ids": p, "completion_ids": g[0, 4:].tolist(), "temperature": 0.0})
    to_c = full_to_compact_map(subset, V, 0)
    draft = build_from_target(target, subset, (0,), tie=True)
    ids, cids, mask = batch_tensors(rows, to_c, "cpu")

    def loss():
        with torch.no_grad():
            return subset_kl(draft(input_ids=cids).logits, target(input_ids=ids).logits, subset, mask)[0].item()

    before = loss()
    kw = dict(batch_size=8, lr=3e-3, warmup=2, seed=0, time_budget_s=None, ckpt_every=5, log=lambda m: None)
    res = distill(target, draft, subset, to_c, rows, tmp_path, steps=10, **kw)
    assert res["steps"] == 10 and loss() < before
    # a rerun with more steps resumes from the checkpoint rather than starting over
    res = distill(target, draft, subset, to_c, rows, tmp_path, steps=12, **kw)
    assert res["steps"] == 12 and torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 12


def test_tied_compact_draft_saves_once_and_loads_alike(tmp_path, target, subset):
    draft = build_from_target(target, subset, (0, 2), tie=True).eval()
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()
    save_draft(draft, subset, tmp_path / "d", full_vocab=V, dtype=torch.float32)
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(tmp_path / "d" / "model.safetensors"))
    assert json.loads((tmp_path / "d" / "config.json").read_text())["tie_word_embeddings"] is True
    hf = load_draft(tmp_path / "d")
    ours = load_model_dir(tmp_path / "d", dtype="float32", role="draft", quant="none")
    x = torch.tensor([[1, 5, 7, 9, 3, 30]])
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        kv = ours.new_kv_slots(1, 16)
        got, _ = ours(x, torch.arange(6)[None], torch.tensor([0]), kv)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.isinf(got[..., 3]).all()  # outside the subset
    # a warm start (online --init-draft) reads the same directory back into a fresh draft of the same shape
    fresh = build_from_target(target, subset, (1, 2), tie=True).eval()
    load_draft_weights(fresh, tmp_path / "d")
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=x.clamp(max=len(subset) - 1)).logits,
                                   draft(input_ids=x.clamp(max=len(subset) - 1)).logits)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="does not fit"):
        load_draft_weights(build_from_target(target, subset, (0,), tie=True), tmp_path / "d")
    # a shallower warm start keeps the picked layers (here the saved draft's layer 1 as layer 0)
    one = build_from_target(target, subset, (0,), tie=True).eval()
    load_draft_weights(one, tmp_path / "d", layers=(1,))
    torch.testing.assert_close(one.model.layers[0].mlp.up_proj.weight, draft.model.layers[1].mlp.up_proj.weight)
    torch.testing.assert_close(one.model.embed_tokens.weight, draft.model.embed_tokens.weight)
    torch.testing.assert_close(one.model.norm.weight, draft.model.norm.weight)


def test_generated_rows_skip_heldout_and_banned_prompts(tmp_path, target, tok):
    out = tmp_path / "data.jsonl"
    n = generate_rows(target, tok, out, seconds=0.5, batch_size=6, max_new_tokens=5, seed=0,
                      mix={"template": 1.0, "self": 1.0}, temperatures=(0.0, 1.0), banned_prompts=set(),
                      banned_code=set(), log=lambda m: None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and n == sum(len(r["completion_ids"]) for r in rows)
    assert not any(is_heldout(r) for r in rows)
    assert {r["source"] for r in rows} <= {"template", "self"} and {r["temperature"] for r in rows} <= {0.0, 1.0}
    for r in rows[:3]:
        assert tok.decode(r["prompt_ids"]).startswith("u ")  # chat-templated
    banned = {tuple(r["prompt_ids"]) for r in rows}
    out2, held = tmp_path / "data2.jsonl", tmp_path / "heldout.jsonl"
    generate_rows(target, tok, out2, seconds=3, batch_size=16, max_new_tokens=5, seed=0, mix={"template": 1.0},
                  temperatures=(0.0, 1.0), banned_prompts=banned, banned_code=set(), heldout_path=held,
                  log=lambda m: None)
    assert not any(tuple(json.loads(line)["prompt_ids"]) in banned for line in out2.read_text().splitlines())
    # the held-out split's greedy rows become a held-out set of the same text, never training rows
    held_rows = [json.loads(line) for line in held.read_text().splitlines()]
    assert held_rows and all(is_heldout(r) and r["temperature"] == 0.0 for r in held_rows)
    assert not any(tuple(r["prompt_ids"]) in banned for r in held_rows)


def test_self_instruct_keeps_finished_user_turns(tok):
    class Sampler(torch.nn.Module):  # stands in for the target: fixed "samples" after the user header
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, **kw):
            assert kw["eos_token_id"] == tok.eos_token_id and kw["do_sample"]
            n = input_ids.shape[1]
            assert tok.decode(input_ids[0]) == "u "  # the template's text before the user's content
            tails = ["how do tides work?! a", "no end here", "hi!", "why is the sky blue!"]
            rows = [input_ids[0].tolist() + tok(t)["input_ids"] for t in tails]
            L = max(map(len, rows))
            assert all(len(r) > n for r in rows)
            return torch.tensor([r + [tok.pad_token_id] * (L - len(r)) for r in rows])

    got = self_instruct(Sampler(), tok, 4, min_chars=5)
    assert got == ["how do tides work?", "why is the sky blue"]  # unfinished and too short ones dropped
