"""The synthetic-acceptance timing pair (specdec_bench/synthetic.py): a draft that proposes the target's own next
greedy token with probability α. Its output is the target's (every mode equals `ar`), and the acceptance measured is
what α implies: each verified block's first token is accepted with probability α, and a block of γ tokens has
α + α² + … + α^γ of them accepted on average (the fraction of drafted tokens accepted is not α)."""
from __future__ import annotations

from pathlib import Path

import pytest

from specdec.common.errors import InvalidRequestError
from specdec.decoding.sampling import SamplingParams
from specdec.scheduling.request import GenerationRequest
from specdec_bench.synthetic import (LABEL, SPEC_FILE, Pair, SyntheticDraftWorker, SyntheticOptions, SyntheticSpec,
                                     coin, expected_acceptance, prompt_digest, random_prompts,
                                     replica_worker, run_synthetic, synthetic_engine)

N = 120  # tokens per request


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair("tiny", "cpu", tmp_path_factory.mktemp("synthetic"))


@pytest.fixture(scope="module")
def prompts(pair):
    return random_prompts(8, 24, pair.vocab_size, seed=3)


@pytest.fixture(scope="module")
def references(pair, prompts):
    """Each prompt's `ar` output (and a margin past N): what the synthetic draft steers towards."""
    eng = synthetic_engine(pair.target, pair.draft, SyntheticSpec(0.0), max_context=256, inline=True)
    try:
        return {tuple(p): _generate(eng, p, "ar", N + 16)[0] for p in prompts}
    finally:
        eng.close()


def _generate(eng, prompt, mode, n=N, gamma=None):
    res = eng.generate(GenerationRequest(prompt_ids=list(prompt), max_new_tokens=n, mode=mode, gamma=gamma,
                                         params=SamplingParams(temperature=0.0)))
    return list(res.token_ids), res.stats


def _engine(pair, alpha, references, preverifier=None, seed=0):
    return synthetic_engine(pair.target, pair.draft, SyntheticSpec(alpha, references, seed), preverifier=preverifier,
                            max_context=256, inline=None)


def _totals(eng, prompts, mode, gamma=None):
    """Summed counts over the prompts: (verified drafted tokens, accepted, blocks verified, first tokens accepted)."""
    v = a = d = f = 0
    outs = []
    for p in prompts:
        ids, st = _generate(eng, p, mode, gamma=gamma)
        outs.append(ids)
        v, a, d = v + st.verified_draft_tokens, a + st.accepted_tokens, d + st.drafts
        f += st.accepted_per_position[0] if st.accepted_per_position else 0
    return outs, v, a, d, f


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0])
def test_every_mode_equals_ar(pair, prompts, references, alpha):
    from specdec.decoding.preverifier import build_random_preverifier

    pv = build_random_preverifier(pair.draft.config.hidden_size, seed=7, block_size=2, threshold=0.5)
    eng = _engine(pair, alpha, references, preverifier=pv)
    try:
        for mode, gamma in (("sd", 2), ("sd", 5), ("pearl", None), ("pacer", None), ("pacer_pearl", None)):
            for p in prompts[:3]:
                ids, _ = _generate(eng, p, mode, gamma=gamma)
                assert ids == references[tuple(p)][:N], (mode, gamma, alpha)
        assert eng.draft_worker.steered["hit" if alpha else "miss"] > 0
    finally:
        eng.close()


def test_sd_acceptance_is_what_alpha_implies(pair, prompts, references):
    """α = 0.8, γ = 4, over 8 prompts of 120 tokens (well over 400 drafted tokens): each block's first token is
    accepted 0.8 of the time, and 0.8(1 − 0.8⁴)/(4 · 0.2) ≈ 0.590 of the drafted tokens are, within ±0.08. A draft
    that ignored α (always right: 1.0 and 1.0), or one whose tokens were each accepted with probability α whatever
    came before (0.8 per token), fails."""
    alpha, gamma = 0.8, 4
    eng = _engine(pair, alpha, references)
    try:
        outs, verified, accepted, drafts, first = _totals(eng, prompts, "sd", gamma)
    finally:
        eng.close()
    assert outs == [references[tuple(p)][:N] for p in prompts]
    assert verified >= 400
    assert abs(first / drafts - alpha) <= 0.08, first / drafts
    want = expected_acceptance(alpha, gamma)
    assert abs(want - 0.5904) < 1e-9
    assert abs(accepted / verified - want) <= 0.08, (accepted / verified, want)
    assert abs(accepted / verified - alpha) > 0.15  # the per-token fraction is not α


@pytest.mark.parametrize("mode, gamma", [("sd", 4), ("pearl", None)])
def test_alpha_one_accepts_every_drafted_token_and_zero_none(pair, prompts, references, mode, gamma):
    for alpha in (1.0, 0.0):
        eng = _engine(pair, alpha, references)
        try:
            outs, verified, accepted, drafts, first = _totals(eng, prompts[:3], mode, gamma)
        finally:
            eng.close()
        assert outs == [references[tuple(p)][:N] for p in prompts[:3]]
        assert verified > 0 and drafts > 0
        assert accepted == (verified if alpha == 1.0 else 0), (alpha, accepted, verified)
        assert first == (drafts if alpha == 1.0 else 0)


def test_the_coin_is_fixed_by_seed_prompt_and_position():
    d = prompt_digest([5, 6, 7])
    draws = [coin(0, d, p) for p in range(2000)]
    assert draws == [coin(0, d, p) for p in range(2000)]
    assert draws != [coin(1, d, p) for p in range(2000)]
    assert draws != [coin(0, prompt_digest([5, 6, 8]), p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws) and abs(sum(u < 0.3 for u in draws) / 2000 - 0.3) < 0.05


def test_redrafting_a_position_proposes_the_same_tokens(pair, prompts, references):
    """PEARL's discarded speculation and retries re-draft positions: the same coins, the same proposals."""
    p = prompts[0]
    ref = references[tuple(p)]
    w = SyntheticDraftWorker(pair.draft, spec=SyntheticSpec(0.5, references), max_sessions=2, max_context=256)
    w.start_session("s", p, SamplingParams())
    first = w.draft("s", len(p) - 1, [p[-1]], 6).tokens
    again = w.draft("s", len(p) - 1, [p[-1]], 6).tokens
    assert first == again
    # along the reference: a proposal is the reference token exactly where that position's coin came up under α
    ctx, want = list(p), []
    for k in range(40):
        u = coin(0, prompt_digest(p), len(p) + k)
        want.append(ref[k] if u < 0.5 else (ref[k] + 1) % pair.vocab_size)
    got = []
    for k in range(40):  # one token at a time, each from the reference's prefix
        base = len(p) - 1 + k
        got.append(w.draft("s", base, [(p + ref)[base]], 1).tokens[0])
    assert got == want
    assert 0 < sum(g == r for g, r in zip(got, ref)) < 40


def test_sampled_and_processed_requests_are_refused(pair, references):
    w = SyntheticDraftWorker(pair.draft, spec=SyntheticSpec(0.5, references), max_sessions=2, max_context=256)
    with pytest.raises(InvalidRequestError, match="greedy requests only"):
        w.start_session("s", [1, 2, 3], SamplingParams(temperature=1.0))
    with pytest.raises(InvalidRequestError, match="penalties"):
        w.start_session("s", [1, 2, 3], SamplingParams(repetition_penalty=1.3))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SyntheticSpec(1.5)


def test_the_replica_factory_reads_its_spec_and_its_changes(pair, prompts, references):
    """`replica_worker` reads synthetic_acceptance.json from the model's directory, again after it changes."""
    from specdec.modeling.model import load_model_dir

    draft_dir = Path(pair.dirs[1])
    draft = load_model_dir(draft_dir, dtype="auto", role="draft")
    (draft_dir / SPEC_FILE).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match=SPEC_FILE):
        replica_worker(draft, max_sessions=2, max_context=256)
    SyntheticSpec(1.0, references).save(draft_dir / SPEC_FILE)
    w = replica_worker(draft, max_sessions=2, max_context=256)
    assert w.spec.alpha == 1.0 and len(w.spec.references) == len(prompts) and w.lookup is None
    SyntheticSpec(0.25, references, seed=4).save(draft_dir / SPEC_FILE)
    w.start_session("s", prompts[0], SamplingParams())
    assert (w.spec.alpha, w.spec.seed) == (0.25, 4)
    (draft_dir / SPEC_FILE).unlink()


def test_the_benchmark_through_the_services_matches_in_process():
    """The whole run, both placements, tiny pair: every output equals ar's, and the draft replica (built by
    --worker-factory) draws the same coins as the in-process draft: the same acceptance counts for sd."""
    opts = SyntheticOptions(alphas=(0.8,), modes=("ar", "sd", "pearl"), gammas=(4,), n_prompts=2, max_new_tokens=48)
    res = run_synthetic(opts, log=lambda m: None)
    rows = res["rows"]
    assert {r["placement"] for r in rows} == {"in-process", "stack"} and all(r["section"] == LABEL for r in rows)
    assert all(r["exact"] for r in rows), [(r["placement"], r["config"]) for r in rows if not r["exact"]]
    sd = {r["placement"]: r for r in rows if r["mode"] == "sd"}
    keys = ("accepted_tokens", "verified_draft_tokens", "drafts", "first_accepted")
    assert [sd["stack"][k] for k in keys] == [sd["in-process"][k] for k in keys]
    assert sd["stack"]["verified_draft_tokens"] > 0 and sd["stack"]["x_ar"] is not None


def test_the_cli_prints_and_writes_the_labelled_rows(tmp_path, capsys):
    import json

    from specdec_bench.cli import main

    out = tmp_path / "syn.json"
    assert main(["--synthetic-acceptance", "0.5,1", "--placements", "in-process", "--modes", "ar", "sd", "--gammas",
                 "3", "--n-prompts", "1", "--max-new-tokens", "24", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Synthetic acceptance" in printed and "sd γ=3" in printed
    rows = json.loads(out.read_text())
    assert {(r["alpha"], r["config"]) for r in rows} == {(0.5, "ar"), (0.5, "sd γ=3"), (1.0, "ar"), (1.0, "sd γ=3")}
    assert all(r["section"] == LABEL and r["exact"] and r["run"]["shapes"] == "tiny" for r in rows)
    assert [r["acceptance"] for r in rows if r["alpha"] == 1.0 and r["mode"] == "sd"] == [1.0]
    with pytest.raises(SystemExit, match="add --synthetic-acceptance"):
        main(["--shapes", "llama-8b/1b"])
    with pytest.raises(SystemExit, match=r"rates in \[0, 1\]"):
        main(["--synthetic-acceptance", "1.5"])
