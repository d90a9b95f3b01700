"""PACER pre-verifier: API, save/load + draft check, exactness with a random pre-verifier in the loop, and a smoke
run of the training pipeline on tiny random models."""
from __future__ import annotations

import itertools
import json
import warnings

import pytest
import torch

from specdec.decoding.stop import make_stop_rule
from specdec.engine import Engine
from specdec.decoding.preverifier import (DEFAULT_PREVERIFIER_DIR, Preverifier, PreverifierMismatchError,
                                 build_random_preverifier, derive_threshold, draft_fingerprint, load_preverifier,
                                 save_preverifier)
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.decoding.stop import DraftFeatures, PreverifierStop, StopSpec
from specdec.scheduling.request import GenerationRequest
from tests.helpers_models import build_tiny_model

torch.set_num_threads(1)


def _features(n=6, d=32, block_start=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return DraftFeatures(hidden=torch.randn(n, d, generator=g), tokens=torch.randint(0, 32, (n,), generator=g),
                         logq=-torch.rand(n, generator=g), entropy=torch.rand(n, generator=g),
                         block_start=block_start, margin=torch.rand(n, generator=g) * 3)


def test_block_accept_prob_is_a_probability_and_block_local():
    pv = build_random_preverifier(32, seed=1)
    f = _features()
    s = pv.block_accept_prob(f)
    assert 0.0 <= s <= 1.0
    # "block" mode: the product over the block's tokens only; "prefix": over the whole round (never larger)
    pv.score_mode = "prefix"
    assert pv.block_accept_prob(f) <= s + 1e-7
    assert isinstance(pv.threshold, float) and isinstance(pv.block_size, int)


@pytest.mark.parametrize("mode", ["block", "prefix"])
@pytest.mark.parametrize("head,lite", [(False, False), (True, False), (False, True)])
def test_round_scorer_equals_the_full_block_score(mode, head, lite):
    """The stop rule's incremental scorer gives block_accept_prob's score at every block boundary of a round,
    also when one scorer sees a second round (it starts over). lite: no hidden state, the margin scalar."""
    draft = build_tiny_model(hidden_size=32, seed=3) if head else None
    pv = build_random_preverifier(32, seed=5, draft_model=draft, use_hidden=not lite, use_margin=lite)
    pv.score_mode = mode
    scorer = pv.round_scorer()
    for rnd, (n, B) in enumerate([(7, 2), (5, 1), (9, 3)]):
        full = _features(n=n, block_start=0, seed=10 + rnd)
        for end in range(B, n + 1, B):
            f = DraftFeatures(full.hidden[:end], full.tokens[:end], full.logq[:end], full.entropy[:end],
                              block_start=end - B, margin=full.margin[:end])
            assert scorer.score(f) == pytest.approx(pv.block_accept_prob(f), rel=1e-5, abs=1e-7)
    with torch.no_grad():  # a parameter changed in place (training): the folded weights follow
        for q in pv.parameters():
            q.mul_(0.7)
    f = _features(n=4, block_start=0, seed=30)
    assert scorer.score(f) == pytest.approx(pv.block_accept_prob(f), rel=1e-5, abs=1e-7)


def test_scalar_rows_equal_token_scalars():
    from specdec.decoding.preverifier import token_scalars
    from specdec.decoding.round_scorer import scalar_row

    g = torch.Generator().manual_seed(0)
    logq = -torch.rand(9, generator=g) * 5
    logq[3] = -80.0  # clamped at -30
    entropy = torch.rand(9, generator=g) * 3
    margin = torch.rand(9, generator=g) * 40  # clamped at 30
    for m in (None, margin):
        table = token_scalars(logq, entropy, m)
        for t in range(9):
            row = scalar_row(logq.tolist(), entropy.tolist(), t, None if m is None else m.tolist())
            assert row == pytest.approx(table[t].tolist(), rel=1e-5, abs=1e-6)


def test_stop_rule_uses_the_preverifier_threshold():
    pv = build_random_preverifier(32, seed=2, threshold=0.37)
    rule = make_stop_rule(StopSpec("pacer"), pv)
    assert isinstance(rule, PreverifierStop) and rule.threshold == pytest.approx(0.37)
    assert make_stop_rule(StopSpec("pacer", 0.9), pv).threshold == 0.9


def test_head_statistics_need_the_draft():
    draft = build_tiny_model(hidden_size=32, seed=3)
    pv = build_random_preverifier(32, seed=1, draft_model=draft)
    f = _features()
    assert 0.0 <= pv.block_accept_prob(f) <= 1.0
    object.__setattr__(pv, "_draft", None)
    with pytest.raises(RuntimeError, match="draft_model"):
        pv.block_accept_prob(f)


def test_save_load_roundtrip_and_draft_check(tmp_path):
    draft = build_tiny_model(hidden_size=32, seed=3)
    other = build_tiny_model(hidden_size=32, seed=4)
    pv = build_random_preverifier(32, seed=5, block_size=3, threshold=0.42)
    save_preverifier(pv, tmp_path / "pv", {"draft_fingerprint": draft_fingerprint(draft), "note": "test"})
    assert json.loads((tmp_path / "pv" / "card.json").read_text())["note"] == "test"
    back = load_preverifier(tmp_path / "pv", draft_model=draft)
    assert back.block_size == 3 and back.threshold == pytest.approx(0.42)
    f = _features()
    assert back.block_accept_prob(f) == pytest.approx(pv.block_accept_prob(f), abs=1e-6)
    with pytest.warns(RuntimeWarning, match="another draft"):
        load_preverifier(tmp_path / "pv", draft_model=other)
    import copy
    import warnings

    with warnings.catch_warnings():  # the same draft served in another dtype (a GPU's bf16) is the same draft
        warnings.simplefilter("error")
        load_preverifier(tmp_path / "pv", draft_model=copy.deepcopy(draft).to(torch.bfloat16), strict=True)
    with pytest.raises(PreverifierMismatchError):
        load_preverifier(tmp_path / "pv", draft_model=other, strict=True)
    with pytest.raises(PreverifierMismatchError, match="hidden size"):
        load_preverifier(tmp_path / "pv", draft_model=build_tiny_model(hidden_size=64, seed=3))


def test_derived_threshold_falls_with_the_cost_ratio():
    assert derive_threshold(20, 3.0, 4) < derive_threshold(5, 3.0, 4) < 1.0


def test_derived_threshold_is_the_cost_models_value():
    """θ = τ (1 + slope/T_draft) / (a · (c + γ̄)), clipped to [0, 0.99], worked by hand. A mutation audit of session
    29 found that `(c + 1)` in place of `(c + γ̄)` passed every test (only the ordering was checked)."""
    assert derive_threshold(10, 2.0, 3.0) == pytest.approx(2.0 / (0.8 * 13))  # 0.19231
    assert derive_threshold(6, 1.5, 4, accept_rate=0.75, verify_slope_ratio=0.2) == pytest.approx(0.24)
    assert derive_threshold(0.5, 3.0, 1.0) == pytest.approx(0.99)  # 3 / (0.8 · 1.5) = 2.5, clipped


def _pair(vocab=32, hidden=32):
    target = build_tiny_model(vocab_size=vocab, hidden_size=hidden, seed=0, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=vocab, hidden_size=hidden, seed=0, num_layers=1, logit_scale=2.0)
    return target, draft


@pytest.mark.parametrize("block_size,threshold,head,lite", [(1, 0.5, False, False), (2, 0.3, True, False),
                                                            (3, 0.9, False, False), (1, 0.6, False, True)])
def test_greedy_pacer_with_random_preverifier_equals_ar(block_size, threshold, head, lite):
    target, draft = _pair()
    pv = build_random_preverifier(32, seed=7, block_size=block_size, threshold=threshold,
                                  draft_model=draft if head else None, use_hidden=not lite, use_margin=lite)
    eng = Engine(target, draft, preverifier=pv, max_sessions=2, max_context=128)
    stops = 0
    try:
        for i in range(4):
            prompt = torch.randint(0, 32, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()
            ar = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="ar"))
            for mode in ("pacer", "pacer_pearl"):
                out = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode=mode, gamma=8,
                                                     block_size=block_size))
                assert out.token_ids == ar.token_ids, (mode, i)
                stops += out.stats.draft_tokens
    finally:
        eng.close()
    assert stops > 0


def test_random_preverifier_actually_varies_the_draft_length():
    target, draft = _pair()
    pv = build_random_preverifier(32, seed=7, block_size=1, threshold=0.5)
    eng = Engine(target, draft, preverifier=pv, max_sessions=1, max_context=128)
    try:
        prompt = [1, 2, 3, 4, 5]
        lengths = set()
        for th in (0.0, 0.5, 1.0):
            r = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="pacer", gamma=6, block_size=1,
                                               pacer_threshold=th))
            lengths.add(r.stats.draft_tokens / r.stats.rounds)
    finally:
        eng.close()
    assert len(lengths) == 3  # threshold 0: always gamma_max; 1: one block (no prediction reaches 1); 0.5: between


def _exact_continuation_dist(model, prompt, vocab, n_new, params):
    """Enumerate every n_new-token continuation: exact P under the target at `params`."""
    from specdec.workers.target import TargetWorker

    probs = {}
    cache = {}

    def next_probs(prefix):
        key = tuple(prefix)
        if key not in cache:
            kv = model.new_kv_slots(1, 64)
            ids = torch.tensor([list(prompt) + list(prefix)])
            logits, _ = model(ids, torch.arange(ids.shape[1])[None], torch.tensor([0]), kv)
            cache[key] = logits_to_probs(logits[0, -1], params)
        return cache[key]

    for seq in itertools.product(range(vocab), repeat=n_new):
        p = 1.0
        for i in range(n_new):
            p *= float(next_probs(seq[:i])[seq[i]])
        probs[seq] = p
    del TargetWorker
    return probs


@pytest.mark.parametrize("method,lite", [("block", False), ("block", True)])
def test_sampled_pacer_with_random_preverifier_matches_target_distribution(method, lite):
    """Chi-square: 5,000 seeded pacer runs at T=1 (vocab 8, 3-token continuations) against the exact target."""
    from scipy.stats import chisquare

    V, n_new, runs = 8, 3, 5000
    target = build_tiny_model(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1, seed=11, logit_scale=1.5)
    draft = build_tiny_model(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1, seed=12, num_layers=1,
                             logit_scale=1.5)
    pv = build_random_preverifier(16, seed=13, block_size=1, threshold=0.5, use_hidden=not lite, use_margin=lite)
    prompt = [1, 5, 2]
    params = SamplingParams(temperature=1.0)
    exact = _exact_continuation_dist(target, prompt, V, n_new, params)
    eng = Engine(target, draft, preverifier=pv, max_sessions=1, max_context=32)
    counts = {k: 0 for k in exact}
    reasons = 0
    try:
        for seed in range(runs):
            r = eng.generate(GenerationRequest(prompt, max_new_tokens=n_new, mode="pacer", gamma=3, block_size=1,
                                               verify_method=method,
                                               params=SamplingParams(temperature=1.0, seed=seed)))
            counts[tuple(r.token_ids)] += 1
            reasons += r.stats.rounds
    finally:
        eng.close()
    # merge sparse cells so every expected count is >= 5
    keys = sorted(exact, key=lambda k: exact[k])
    obs, exp, acc_o, acc_e = [], [], 0, 0.0
    for k in keys:
        acc_o += counts[k]
        acc_e += exact[k] * runs
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o, acc_e = 0, 0.0
    if acc_e > 0:
        obs[-1] += acc_o
        exp[-1] += acc_e
    exp = [e * runs / sum(exp) for e in exp]  # the exact probabilities sum to 1 only up to float rounding
    stat, p = chisquare(obs, exp)
    assert p > 0.001, (stat, p, len(obs))
    assert sum(counts.values()) == runs


def test_training_pipeline_smoke_on_tiny_models(tmp_path):
    """collect → train → save → load → pacer mode runs; AUC is computed (tiny random pair: no quality bar)."""
    from specdec_train.preverifier import train as T
    from specdec_train.preverifier.collect import collect

    target, draft = _pair()
    prompts = [torch.randint(0, 32, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(12)]
    rounds, st = collect(draft, target, prompts, gamma_max=6, temperatures=(0.0, 1.0), max_new_tokens=20)
    assert st.rounds == len(rounds) > 0
    for r in rounds:
        assert r.hidden.shape == (6, 32) and r.label.shape == (6,)
        assert ((r.label >= 0) & (r.label <= 1)).all()
        if r.temperature == 0.0:  # greedy labels: the real verification accepted exactly the leading ones
            lead = int(torch.cumprod(r.label, 0).sum())
            assert lead == r.num_accepted
    rows = [r.to_dict() for r in rounds]
    ds = T.to_tokenset(rows)
    model, info = T.train_preverifier(ds, ds, 32, dim=16, hash_buckets=64, epochs=2, log=lambda *_: None)
    tab = T.round_table(model, ds)
    score, lab, reached = T.block_scores(tab, 2)
    rep = T.classification_report(score, lab, 0.5)
    assert 0.0 <= rep["auc"] <= 1.0
    costs = T.Costs(draft_token_s=1e-3, target_base_s=5e-3, target_per_token_s=0.0)
    th, sim = T.tune_threshold(tab, costs, 2, 6)
    assert sim["tokens_per_s"] > 0
    model.threshold, model.block_size = th, 2
    save_preverifier(model, tmp_path / "pv", {"draft_fingerprint": draft_fingerprint(draft)})
    pv = load_preverifier(tmp_path / "pv", draft_model=draft, strict=True)
    eng = Engine(target, draft, preverifier=pv, max_sessions=1, max_context=64)
    try:
        out = eng.generate(GenerationRequest(prompts[0], max_new_tokens=12, mode="pacer", gamma=6, block_size=2))
        ar = eng.generate(GenerationRequest(prompts[0], max_new_tokens=12, mode="ar"))
        assert out.token_ids == ar.token_ids
    finally:
        eng.close()


def test_weighted_auc():
    from specdec_train.preverifier.train import weighted_auc

    assert weighted_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0., 0., 1., 1.])) == 1.0
    assert weighted_auc(torch.tensor([0.5, 0.5]), torch.tensor([0., 1.])) == 0.5
    assert weighted_auc(torch.tensor([0.9, 0.1]), torch.tensor([0., 1.])) == 0.0


@pytest.mark.skipif(not (DEFAULT_PREVERIFIER_DIR / "config.json").is_file(), reason="no shipped pre-verifier")
def test_shipped_preverifier_loads_for_the_shipped_draft():
    from specdec.modeling.hub import DEFAULT_DRAFT_DIR

    if not (DEFAULT_DRAFT_DIR / "config.json").is_file():
        pytest.skip("no shipped draft")
    from specdec.modeling.model import load_model_dir

    draft = load_model_dir(DEFAULT_DRAFT_DIR)
    served = load_model_dir(DEFAULT_DRAFT_DIR, dtype="auto", role="draft")  # int8 weights on a bf16 CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pv = load_preverifier(draft_model=draft, draft_dir=DEFAULT_DRAFT_DIR)
        load_preverifier(draft_model=served, draft_dir=DEFAULT_DRAFT_DIR)  # the draft as the service runs it
    assert isinstance(pv, Preverifier) and 0 < pv.threshold < 1 and pv.block_size >= 1
    assert pv.card["heldout_test"]["greedy"][f"B={pv.block_size}"]["all_blocks"]["auc"] >= 0.75


def test_teacher_forced_collection_matches_the_workers_on_greedy_rounds():
    """The fast collector reproduces the worker-driven rounds (features and labels up to the first rejection)."""
    from specdec_train.preverifier.collect import collect
    from specdec_train.preverifier.collect_tf import collect_tf

    target, draft = _pair()
    G, n_new = 4, 40
    prompt = [3, 1, 4, 1, 5, 9]
    eng = Engine(target, draft, max_sessions=1, max_context=128)
    try:
        comp = eng.generate(GenerationRequest(prompt, max_new_tokens=n_new, mode="ar")).token_ids
    finally:
        eng.close()
    worker_rounds, _ = collect(draft, target, [prompt], gamma_max=G, temperatures=(0.0,), max_new_tokens=n_new)
    tf_rounds = collect_tf(draft, [{"prompt_ids": prompt, "completion_ids": comp, "temperature": 0.0}],
                           gamma_max=G, rounds_per_token=100.0)
    assert len(tf_rounds) >= 3
    for w, t in zip(worker_rounds, tf_rounds):
        k = min(w.num_accepted + 1, G)
        assert w.num_accepted == t["num_accepted"]
        assert torch.equal(w.tokens[:k].long(), t["tokens"][:k].long())
        assert torch.equal(w.label[:k], t["label"][:k])
        assert torch.allclose(w.hidden[:k].float(), t["hidden"][:k].float(), atol=2e-3)
        # greedy confidence features come from the logits: a batched vs one-row forward may differ in the last ulp
        assert torch.allclose(w.logq[:k], t["logq"][:k], atol=1e-4)
        assert torch.allclose(w.entropy[:k], t["entropy"][:k], atol=1e-4)
        assert (w.logq[:k] < 0).all() and (w.entropy[:k] > 0).all()  # real confidence, not the one-hot zeros


def test_ablation_configs_per_draft_variant():
    import argparse

    from specdec_train.preverifier.bench import _configs

    pv = build_random_preverifier(8, seed=0, block_size=1, threshold=0.3)
    args = argparse.Namespace(gammas=[2, 3], block_sizes=[1], gamma_max=12, draft_quants=["none", "int8"])
    cfgs = [c for i, q in enumerate(args.draft_quants) for c in _configs(args, pv, q, with_ar=i == 0)]
    names = [c["name"] for c in cfgs]
    assert names == ["ar", "sd γ=2 [none]", "sd γ=3 [none]", "pacer B=1 [none]", "sd γ=2 [int8]", "sd γ=3 [int8]",
                     "pacer B=1 [int8]"]
    assert {c["quant"] for c in cfgs[4:]} == {"int8"} and cfgs[3]["threshold"] == 0.3
    # θ sweeps and PEARL first-block configs (ablate --thresholds / --pearl)
    args = argparse.Namespace(gammas=[3], block_sizes=[1], gamma_max=12, draft_quants=["auto"], thresholds=[0.1, 0.2],
                              pearl=["pearl:0", "pacer_pearl:pacer"])
    cfgs = _configs(args, pv)
    assert [c["name"] for c in cfgs] == ["ar", "sd γ=3", "pacer B=1 θ=0.1", "pacer B=1 θ=0.2", "pearl first=0",
                                         "pacer_pearl first=pacer"]
    assert [c.get("threshold") for c in cfgs[2:4]] == [0.1, 0.2]
    assert (cfgs[4]["pearl_first_block"], cfgs[5]["pearl_first_block"]) == (0, None)
    with pytest.raises(SystemExit, match="pacer_pearl"):
        _configs(argparse.Namespace(**{**vars(args), "pearl": ["pearl:pacer"]}), pv)
    # the shadow-drafting θ of pacer_pearl (MODE:FIRST:POST) reaches the request
    cfgs = _configs(argparse.Namespace(**{**vars(args), "pearl": ["pacer_pearl:3:0.2"]}), pv)
    assert cfgs[-1]["name"] == "pacer_pearl first=3 post=0.2" and cfgs[-1]["post_threshold"] == 0.2
    from specdec_train.preverifier.bench import _req

    assert _req(cfgs[-1], [1, 2], 4, 0.0, 0, (0,)).pacer_post_threshold == 0.2
    for bad in ("pearl:3:0.2", "pacer_pearl:3:high"):
        with pytest.raises(SystemExit, match="θ"):
            _configs(argparse.Namespace(**{**vars(args), "pearl": [bad]}), pv)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_pacer_skip_drafts_nothing_when_the_first_block_scores_low(temperature):
    """pacer_skip_below: a first block scoring below it is dropped and the round is a one-row target step. Above
    1 every round is skipped (an `ar` run: one forward per token, nothing drafted); in between the output is
    still ar's. A sampled request ignores it (the score reads the drafted tokens: skipping on it would bias the
    output; tests/test_exactness.py measures that it is exact)."""
    target, draft = _pair()
    pv = build_random_preverifier(32, seed=7, block_size=1, threshold=0.5)
    eng = Engine(target, draft, preverifier=pv, max_sessions=2, max_context=128)
    params = SamplingParams(temperature=temperature, seed=3)
    try:
        prompt = [1, 2, 3, 4, 5]
        ar = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="ar", params=params))
        always = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="pacer", gamma=6, block_size=1,
                                                pacer_skip_below=1.0, params=params))
        some = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="pacer", gamma=6, block_size=1,
                                              pacer_skip_below=0.5, params=params))
        none = eng.generate(GenerationRequest(prompt, max_new_tokens=24, mode="pacer", gamma=6, block_size=1,
                                              params=params))
        if temperature == 0.0:
            assert always.stats.draft_tokens == 0 and always.stats.target_forwards == 24
            assert always.token_ids == some.token_ids == none.token_ids == ar.token_ids
            assert none.stats.draft_tokens > some.stats.draft_tokens > 0
        else:  # ignored: the same seeded run as without it
            assert always.token_ids == some.token_ids == none.token_ids
            assert always.stats.draft_tokens == some.stats.draft_tokens == none.stats.draft_tokens > 0
        with pytest.raises(Exception, match="pacer_skip_below"):
            eng.generate(GenerationRequest(prompt, max_new_tokens=4, mode="pacer", pacer_skip_below=1.5))
    finally:
        eng.close()


def test_greedy_confidence_of_a_compact_head_draft_equals_the_full_row():
    """The pre-verifier's log q(x) and entropy, taken on a compact-head draft's subset logits, are the numbers the
    full (-inf outside the subset) row gives."""
    from specdec.modeling.model import CausalLM, ModelConfig
    from specdec.workers.drafting import confidence

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    subset = torch.tensor([0, 2, 3, 7, 8, 11, 19, 20, 25, 31])
    model = CausalLM(cfg, vocab_subset=subset).eval()
    with torch.no_grad():
        compact = model.lm_head(torch.randn(16)).float()
    row = model.expand_logits(compact)
    x = int(row.argmax())
    assert x in subset.tolist() and x == int(subset[int(compact.argmax())])
    lq = torch.log_softmax(row, -1)
    logq, ent = confidence(compact, int(compact.argmax()))  # what advance feeds it: the compact row
    assert logq == pytest.approx(float(lq[x]), abs=1e-6)
    assert ent == pytest.approx(float(torch.special.entr(lq.exp()).sum()), abs=1e-5)


def test_oracle_stop_drafts_exactly_up_to_the_first_rejection():
    """The ablation's perfect stop rule (`ablate --oracle`): every round drafts the accepted run plus the one
    token the target rejects, so it wastes exactly one drafted token per round (the last round may end at the
    token budget instead), and no fixed γ needs fewer target forwards."""
    from specdec_train.preverifier.bench import OracleStop

    target = build_tiny_model(vocab_size=32, hidden_size=32, seed=0, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, hidden_size=32, seed=0, logit_scale=2.0)
    with torch.no_grad():  # the target, perturbed: it agrees on ~40 % of tokens, so rounds end every which way
        g = torch.Generator().manual_seed(1)
        for p in draft.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    oracle = OracleStop()
    eng = Engine(target, draft, preverifier=oracle, max_sessions=2, max_context=160)
    oracle.watch(eng.draft_worker)
    try:
        for i in range(3):
            prompt = torch.randint(0, 32, (6 + i,), generator=torch.Generator().manual_seed(10 + i)).tolist()
            ar = eng.generate(GenerationRequest(prompt, max_new_tokens=40, mode="ar")).token_ids
            req = GenerationRequest(prompt, max_new_tokens=40, mode="pacer", gamma=12, block_size=1,
                                    pacer_threshold=0.5)
            assert oracle.settle(lambda: eng.generate(req).token_ids, prompt)
            assert oracle.ref == prompt + ar  # fp32 tiny models: the same path as ar
            st = eng.generate(req).stats
            assert st.accepted_tokens > 0 and st.rounds - 1 <= st.draft_tokens - st.accepted_tokens <= st.rounds
            for g in (1, 2, 4, 12):
                sd = eng.generate(GenerationRequest(prompt, max_new_tokens=40, mode="sd", gamma=g))
                assert sd.token_ids == ar and st.target_forwards <= sd.stats.target_forwards, g
    finally:
        eng.close()


def test_measured_costs_read_the_drafting_loop_with_the_preverifier():
    """--measure-costs: the draft's cost comes from the worker's loop and the pre-verifier's from its calls there."""
    from specdec_train.preverifier.collect_tf import measure_costs

    target, draft = _pair()
    pv = build_random_preverifier(draft.config.hidden_size, seed=0)
    # medians of several reps: one slow rep on a busy host must not decide a comparison of two timings
    plain = measure_costs(draft, target, gamma_max=4, ctx=16, reps=9, loop_tokens=4, loop_reps=9)
    assert "preverifier_s" not in plain and plain["draft_token_s"] > 0 and plain["draft_forward_s"] > 0
    loop = measure_costs(draft, target, gamma_max=4, ctx=16, reps=9, preverifier=pv, loop_tokens=4, loop_reps=9)
    assert loop["draft_forward_s"] > 0 and loop["preverifier_s"] >= 0.0
    # the worker's loop does more than the bare forward (sampling, bookkeeping), but two timings of a few hundred µs
    # on a busy 2-core host can invert by 2x (a CI run measured 0.28 against 0.64 ms): the bound catches a loop
    # that measures nothing or divides by the wrong count, not noise
    assert loop["draft_token_s"] > 0.1 * loop["draft_forward_s"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_worker_margin_equals_the_collected_head_statistic(temperature):
    """DraftFeatures.margin (drafting loop) is the margin the collectors store (head_stats' third column)."""
    from specdec.decoding.preverifier import head_stats
    from specdec.workers.draft import DraftWorker

    _, draft = _pair()
    pv = build_random_preverifier(32, seed=2, block_size=1, threshold=0.0, use_hidden=False, use_margin=True)
    seen = []

    class Capture(PreverifierStop):
        def should_stop(self, features):
            seen.append(features)
            return super().should_stop(features)

    worker = DraftWorker(draft, preverifier=pv, max_sessions=1, max_context=64)
    prompt = [3, 1, 4, 1, 5]
    worker.start_session("s", prompt, SamplingParams(temperature=temperature, seed=1))
    blk = worker.draft("s", len(prompt) - 1, [prompt[-1]], 6, Capture(pv, 0.0), block_size=1)
    f = seen[-1]
    assert f.margin is not None and f.margin.shape == (5,)  # asked after every token but the last
    ids = prompt + blk.tokens
    kv = draft.new_kv_slots(1, len(ids) + 1)
    logits, _ = draft(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), kv)
    rows = logits[0, len(prompt) - 1:len(prompt) - 1 + 5]
    want = head_stats(rows, torch.tensor(blk.tokens[:5]))[:, 2]
    assert torch.allclose(f.margin, want, atol=1e-4)


@pytest.mark.parametrize("lite", [False, True])
def test_replay_walks_the_same_rounds_as_the_engine(lite):
    """`collect --walk-gamma 0` + `train.replay`: the simulated decoder makes exactly the engine's rounds, for
    fixed γ and for pacer with a (random) pre-verifier, so θ tuned by replay is tuned on real rounds."""
    from specdec_train.preverifier import train as T
    from specdec_train.preverifier.collect_tf import collect_tf

    target, draft = _pair()
    G, n_new = 6, 30
    pv = build_random_preverifier(32, seed=11, block_size=1, threshold=0.5, use_hidden=not lite, use_margin=lite)
    eng = Engine(target, draft, preverifier=pv, max_sessions=1, max_context=128)
    prompts = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8], [6, 6, 0, 2, 2]]
    try:
        rows, engine_forwards = [], {}
        for i, p in enumerate(prompts):
            comp = eng.generate(GenerationRequest(p, max_new_tokens=n_new + G + 2, mode="ar")).token_ids
            rows.append({"prompt_ids": p, "completion_ids": comp, "temperature": 0.0, "prompt": i})
            for name, kw in (("sd3", dict(mode="sd", gamma=3)), ("pacer", dict(mode="pacer", gamma=G, block_size=1))):
                out = eng.generate(GenerationRequest(p, max_new_tokens=n_new, **kw))
                engine_forwards[name] = engine_forwards.get(name, 0) + out.stats.target_forwards
    finally:
        eng.close()
    rounds = collect_tf(draft, rows, gamma_max=G, walk_gamma=0)
    assert {r["start"] for r in rounds if r["prompt"] == 0} == set(range(n_new + 3))
    tab = T.attach_starts(T.round_table(pv, T.to_tokenset(rounds, False, None, lite)), rounds)
    assert tab.exact
    costs = T.Costs(draft_token_s=1e-3, target_base_s=5e-3, target_per_token_s=0.0)
    sd3 = T.replay(tab, costs, None, None, 3, max_tokens=n_new)
    pacer = T.replay(tab, costs, 1, pv.threshold, G, pv.score_mode, max_tokens=n_new)
    assert sd3["rounds"] == engine_forwards["sd3"]
    assert pacer["rounds"] == engine_forwards["pacer"]
    assert T.replay(tab, costs, None, None, G, oracle=True, max_tokens=n_new)["rounds"] <= sd3["rounds"]
    from specdec_train.preverifier.evaluate import evaluate  # `eval` walks the same decoder over whole texts

    rep = evaluate(pv, rounds, costs, gamma_max=G)
    assert rep["exact_replay"]
    assert rep["preverifier"]["rounds"] == T.replay(tab, costs, 1, pv.threshold, G, pv.score_mode)["rounds"]


def test_train_refuses_benchmark_prompt_rounds(tmp_path):
    """Rounds collected on the benchmark's prompts (`collect --prompts benchmark`) are for diagnosis only."""
    from specdec_train.preverifier import data as D
    from specdec_train.preverifier.__main__ import main

    f = tmp_path / "bench.pt"
    D.save_rounds([], f, {"draft_sha256": "x", "gamma_max": 4, "diagnostic_only": True})
    with pytest.raises(SystemExit, match="never train"):
        main(["train", "--data", str(f), "--out", str(tmp_path / "pv")])
