"""The dtype a model is served in: `auto` picks bf16 on CPUs where oneDNN runs bf16 GEMMs natively, and on AVX2
hosts where the native streaming linear runs (bf16 weights, fp32 arithmetic); fp32 elsewhere."""
from __future__ import annotations

import torch

from specdec.common import settings


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN runs bf16 GEMMs on this CPU: natively with AVX512-BF16 or AMX, or with AVX512 (BW/VL/DQ) or
    AVX-NE-CONVERT; False on an AVX2-only CPU, where oneDNN refuses bf16 (the `ONEDNN_MAX_CPU_ISA` cap counts), and
    where `specdec.common.settings` `isa` is avx2 (an AVX2-only host emulated)."""
    if settings.get().isa == "avx2":
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def auto_dtype(device: str | torch.device = "cpu", role: str = "target") -> torch.dtype:
    """The dtype `auto` picks: bf16 on GPUs, on CPUs where oneDNN has native bf16 GEMMs, and on CPUs without them
    where the native streaming linear runs (AVX2 + FMA, the native kernels on: `specdec.modeling.native`); else fp32.

    Target: verification forwards several rows, and bf16 GEMMs stay flat in the row count (default target, 1
    thread, 1/4/8 rows: fp32 82/155/204 ms, bf16 76/103/108 ms; docs/benchmarks.md). Draft: one row per session
    per step, where the two tie (9.55 vs 9.46 ms/token, interleaved medians), but a draft replica steps all its
    sessions in one forward, and there bf16 stays flat too (default draft, 1/2/4/8 sessions per step: fp32
    8.9/10.8/17.2/26.3 ms, bf16 7.8/9.5/9.9/11.8 ms). `role` is kept for dtype choices that differ per role.

    Without native bf16 GEMMs (AVX2-only hosts) bf16 weights through the streaming linear read half the bytes of
    fp32 per step and stay flat in the row count, where torch's fp32 GEMM does not (docs/benchmarks.md, "AVX2-only
    hosts")."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    if cpu_has_fast_bf16():
        return torch.bfloat16
    from specdec.modeling import native  # builds the native kernels on first use

    return torch.bfloat16 if native.stream_linear_supported() else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", role: str = "target") -> torch.dtype:
    """A dtype name (auto, float32/fp32, bfloat16/bf16, float16/fp16) or torch dtype → torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, role)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return table[dtype]
