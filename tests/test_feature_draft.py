"""Feature drafts (EAGLE-style, docs/design/feature_draft.md): the draft reads the target's hidden states.

The features only steer the draft: outputs stay exactly the target's (greedy equality, chi-square against the
exact distribution), the target returns the features of exactly the positions a call committed, and a draft
that got its features late (re-fed) ends in the same state as one that had them from the start.
"""
import itertools
import os
from collections import Counter

import pytest
import torch

from specdec.common.errors import InvalidRequestError
from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
from specdec.state.feature_state import TargetFeatures
from specdec.workers.draft import DraftWorker
from specdec.workers.target import TargetWorker
from tests.helpers_models import build_tiny_model

PROMPT = [3, 1, 4, 1, 5]


def _pair(vocab=32, draft_seed=2):
    target = build_tiny_model(vocab_size=vocab, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=vocab, seed=draft_seed, num_layers=1, logit_scale=2.0, feature_size=32)
    return target, draft


@torch.no_grad()
def _target_features(target, ids):
    kv = target.new_kv_slots(1, 64)
    _, h = target(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), kv)
    return h[0]


@pytest.mark.parametrize("mode", ["sd", "pearl", "pacer", "pacer_pearl"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_equals_target_only(mode, gamma):
    target, draft = _pair()
    pv = build_random_preverifier(hidden_size=32, seed=3, block_size=1)
    eng = Engine(target, draft, preverifier=pv)
    assert eng.draft.reads_features
    ref = eng.generate(GenerationRequest(PROMPT, 30, mode="ar")).token_ids
    out = eng.generate(GenerationRequest(PROMPT, 30, mode=mode, gamma=gamma))
    assert out.token_ids == ref
    eng.close()


def test_target_returns_features_of_committed_positions():
    target, _ = _pair()
    tw = TargetWorker(target)
    prompt = PROMPT + [7, 8]
    f0 = tw.start_session("s", prompt, SamplingParams(), want_features=True)
    ref = _target_features(target, prompt + [9, 10, 11])
    assert f0.start == 0 and len(f0) == len(prompt) - 1
    torch.testing.assert_close(f0.rows, ref[:len(prompt) - 1])
    nxt = int(target(torch.tensor([prompt]), torch.arange(len(prompt))[None], torch.tensor([0]),
                     target.new_kv_slots(1, 64))[0][0, -1].argmax())
    out = tw.verify("s", len(prompt) - 1, [prompt[-1]], [nxt, 10], None, "greedy")
    assert out.num_accepted >= 1
    assert out.features.start == len(prompt) - 1 and len(out.features) == 1 + out.num_accepted
    torch.testing.assert_close(out.features.rows[:1], ref[len(prompt) - 1:len(prompt)], atol=1e-5, rtol=1e-5)
    tw2 = TargetWorker(target)  # a session that did not ask gets none
    assert tw2.start_session("s", prompt, SamplingParams()) is None
    assert tw2.verify("s", len(prompt) - 1, [prompt[-1]], [], None, "greedy").features is None


def test_late_features_refeed_to_the_same_state():
    """Draft on guesses, then get the target's features: the draft re-feeds and drafts exactly what a draft
    that had them all along drafts."""
    target, draft = _pair()
    seq = PROMPT + [6, 2, 9, 4]
    feats = _target_features(target, seq)
    late, early = DraftWorker(draft), DraftWorker(draft)
    late.start_session("a", PROMPT, SamplingParams())  # no features: guesses for the whole prompt
    late.draft("a", len(PROMPT) - 1, [PROMPT[-1]], 3)
    got = late.draft("a", len(PROMPT) - 1, seq[len(PROMPT) - 1:], 4,
                     features=[TargetFeatures(0, feats[:len(seq) - 1])])
    early.start_session("b", PROMPT, SamplingParams(), features=[TargetFeatures(0, feats[:len(PROMPT) - 1])])
    want = early.draft("b", len(PROMPT) - 1, seq[len(PROMPT) - 1:], 4,
                       features=[TargetFeatures(len(PROMPT) - 1, feats[len(PROMPT) - 1:len(seq) - 1])])
    assert got.tokens == want.tokens
    sa, sb = late.sessions["a"], early.sessions["b"]
    n = len(seq) - 1
    assert bool(sa.feats.fed_true[:n].all()) and bool(sb.feats.fed_true[:n].all())
    for layer in range(draft.config.num_hidden_layers):
        torch.testing.assert_close(late.kv.k[layer][sa.slot, :n], early.kv.k[layer][sb.slot, :n])
        torch.testing.assert_close(late.kv.v[layer][sa.slot, :n], early.kv.v[layer][sb.slot, :n])


def test_a_refeed_cancelled_before_its_forward_keeps_the_session():
    """Features that arrive with a call make it re-feed older positions. If the call is cancelled before its first
    forward (PEARL cuts a post-verify draft as soon as the verify returns), the session must still hold every
    position its caller assumes: a draft truncated to the re-feed point left it short (FAILED_PRECONDITION on
    the next call, seen under load in the coordinator's tests)."""
    target, draft = _pair()
    seq = PROMPT + [6, 2, 9, 4]
    feats = _target_features(target, seq)
    dw = DraftWorker(draft)
    dw.start_session("a", PROMPT, SamplingParams())  # no features: the prompt is fed with guesses
    base = len(PROMPT) - 1
    call = dw.begin("a", base, [PROMPT[-1]], 3, features=[TargetFeatures(0, feats[:base])])
    assert call.pos < base  # the call will re-feed
    dw.cancel("a")
    blocks = dw.advance([call])[0]
    assert call.done and blocks[-1].stop_reason == "cancelled" and not blocks[-1].tokens
    assert len(dw.sessions["a"].tokens) == base  # what the caller assumes the draft holds
    assert dw.draft("a", base, [PROMPT[-1]], 2).tokens  # and the next call is served


def test_bad_features_are_refused():
    _, draft = _pair()
    dw = DraftWorker(draft, max_context=64)
    dw.start_session("s", PROMPT, SamplingParams())
    with pytest.raises(InvalidRequestError, match="features"):
        dw.draft("s", 4, [5], 2, features=[TargetFeatures(0, torch.zeros(3, 7))])
    with pytest.raises(InvalidRequestError, match="outside the context"):
        dw.draft("s", 4, [5], 2, features=[TargetFeatures(500, torch.zeros(3, 32))])


def test_sampling_matches_exact_target_distribution():
    """T = 1, 3 tokens, vocabulary 8: chi-square of seeded sd/pearl runs against the exact distribution."""
    from tests.test_exactness import chi_square_pvalue

    target, draft = _pair(vocab=8, draft_seed=5)
    params = SamplingParams(temperature=1.0)
    prompt = [1, 5, 2]

    @torch.no_grad()
    def cond(prefix):
        lg, _ = target(torch.tensor([prefix]), torch.arange(len(prefix))[None], torch.tensor([0]),
                       target.new_kv_slots(1, 16))
        return logits_to_probs(lg[0, -1], params).double()

    exact = {}
    for seq in itertools.product(range(8), repeat=3):
        p = 1.0
        for i in range(3):
            p *= float(cond(prompt + list(seq[:i]))[seq[i]])
        exact[seq] = p
    eng = Engine(target, draft, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_FEATURE", "2000"))
    for mode in ("sd", "pearl"):
        counts = Counter(tuple(eng.generate(GenerationRequest(prompt, 3, params=SamplingParams(temperature=1.0,
                                                                                               seed=s),
                                                              mode=mode, gamma=2)).token_ids) for s in range(n))
        assert chi_square_pvalue(counts, exact, n) > 0.001, mode
    eng.close()


def test_training_forward_matches_serving_and_warm_start_equals_plain():
    from specdec_train.distill.feature_train import build_feature_draft, feature_loss, train_forward

    plain = build_tiny_model(vocab_size=32, seed=4)
    m = build_feature_draft(plain, feature_size=16, feature_scale=0.5)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    feats = torch.randn(1, 8, 16)
    pos, slot = torch.arange(8)[None], torch.tensor([0])
    # fc = [I | 0]: the warm-started feature draft drafts exactly like the plain draft, whatever the features
    ref, _ = plain(ids, pos, slot, plain.new_kv_slots(1, 16))
    got, _ = m(ids, pos, slot, m.new_kv_slots(1, 16), features=feats)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        m.fc.weight[:, 32:].normal_(0, 0.3)
    _, served = m(ids, pos, slot, m.new_kv_slots(1, 16), features=feats)
    trained = train_forward(m, ids, feats)
    torch.testing.assert_close(trained, served, atol=1e-5, rtol=1e-5)
    loss = feature_loss(m, m.lm_head.weight.detach(), trained, served, torch.ones(1, 8, dtype=torch.bool))
    loss.backward()
    assert m.fc.weight.grad is not None and float(m.fc.weight.grad[:, 32:].abs().sum()) > 0


def test_feature_pipeline_runs_and_resumes(tmp_path):
    """run_features -> train_feature_draft (checkpoint, resume) -> feature_agreement, on tiny models."""
    from specdec_train.distill.feature_train import (build_feature_draft, feature_agreement, load_features, run_features,
                                               train_feature_draft)

    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    rows = [{"prompt_ids": [1, 2, 3, i % 7 + 4], "completion_ids": [5, 6, i % 5 + 7, 9, 10], "temperature": 0.0}
            for i in range(12)]
    run_features(target, rows, tmp_path / "features", shard_size=5, progress=False)
    feats = load_features(tmp_path / "features")
    assert len(feats) == 12 and feats[0]["feat"].shape == (9, 32) and len(list((tmp_path / "features").glob("*.pt"))) == 3
    m = build_feature_draft(build_tiny_model(vocab_size=32, seed=2), feature_size=32, feature_scale=0.5)
    m.to_compact = torch.arange(32)  # no vocabulary subset: identity maps
    m.vocab_subset = torch.arange(32)
    head = target.lm_head.weight.detach().to(torch.bfloat16)
    before = feature_agreement(m, feats, m.to_compact, m.vocab_subset)["agreement"]
    out = train_feature_draft(m, head, feats, tmp_path / "run", steps=3, batch_size=4, ckpt_every=2, progress=False,
                              log=lambda *_: None)
    assert out["steps"] == 3 and (tmp_path / "run" / "ckpt.pt").exists()
    again = train_feature_draft(m, head, feats, tmp_path / "run", steps=5, batch_size=4, progress=False,
                                log=lambda *_: None)
    assert again["steps"] == 5  # resumed at 3, ran 2 more
    assert 0.0 <= feature_agreement(m, feats, m.to_compact, m.vocab_subset)["agreement"] <= 1.0 and 0 <= before <= 1
