"""A compact-head draft (one head row per vocabulary-subset entry, docs/design/distillation.md) drafts from its
compact logits (`CausalLM.forward(compact_logits=True)`), never expanding a full-vocabulary row per token: it must
propose exactly the tokens the full row gives, and decoding with it stays the target's."""
import pytest
import torch

from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.modeling.model import CausalLM
from specdec.scheduling.request import GenerationRequest
from specdec.workers.draft import DraftWorker
from tests.helpers_models import build_tiny_model, target_greedy

VOCAB = 32
PROMPT = [3, 1, 4, 1, 5]


def compact_draft(seed: int = 2) -> CausalLM:
    base = build_tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=1, seed=seed, logit_scale=2.0)
    subset = torch.tensor(sorted(set(PROMPT) | set(range(0, VOCAB, 2))))  # sorted, as the pipeline writes it
    model = CausalLM(base.config, vocab_subset=subset)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.6)
    return model.eval()


def test_compact_logits_are_the_subset_of_the_full_row():
    m = compact_draft()
    kv, slots = m.new_kv_slots(1, 16), torch.tensor([0])
    full, _ = m(torch.tensor([PROMPT]), torch.arange(5)[None], slots, kv)
    compact, _ = m(torch.tensor([PROMPT]), torch.arange(5)[None], slots, kv, compact_logits=True)
    assert compact.shape[-1] == len(m.vocab_subset)
    assert torch.equal(m.expand_logits(compact), full)
    assert torch.isinf(full[..., [t for t in range(VOCAB) if t not in m.vocab_subset.tolist()]]).all()


def test_greedy_drafts_are_the_full_rows_argmax():
    m = compact_draft()
    worker = DraftWorker(m, max_sessions=1, max_context=64)
    worker.start_session("s", PROMPT, SamplingParams(temperature=0.0))
    block = worker.draft("s", len(PROMPT) - 1, [PROMPT[-1]], 8)
    assert block.tokens == target_greedy(m, PROMPT, 8)  # full logits, argmax per step
    assert set(block.tokens) <= set(m.vocab_subset.tolist())


@pytest.mark.parametrize("mode", ["sd", "pearl"])
def test_decoding_with_a_compact_draft_is_the_targets(mode):
    target = build_tiny_model(vocab_size=VOCAB, seed=1, logit_scale=2.0)
    engine = Engine(target, compact_draft(), max_sessions=2, max_context=64)
    try:
        r = engine.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=24, mode=mode, gamma=4,
                                              params=SamplingParams(temperature=0.0)))
        assert r.token_ids == target_greedy(target, PROMPT, 24)
        assert r.stats.draft_tokens > 0
        # sampled drafting expands the row before sampling: q lives on the subset, ids in the full vocabulary
        r = engine.generate(GenerationRequest(prompt_ids=PROMPT, max_new_tokens=12, mode=mode, gamma=4,
                                              params=SamplingParams(temperature=1.0, seed=3)))
        assert len(r.token_ids) == 12
    finally:
        engine.close()
