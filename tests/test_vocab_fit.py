"""A draft checkpoint with fewer vocabulary rows than its target's, of the same tokenizer (Qwen2.5-0.5B's 151,936
for Qwen2.5-7B's 152,064): fitted (specdec/text/vocab.py), it takes every target id, proposes none past its rows, and
the output is still exactly the target's, greedy and sampled. A pair that cannot share a tokenizer is refused."""
import asyncio
import itertools
import os
from collections import Counter

import grpc
import pytest
import torch

from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams, logits_to_probs
from specdec.engine import Engine
from specdec.scheduling.request import GenerationRequest
from specdec.text.vocab import PADDING_SLACK, draft_vocabulary_error, fit_draft_vocabulary
from tests.helpers_models import build_tiny_model, start_replica, target_greedy
from tests.test_exactness import chi_square_pvalue

VT, VD = 40, 32  # the target's rows, the draft's
PROMPT = [3, 35, 7, 39, 1]  # ids past the draft's rows: it embeds them as its OOV row


def _pair(vt=VT, vd=VD, scale=1.0):
    target = build_tiny_model(vocab_size=vt, seed=1, logit_scale=scale)
    draft = build_tiny_model(vocab_size=vd, hidden_size=16, num_layers=1, seed=2, logit_scale=scale)
    return target, draft


def test_the_fitted_draft_takes_target_ids_and_proposes_none_past_its_rows():
    target, draft = _pair()
    row = draft(torch.tensor([[3, 4]]), torch.arange(2)[None], torch.tensor([0]), draft.new_kv_slots(1, 8))[0][0, -1]
    assert fit_draft_vocabulary(draft, VT) and draft.config.vocab_size == VT
    assert not fit_draft_vocabulary(draft, VT)  # a second fit changes nothing
    kv = draft.new_kv_slots(1, 16)
    logits, _ = draft(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], torch.tensor([0]), kv)
    assert logits.shape[-1] == VT and torch.isinf(logits[..., VD:]).all() and torch.isfinite(logits[..., :VD]).all()
    same, _ = draft(torch.tensor([[3, 4]]), torch.arange(2)[None], torch.tensor([0]), draft.new_kv_slots(1, 8))
    torch.testing.assert_close(same[0, -1, :VD], row)  # ids it has rows for: the same logits as before the fit


@pytest.mark.parametrize("mode", ["sd", "pacer", "pearl"])
def test_greedy_output_is_the_targets_with_a_smaller_draft(mode):
    """The target sampling a token the draft has no row for is what the fit is for: a target whose favourite
    tokens lie past the draft's rows (a head scaled up there) makes it happen in every request."""
    target, draft = _pair()
    with torch.no_grad():
        target.lm_head.weight[VD:] *= 3
    want = target_greedy(target, PROMPT, 24)
    assert any(t >= VD for t in want)
    pv = build_random_preverifier(hidden_size=16, seed=3, block_size=2, threshold=0.5) if mode == "pacer" else None
    eng = Engine(target, draft, preverifier=pv, inline=mode != "pearl")
    try:
        res = eng.generate(GenerationRequest(PROMPT, 24, params=SamplingParams(temperature=0.0), mode=mode, gamma=4))
    finally:
        eng.close()
    assert res.token_ids == want
    assert res.stats.draft_tokens > 0


def test_a_draft_equal_to_the_target_on_its_rows_accepts_everything_there():
    """'draft == target accepts everything': a draft that is the target with its last rows cut off proposes the
    target's own argmax wherever that lies within its rows."""
    target, _ = _pair()
    draft = build_tiny_model(vocab_size=VD, seed=1)
    with torch.no_grad():
        for (name, p), (_, q) in zip(draft.named_parameters(), target.named_parameters()):
            p.copy_(q[:VD] if name in ("model.embed_tokens.weight", "lm_head.weight") else q)
        target.lm_head.weight[VD:] = 0  # the target's last rows: logit 0, never its argmax here
    prompt = [3, 1, 4, 1, 5]
    want = target_greedy(target, prompt, 24)
    assert max(want) < VD
    eng = Engine(target, draft, inline=True)
    try:
        res = eng.generate(GenerationRequest(prompt, 24, params=SamplingParams(temperature=0.0), mode="sd", gamma=4))
    finally:
        eng.close()
    assert res.token_ids == want and res.stats.accepted_tokens == res.stats.draft_tokens


@pytest.mark.parametrize("method", ["token", "block"])
def test_sampled_output_follows_the_exact_target_distribution(method):
    """Vocabularies of 8 and 6 tokens: the exact distribution of every 3-token continuation against seeded runs
    (chi-square). The target puts real mass on ids 6 and 7, which the draft's q must give none."""
    vt, vd, prompt = 8, 6, [1, 7, 2]
    target, draft = _pair(vt, vd, scale=4.0)
    params = SamplingParams(temperature=1.0)

    def cond(prefix):
        kv = target.new_kv_slots(1, 16)
        logits, _ = target(torch.tensor([prefix]), torch.arange(len(prefix))[None], torch.tensor([0]), kv)
        return logits_to_probs(logits[0, -1], params).double()

    exact = {}
    for seq in itertools.product(range(vt), repeat=3):
        exact[seq] = float(cond(prompt)[seq[0]] * cond(prompt + [seq[0]])[seq[1]]
                           * cond(prompt + list(seq[:2]))[seq[2]])
    assert sum(v for k, v in exact.items() if max(k) >= vd) > 0.2
    eng = Engine(target, draft, inline=True)
    n = int(os.environ.get("SPECDEC_EXACT_RUNS_TRUNC", "3000"))
    counts = Counter()
    try:
        for seed in range(n):
            req = GenerationRequest(prompt, 3, params=SamplingParams(temperature=1.0, seed=seed), mode="sd",
                                    verify_method=method, gamma=3)
            counts[tuple(eng.generate(req).token_ids)] += 1
    finally:
        eng.close()
    assert chi_square_pvalue(counts, exact, n) > 0.001


def test_pairs_that_cannot_share_a_tokenizer_are_refused():
    assert draft_vocabulary_error(151936, 152064) == ""  # Qwen2.5-0.5B for Qwen2.5-7B
    assert "larger than the target's" in draft_vocabulary_error(152064, 151936)
    assert "share a tokenizer" in draft_vocabulary_error(32000, 32000 + PADDING_SLACK + 1)
    target, _ = _pair()
    with pytest.raises(ValueError, match="larger than the target's"):
        Engine(target, build_tiny_model(vocab_size=VT + 8, hidden_size=16, num_layers=1))
    with pytest.raises(ValueError, match="share a tokenizer"):
        Engine(build_tiny_model(vocab_size=VD + PADDING_SLACK + 1, seed=1), build_tiny_model(vocab_size=VD))


def test_the_draft_service_fits_its_model_to_target_vocab_size():
    """DRAFT_TARGET_VOCAB_SIZE: the replica reports the target's vocabulary and takes a prompt with ids past its
    rows (before, INVALID_ARGUMENT 'outside the vocabulary'); a larger draft does not start."""
    from specdec_rpc.pb import draft_pb2, draft_pb2_grpc

    async def run():
        app = await start_replica("draft", _pair()[1], target_vocab_size=VT)
        try:
            async with grpc.aio.insecure_channel(app.endpoint) as ch:
                stub = draft_pb2_grpc.DraftServiceStub(ch)
                info = await stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())
                assert info.info.vocab_size == VT
                start = draft_pb2.DraftServiceStartSessionRequest(session_id="s", prompt_ids=PROMPT)
                await stub.StartSession(start)
        finally:
            await app.shutdown(0)
        with pytest.raises(ValueError, match="target_vocab_size 24: the draft's vocabulary"):
            await start_replica("draft", _pair()[1], target_vocab_size=24)

    asyncio.run(run())


def test_the_embedded_stack_fits_a_smaller_draft(tmp_path):
    """`specdec generate` / `serve` with such a pair: the stack starts the draft replica with --target-vocab-size
    (read from both config.json files), so a prompt with ids past the draft's rows is drafted for, not run
    target-only."""
    from coordinator.stack import LocalStack, config_vocab_size
    from specdec_bench.runners import StackClient
    from tests.helpers_models import save_model, save_tiny_tokenizer

    target, draft = _pair()
    with torch.no_grad():
        target.lm_head.weight[VD:] *= 3
    tdir, ddir = save_model(target, tmp_path / "target"), save_model(draft, tmp_path / "draft")
    save_tiny_tokenizer(tdir)
    assert (config_vocab_size(str(tdir)), config_vocab_size(str(ddir)), config_vocab_size(str(tmp_path))) == (VT, VD, 0)
    want = target_greedy(target, PROMPT, 16)

    async def run():
        stack = LocalStack(str(tdir), str(ddir), use_ray=False, dtype="float32", max_sessions=2, max_context=64)
        await stack.start()
        client = StackClient(stack.address)
        try:
            return await client.generate(PROMPT, "sd", 4, 0.0, 0, 16, ignore_eos=True)
        finally:
            await client.close()
            await stack.stop()

    got = asyncio.run(run())
    assert got.token_ids == want
    assert got.stats["draft_tokens"] > 0 and got.stats["target_forwards"] < 16


@pytest.mark.parametrize("fitted", [False, True])
def test_the_coordinator_names_the_setting_a_short_draft_replica_lacks(fitted, caplog):
    """A draft replica left at its own, smaller vocabulary refuses requests holding the target's last ids: the
    coordinator says which setting fixes it, once, when it learns both sizes; a fitted replica gets no warning."""
    from tests.helpers_models import start_coordinator

    async def run():
        target, draft = _pair()
        t = await start_replica("target", target)
        d = await start_replica("draft", draft, **({"target_vocab_size": VT} if fitted else {}))
        coord = await start_coordinator(t.endpoint, d.endpoint)  # its start refreshes the pools once
        for a in (coord, d, t):
            await a.shutdown(0)

    with caplog.at_level("WARNING", logger="coordinator.routing.pool"):
        asyncio.run(run())
    warned = [r.getMessage() for r in caplog.records if "vocabulary rows" in r.getMessage()]
    if fitted:
        assert warned == []
    else:
        assert len(warned) == 1 and f"DRAFT_TARGET_VOCAB_SIZE={VT}" in warned[0] and f"has {VD}" in warned[0]
