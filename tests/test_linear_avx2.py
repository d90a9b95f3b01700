"""The host-dependent linear tests again, on a simulated AVX2-only CPU: oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA) and
ATen's kernels too (ATEN_CPU_CAPABILITY), both read when torch loads, so in a fresh interpreter. On such a CPU oneDNN
runs no bf16: nothing is packed. With the native kernels off the plain kernels must keep the same invariants
(tests/test_linear.py); with them on the streaming linear is offered and must keep them too
(tests/test_stream_linear.py, which also pins the emulation through `specdec.common.settings` `isa`)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# the tests whose assertions depend on whether oneDNN runs bf16 here (the oneDNN cache test too, but it takes a
# minute: run it by hand with the environment above)
HOST_DEPENDENT = ("test_prepack_skips_what_it_cannot_pack", "test_a_one_row_gemv_that_rounds_unlike_the_batch",
                  "test_prepacked_multi_row_kernel_is_bit_identical", "test_tuning_gives_every_bf16_linear",
                  "test_a_row_invariant_linear_rounds_every_row_alike", "test_model_logits_do_not_depend",
                  "test_every_kernel_computes_the_linear")
# the streaming linear's tests that ask the host what specdec.modeling.linear offers (the rest run the same everywhere)
STREAM_HOST_DEPENDENT = ("test_hosts_with_native_bf16_gemms_keep_their_paths",
                         "test_emulated_avx2_host_offers_the_kernel", "test_greedy_sd_equals_ar_with_the_kernel",
                         "test_a_row_invariant_layer_on_the_kernel")

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 simulation"),
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"),
                       reason="this host is AVX2 or below: tests/test_linear.py already runs there"),
]


def _pytest(path: str, names: tuple[str, ...], **env: str) -> None:
    check = subprocess.run([sys.executable, "-c", "import torch, specdec.modeling.dtypes as d; "
                            "print(torch.backends.cpu.get_cpu_capability(), d.cpu_has_fast_bf16())"],
                           capture_output=True, text=True, env={**os.environ, **AVX2, **env}, cwd=ROOT, timeout=120)
    assert check.stdout.split() == ["AVX2", "False"], check.stdout + check.stderr  # the simulation holds
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
                           "-k", " or ".join(names)], capture_output=True, text=True,
                          env={**os.environ, **AVX2, **env}, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_linear_tests_pass_on_an_avx2_only_cpu():
    """The plain kernels (the native kernels off: no streaming linear)."""
    _pytest("tests/test_linear.py", HOST_DEPENDENT, SPECDEC_NATIVE="0")


def test_streaming_linear_tests_pass_on_an_avx2_only_cpu():
    """oneDNN itself reports no bf16 (no `isa` setting): the streaming linear is offered, and keeps rows invariant."""
    _pytest("tests/test_stream_linear.py", STREAM_HOST_DEPENDENT)
