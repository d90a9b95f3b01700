"""Logprobs of the output under the target (SamplingParams.logprobs): every mode returns, for each generated
token, the target's raw log-softmax at that position (teacher-forced reference) and its top alternatives, whatever
drafted it; over the wire too; aligned with the tokens when a stop string cuts the text."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding.preverifier import build_random_preverifier
from specdec.decoding.sampling import SamplingParams
from specdec.engine import Engine
from specdec.scheduling.field_rules import check_sampling
from specdec.scheduling.request import MODES, GenerationRequest
from tests.helpers_models import build_tiny_model

PROMPT = [3, 1, 4, 1, 5]


def reference(model, prompt: list[int], out: list[int], top: int):
    """(logprob of each out token, top ids, top logprobs) from one teacher-forced forward of the target."""
    ids = prompt + out
    kv = model.new_kv_slots(1, len(ids) + 8)
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]), torch.arange(len(ids))[None], torch.tensor([0]), kv)
    lp = torch.log_softmax(logits[0, len(prompt) - 1:len(ids) - 1].float(), -1)
    chosen = lp.gather(-1, torch.tensor(out)[:, None])[:, 0]
    vals, top_ids = lp.topk(top, -1)
    return chosen, top_ids, vals


def check(model, prompt, token_ids, logprobs, top):
    assert logprobs is not None and len(logprobs) == len(token_ids)
    chosen, top_ids, vals = reference(model, prompt, token_ids, top)
    torch.testing.assert_close(torch.tensor([e[0] for e in logprobs]), chosen, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([e[2] for e in logprobs]), vals, atol=1e-4, rtol=1e-4)
    for (_, ids, _), ref_ids, ref_vals in zip(logprobs, top_ids.tolist(), vals.tolist()):
        assert len(ids) == top
        for a, b, v in zip(ids, ref_ids, ref_vals):
            if a != b:  # a near-tie, whose order a batched forward may flip
                assert a in ref_ids and abs(ref_vals[ref_ids.index(a)] - v) < 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_returns_the_targets_logprobs(mode):
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    pv = build_random_preverifier(draft.config.hidden_size, seed=5, block_size=2, threshold=0.5)
    eng = Engine(target, draft, preverifier=pv)
    for gamma in (1, 4):
        # raw logprobs at any temperature (not those of the tempered distribution)
        for temperature, method in ((0.0, "greedy"), (1.0, "token"), (0.5, "block")):
            req = GenerationRequest(PROMPT, 30, mode=mode, gamma=gamma, verify_method=method,
                                    params=SamplingParams(temperature=temperature, seed=9, logprobs=3))
            res = eng.generate(req)
            check(target, PROMPT, res.token_ids, res.logprobs, 3)
    plain = eng.generate(GenerationRequest(PROMPT, 8, mode=mode))
    assert plain.logprobs is None, "only when asked"
    eng.close()


def test_draft_equal_to_target_and_no_alternatives():
    target = build_tiny_model(vocab_size=32, seed=1)
    eng = Engine(target, target)
    res = eng.generate(GenerationRequest(PROMPT, 20, mode="sd", gamma=4,
                                         params=SamplingParams(temperature=1.0, seed=2, logprobs=0)))
    assert res.stats.accepted_tokens == res.stats.draft_tokens
    check(target, PROMPT, res.token_ids, res.logprobs, 0)
    eng.close()


@pytest.mark.parametrize("mode", ["ar", "pearl"])
def test_prompt_logprobs_from_the_prefill(mode):
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = build_tiny_model(vocab_size=32, seed=2, logit_scale=2.0)
    eng = Engine(target, draft, prefill_chunk=3)  # several chunks: positions must line up
    prompt = PROMPT + [7, 2, 9, 4]
    res = eng.generate(GenerationRequest(prompt, 6, mode=mode, params=SamplingParams(prompt_logprobs=2)))
    plain = eng.generate(GenerationRequest(prompt, 6, mode=mode))
    assert res.token_ids == plain.token_ids and plain.prompt_logprobs is None and res.logprobs is None
    lp = res.prompt_logprobs
    assert lp.position == 1 and lp.token_ids == prompt[1:]
    check(target, prompt[:1], prompt[1:], list(zip(lp.logprobs, lp.top_ids, lp.top_logprobs)), 2)
    eng.close()


def test_logprobs_bounds():
    from specdec.common.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="logprobs"):
        check_sampling(SamplingParams(logprobs=21))


@pytest.mark.asyncio
async def test_logprobs_over_the_wire_whole_streamed_and_cut_by_a_stop_string(tmp_path):
    import grpc

    from coordinator.config import CoordinatorSettings
    from coordinator.server import build_coordinator
    from specdec.text.tokenizer import load_tokenizer
    from specdec_rpc.pb import generation_pb2 as g, generation_pb2_grpc as gg
    from tests.helpers_models import save_tiny_tokenizer, start_replica, tiny_pair

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "tok"))
    target, draft = tiny_pair()
    t = await start_replica("target", target)
    d = await start_replica("draft", draft, preverifier="random")
    s = CoordinatorSettings(host="127.0.0.1", port=0, metrics_port=0, ray=False, tokenizer="", grace_s=0,
                            draft_endpoints=d.endpoint, target_endpoints=t.endpoint, log_level="WARNING")
    app, _ = await build_coordinator(s, tokenizer=tok, eos_token_ids=set())
    await app.start()
    stub = gg.GenerationServiceStub(ch := grpc.aio.insecure_channel(f"127.0.0.1:{app.port}"))

    def entries(msg):
        return [(lp, list(top.ids), list(top.logprobs)) for lp, top in zip(msg.logprobs, msg.top)]

    try:
        for mode in MODES:
            for temperature in (0.0, 1.0):
                r = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=24, mode=mode, temperature=temperature,
                                      seed=4, logprobs=2)
                whole = await stub.Generate(r)
                check(target, PROMPT, list(whole.token_ids), entries(whole.logprobs), 2)
                parts = [p async for p in stub.GenerateStream(r)]
                if temperature == 0:
                    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
                    streamed = [e for p in parts for e in entries(p.logprobs)]
                    check(target, PROMPT, list(whole.token_ids), streamed, 2)
                    assert all(len(p.logprobs.logprobs) == len(p.token_ids) for p in parts)
        plain = await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4))
        assert not plain.HasField("logprobs") and not plain.HasField("prompt_logprobs")
        for mode in ("ar", "pacer_pearl"):
            r = g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, mode=mode, prompt_logprobs=2)
            whole = await stub.Generate(r)
            check(target, PROMPT[:1], PROMPT[1:], entries(whole.prompt_logprobs), 2)
            parts = [p async for p in stub.GenerateStream(r)]
            assert entries(parts[-1].prompt_logprobs) == entries(whole.prompt_logprobs)
        text_req = g.GenerateRequest(prompt="hello", max_new_tokens=30, mode="pearl", logprobs=0)
        full = await stub.Generate(text_req)
        stop = full.text[10:12]
        text_req.stop.append(stop)
        cut = await stub.Generate(text_req)
        assert cut.text == full.text[:full.text.index(stop)]
        assert len(cut.logprobs.logprobs) == len(cut.token_ids) < len(full.token_ids)
        assert list(cut.logprobs.logprobs) == list(full.logprobs.logprobs[:len(cut.token_ids)])
        with pytest.raises(grpc.aio.AioRpcError, match="logprobs"):
            await stub.Generate(g.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=4, logprobs=21))
    finally:
        await ch.close()
        for a in (app, t, d):
            await a.shutdown(0)
