#!/usr/bin/env bash
# GPU check of the CUDA replay path (gearflow/native): the CUDA tests and a short
# micro-benchmark, all output in one log file.
#
#   launch/gpu_check.sh [LOG]        # LOG defaults to ./gpu_check.log
#
# For a machine with an NVIDIA GPU where gearflow is already installed with its
# `gpu` (CUDA 12) or `gpu-cu13` (CUDA 13) extra and the dev extra (pytest); this
# script installs nothing. Steps, each under its own time limit (under 5 minutes
# in all):
#   1. environment: `gearflow info`, nvidia-smi, and a probe that CuPy can run a
#      kernel (the check stops here if it cannot: the CUDA tests would only skip)
#   2. python -m pytest -m cuda tests/test_native.py tests/test_device_replay.py -q
#      (kernels vs CPU references, selection distribution, cudaHostRegister round
#      trip; Table(device="cuda") batches vs what was written, chi-square of the
#      device draws, torn items redrawn)
#   3. gearflow bench replay --device cuda --json   (zero-copy gather GB/s vs pinned
#      cudaMemcpy vs CPU gather + H2D; device sampling time for batch 256 at 10^6
#      and 10^7; Table(device="cuda") end to end, every sampled row verified)
# Exit status: 0 when every step passed. Set PYTHON to choose the interpreter.
set -euo pipefail

LOG="$(realpath -m -- "${1:-gpu_check.log}")"
PY="${PYTHON:-python}"
cd "$(dirname -- "$0")/.."
: >"$LOG"
failed=0
trap 'echo "gpu_check: $([ "$failed" = 0 ] && echo "all steps passed" || echo "FAILED"); log: $LOG"' EXIT

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2 rc=0
  shift 2
  echo "gpu_check: $name (limit ${limit}s)"
  printf '\n===== %s: %s (limit %ss, %s)\n' "$name" "$*" "$limit" "$(date -Is)" >>"$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    printf '===== %s: ok\n' "$name" >>"$LOG"
  else
    [ "$rc" = 124 ] && printf '===== %s: timed out after %ss\n' "$name" "$limit" >>"$LOG"
    printf '===== %s: FAILED (exit %s)\n' "$name" "$rc" >>"$LOG"
    echo "gpu_check: $name FAILED (exit $rc)"
    failed=1
  fi
  return "$rc"
}

step "environment" 20 "$PY" -m gearflow info || true
if command -v nvidia-smi >/dev/null; then
  step "nvidia-smi" 10 nvidia-smi || true
fi
if ! step "cupy probe" 30 "$PY" -c '
import sys
from gearflow.native import probe_cupy
p = probe_cupy()
print(p)
sys.exit(0 if p.ok else 1)'; then
  echo "gpu_check: CuPy cannot run a kernel here (see the log); the CUDA tests would only be skipped" >&2
  exit 1
fi
step "cuda tests" 110 "$PY" -m pytest -m cuda tests/test_native.py tests/test_device_replay.py -q -rs \
  -p no:cacheprovider || true
step "cuda benchmark" 110 "$PY" -m gearflow bench replay --device cuda --json || true
[ "$failed" = 0 ]
