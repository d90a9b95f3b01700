"""specdec.modeling.linear on any x86-64 host. Where oneDNN runs bf16 (AVX512 BW/VL/DQ, AVX512-BF16, AMX:
`packing_supported()`), bf16 weights are packed and `packed` is a candidate; on an AVX2-only CPU nothing is packed
and the plain kernels (`gemm`, `gemv`) must keep the same invariants. Each test asks the host which it is and checks
what follows. tests/test_linear_avx2.py runs the host-dependent ones again on a simulated AVX2-only CPU
(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)."""
import os

import pytest
import torch
import torch.nn.functional as F

from specdec.modeling.attention import attention
from specdec.modeling.dtypes import cpu_has_fast_bf16
from specdec.modeling.linear import (PAD_MAX_ROWS, Linear, packing_supported, prepack_linears, set_padding, set_plan,
                            tune_linears)
from tests.helpers_models import build_tiny_model


def test_one_row_gemv_computes_the_linear():
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    for shape in [(1, 1, 64), (1, 64), (64,), (1, 3, 64), (5, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        y = lin(x)
        assert y.shape == (*shape[:-1], 48) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), F.linear(x, lin.weight, lin.bias).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("plan", [("gemm",) * 4, ("gemv", "gemm", "gemm", "gemm"),
                                  ("gemv", "packed", "packed", "packed"), ("packed",) * 4, None])
def test_model_logits_do_not_depend_on_the_kernel_plan(plan):
    m = build_tiny_model(vocab_size=32, seed=3).to(torch.bfloat16)
    prepack_linears(m)
    kv = m.new_kv_slots(1, 16)
    slots = torch.tensor([0])
    m(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], slots, kv)
    set_plan(m, ("gemm",) * 4)
    ref = m(torch.tensor([[4, 5]]), torch.tensor([[3, 4]]), slots, kv)[0]
    set_plan(m, plan)
    out = m(torch.tensor([[4, 5]]), torch.tensor([[3, 4]]), slots, kv)[0]  # 2 rows
    one = m(torch.tensor([[4]]), torch.tensor([[3]]), slots, kv)[0]  # 1 row
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(one[0, -1].float(), ref[0, 0].float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("pad_to", [(4, 4, 4, 4, 5, 6, 7, 8), (8,) * 8, (2, 5, 3, 6, 5, 8, 7, 8)])
def test_padded_calls_compute_the_unpadded_rows(pad_to):
    """Row padding appends zero rows and drops their outputs: every shape keeps its real rows' values."""
    torch.manual_seed(3)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    lin.prepack()
    for shape in [(1, 1, 64), (64,), (2, 64), (1, 3, 64), (7, 64), (1, 8, 64), (12, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        lin.pad_to = None
        ref = lin(x)
        lin.pad_to = pad_to
        y = lin(x)
        assert y.shape == ref.shape == (*shape[:-1], 48) and y.is_contiguous()
        torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y.float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()),
                                   rtol=2e-2, atol=2e-2)


def test_model_logits_do_not_depend_on_row_padding():
    m = build_tiny_model(vocab_size=32, seed=4).to(torch.bfloat16)
    prepack_linears(m)
    slots = torch.tensor([0])
    outs = []
    for pad in (None, (4, 4, 4, 4, 5, 6, 7, 8)):
        set_padding(m, pad)
        kv = m.new_kv_slots(1, 16)
        m(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], slots, kv)
        outs.append((m(torch.tensor([[4, 5]]), torch.tensor([[3, 4]]), slots, kv)[0],
                     m(torch.tensor([[6]]), torch.tensor([[5]]), slots, kv)[0]))
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_every_kernel_computes_the_linear():
    torch.manual_seed(2)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    lin.prepack()
    for rows in (1, 3, 8, 20):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
        for k in lin.kernels(rows):
            torch.testing.assert_close(lin.run_kernel(k, x).float(), ref, rtol=2e-2, atol=2e-2)
    assert "gemv" in lin.kernels(1) and "gemv" not in lin.kernels(2)


def test_tuning_gives_every_bf16_linear_a_plan_of_runnable_kernels(runtime_settings):
    from specdec.modeling.quant import Int8Linear, int8_supported, quantize_int8_

    m = build_tiny_model(vocab_size=32, seed=3).to(torch.bfloat16)
    if int8_supported("cpu", torch.bfloat16):
        quantize_int8_(m.model.layers[0])
    prepack_linears(m)
    counts = tune_linears(m)
    layers = [x for x in m.modules() if isinstance(x, Linear)]
    assert sum(counts.values()) == len(layers)
    for x in layers:
        assert len(x.plan) == 4
        for cls, rows in enumerate((1, 4, 8, 9)):
            assert x.plan[cls] in x.kernels(rows)
        assert isinstance(x, Int8Linear) or "int8" not in x.plan
        # row padding: a call of r rows runs as p >= r rows, never more than PAD_MAX_ROWS
        assert x.pad_to is None or (len(x.pad_to) == PAD_MAX_ROWS
                                    and all(r <= p <= PAD_MAX_ROWS for r, p in enumerate(x.pad_to, 1)))
    runtime_settings(kernel_tune=False)  # off: no measurement, plans untouched
    set_plan(m, None)
    set_padding(m, None)
    assert tune_linears(m) == {} and all(x.plan is None and x.pad_to is None for x in layers)
    assert tune_linears(build_tiny_model(vocab_size=32, seed=3)) == {}  # fp32: nothing to tune either way


def test_decode_attention_matches_the_fused_kernel():
    torch.manual_seed(4)
    for H, KV, L in ((9, 3, 40), (4, 4, 7), (8, 2, 300)):
        q = torch.randn(1, H, 1, 64).to(torch.bfloat16)
        k, v = (torch.randn(1, KV, L, 64).to(torch.bfloat16) for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=KV != H)
        out = attention(q, k, v, None)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("S", [2, 5, 16])
def test_verify_block_attention_matches_the_fused_kernel(S):
    """A few masked query rows (a verify block: causal over the cache; a token tree: any mask) take the two-matmul
    path and agree with SDPA; longer blocks take SDPA itself."""
    torch.manual_seed(S)
    H, KV, L = 9, 3, 50
    q = torch.randn(1, H, S, 64).to(torch.bfloat16)
    k, v = (torch.randn(1, KV, L, 64).to(torch.bfloat16) for _ in range(2))
    causal = (torch.arange(L)[None, :] <= torch.arange(L - S, L)[:, None])[None, None]
    tree = causal & (torch.rand(1, 1, S, L) > 0.3)
    tree[..., torch.arange(S), torch.arange(L - S, L)] = True  # every row sees itself
    for mask in (causal, tree):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        out = attention(q, k, v, mask)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    # a non-contiguous mask view (Attention._per_row slices each row's own keys)
    wide = torch.cat([causal, torch.zeros(1, 1, S, 7, dtype=torch.bool)], dim=-1)[..., :L]
    torch.testing.assert_close(attention(q, k, v, wide).float(),
                               F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=causal,
                                                              enable_gqa=True), rtol=1e-2, atol=1e-2)


def test_prepacked_multi_row_kernel_is_bit_identical_and_never_stale():
    """Packed where this host packs (else the multi-row calls are F.linear itself): bit-identical to F.linear."""
    torch.manual_seed(1)
    lin = Linear(64, 48, bias=False).to(torch.bfloat16)
    assert lin.prepack() == packing_supported()
    for shape in [(1, 2, 64), (4, 64), (1, 17, 64), (300, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    with torch.no_grad():  # an in-place update must not be served from the old packed copy
        lin.weight.mul_(2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_prepack_skips_what_it_cannot_pack():
    """fp32 weights are never packed (F.linear already has a good kernel); bf16 ones are where oneDNN runs bf16 on
    this CPU, and on a CPU without (AVX2 only) none is, and the unpacked model still runs every row class."""
    assert not Linear(8, 8).prepack()
    if torch.backends.mkldnn.is_available():
        assert packing_supported() == cpu_has_fast_bf16()
    m = build_tiny_model(vocab_size=32, seed=3).to(torch.bfloat16)
    layers = [x for x in m.modules() if isinstance(x, Linear)]
    packed = prepack_linears(m)
    if packing_supported():
        assert packed == len(layers) and all("packed" in x.kernels(rows) for x in layers for rows in (1, 4, 9))
    else:
        # without fast bf16 GEMMs the weight-streaming kernel is a candidate where it builds
        # (specdec/modeling/linear.py)
        assert packed == 0 and all(x.kernels(rows) in (["gemm"], ["gemm", "stream"]) for x in layers
                                   for rows in (4, 9))
    kv = m.new_kv_slots(1, 32)
    for n, start in ((12, 0), (4, 12), (1, 16)):  # a prefill, a verify block, a decode step: default plans
        logits = m(torch.arange(n)[None] % 32, torch.arange(start, start + n)[None], torch.tensor([0]), kv)[0]
        assert logits.shape == (1, n, 32) and torch.isfinite(logits).all()


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_compute_the_same_model(bias):
    import copy

    from specdec.modeling.fusion import fuse_projections_, unfused_state
    from specdec.modeling.model import draft_fingerprint
    from specdec.modeling.quant import quantize_int8_

    m = build_tiny_model(vocab_size=32, seed=5)
    if bias:  # q/k/v biases (Qwen-style attention_bias) are stacked too
        for layer in m.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(layer.self_attn, name)
                b = Linear(lin.in_features, lin.out_features, bias=True)
                with torch.no_grad():
                    b.weight.copy_(lin.weight)
                    b.bias.normal_()
                setattr(layer.self_attn, name, b)
    state, fp = {k: v.clone() for k, v in m.state_dict().items()}, draft_fingerprint(m)
    fused = copy.deepcopy(m)
    assert fuse_projections_(fused) == 2
    a = fused.model.layers[0]
    assert a.self_attn.qkv_proj is not None and not hasattr(a.self_attn, "q_proj") and not hasattr(a.mlp, "up_proj")
    slots, ids = torch.tensor([0]), torch.tensor([[1, 7, 3, 9]])
    kv1, kv2 = m.new_kv_slots(1, 16), fused.new_kv_slots(1, 16)
    ref, got = m(ids, torch.arange(4)[None], slots, kv1)[0], fused(ids, torch.arange(4)[None], slots, kv2)[0]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    step = m(torch.tensor([[2]]), torch.tensor([[4]]), slots, kv1)[0]
    torch.testing.assert_close(fused(torch.tensor([[2]]), torch.tensor([[4]]), slots, kv2)[0], step,
                               rtol=1e-5, atol=1e-5)
    # the checkpoint's layout comes back exactly, and with it the pre-verifier's name for the draft
    back = unfused_state(fused)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert draft_fingerprint(fused) == fp
    # int8 keeps one scale per output channel: the stacked layer quantizes as its parts do
    q_sep, q_fused = copy.deepcopy(m).to(torch.bfloat16), fused.to(torch.bfloat16)
    quantize_int8_(q_sep)
    quantize_int8_(q_fused)
    s0, f0 = q_sep.model.layers[0], q_fused.model.layers[0]
    assert torch.equal(f0.self_attn.qkv_proj.qweight, torch.cat([s0.self_attn.q_proj.qweight,
                                                                  s0.self_attn.k_proj.qweight,
                                                                  s0.self_attn.v_proj.qweight]))
    assert torch.equal(f0.mlp.gate_up_proj.scales, torch.cat([s0.mlp.gate_proj.scales, s0.mlp.up_proj.scales]))


def _down_projection(seed: int = 0) -> Linear:
    """A bf16 linear of the default target's down-projection shape (1536 → 576), packed."""
    torch.manual_seed(seed)
    lin = Linear(1536, 576, bias=False).to(torch.bfloat16).eval()
    lin.prepack()
    return lin


@pytest.mark.parametrize("plan", ["tuned", "gemv", "packed"])
def test_a_row_invariant_linear_rounds_every_row_alike_alone_or_batched(plan, monkeypatch):
    """A target's row must round the same alone (a lone decode step) as among other sessions' rows (a batched step),
    whatever tuning chose: no gemv, no one-row call."""
    from specdec.modeling import linear

    lin = _down_projection()
    linear.set_row_invariant(lin)
    monkeypatch.setattr(linear, "_TUNED", {})
    monkeypatch.setattr(linear, "_PADS", {})
    if plan == "tuned":
        tune_linears(lin)
        # gemv, the weight-streaming kernel (row-invariant by construction, AVX2-only hosts), or a padded call
        assert lin.plan[0] in ("gemv", "stream") or lin.rows_to_run(1) >= linear.MIN_INVARIANT_ROWS
    else:  # what a tuner may pick elsewhere, unpadded
        lin.plan, lin.pad_to = (plan, "packed", "packed", "packed"), None
        assert linear.enforce_row_invariance(lin) == []
    assert linear.check_row_invariance(lin) == []
    x = torch.randn(48, 1536, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(48)])
        assert torch.equal(lin(x), alone)
        # and it is still the linear (bitwise only where F.linear's kernel rounds like the chunks of at most
        # MAX_INVARIANT_ROWS rows that a row-invariant layer runs: not on AMX hosts at 48 rows)
        torch.testing.assert_close(alone, F.linear(x, lin.weight), rtol=1.6e-2, atol=2e-2)


def test_the_invariance_check_sees_a_one_row_path_that_rounds_differently(monkeypatch):
    """With one-row calls allowed, oneDNN's one-row kernel rounds some rows of this shape unlike its multi-row one
    on some hosts; the load-time check must report it (skipped where this host's kernels happen to agree)."""
    from specdec.modeling import linear

    lin = _down_projection()
    lin.plan, lin.pad_to = ("packed",) * 4, None
    n = linear.MAX_INVARIANT_ROWS  # within one call of a row-invariant layer (longer calls are split)
    x = torch.randn(n, 1536, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        differs = not torch.equal(torch.cat([lin(x[i:i + 1]) for i in range(n)]), lin(x))
    if not differs:
        pytest.skip("this host's one-row and multi-row kernels round alike")
    linear.set_row_invariant(lin)
    monkeypatch.setattr(linear, "MIN_INVARIANT_ROWS", 1)
    assert linear.check_row_invariance(lin, max_rows=48) == [(576, 1536)]
    monkeypatch.setattr(linear, "MIN_INVARIANT_ROWS", 2)
    assert linear.check_row_invariance(lin, max_rows=48) == []


def test_only_the_target_is_row_invariant(tmp_path, runtime_settings):
    """load_model_dir makes a target's linears row-invariant (unless SPECDEC_ROW_INVARIANT=0), not a draft's."""
    from specdec.modeling.model import load_model_dir
    from tests.helpers_models import save_model

    path = save_model(build_tiny_model(vocab_size=64, hidden_size=32, seed=1), tmp_path / "m")

    def invariant(role):
        model = load_model_dir(path, dtype=torch.bfloat16, role=role, quant="none")
        flags = {m.row_invariant for m in model.modules() if isinstance(m, Linear)}
        assert len(flags) == 1
        return flags.pop()

    assert invariant("target") and not invariant("draft")
    runtime_settings(row_invariant=False)
    assert not invariant("target")


def test_a_one_row_gemv_that_rounds_unlike_the_batch_is_replaced_at_load(monkeypatch):
    """Where `torch.mv` rounds a row unlike the multi-row kernel (simulated: one bf16 ulp off), the load-time check
    moves one-row calls to the padded oneDNN call."""
    from specdec.modeling import linear

    real = Linear.run_kernel

    def off_by_an_ulp(self, kernel, x2):
        y = real(self, kernel, x2)
        if kernel == "gemv" and x2.shape[0] == 1:
            y = y.clone()
            y.view(torch.int16)[0, 0] += 1
        return y

    monkeypatch.setattr(Linear, "run_kernel", off_by_an_ulp)
    lin = _down_projection()
    linear.set_row_invariant(lin)
    lin.plan, lin.pad_to = ("gemv", "packed", "packed", "packed"), None
    assert linear.check_row_invariance(lin) == [(576, 1536)]
    assert linear.enforce_row_invariance(lin) == []
    # the padded multi-row call: the packed kernel where this host packs bf16 weights, else F.linear
    assert lin.plan[0] == ("packed" if packing_supported() else "gemm")
    assert lin.rows_to_run(1) == linear.MIN_INVARIANT_ROWS


_CACHE_PROBE = """
import sys, torch
from specdec.common import settings
if sys.argv[1] == "1":
    settings.prepare_process()  # as a model load does, after torch is imported
import specdec.modeling.linear as L
rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) // 1024
torch.set_num_threads(1)
dtype = getattr(torch, sys.argv[3])
if sys.argv[2] == "linear":  # specdec.modeling.linear.Linear, packed where this host packs
    lins = [L.Linear(576, n, bias=False).to(dtype) for n in (576, 192, 1536)]
    for m in lins: m.prepack()
    calls = [(m, m.in_features) for m in lins]
else:  # oneDNN's own packed linear, which runs fp32 on any x86-64 CPU
    ws = [torch.randn(n, 576).to(dtype) for n in (576, 192, 1536)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in ws]
    calls = [(lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), 576) for w in packed]
r0 = rss()
with torch.no_grad():
    for rows in range(1, 320):
        for f, k in calls:
            f(torch.randn(rows, k, dtype=dtype))
print(rss() - r0)
"""


def _cache_growth(prepare: bool, path: str, dtype: str, cap: str | None = None) -> int:
    """MB an interpreter grows by running 3 weight shapes at 1-319 rows each (in a fresh process: the caches' sizes
    are read at its first oneDNN call). `prepare`: it calls settings.prepare_process() first; `cap`: both cache
    sizes set in its environment."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    env.update({"LRU_CACHE_CAPACITY": cap, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": cap} if cap else {})
    out = subprocess.run([sys.executable, "-c", _CACHE_PROBE, str(int(prepare)), path, dtype], capture_output=True,
                         text=True, env=env, check=True, timeout=300)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")
def test_onednn_kernel_caches_stay_bounded_over_every_row_count():
    """oneDNN and ideep keep a kernel per (row count, weight shape), 1024 of each by default: a replica fed every
    row count grew by hundreds of MB. settings.prepare_process() caps both caches at 256. Where this host packs bf16
    weights, the bf16 linears fill those caches; where it does not (AVX2 only), they build no oneDNN kernels at all,
    and the cap is checked on oneDNN's fp32 packed linear, which runs on any x86-64 CPU."""
    if packing_supported():
        path, dtype = "linear", "bfloat16"
    else:
        assert _cache_growth(False, "linear", "bfloat16", cap="1024") < 64  # measured: 3 MB, capped or not
        path, dtype = "onednn", "float32"
    capped, default = _cache_growth(True, path, dtype), _cache_growth(False, path, dtype, cap="1024")
    assert capped < 0.6 * default, (capped, default)  # measured: 265 MB against 570 MB (bf16, AMX host)
