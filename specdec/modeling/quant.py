"""Weight-only int8 linears for small-row decoding on CPU (the draft's hot path).

A draft decodes one row per session per step, so its linears are GEMVs that stream every weight once per token.
`torch._weight_int8pack_mm` (int8 weights, per-output-channel scales, bf16 activations) reads half of bf16's bytes
and a quarter of fp32's. At one row it beat every bf16 kernel on both hosts measured (the whole draft step costs
about half; docs/benchmarks.md, "int8 draft weights" and "Kernels per host"); from a few rows on it can lose to the
prepacked bf16 kernel. So an `Int8Linear` also keeps the *dequantized* bf16 weight, and which of the two serves 1,
4 and 8 rows is measured per host (`specdec.modeling.linear.tune_linears`); prefills always take the bf16 weight. Both
compute the same function up to summation order, which makes the quantized model one well-defined draft.

Quantizing the draft never touches losslessness: verification uses the draft's own q, whatever computed it. The
target is never quantized here (its distribution is the output distribution).
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.common.defaults import QUANT_MODES
from specdec.modeling.linear import Linear

INT8_MAX_ROWS = 8  # the int8 kernel is a candidate up to this many rows (above, it loses everywhere measured)


def int8_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """The packed int8 kernel exists for CPU and pays only with bf16 activations (with fp32 ones it is slower)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and hasattr(torch, "_weight_int8pack_mm"))


class Int8Linear(Linear):
    """`nn.Linear` with int8 weights and one scale per output channel (symmetric, round to nearest).

    It keeps the dequantized bf16 weight too (`weight`): calls with more rows than the int8 kernel pays for run a
    bf16 kernel on it (packed at load like any `Linear`), and which kernel serves 1, 4 and 8 rows is measured per
    host like any `Linear`'s (`specdec.modeling.linear.tune_linears`; untuned: int8 up to INT8_MAX_ROWS rows)."""

    DEFAULT_PLAN = ("int8", "int8", "int8", "packed")

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        dtype = linear.weight.dtype
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("weight", (q.float() * scales[:, None]).to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def kernels(self, rows: int) -> list[str]:
        return super().kernels(rows) + (["int8"] if rows <= INT8_MAX_ROWS else [])

    def run_kernel(self, kernel: str, x2: torch.Tensor) -> torch.Tensor:
        if kernel == "int8" and x2.shape[0] <= INT8_MAX_ROWS and x2.dtype == self.scales.dtype:
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
            return y if self.bias is None else y + self.bias
        return super().run_kernel(kernel, x2)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize_int8_(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by an `Int8Linear`, in place; returns how many were replaced."""
    n = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
            n += 1
        else:
            n += quantize_int8_(child)
    return n


def resolve_quant(quant: str, role: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """`auto` → int8 for a draft where the int8 kernel pays (CPU, bf16), else none. `int8` where it does not pay
    is refused with what to change, rather than silently served slower."""
    if quant not in QUANT_MODES:
        raise ValueError(f"quant {quant!r} is not supported; use one of {', '.join(QUANT_MODES)}")
    if quant == "auto":
        return "int8" if role == "draft" and int8_supported(device, dtype) else "none"
    if quant == "int8" and not int8_supported(device, dtype):
        raise ValueError(f"int8 weights need a CPU device and bfloat16 activations (got {device}, {dtype}); "
                         "use --dtype bfloat16 on CPU, or quant none")
    return quant


def weight_quant(model: nn.Module) -> str:
    """"int8" if `model` carries int8 linears (`quantize_int8_`), else "none" (what GetInfo reports)."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"
