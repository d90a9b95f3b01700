"""Int8 draft weights (specdec.modeling.quant): the kernel path equals the dequantized GEMM, the mode rules, and that an
int8 draft leaves the output exactly the target's (greedy equality; a statistical check at T = 1)."""
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draft_service.config import DraftSettings
from specdec.decoding.preverifier import build_random_preverifier
from specdec.engine import Engine
from specdec.modeling.model import load_model_dir
from specdec.modeling.quant import (INT8_MAX_ROWS, Int8Linear, int8_supported, quantize_int8_, resolve_quant,
                           weight_quant)
from specdec.decoding.sampling import SamplingParams
from specdec.scheduling.request import GenerationRequest
from tests.helpers_models import build_tiny_model

pytestmark = pytest.mark.skipif(not int8_supported("cpu", torch.bfloat16),
                                reason="this torch build has no CPU int8 weight-only kernel")
PROMPT = [3, 1, 4, 1, 5]


def _int8_model(seed: int, logit_scale: float = 2.0, vocab_size: int = 32):
    m = build_tiny_model(vocab_size=vocab_size, seed=seed, logit_scale=logit_scale).to(torch.bfloat16)
    assert weight_quant(m) == "none" and quantize_int8_(m) == 2 * 7 + 1  # q k v o gate up down per layer, head
    assert weight_quant(m) == "int8"
    return m


def test_int8_linear_kernel_and_gemm_paths_agree():
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    q = Int8Linear(lin)
    # the stored weight is the dequantization of (int8, scale): at most half a step off the original
    step = q.scales.float()[:, None]
    assert ((q.weight.float() - lin.weight.float()).abs() <= 0.5 * step + 1e-2 * step + 1e-3).all()
    for rows in (1, 3, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, 40):  # kernel path up to max_rows, GEMM above
        x = torch.randn(rows, 96).to(torch.bfloat16)
        ref = F.linear(x.float(), q.weight.float(), q.bias.float())
        torch.testing.assert_close(q(x).float(), ref, atol=0.05, rtol=0.02)
    x3 = torch.randn(2, 3, 96).to(torch.bfloat16)  # leading dims are kept
    assert q(x3).shape == (2, 3, 200)


def test_resolve_quant_rules():
    assert resolve_quant("auto", "draft", "cpu", torch.bfloat16) == "int8"
    assert resolve_quant("auto", "draft", "cpu", torch.float32) == "none"  # the kernel is slow with fp32 inputs
    assert resolve_quant("auto", "target", "cpu", torch.bfloat16) == "none"  # the target is never quantized
    assert resolve_quant("none", "draft", "cpu", torch.bfloat16) == "none"
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_quant("int8", "draft", "cpu", torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        resolve_quant("int4", "draft", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="quant must be one of"):
        DraftSettings(quant="fp8")


def _save_tiny_dir(path):
    from safetensors.torch import save_file

    m = build_tiny_model(vocab_size=32, seed=3)
    c = m.config
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta}))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path / "model.safetensors"))
    return path


def test_loader_quantizes_a_bf16_draft_only(tmp_path):
    _save_tiny_dir(tmp_path)
    kinds = lambda model: {type(x).__name__ for x in model.modules()} & {"Int8Linear", "Linear"}
    assert kinds(load_model_dir(tmp_path, dtype="bfloat16", role="draft")) == {"Int8Linear"}
    assert kinds(load_model_dir(tmp_path, dtype="bfloat16", role="target")) == {"Linear"}
    assert kinds(load_model_dir(tmp_path, dtype="float32", role="draft")) == {"Linear"}
    assert kinds(load_model_dir(tmp_path, dtype="bfloat16", role="draft", quant="none")) == {"Linear"}
    # a pre-verifier trained for these weights still recognises them once quantized
    from specdec.modeling.model import draft_fingerprint

    assert draft_fingerprint(load_model_dir(tmp_path, dtype="bfloat16", role="draft")) == \
        draft_fingerprint(load_model_dir(tmp_path, dtype="float32"))


@pytest.mark.parametrize("mode", ["sd", "pearl", "pacer"])
def test_int8_draft_greedy_equals_target_only(mode):
    target = build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0)
    draft = _int8_model(seed=2)
    pv = build_random_preverifier(32, seed=3, block_size=1, draft_model=draft) if mode == "pacer" else None
    eng = Engine(target, draft, preverifier=pv)  # the pre-verifier reads the int8 draft's (dequantized) head
    ref = eng.generate(GenerationRequest(PROMPT, 30, mode="ar")).token_ids
    for gamma in (1, 3, 6):
        out = eng.generate(GenerationRequest(PROMPT, 30, mode=mode, gamma=gamma))
        assert out.token_ids == ref, (mode, gamma)
    eng.close()


def test_int8_draft_keeps_the_target_distribution_at_t1():
    """First generated token at T = 1: 1,200 seeded sd runs with an int8 draft vs the target's exact p."""
    from scipy.stats import chisquare

    from specdec.decoding.sampling import logits_to_probs

    target = build_tiny_model(vocab_size=8, seed=1, logit_scale=1.0)
    eng = Engine(target, _int8_model(seed=4, logit_scale=1.0, vocab_size=8))
    kv = target.new_kv_slots(1, 16)
    logits, _ = target(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], torch.tensor([0]), kv)
    p = logits_to_probs(logits[0, -1], SamplingParams(temperature=1.0)).double()
    n, counts = 1200, Counter()
    for seed in range(n):
        out = eng.generate(GenerationRequest(PROMPT, 2, mode="sd", gamma=3,
                                             params=SamplingParams(temperature=1.0, seed=seed)))
        counts[out.token_ids[0]] += 1
    eng.close()
    obs = [counts.get(i, 0) for i in range(8)]
    assert chisquare(obs, (p / p.sum() * n).tolist()).pvalue > 1e-3


@pytest.mark.parametrize("quant, want", [("auto", "int8"), ("none", "none")])
async def test_draft_service_serves_and_reports_its_weight_quant(tmp_path, quant, want):
    import grpc

    from draft_service.server import build_app
    from specdec_rpc.pb import draft_pb2, draft_pb2_grpc

    app = await build_app(DraftSettings(model=str(_save_tiny_dir(tmp_path)), dtype="bfloat16", quant=quant,
                                        host="127.0.0.1", port=0, metrics_port=0, grace_s=0.5), warmup=False)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            info = (await stub.GetInfo(draft_pb2.DraftServiceGetInfoRequest())).info
            assert info.weight_quant == want and info.dtype == "bfloat16"
            await stub.StartSession(draft_pb2.DraftServiceStartSessionRequest(session_id="s", prompt_ids=[1, 2, 3]))
            out = await stub.Draft(draft_pb2.DraftRequest(session_id="s", base_position=2, append_ids=[3],
                                                          gamma_max=3))
            assert len(out.token_ids) == 3
    finally:
        await app.shutdown(0.5)
