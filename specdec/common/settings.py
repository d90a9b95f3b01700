"""The core's runtime switches: one typed, documented field each, read from the environment once per process.

Each field's environment variable is `SPECDEC_<FIELD>` (e.g. `SPECDEC_KERNEL_TUNE=0`) unless its description names
another (`CC`, `HF_HUB_OFFLINE`, `HF_ENDPOINT`: the variables those tools already read). Booleans take 1/0,
true/false, yes/no, on/off. `get()` reads them on its first call and keeps the result; nothing reads them again.
A process changes them explicitly: `configure(...)` (a command line's flags) or `override(...)` (a test, an
in-process A/B measurement; restored on exit).

Some variables are read by native libraries when they first run, not by Python: `prepare_process()` sets those
(oneDNN's kernel cache sizes), at process start or the first model load. It and `child_environ()` are, with this
module's reads and specdec_rpc/settings.py's, the only places the production packages touch os.environ
(tests/test_settings_env.py checks).
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["RuntimeSettings", "get", "configure", "override", "prepare_process", "child_environ",
           "setdefault_environ"]


class RuntimeSettings(BaseSettings):
    """Kernel choices, model-load options and a few paths and endpoints of the core (specdec/)."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_", extra="ignore", frozen=True, populate_by_name=True)

    decode_attention: bool = Field(True, description=(
        "a CPU bf16/fp16 attention call of up to SMALL_BLOCK_ROWS query rows (a decode step, a verify block) takes the "
        "two-matmul path, or the native kernel (specdec.modeling.attention, specdec.modeling.native); off: PyTorch's "
        "fused SDPA"))
    native: bool = Field(True, description=(
        "the native C kernels (decode attention, RMSNorm; specdec.modeling.native) run where they are built; off: the "
        "torch path, and nothing is compiled"))
    native_layers: bool = Field(True, description=(
        "a decode step or verify block whose every linear runs on the streaming kernel (hosts without native bf16 "
        "GEMMs) runs each decoder layer as one native call (specdec.modeling.native.decoder_layer); off: layer by layer "
        "in torch ops around the same kernels"))
    fuse: bool = Field(True, description=(
        "a loaded model runs each layer's q/k/v and gate/up projections as one GEMM each (specdec.modeling.fusion); "
        "off: the checkpoint's layout"))
    kernel_tune: bool = Field(True, description=(
        "time each bf16 CPU linear's kernels and row padding at load and keep the fastest (specdec.modeling.linear); "
        "off: each layer's default plan, unpadded, so outputs also repeat across processes"))
    row_invariant: bool = Field(True, description=(
        "a target's bf16 CPU linears round each row alike whether it runs alone or batched (specdec.modeling.linear)"))
    cuda_graphs: bool = Field(True, description=(
        "a model on a CUDA device replays its decode steps and verify blocks as CUDA graphs "
        "(specdec.modeling.cuda_graphs); off: every forward runs eagerly"))
    isa: Literal["native", "avx2"] = Field("native", description=(
        "the x86 instruction set the CPU kernels assume: native = this host's; avx2 = behave as on an AVX2-only host "
        "(no AVX512, no native bf16 GEMMs), to emulate one on a richer CPU: bf16 counts as slow "
        "(specdec.modeling.dtypes.cpu_has_fast_bf16), the native kernels build with -mavx2 -mfma -mf16c, and "
        "prepare_process caps oneDNN and MKL at AVX2 (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS; ATen's own kernels "
        "follow ATEN_CPU_CAPABILITY=avx2, which must be set before torch loads)"))
    onednn_cache_capacity: int = Field(256, ge=1, description=(
        "entries in oneDNN's primitive cache and ideep's kernel cache (their defaults: 1024 each), set by "
        "prepare_process as ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY unless those are set"))
    cache: Path | None = Field(None, description=(
        "where converted models and native builds are cached (specdec.modeling.hub.cache_root); unset: "
        "platformdirs.user_cache_dir('specdec'), which honours XDG_CACHE_HOME"))
    api_key: str = Field("", repr=False, description="the `specdec generate --coordinator` default API key")
    cc: str = Field("cc", validation_alias=AliasChoices("CC", "cc"),
                    description="env CC: the C compiler that builds the native kernels (then gcc, clang)")
    hf_hub_offline: bool = Field(False, validation_alias=AliasChoices("HF_HUB_OFFLINE", "hf_hub_offline"),
                                 description="env HF_HUB_OFFLINE: never contact the Hugging Face hub")
    hf_endpoint: str = Field("https://huggingface.co",
                             validation_alias=AliasChoices("HF_ENDPOINT", "hf_endpoint"),
                             description="env HF_ENDPOINT: the hub a hub id is downloaded from")

    @field_validator("hf_hub_offline", mode="before")
    @classmethod
    def _hub_offline(cls, v):  # huggingface_hub's own reading: 1/true/yes/on (any case) is on, anything else off
        return str(v).strip().lower() in ("1", "true", "yes", "on") if isinstance(v, str) else v

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, v):  # an empty SPECDEC_CACHE is unset
        return None if isinstance(v, str) and not v.strip() else v


_lock = threading.RLock()  # reentrant: configure and override read get() under it, which may take it first
_current: RuntimeSettings | None = None


def get() -> RuntimeSettings:
    """The process's settings: read from the environment on the first call, then kept (a cheap call: hot paths
    read their switch through it)."""
    s = _current
    if s is None:
        with _lock:
            s = _current if _current is not None else _set(RuntimeSettings())
    return s


def _set(s: RuntimeSettings) -> RuntimeSettings:
    global _current
    _current = s
    return s


def _with(base: RuntimeSettings, changes: dict) -> RuntimeSettings:
    unknown = set(changes) - set(RuntimeSettings.model_fields)
    if unknown:
        raise TypeError(f"no such runtime setting: {', '.join(sorted(unknown))}")
    return RuntimeSettings.model_validate({**base.model_dump(), **changes})


def configure(**changes) -> RuntimeSettings:
    """Replace fields of the process's settings (validated) for the rest of its life: a command line's flags."""
    with _lock:
        return _set(_with(get(), changes))


@contextlib.contextmanager
def override(**changes):
    """Change fields for the duration of a `with` block, then restore the previous settings (tests, in-process A/B
    measurements). Process-wide: threads running meanwhile see the change too."""
    with _lock:
        before = get()
        _set(_with(before, changes))
    try:
        yield _current
    finally:
        _set(before)


def setdefault_environ(**values: str) -> None:
    """Set environment variables that are not set already (ones a library reads when it initializes)."""
    for name, value in values.items():
        os.environ.setdefault(name, value)


def prepare_process() -> None:
    """Set the environment variables that native libraries read once, when they first run; call it at process start
    or before the first model load, before any oneDNN call (idempotent; a variable already set is kept).

    oneDNN and ideep keep a compiled kernel per (row count, weight shape) in LRU caches of 1024 entries each, read
    at the first oneDNN call. A replica's prefill tails, feeds and batches come in every row count: a draft
    replica's RSS grew from 533 to 791 MB in 2 minutes of prompts of random lengths, still rising; at 256 entries
    it stayed at ~640 MB. Three shapes fed 1-319 rows: +551 MB at 1024, +214 MB at 256. A miss rebuilds a kernel in
    ~17 µs: 32 row counts cycled through the default target's linears took 1-3 % longer at 256.

    With `isa` avx2 it also caps oneDNN and MKL at AVX2, so that this host runs their kernels as an AVX2-only one
    would."""
    cap = str(get().onednn_cache_capacity)
    setdefault_environ(LRU_CACHE_CAPACITY=cap, ONEDNN_PRIMITIVE_CACHE_CAPACITY=cap)
    if get().isa == "avx2":  # an AVX2-only host emulated: oneDNN and MKL read these at their first call
        setdefault_environ(ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")


def child_environ(**overrides: str) -> dict[str, str]:
    """The environment for a child process: this process's, with `overrides`."""
    return {**os.environ, **overrides}
