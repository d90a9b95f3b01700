"""Native CPU kernels: C sources in `specdec/modeling/csrc`, built with the host's C compiler on first use, called by
ctypes.

Four kernels. Two replace a run of small torch ops whose dispatch cost more than their arithmetic
(docs/benchmarks.md, "Native decode attention"):
- `decode_attention` (`csrc/decode_attention.c`): a whole layer's attention for a batch of sequences with a few
  query rows each, reading the KV cache in place. The torch path runs ~10 small ops per sequence and layer; at 8
  sessions per target step that was a third of the step.
- `rms_norm` (`csrc/rms_norm.c`): an RMSNorm, optionally with the residual add before it, in one pass (~7 ops).

The third, `stream_linear` (`csrc/stream_linear.c`, AVX2 + FMA), is a linear layer for a few rows that reads the
weight once for all of them, bitwise row-invariant: `specdec.modeling.linear`'s kernel for hosts without native bf16
GEMMs (docs/benchmarks.md, "AVX2-only hosts"). It reads the weight in its own layout (`stream_pack`), a copy its caller
keeps.

The fourth, `decoder_layer` (`csrc/decoder_layer.c`), runs a whole decoder layer of a decode step or verify block
on the other three, with RoPE, the cache write, SiLU and the residual adds between them in C: where every linear of
a layer streams (hosts without native bf16 GEMMs; a draft wherever that measured faster), the ~25 torch ops per
layer between the kernels cost more than a third of a one-row step (docs/benchmarks.md, "Native decoder layers").

The build is a plain shared object (no torch or Python headers: it compiles in about a second), tuned for this
CPU (`-march=native`; `-mavx2 -mfma -mf16c` where `specdec.common.settings` `isa` is avx2) and cached under
`cache_root()/native/`, keyed by the sources, the flags, the compiler and the CPU's feature flags, so a cache
shared by different hosts never hands one host another's build. It is
written to a temporary name and renamed into place, so processes that start together (a draft and a target
server) never load a half-written file. Where there is no compiler, or the kernels are switched off
(`specdec.common.settings` `native`, SPECDEC_NATIVE=0), `available()` is False and callers take the torch path; the
reason is logged once. Switched off, nothing is compiled.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specdec.common import settings

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
# Each source with its own flags. -ffast-math for attention and RMSNorm, compile only: it lets the reductions and
# expf vectorize. Linked with it, gcc < 13 adds crtfastmath.o, whose constructor sets flush-to-zero for the whole
# process on load and would change torch's numerics; the link step runs without it (tests/test_native.py checks
# that subnormals survive the load). The streaming linear is row-invariant only if the compiler keeps its order of
# operations: no -ffast-math, no contraction beyond its own FMAs.
SOURCES = {_CSRC / "decode_attention.c": ("-ffast-math",), _CSRC / "rms_norm.c": ("-ffast-math",),
           _CSRC / "stream_linear.c": ("-ffp-contract=off",), _CSRC / "decoder_layer.c": ("-ffp-contract=off",)}
HEADERS = sorted(_CSRC.glob("*.h"))  # included by the sources (bf16.h): part of the build's cache key
CFLAGS = ("-O3", "-fPIC")
# The instruction set the build targets (`specdec.common.settings` `isa`): this CPU's, or an AVX2-only x86 host's (the
# emulation of one on a richer host).
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-mavx2", "-mfma", "-mf16c")}
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the caches the kernel reads; others take the torch path


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(settings.get().cc) or shutil.which("gcc") or shutil.which("clang")


def _commands(cc: str, tmp: str) -> tuple[list[list[str]], str]:
    """The compile and link commands of the library (into `tmp`), and the library's path."""
    isa = ISA_FLAGS[settings.get().isa]
    objs = [os.path.join(tmp, f.stem + ".o") for f in SOURCES]
    lib = os.path.join(tmp, "kernels.so")
    cmds = [[cc, *CFLAGS, *isa, *extra, "-c", str(f), "-o", o] for (f, extra), o in zip(SOURCES.items(), objs)]
    return cmds + [[cc, "-shared", *objs, "-o", lib, "-lm"]], lib


def _build(cc: str) -> Path:
    from specdec.modeling.hub import cache_root

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    flags = " ".join(f"{f.name}:{' '.join(e)}" for f, e in SOURCES.items())
    key = hashlib.sha256("\0".join((*(f.read_text() for f in (*SOURCES, *HEADERS)), " ".join(CFLAGS), flags,
                                    " ".join(ISA_FLAGS[settings.get().isa]), version,
                                    platform.machine(), _cpu_flags())).encode()).hexdigest()[:24]
    out = cache_root() / "native" / f"specdec-kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cmds, lib = _commands(cc, tmp)
        for cmd in cmds:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, out)  # atomic: a process starting beside this one loads a whole file or builds its own
    return out


@functools.lru_cache(maxsize=None)
def _log_off() -> None:
    log.info("native kernels are off (SPECDEC_NATIVE=0): attention and RMSNorm take the torch path")


@functools.lru_cache(maxsize=None)
def _library():
    """The loaded kernel library, or None (logged once) where it cannot be built."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC): attention and RMSNorm take the slower torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native kernels unavailable, attention and RMSNorm take the torch path: %s", e)
        return None
    log.info("native kernels loaded (%s)", lib._name)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.specdec_decode_attention.argtypes = [i32] * 6 + [ptr, i64, i64, i64] * 3 + [ptr, ptr, ctypes.c_float, ptr]
    lib.specdec_decode_attention.restype = i32
    lib.specdec_rms_norm.argtypes = [i32, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_float, ptr]
    lib.specdec_rms_norm.restype = None
    lib.specdec_stream_linear.argtypes = [i32] * 3 + [i64] * 3 + [ptr] * 4
    lib.specdec_stream_linear.restype = i32
    lib.specdec_stream_packed_size.argtypes = [i64, i64]
    lib.specdec_stream_packed_size.restype = i64
    lib.specdec_stream_pack.argtypes = [i32, i64, i64, ptr, ptr]
    lib.specdec_stream_pack.restype = None
    lib.specdec_decoder_layer.argtypes = [i32] * 7 + [i64, ctypes.c_float, ctypes.c_float] + [ptr] * 10 \
        + [ptr, i64, i64, i64] * 2 + [ptr, ptr]
    lib.specdec_decoder_layer.restype = i32
    lib.specdec_exp.argtypes = [ptr, ptr, i64]
    lib.specdec_exp.restype = None
    lib.specdec_stream_linear_supported.argtypes = []
    lib.specdec_stream_linear_supported.restype = i32
    return lib


def available() -> bool:
    """Whether the native kernels are switched on, built and loaded (builds them on the first call that finds them
    on)."""
    if not settings.get().native:
        _log_off()
        return False
    return _library() is not None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
    """q: [B, S, H, D]; k_cache/v_cache: [num_slots, max_len, KV, D] (same dtype as q, float32 or bfloat16);
    slots: [B] int64; visible: [B, S] int64 contiguous, the keys each query row sees (its position + 1).
    Returns [B, S, H, D] float32. The caller checks `supports` first, and that slots lie in the cache and each
    row's visible keys in [1, max_len] (`CausalLM.forward` does): the kernel reads what they point to."""
    if q.dtype != k_cache.dtype or q.stride(-1) != 1:
        raise ValueError(f"decode_attention takes queries of the cache's dtype ({k_cache.dtype}) with a unit-stride "
                         f"head dim; got {q.dtype}, stride {q.stride(-1)}")
    fn = _library().specdec_decode_attention
    B, S, H, D = q.shape
    out = torch.empty((B, S, H, D), dtype=torch.float32)
    rc = fn(DTYPES[q.dtype], B, S, H, k_cache.shape[2], D,
            q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
            k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            slots.data_ptr(), visible.data_ptr(), D ** -0.5, out.data_ptr())
    if rc != 0:
        raise MemoryError("native decode attention could not allocate its work buffers")
    return out


def supports(k_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` runs for a model with this cache (its queries share the cache's dtype): a CPU
    cache of float32 or bfloat16 with unit stride on the head dim, and the kernels on and built."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in DTYPES and k_cache.stride(-1) == 1
            and available())


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm` takes these: inference (no autograd), CPU, float32 or bfloat16 alike, x contiguous, a
    residual of x's shape, and the kernels on and built."""
    return (not torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype in DTYPES
            and weight.dtype == x.dtype and weight.shape == x.shape[-1:] and x.is_contiguous()
            and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)) and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim with Llama's rounding (csrc/rms_norm.c). Without `residual`: the normed x. With
    it: (x + residual, the normed sum), the add and the norm in one pass. The caller checks `rms_norm_supported`."""
    dim = x.shape[-1]
    out = torch.empty_like(x)
    total = None
    if residual is not None:
        residual = residual.contiguous()
        total = torch.empty_like(x)
    _library().specdec_rms_norm(DTYPES[x.dtype], x.numel() // dim, dim, x.data_ptr(),
                                None if residual is None else residual.data_ptr(),
                                None if total is None else total.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out if residual is None else (total, out)


def stream_linear_supported() -> bool:
    """Whether `stream_linear` runs here: the kernels on and built, and the CPU has AVX2 and FMA (the kernel's own
    check; a build for another instruction set has no kernel)."""
    return available() and bool(_library().specdec_stream_linear_supported())


@functools.lru_cache(maxsize=None)
def _stream_packed_size(in_f: int, out_f: int) -> int:
    """Elements of a packed weight (csrc/stream_linear.c), per shape: asked of the library once, not per call."""
    return _library().specdec_stream_packed_size(in_f, out_f)


def stream_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (fp32 or bf16, CPU) laid out as `stream_linear` reads it (csrc/stream_linear.c: panels of
    16 output features, each k-major), a new 1-D tensor of its dtype, as large as the weight rounded up to 16
    output features. A copy: it goes stale when the weight changes (`specdec.modeling.linear.Linear` checks)."""
    if weight.dtype not in DTYPES or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"stream_pack takes a 2-D fp32/bf16 CPU weight; got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    weight = weight.detach().contiguous()
    out_f, in_f = weight.shape
    packed = torch.empty(_stream_packed_size(in_f, out_f), dtype=weight.dtype)
    _library().specdec_stream_pack(DTYPES[weight.dtype], in_f, out_f, weight.data_ptr(), packed.data_ptr())
    return packed


def stream_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T (+ bias) → [rows, out] of x's dtype, reading the weight once per 48 rows
    (csrc/stream_linear.c): weight bf16 or fp32, x bf16 or fp32, each output the fp32 chain of fused multiply-adds
    over k in order, then the bias, then one rounding to x's dtype; so each row's result is bitwise the same whatever
    the number of rows in the call. `packed`: `stream_pack(weight)`, made once by the caller (packed here when
    None). One thread (csrc/stream_linear.c says why). The caller checks `stream_linear_supported`."""
    if x.dtype not in DTYPES or weight.dtype not in DTYPES or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"stream_linear takes fp32/bf16 inputs and a bias of the weight's dtype; got x {x.dtype}, "
                         f"weight {weight.dtype}, bias {None if bias is None else bias.dtype}")
    out_f, in_f = weight.shape
    if packed is None:
        packed = stream_pack(weight)
    elif packed.dtype != weight.dtype or packed.numel() != _stream_packed_size(in_f, out_f):
        raise ValueError(f"packed is not stream_pack of a {out_f} x {in_f} {weight.dtype} weight")
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    rows = x.shape[0]
    y = torch.empty((rows, out_f), dtype=x.dtype)
    rc = _library().specdec_stream_linear(DTYPES[x.dtype], DTYPES[weight.dtype], DTYPES[x.dtype], rows, in_f, out_f,
                                          x.data_ptr(), packed.data_ptr(),
                                          None if bias is None else bias.data_ptr(), y.data_ptr())
    if rc != 0:
        raise MemoryError("the native streaming linear could not allocate its scratch")
    return y


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of a float32 tensor as the native decoder layer's SiLU computes it (csrc/expf.h: within about 1 ulp, +inf
    above 88.38, 0 below -87.34), 8 elements at a time and the rest one at a time. The caller checks `available`."""
    if x.dtype != torch.float32:
        raise ValueError(f"exp takes float32, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    _library().specdec_exp(x.data_ptr(), y.data_ptr(), x.numel())
    return y


def tensor_args(*tensors: torch.Tensor | None) -> tuple[int, ...]:
    """The addresses of tensors (0 for None) as `decoder_layer` takes a layer's weights. The caller keeps the tensors
    alive and unchanged in place while it uses them (`specdec.modeling.model.CausalLM` checks at every forward)."""
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def decoder_layer(x: torch.Tensor, weights: tuple[int, ...], eps: float, heads: int, kv_heads: int,
                  intermediate: int, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor) -> None:
    """One decoder layer of a decode step or verify block in one call (csrc/decoder_layer.c), in place on x
    [B, S, D] contiguous (the residual stream). `weights`: `tensor_args(ln1, ln2, w_qkv, b_qkv, w_o, w_gate_up,
    w_down)`, the fused layouts of specdec/modeling/fusion.py, all of x's dtype (float32 or bfloat16), the four weights
    as `stream_pack` lays them out;
    cos/sin [B, S, head_dim] contiguous (sin signed, `CausalLM._rope`); the layer's caches as `decode_attention`
    takes them, each row's k and v written at (slot, visible - 1). The caller checks `stream_linear_supported`, the
    shapes and dtypes, and that slots and positions lie in the cache (`specdec.modeling.model.CausalLM.forward`)."""
    B, S, D = x.shape
    hd = k_cache.shape[-1]
    rc = _library().specdec_decoder_layer(
        DTYPES[x.dtype], B, S, D, heads, kv_heads, hd, intermediate, eps, hd ** -0.5, x.data_ptr(), *weights,
        cos.data_ptr(), sin.data_ptr(),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slots.data_ptr(), visible.data_ptr())
    if rc != 0:
        raise MemoryError("the native decoder layer could not allocate its work buffers")
