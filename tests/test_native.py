"""The native decode attention (specdec/modeling/csrc/decode_attention.c via specdec.modeling.native): exact against a
float64 reference, equal to the torch path inside the model, safe to load, and optional (the torch path stands in)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.modeling import native

from specdec.common import settings
from tests.helpers_models import build_tiny_model, sessions_then_block

needs_kernel = pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernel is not built")


def _reference(q, kc, vc, slots, visible):
    """float64 softmax(q k^T / sqrt(D)) v over each query row's visible keys of its slot."""
    B, S, H, D = q.shape
    G = H // kc.shape[2]
    out = torch.empty(B, S, H, D, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            n = int(visible[b, s])
            for h in range(H):
                keys = kc[slots[b], :n, h // G].double()
                w = torch.softmax(keys @ q[b, s, h].double() * D ** -0.5, dim=0)
                out[b, s, h] = w @ vc[slots[b], :n, h // G].double()
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 64), (4, 4, 128), (3, 1, 24)])
@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 5), (3, 1), (3, 9)])
def test_kernel_matches_float64_reference(dtype, heads, kv_heads, head_dim, batch, rows):
    gen = torch.Generator().manual_seed(heads * 100 + batch * 10 + rows)
    num_slots, max_len = 5, 80
    kc = torch.randn(num_slots, max_len, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_slots, max_len, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, rows, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_slots, generator=gen)[:batch]
    ends = torch.randint(rows, max_len - rows, (batch,), generator=gen)  # each row's own length
    visible = (ends[:, None] + torch.arange(1, rows + 1)[None]).contiguous()
    out = native.decode_attention(q, kc, vc, slots, visible)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, slots, visible), atol=2e-5, rtol=1e-4)


@needs_kernel
def test_kernel_exact_on_peaked_scores():
    """Scores hundreds apart (an attention sink): the clamped exponent must not change the weights."""
    gen = torch.Generator().manual_seed(7)
    kc = torch.randn(2, 300, 2, 64, generator=gen) * 30
    vc = torch.randn(2, 300, 2, 64, generator=gen)
    q = torch.randn(2, 3, 4, 64, generator=gen) * 3
    slots, visible = torch.tensor([1, 0]), torch.tensor([[250, 251, 252], [98, 99, 100]])
    out = native.decode_attention(q, kc, vc, slots, visible)
    torch.testing.assert_close(out.double(), _reference(q, kc, vc, slots, visible), atol=2e-5, rtol=1e-4)


def _decode(model, native_on: bool, dtype: torch.dtype, rows: int):
    """Prefill three sessions of different lengths, then one batched forward of `rows` rows each, and one
    single-session verify block: the logits of both."""
    with settings.override(native=native_on):
        batched, single, _ = sessions_then_block(model, rows)
        return batched, single


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_model_native_equals_torch_path(dtype, rows):
    model = build_tiny_model(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, seed=5).to(dtype)
    on, off = _decode(model, True, dtype, rows), _decode(model, False, dtype, rows)
    for a, b in zip(on, off):
        # fp32: the kernel sums in another order than torch's matmuls, and the difference grows through the layers
        # (1.4e-5 on an Intel host, under 1e-5 on AMD); a wrong key, slot or mask moves logits by O(1).
        # bf16: rounding of the o_proj input may differ by an ulp.
        tol = 1e-4 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        if dtype == torch.float32:
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_bad_slot_is_a_clear_error_not_a_wild_read():
    model = build_tiny_model()
    kv = model.new_kv_slots(2, 16)
    with pytest.raises(ValueError, match="slots must lie in"):
        model(torch.tensor([[1], [2]]), torch.tensor([[0], [0]]), torch.tensor([0, 2]), kv)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=Path(__file__).resolve().parent.parent)


@needs_kernel
def test_fresh_build_keeps_subnormals(tmp_path):
    """A fresh build loads, and loading it leaves the process's float mode alone (no flush-to-zero, which a
    -ffast-math link would set for every thread's later torch ops in the loading thread)."""
    done = _python("import torch; from specdec.modeling import native; assert native.available(); "
                   "x = torch.tensor([1e-39]); assert float(x * 1.0) > 0, 'subnormals flushed'",
                   SPECDEC_CACHE=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert len(list((tmp_path / "native").glob("specdec-kernels-*.so"))) == 1


@pytest.mark.parametrize("env", [{"SPECDEC_NATIVE": "0"}, {"CC": "false"}])
def test_torch_path_stands_in(tmp_path, env):
    """Switched off, or with a compiler that fails, the model still runs (the torch path) and says why."""
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO); from specdec.modeling import native; "
            "from tests.helpers_models import build_tiny_model; assert not native.available(); m = build_tiny_model(); "
            "kv = m.new_kv_slots(1, 8); m(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], torch.tensor([0]), kv); "
            "print(m(torch.tensor([[4]]), torch.tensor([[3]]), torch.tensor([0]), kv)[0].shape)")
    done = _python(code, SPECDEC_CACHE=str(tmp_path), **env)
    assert done.returncode == 0, done.stderr
    assert "torch.Size([1, 1, 32])" in done.stdout
    assert "torch path" in done.stderr


def _torch_rms_norm(x, weight, eps, residual=None):
    """specdec.modeling.model.RMSNorm's torch path."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (x, y)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (150, 96)])
def test_rms_norm_matches_the_torch_path(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(1, rows, dim, generator=gen) * 3).to(dtype)
    res = torch.randn(1, rows, dim, generator=gen).to(dtype)
    w = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    with torch.inference_mode():
        y, ref = native.rms_norm(x, w, 1e-5), _torch_rms_norm(x, w, 1e-5)
        total, y_res = native.rms_norm(x, w, 1e-5, residual=res)
        ref_total, ref_res = _torch_rms_norm(x, w, 1e-5, res)
    assert torch.equal(total, ref_total)  # the residual add rounds as torch's does, bit for bit
    for got, want in ((y, ref), (y_res, ref_res)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # the mean's summation order may move y across a bf16 rounding boundary, and weight * y rounds
            # again: up to 2 ulps, seldom
            assert (got != want).float().mean() < 0.01
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -6)


def test_rms_norm_keeps_autograd_on_the_torch_path():
    """Training (distillation) differentiates through the norms: with grad enabled the torch path runs."""
    norm = build_tiny_model().model.norm
    x = torch.randn(2, 3, 32, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
