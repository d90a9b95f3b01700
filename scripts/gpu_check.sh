#!/usr/bin/env bash
# The prepared GPU check (docs/operations/gpu.md). On a bare GPU machine, from the working tree:
#   scripts/gpu_check.sh                 # all phases, ~7 minutes, report under $OUT (or ./gpu-check-out)
#   scripts/gpu_check.sh --dry-run       # CPU, tiny shapes, about a minute: shows the check works end to end
# Extra arguments go to scripts/gpu_check.py (--budget-s, --tests-limit-s, --phases, --out, --device).
#
# On a machine without a package index and with nothing but Python and a CUDA build of torch, everything else the
# check imports (numpy, safetensors, tokenizers, platformdirs, transformers, gRPC, pydantic-settings, pytest, ...)
# comes as wheels in .whl/, beside the generated gRPC stubs in specdec_rpc/pb/ (both git-ignored; the list is in
# docs/operations/gpu.md); they install into /tmp/site, no index, no deps. PYTHON=... picks the interpreter (the
# default: a development checkout's .venv where it has the project's dependencies, else python3).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 SPECDEC_TEST_THREADS=${SPECDEC_TEST_THREADS:-4}

if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && .venv/bin/python -c "import pydantic_settings" 2>/dev/null; then
  PY=$ROOT/.venv/bin/python  # a development checkout: its environment has everything
else
  PY=${PYTHON:-python3}
  if ls .whl/*.whl >/dev/null 2>&1; then
    t0=$(date +%s)
    pipi() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
    if ! pipi .whl/*.whl; then  # one wheel this machine refuses (its glibc, say) stops the rest: one at a time
      for w in .whl/*.whl; do pipi "$w" || echo "gpu_check: could not install $w" >&2; done
    fi
    echo "gpu_check: wheels from .whl installed into /tmp/site in $(( $(date +%s) - t0 )) s"
  fi
  export PYTHONPATH=/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

if ! ls specdec_rpc/pb/*_pb2.py >/dev/null 2>&1; then
  "$PY" scripts/gen_protos.py || echo "gpu_check: no generated gRPC stubs (copy specdec_rpc/pb from a built checkout): the stack phase will fail" >&2
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,temperature.gpu \
  --format=csv > "$OUT/nvidia-smi.csv" 2>&1
"$PY" -u scripts/gpu_check.py "$@" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
