"""Whole decoder layers as one native call (specdec/modeling/csrc/decoder_layer.c via
specdec.modeling.native.decoder_layer): taken by `CausalLM.forward` for a decode step or verify block whose every linear
runs on the streaming kernel (hosts without native bf16 GEMMs), the same arithmetic as the op-by-op path, each row
bitwise the same alone or in a block, greedy `sd`/`pearl` equal to `ar` through it, and the op-by-op path wherever a
layer does not qualify.

The streaming kernel needs an x86-64 CPU with AVX2 and FMA (every CI host has them; elsewhere these tests skip,
saying so). The tests pin the plan (`set_plan(..., STREAM_PLAN)`) rather than ask the host which kernel it would
tune to, so they run the same on AMX, AVX512-BF16 and AVX2-only hosts."""
from __future__ import annotations

import pytest
import torch

from specdec.common import settings
from specdec.engine import Engine
from specdec.modeling import linear as linear_mod
from specdec.modeling import native
from specdec.modeling.fusion import fuse_projections_
from specdec.modeling.linear import STREAM_PLAN, check_row_invariance, set_plan, set_row_invariant
from specdec.modeling.model import CausalLM, ModelConfig
from specdec.scheduling.request import GenerationRequest
from tests.helpers_models import build_tiny_model, sessions_then_block
from tests.test_stream_linear import HOST_AVX2

needs_kernel = pytest.mark.skipif(not (HOST_AVX2 and native.stream_linear_supported()),
                                  reason="the streaming linear is not built here (no AVX2+FMA, no C compiler, or "
                                         "SPECDEC_NATIVE=0)")
pytestmark = needs_kernel
DTYPES = (torch.bfloat16, torch.float32)


def _streaming(model: CausalLM) -> CausalLM:
    fuse_projections_(model)
    set_plan(model, STREAM_PLAN)
    return model


def _tiny(dtype, **kw) -> CausalLM:
    return _streaming(build_tiny_model(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, seed=5, **kw)
                      .to(dtype))


def _run(model: CausalLM, native_layers: bool, rows: int):
    """Prefill three sessions of different lengths, then a batched forward of `rows` rows each and a one-session
    block: their logits, and every layer's cache afterwards."""
    with settings.override(native_layers=native_layers):
        batched, single, kv = sessions_then_block(model, rows)
        return batched, single, [c.clone() for c in kv.k + kv.v]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 9, 16])
def test_native_layers_compute_what_the_op_by_op_path_computes(dtype, rows):
    """RoPE, the cache write, the projections and the first layer's keys and values are bitwise those of the
    op-by-op path; the logits agree to an ulp of the activation (libm's expf in SiLU against ATen's); a row alone
    is bitwise the row in a batch."""
    model = _tiny(dtype)
    assert model._native_layers(3 * rows, dtype) is not None  # the native call does run
    (nb, ns, ncache), (tb, ts, tcache) = _run(model, True, rows), _run(model, False, rows)
    n_layers = model.config.num_hidden_layers
    assert torch.equal(ncache[0], tcache[0]) and torch.equal(ncache[n_layers], tcache[n_layers])  # layer 0's k, v
    tol = 1e-5 if dtype is torch.float32 else 0.05
    for a, b in ((nb, tb), (ns, ts)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    if dtype is torch.float32:
        assert torch.equal(nb.argmax(-1), tb.argmax(-1))
    assert torch.equal(nb[1:2], ns)  # row invariance: the session alone equals its rows in the batch


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_invariant_target_on_native_layers_passes_the_load_time_check(dtype):
    model = _tiny(dtype)
    set_row_invariant(model)
    set_plan(model, STREAM_PLAN)
    assert model._native_layers(8, dtype) is not None
    assert check_row_invariance(model) == []


def test_layers_that_do_not_qualify_take_the_op_by_op_path(monkeypatch):
    """A linear on another kernel, q/k norms (Qwen3), unfused projections, or the switch off: no native call."""
    calls = []
    real = native.decoder_layer
    monkeypatch.setattr(native, "decoder_layer", lambda *a: calls.append(1) or real(*a))
    tok, pos, slot = torch.tensor([[5]]), torch.tensor([[0]]), torch.tensor([0])

    def runs(model) -> bool:
        calls.clear()
        model(tok, pos, slot, model.new_kv_slots(1, 8))
        return bool(calls)

    model = _tiny(torch.bfloat16)
    assert runs(model)
    model.model.layers[1].mlp.down_proj.plan = ("gemm",) * 4  # one linear elsewhere: the memo sees the change
    assert not runs(model)
    model.model.layers[1].mlp.down_proj.plan = STREAM_PLAN
    assert runs(model)
    with settings.override(native_layers=False):
        assert not runs(model)
    assert not runs(build_tiny_model(vocab_size=97, hidden_size=64, seed=5).to(torch.bfloat16))  # unfused
    model.to(torch.float32)  # new weights in place of the old: the memo hands the call their addresses
    assert runs(model)
    kv_a, kv_b = model.new_kv_slots(1, 8), model.new_kv_slots(1, 8)
    native_logits = model(tok, pos, slot, kv_a)[0]
    with settings.override(native_layers=False):
        torch.testing.assert_close(native_logits, model(tok, pos, slot, kv_b)[0], atol=1e-5, rtol=1e-5)
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, qk_norm=True)
    assert not runs(_streaming(CausalLM(cfg).to(torch.bfloat16)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,gamma", [("sd", 2), ("sd", 5), ("pearl", 3)])
def test_greedy_sd_equals_ar_on_native_layers(dtype, mode, gamma, monkeypatch, runtime_settings):
    """Target and draft on native layers (one-row steps and verify blocks): greedy `sd` and `pearl` give `ar`'s
    tokens, and the native layers did run for both row counts."""
    from specdec.modeling import linear

    runtime_settings(kernel_tune=False)  # the engine keeps the plan set below
    monkeypatch.setattr(linear, "_TUNED", {})
    monkeypatch.setattr(linear, "_PADS", {})
    rows = []
    real = native.decoder_layer
    monkeypatch.setattr(native, "decoder_layer", lambda x, *a: rows.append(x.shape[0] * x.shape[1]) or real(x, *a))
    target = _streaming(build_tiny_model(vocab_size=32, hidden_size=48, seed=1, logit_scale=2.0).to(dtype))
    draft = _streaming(build_tiny_model(vocab_size=32, seed=3, logit_scale=2.0).to(dtype))
    set_row_invariant(target)
    set_plan(target, STREAM_PLAN)
    eng = Engine(target, draft)
    try:
        prompt = [3, 1, 4, 1, 5]
        ref = eng.generate(GenerationRequest(prompt, 30, mode="ar")).token_ids
        out = eng.generate(GenerationRequest(prompt, 30, mode=mode, gamma=gamma, verify_method="greedy"))
        assert out.token_ids == ref
    finally:
        eng.close()
    assert 1 in rows and max(rows) > 1


def test_bad_slot_is_still_a_clear_error():
    model = _tiny(torch.bfloat16)
    kv = model.new_kv_slots(2, 16)
    with pytest.raises(ValueError, match="slots must lie in"):
        model(torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([5]), kv)


def _draft(quantized: bool = False) -> CausalLM:
    from specdec.modeling.linear import tune_linears
    from specdec.modeling.quant import quantize_int8_

    model = build_tiny_model(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, seed=7).to(torch.bfloat16)
    fuse_projections_(model)
    if quantized:
        quantize_int8_(model)
    tune_linears(model)
    return model


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("margin,moves", [(-10.0, True), (1.0, False)])
def test_a_draft_moves_to_native_layers_only_where_it_measures_faster(quantized, margin, moves, monkeypatch):
    """`tune_native_layers` keeps, per row class, whichever measured faster: with a margin no timing can miss
    (stream always kept) every class 1/4/8 runs natively, the prefill class keeps its kernel; with one no timing
    can meet, the tuned plans stay as they were. An int8 draft (its dequantized weight on `stream`) alike."""
    import specdec.modeling.model as model_mod

    monkeypatch.setattr(model_mod, "NATIVE_MARGIN", margin)
    model = _draft(quantized)
    layer_linears = [m for m in model.model.layers.modules() if isinstance(m, linear_mod.Linear)]
    tuned = [(m.plan or m.default_plan(), m.pad_to) for m in layer_linears]
    moved = model.tune_native_layers(budget_s=0.05)
    if moves:
        assert moved == [1, 4, 8]
        assert all(model._native_layers(r, torch.bfloat16) is not None for r in range(1, 9))
        assert all(m.plan[3] == plan[3] for m, (plan, _) in zip(layer_linears, tuned))  # prefills keep theirs
    else:
        assert moved == [] and [(m.plan or m.default_plan(), m.pad_to) for m in layer_linears] == tuned


def test_a_row_invariant_model_or_tuning_off_keeps_its_plans(monkeypatch, runtime_settings):
    import specdec.modeling.model as model_mod

    monkeypatch.setattr(model_mod, "NATIVE_MARGIN", -10.0)
    target = _draft()
    set_row_invariant(target)
    assert target.tune_native_layers(budget_s=0.05) == []
    draft = _draft()
    runtime_settings(kernel_tune=False)
    assert draft.tune_native_layers(budget_s=0.05) == []


@pytest.mark.parametrize("mode", ["sd", "pearl"])
def test_greedy_output_with_a_native_layer_draft_is_the_targets(mode, monkeypatch):
    """A draft moved to native layers by its engine's tuning (forced) beside an op-by-op target: greedy output
    equals `ar`'s (the draft's numerics never reach the output)."""
    import specdec.modeling.model as model_mod

    monkeypatch.setattr(model_mod, "NATIVE_MARGIN", -10.0)
    calls = []
    real = native.decoder_layer
    monkeypatch.setattr(native, "decoder_layer", lambda *a: calls.append(1) or real(*a))
    target = build_tiny_model(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, seed=5,
                              logit_scale=2.0).to(torch.bfloat16)
    set_row_invariant(target)
    eng = Engine(target, _draft())
    try:
        prompt = [3, 1, 4, 1, 5]
        ref = eng.generate(GenerationRequest(prompt, 24, mode="ar")).token_ids
        assert eng.generate(GenerationRequest(prompt, 24, mode=mode, gamma=3, verify_method="greedy")).token_ids == ref
    finally:
        eng.close()
    assert calls  # the draft ran native layers


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_qkv_bias_runs_natively_and_a_sliding_window_changes_nothing(dtype):
    """Qwen2.5's q/k/v bias is the streaming kernel's bias; a window (Mistral) is served up to its length, where it
    equals full attention (specdec/modeling/model.py)."""
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True, sliding_window=4096)
    model = CausalLM(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = _streaming(model.to(dtype))
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert model._native_layers(3, dtype) is not None
    (nb, ns, ncache), (tb, ts, tcache) = _run(model, True, 3), _run(model, False, 3)
    assert torch.equal(ncache[0], tcache[0])
    tol = 1e-5 if dtype is torch.float32 else 0.05
    torch.testing.assert_close(nb, tb, atol=tol, rtol=tol)


def test_a_feature_draft_tunes_and_runs_native_layers(monkeypatch):
    """A feature draft (its fc mixes the target's features in before the layers) times its forwards with features
    and runs its layers natively; the logits equal the op-by-op path's."""
    from specdec.modeling.linear import tune_linears
    import specdec.modeling.model as model_mod

    monkeypatch.setattr(model_mod, "NATIVE_MARGIN", -10.0)
    model = build_tiny_model(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, seed=9,
                             feature_size=48).to(torch.bfloat16)
    fuse_projections_(model)
    tune_linears(model)
    assert model.tune_native_layers(budget_s=0.05) == [1, 4, 8]
    feats = torch.randn(1, 3, 48, generator=torch.Generator().manual_seed(1))
    outs = []
    for on in (True, False):
        with settings.override(native_layers=on):
            kv = model.new_kv_slots(1, 16)
            outs.append(model(torch.tensor([[4, 5, 6]]), torch.arange(3)[None], torch.tensor([0]), kv,
                              features=feats)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=0.05, rtol=0.05)


def test_silu_exp_is_within_an_ulp_and_the_same_in_a_vector_or_a_tail():
    """SiLU's exp (csrc/expf.h) against float64: within 1 ulp of fp32 over its range, +inf above 88.38, 0 below
    -87.34, NaN kept; and an element's value does not depend on whether it falls in an 8-wide vector or in the
    scalar tail (a shifted copy of the input gives the same values), so a row's activations are the same wherever
    its features fall."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-87.3, 88.3, 20_003), torch.randn(5_000, generator=gen) * 4,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.2, -87.0])])
    y = native.exp(x)
    ref = torch.exp(x.double())
    ulp = (ref.float().nextafter(torch.tensor(float("inf"))) - ref.float()).double()
    assert float(((y.double() - ref).abs() / ulp).max()) <= 1.0
    edges = native.exp(torch.tensor([88.5, 100.0, -87.5, -200.0, float("inf"), float("-inf"), float("nan")]))
    assert edges[:2].isinf().all() and (edges[2:4] == 0).all() and edges[4].isinf() and edges[5] == 0
    assert edges[6].isnan()
    for shift in (1, 3, 7):  # each element moves between vector lanes and the tail
        assert torch.equal(native.exp(x[shift:]), y[shift:])
