"""Device placement: nothing CPU-only runs for a model off the CPU (the native C kernels, oneDNN prepacking and
kernel plans, int8 GEMVs, the CPU decode attention), checked on CPU with `meta` tensors standing in for a GPU's (a
non-CPU device that needs none: every guard asks `device.type == "cpu"`); and the same on a real CUDA device where
there is one (marked `cuda`)."""
from __future__ import annotations

import pytest
import torch

from specdec.modeling import native
from specdec.modeling.attention import attention
from specdec.modeling.dtypes import auto_dtype
from specdec.modeling.linear import Linear, check_row_invariance, prepack_linears, set_row_invariant, tune_linears
from specdec.modeling.quant import int8_supported, resolve_quant
from tests.helpers_models import build_tiny_model


def _meta_model():
    return build_tiny_model().to("meta", torch.bfloat16)


def test_native_kernels_refuse_non_cpu_tensors(monkeypatch):
    # were the guards to ask `available()` first, this would be reached: it must not be
    monkeypatch.setattr(native, "available", lambda: pytest.fail("native.available() asked for a non-CPU tensor"))
    k = torch.empty(2, 8, 2, 16, device="meta", dtype=torch.bfloat16)
    x = torch.empty(3, 64, device="meta", dtype=torch.bfloat16)
    assert not native.supports(k)
    with torch.inference_mode():
        assert not native.rms_norm_supported(x, torch.empty(64, device="meta", dtype=torch.bfloat16))


def test_linear_never_plans_or_packs_off_the_cpu(monkeypatch):
    model = _meta_model()
    set_row_invariant(model)
    assert prepack_linears(model) == 0  # oneDNN packing: CPU only
    assert tune_linears(model) == {}  # no plan measured for a non-CPU layer
    assert check_row_invariance(model) == []  # nor checked (it runs CPU kernels)
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    monkeypatch.setattr(Linear, "run_kernel", lambda *a: pytest.fail("a CPU kernel plan ran for a non-CPU call"))
    with torch.inference_mode():
        y = layer(torch.empty(1, 3, layer.in_features, device="meta", dtype=torch.bfloat16))
    assert y.shape == (1, 3, layer.out_features) and y.device.type == "meta"  # F.linear, the device's own GEMM


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "meta"])
def test_int8_weights_are_cpu_only(device):
    assert not int8_supported(device, torch.bfloat16)
    assert resolve_quant("auto", "draft", device, torch.bfloat16) == "none"
    with pytest.raises(ValueError, match="int8 weights need a CPU device"):
        resolve_quant("int8", "draft", device, torch.bfloat16)


def test_cpu_decode_attention_path_is_cpu_only(monkeypatch):
    """attention.py's two-matmul path is for CPUs; elsewhere the fused SDPA runs (checked by what it calls)."""
    called = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: called.append(1) or torch.empty(1, 4, 2, 16, device="meta"))
    q = torch.empty(1, 4, 2, 16, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(1, 2, 8, 16, device="meta", dtype=torch.bfloat16)
    attention(q, kv, kv, None)
    assert called == [1]


def test_gpu_dtype_is_bf16():
    assert auto_dtype("cuda") == torch.bfloat16 and auto_dtype("cuda:1", "draft") == torch.bfloat16


# ---------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_forward_matches_cpu_and_uses_no_cpu_kernels(monkeypatch):
    cpu = build_tiny_model()
    gpu = build_tiny_model().to("cuda")
    toks, pos = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    want, _ = cpu(toks, pos, torch.tensor([0]), cpu.new_kv_slots(1, 16))  # the CPU reference may use them
    monkeypatch.setattr(native, "available", lambda: pytest.fail("native kernels asked for on CUDA"))
    monkeypatch.setattr(Linear, "run_kernel", lambda *a: pytest.fail("a CPU kernel plan ran on CUDA"))
    got, _ = gpu(toks.cuda(), pos.cuda(), torch.tensor([0], device="cuda"), gpu.new_kv_slots(1, 16))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_draft_and_target_on_different_devices():
    from specdec.decoding.sampling import SamplingParams
    from specdec.engine import Engine
    from specdec.scheduling.request import GenerationRequest

    target = build_tiny_model(seed=1, logit_scale=2.0).to("cuda:0")
    draft = build_tiny_model(hidden_size=16, num_layers=1, seed=2, logit_scale=2.0).to("cuda:1")
    eng = Engine(target, draft, inline=True)
    try:
        req = dict(prompt_ids=[1, 2, 3], max_new_tokens=12, params=SamplingParams(temperature=0.0), gamma=3)
        assert eng.generate(GenerationRequest(mode="sd", **req)).token_ids == \
            eng.generate(GenerationRequest(mode="ar", **req)).token_ids
    finally:
        eng.close()
