"""Weight-only int8 linears for small-row decoding on CPU (the draft's hot path).

A draft decodes one row per session per step, so its linears are GEMVs that stream every weight once per token.
On this class of CPU the bf16 GEMV runs at ~2 GB/s and fp32 at ~4-8 GB/s, while `torch._weight_int8pack_mm`
(int8 weights, per-output-channel scales, bf16 activations) reads a quarter of fp32's bytes: for the default
draft's 8192-row head it is ~3-5x faster than bf16/fp32 at one row, still ahead at 8 rows (1-thread
microbenchmarks), and the whole draft step costs half (docs/benchmarks.md, "int8 draft weights"). With many rows
(a prefill) that kernel is slow, so those go through a bf16 GEMM of the *dequantized* weight: both paths compute
the same function up to summation order, which makes the quantized model one well-defined draft.

Quantizing the draft never touches losslessness: verification uses the draft's own q, whatever computed it. The
target is never quantized here (its distribution is the output distribution).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.defaults import QUANT_MODES

INT8_MAX_ROWS = 8  # above this many rows the packed kernel loses to a bf16 GEMM (measured; see module docstring)


def int8_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """The packed int8 kernel exists for CPU and pays only with bf16 activations (with fp32 ones it is slower)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and hasattr(torch, "_weight_int8pack_mm"))


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights and one scale per output channel (symmetric, round to nearest)."""

    def __init__(self, linear: nn.Linear, max_rows: int = INT8_MAX_ROWS):
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        dtype = linear.weight.dtype
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(dtype))
        # the dequantized weight, for many-row calls; `weight` keeps the attribute nn.Linear users read (dtype...)
        self.register_buffer("weight", (q.float() * scales[:, None]).to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features, self.max_rows = linear.in_features, linear.out_features, max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype != self.scales.dtype:
            return F.linear(x, self.weight, self.bias)
        y = torch._weight_int8pack_mm(x.reshape(rows, self.in_features), self.qweight, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

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
