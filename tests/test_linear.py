import torch
import torch.nn.functional as F

import specdec.linear
from specdec.linear import Linear
from tests.helpers_models import build_tiny_model


def test_one_row_gemv_computes_the_linear():
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    for shape in [(1, 1, 64), (1, 64), (64,), (1, 3, 64), (5, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        y = lin(x)
        assert y.shape == (*shape[:-1], 48) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), F.linear(x, lin.weight, lin.bias).float(), rtol=1e-2, atol=1e-2)


def test_model_logits_do_not_depend_on_the_one_row_kernel():
    m = build_tiny_model(vocab_size=32, seed=3).to(torch.bfloat16)
    kv = m.new_kv_slots(1, 16)
    slots = torch.tensor([0])
    m(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], slots, kv)
    out = {}
    for gemv in (True, False):
        specdec.linear.GEMV_ONE_ROW = gemv
        out[gemv] = m(torch.tensor([[4]]), torch.tensor([[3]]), slots, kv)[0]
    specdec.linear.GEMV_ONE_ROW = True
    torch.testing.assert_close(out[True], out[False], rtol=2e-2, atol=2e-2)
    assert int(out[True].argmax()) == int(out[False].argmax())



def test_prepacked_multi_row_kernel_is_bit_identical_and_never_stale():
    torch.manual_seed(1)
    lin = Linear(64, 48, bias=False).to(torch.bfloat16)
    if not lin.prepack():
        import pytest
        pytest.skip("oneDNN weight packing is not available in this torch build")
    for shape in [(1, 2, 64), (4, 64), (1, 17, 64), (300, 64)]:
        x = torch.randn(shape).to(torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    with torch.no_grad():  # an in-place update must not be served from the old packed copy
        lin.weight.mul_(2)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_prepack_skips_what_it_cannot_pack():
    assert not Linear(8, 8).prepack()  # fp32: F.linear already has a good kernel
    m = build_tiny_model(vocab_size=32, seed=3).to(torch.bfloat16)
    from specdec.linear import packing_supported, prepack_linears
    assert prepack_linears(m) == (sum(isinstance(x, Linear) for x in m.modules()) if packing_supported() else 0)
