"""The native streaming linear (specdec/modeling/csrc/stream_linear.c via specdec.modeling.native.stream_linear), the
kernel of hosts without native bf16 GEMMs: exact to fp32 against a float64 reference, each row bitwise the same whatever
the rows and threads of its call, chosen by specdec.modeling.linear where the host (or `specdec.common.settings` `isa`
avx2, the emulation of an AVX2-only host) has no native bf16 GEMMs, and greedy `sd`/`pearl` equal to `ar` with it in
use.

The kernel needs an x86-64 CPU with AVX2 and FMA: every test checks that first and skips, saying so, elsewhere. The
kernel itself runs the same on AMX, AVX512-BF16 and AVX2-only hosts (it uses AVX2 only); what differs per host is
whether specdec.modeling.linear offers it, which the tests ask the host (or pin with the emulation)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.modeling import native

from specdec.common import settings
from specdec.engine import Engine
from specdec.modeling.dtypes import auto_dtype, cpu_has_fast_bf16
from specdec.modeling.linear import (STREAM_PLAN, Linear, check_row_invariance, release_stream_weights, set_plan,
                            set_row_invariant, stream_supported, tune_linears)
from specdec.scheduling.request import GenerationRequest
from tests.helpers_models import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HOST_AVX2 = platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma"} <= _cpu_flags()
needs_avx2 = pytest.mark.skipif(not HOST_AVX2, reason="the streaming linear needs an x86-64 CPU with AVX2 and FMA")
needs_kernel = pytest.mark.skipif(not (HOST_AVX2 and native.stream_linear_supported()),
                                  reason="the streaming linear is not built here (no AVX2+FMA, no C compiler, or "
                                         "SPECDEC_NATIVE=0)")
DTYPES = (torch.bfloat16, torch.float32)


def _reference(x, w, b):
    """float64 x @ w^T + b, and a bound on an fp32 accumulation's error (K + 8 roundings of the magnitudes)."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return ref, (x.shape[1] + 8) * 2.0 ** -24 * mag


@needs_avx2
@needs_kernel
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (96, 1536), (37, 45), (100, 17), (1, 8), (7, 3)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 40])
def test_kernel_matches_float64_reference(w_dtype, x_dtype, out_f, in_f, rows):
    """Every tile shape (1-3 rows wide, 4+ rows in groups of 3-6), a last panel cut short (out_f not a multiple of
    16), odd in_f, more than one row group, a bias: within fp32 accumulation error, plus one bf16 rounding for a
    bf16 output."""
    gen = torch.Generator().manual_seed(out_f * 1000 + in_f + rows)
    w = torch.randn(out_f, in_f, generator=gen).to(w_dtype)
    b = torch.randn(out_f, generator=gen).to(w_dtype)
    x = torch.randn(rows, in_f, generator=gen).to(x_dtype)
    for bias in (None, b):
        y = native.stream_linear(x, w, bias)
        assert y.shape == (rows, out_f) and y.dtype == x_dtype
        ref, bound = _reference(x, w, bias)
        if x_dtype is torch.bfloat16:
            bound = bound + 2.0 ** -8 * ref.abs()
        assert bool(((y.double() - ref).abs() <= bound).all()), float(((y.double() - ref).abs() - bound).max())


def _fma_chain(x, w, b, out_dtype):
    """What the kernel computes (csrc/stream_linear.c, "Numerics"), emulated: per output the fp32 chain
    acc = fma(x[k], w[n][k], acc) over k in order from 0 (a product of an fp32 and a bf16/fp32 value is exact in
    float64, and the sum is rounded to fp32 once per step), then + bias in fp32, then one rounding to out_dtype."""
    xd, wd = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (xd[:, k, None] * wd[None, :, k] + acc.double()).float()
    if b is not None:
        acc = acc + b.float()
    return acc.to(out_dtype)


@needs_avx2
@needs_kernel
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f", [(96, 64), (80, 40), (37, 45), (16, 9), (5, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 16, 50])
def test_kernel_is_bitwise_the_fused_multiply_add_chain_over_k(w_dtype, x_dtype, out_f, in_f, rows):
    """The kernel's numerics exactly, on every tile shape and row grouping (and past one 48-row block): each output
    bitwise the fp32 FMA chain over k in order, then the bias, then the output's rounding. So every host computes
    the same bits, and row invariance follows."""
    gen = torch.Generator().manual_seed(out_f * 7 + in_f * 3 + rows)
    w = torch.randn(out_f, in_f, generator=gen).to(w_dtype)
    b = torch.randn(out_f, generator=gen).to(w_dtype)
    x = torch.randn(rows, in_f, generator=gen).to(x_dtype)
    for bias in (None, b):
        y = native.stream_linear(x, w, bias)
        assert torch.equal(y, _fma_chain(x, w, bias, x_dtype)), (rows, bias is not None)


@needs_avx2
@needs_kernel
def test_a_packed_weight_is_checked_and_repacked_after_the_weight_changes():
    """`stream_linear` refuses a packed weight of another shape or dtype; `Linear.stream_weight` packs once, packs
    again after an in-place change of the weight (the result follows it), and `release_stream_weights` drops the
    copy where the plan does not use `stream`."""
    gen = torch.Generator().manual_seed(3)
    lin = Linear(40, 24, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="packed"):
        native.stream_linear(x, lin.weight, packed=native.stream_pack(torch.zeros(8, 40, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="packed"):
        native.stream_linear(x, lin.weight, packed=native.stream_pack(lin.weight.float()))
    with torch.inference_mode():
        first = lin.stream_weight()
        assert lin.stream_weight() is first
        y = lin.run_kernel("stream", x)
        lin.weight.mul_(2)
        assert lin.stream_weight() is not first
        assert torch.equal(lin.run_kernel("stream", x), native.stream_linear(x, lin.weight))
        assert torch.equal(lin.run_kernel("stream", x), (y.float() * 2).to(torch.bfloat16))
    model = torch.nn.Sequential(lin)
    lin.plan = ("gemm",) * 4
    assert release_stream_weights(model) == 1 and lin._streamed is None
    lin.plan = STREAM_PLAN
    lin.stream_weight()
    assert release_stream_weights(model) == 0 and lin._streamed is not None


@needs_avx2
@needs_kernel
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("out_f,in_f", [(576, 576), (200, 1536), (53, 45)])
def test_every_row_rounds_alike_alone_or_batched_on_any_thread_count(w_dtype, x_dtype, out_f, in_f):
    """Row invariance by construction: row i of a call of n rows is bitwise the row computed alone, for n = 2, 8,
    16 (and 1..40), whatever torch's thread count (1 or 2)."""
    gen = torch.Generator().manual_seed(in_f)
    w = (torch.randn(out_f, in_f, generator=gen) * 0.05).to(w_dtype)
    b = torch.randn(out_f, generator=gen).to(w_dtype)
    x = torch.randn(40, in_f, generator=gen).to(x_dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([native.stream_linear(x[i:i + 1], w, b) for i in range(40)])
        for n in (2, 8, 16, *range(1, 41)):
            assert torch.equal(native.stream_linear(x[:n], w, b), alone[:n]), n
        torch.set_num_threads(2)
        for n in (1, 2, 8, 16, 40):
            assert torch.equal(native.stream_linear(x[:n], w, b), alone[:n]), ("2 threads", n)
    finally:
        torch.set_num_threads(threads)


@needs_avx2
@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_invariant_layer_on_the_kernel_passes_the_load_time_check(dtype):
    """On `stream` a row-invariant layer runs one row unpadded and a long call unsplit, and the load-time check
    (which compares a row alone with calls of 2..40 rows) finds nothing."""
    m = build_tiny_model(vocab_size=64, hidden_size=48, seed=5).to(dtype)
    set_row_invariant(m)
    set_plan(m, STREAM_PLAN)
    lin = m.lm_head
    assert lin.rows_to_run(1) == 1
    assert check_row_invariance(m) == []


@needs_avx2
@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_avx2_host_offers_the_kernel_and_tuning_keeps_rows_invariant(dtype, runtime_settings):
    """`isa` avx2: no native bf16 GEMMs, so `stream` is a candidate for bf16 and fp32 layers, tuning plans fp32
    layers too, and the target's layers end on kernels whose rows round alike (a plan mixing `stream` with torch's
    GEMM would fail the check and move to `stream`)."""
    runtime_settings(isa="avx2")
    assert not cpu_has_fast_bf16() and stream_supported()
    m = build_tiny_model(vocab_size=64, hidden_size=48, seed=6).to(dtype)
    set_row_invariant(m)
    counts = tune_linears(m)
    layers = [x for x in m.modules() if isinstance(x, Linear)]
    assert sum(counts.values()) == len(layers) and all(x.plan is not None for x in layers)
    assert all("stream" in x.kernels(1) for x in layers)
    assert all(set(x.plan) <= set(x.kernels(1)) | {"gemm"} for x in layers)
    assert check_row_invariance(m) == []


@needs_avx2
@needs_kernel
def test_untuned_emulated_avx2_host_runs_every_bf16_layer_on_the_kernel(runtime_settings):
    """Tuning off: no plans, and the default plan of a bf16 layer runs on `stream` (row-invariant or not); an fp32
    layer keeps F.linear."""
    runtime_settings(isa="avx2", kernel_tune=False)
    m = build_tiny_model(seed=7).to(torch.bfloat16)
    set_row_invariant(m.model.layers[0])
    assert tune_linears(m) == {}
    layers = [x for x in m.modules() if isinstance(x, Linear)]
    assert all(x.plan is None and x.default_plan() == STREAM_PLAN for x in layers)
    assert all(x.rows_to_run(1) == 1 for x in layers)
    assert check_row_invariance(m) == []
    fp32 = build_tiny_model(seed=7)
    assert tune_linears(fp32) == {} and all(x.plan is None for x in fp32.modules() if isinstance(x, Linear))


@needs_avx2
@needs_kernel
def test_hosts_with_native_bf16_gemms_keep_their_paths():
    """Where oneDNN runs bf16 (AVX512, AMX) `stream` is never a candidate and fp32 layers are not planned: their
    paths are what they were. On an AVX2-only host the kernel is offered."""
    m = build_tiny_model(seed=8)
    tune_linears(m)  # fp32
    layers = [x for x in m.modules() if isinstance(x, Linear)]
    if cpu_has_fast_bf16():
        assert not stream_supported() and all(x.plan is None and "stream" not in x.kernels(1) for x in layers)
    else:
        assert stream_supported() and all("stream" in x.kernels(1) for x in layers)


@needs_avx2
@needs_kernel
def test_auto_dtype_on_an_avx2_host_is_bf16_through_the_kernel(runtime_settings):
    runtime_settings(isa="avx2")
    assert auto_dtype("cpu") == torch.bfloat16
    runtime_settings(native=False)  # no kernel: fp32, as before
    assert auto_dtype("cpu") == torch.float32


@needs_avx2
@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,gamma", [("sd", 2), ("sd", 4), ("sd", 7), ("pearl", 3)])
def test_greedy_sd_equals_ar_with_the_kernel_in_use(dtype, mode, gamma, monkeypatch, runtime_settings):
    """The target's every linear on the kernel (a verify of gamma + 1 rows, a decode step of one): greedy `sd` and
    `pearl` give `ar`'s tokens, and the kernel did run."""
    from specdec.modeling import linear

    # the engine keeps the plan set below (no tuning), and no padding tuned by earlier tests applies: each call
    # runs on the kernel as the rows it has
    runtime_settings(kernel_tune=False)
    monkeypatch.setattr(linear, "_TUNED", {})
    monkeypatch.setattr(linear, "_PADS", {})
    calls = []
    real = native.stream_linear
    monkeypatch.setattr(native, "stream_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    target = build_tiny_model(vocab_size=32, hidden_size=48, seed=1, logit_scale=2.0).to(dtype)
    draft = build_tiny_model(vocab_size=32, seed=3, logit_scale=2.0).to(dtype)
    set_row_invariant(target)
    for model in (target, draft):
        set_plan(model, STREAM_PLAN)
    eng = Engine(target, draft)
    try:
        prompt = [3, 1, 4, 1, 5]
        ref = eng.generate(GenerationRequest(prompt, 30, mode="ar")).token_ids
        out = eng.generate(GenerationRequest(prompt, 30, mode=mode, gamma=gamma, verify_method="greedy"))
        assert out.token_ids == ref
    finally:
        eng.close()
    assert 1 in calls and max(calls) > 1  # one-row steps and multi-row verifies both ran on it


@needs_avx2
def test_the_emulation_builds_for_avx2_and_caps_onednn(tmp_path):
    """SPECDEC_ISA=avx2 in a fresh process: the kernels build with -mavx2 -mfma -mf16c (not -march=native), the
    kernel runs, bf16 counts as slow, and prepare_process caps oneDNN and MKL at AVX2."""
    code = ("import os, torch; from specdec.modeling import native; from specdec.common import settings; "
            "from specdec.modeling.dtypes import cpu_has_fast_bf16; "
            "cmds, _ = native._commands('cc', '/tmp'); flags = {f for c in cmds for f in c}; "
            "assert {'-mavx2', '-mfma', '-mf16c'} <= flags and '-march=native' not in flags, flags; "
            "settings.prepare_process(); "
            "assert os.environ['ONEDNN_MAX_CPU_ISA'] == 'AVX2' and os.environ['MKL_ENABLE_INSTRUCTIONS'] == 'AVX2'; "
            "assert not cpu_has_fast_bf16(); "
            "print(native.stream_linear_supported())")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**env, "SPECDEC_ISA": "avx2", "SPECDEC_CACHE": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    if native.available():  # a compiler here: the AVX2 build was made and runs the kernel
        assert done.stdout.split() == ["True"]
        assert len(list((tmp_path / "native").glob("specdec-kernels-*.so"))) == 1


@needs_avx2
@needs_kernel
def test_a_call_that_needs_gradients_takes_the_autograd_path():
    """The kernel has no backward: with gradients on, a layer planned on it computes F.linear, and they flow."""
    lin = Linear(48, 20)
    lin.plan = STREAM_PLAN
    x = torch.randn(3, 48, requires_grad=True)
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(lin(x.detach()), torch.nn.functional.linear(x.detach(), lin.weight, lin.bias))
