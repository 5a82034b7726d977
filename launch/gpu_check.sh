#!/usr/bin/env bash
# GPU check of the CUDA replay path (gearflow/native): prerequisites, the CUDA
# tests and a short micro-benchmark, all output in one log file.
#
#   launch/gpu_check.sh [LOG]        # LOG defaults to ./gpu_check.log
#
# Installs nothing. Set up a fresh GPU machine first (README, "GPU replay"):
#   pip install torch --index-url https://download.pytorch.org/whl/cu128   # a CUDA build of torch
#   pip install -e '.[gpu,dev]'            # CuPy for CUDA 12 ('.[gpu-cu13,dev]' for CUDA 13)
#   pip install 'cupy-cuda12x[ctk]'        # only without a system CUDA toolkit (no NVRTC)
#
# Steps, each under its own time limit (at most 14 min 50 s in all; about 8 min
# expected on an H200):
#   1. prerequisites (90 s): pytest, a CUDA build of torch that sees a GPU, and
#      CuPy compiling (NVRTC) and running a test kernel. The first one missing
#      is named with the command that installs it, and the check STOPS here
#      with exit 1: without them the CUDA tests would only skip.
#   2. environment (30 s + 10 s): `gearflow info`, nvidia-smi (for the log).
#   3. cuda tests (240 s): pytest -m cuda tests/test_native.py tests/test_device_replay.py.
#      A skipped CUDA test fails the step (except the one that needs 2 GPUs):
#      kernels vs CPU references; Table(device="cuda") batches vs what was
#      written; rows stamp-checked against keys while the learner's stream is
#      busy; a batch torch still reads not overwritten; cuda:N; impossible
#      slots redrawn; redraws keep the other rows' records; restore onto the
#      device; the draw distribution against the CPU selector (power-checked).
#   4. cuda benchmark (180 s): gearflow bench replay --device cuda --json
#      (zero-copy gather GB/s vs pinned cudaMemcpy vs CPU gather + H2D; device
#      sampling at 10^6 and 10^7; Table(device="cuda") end to end, rows verified).
#   5. e2e pong_apex (170 s): configs/pong_apex.yaml for 120 s, learner and replay
#      on CUDA (device priority vector, zero-copy gather from the shared segment),
#      learner.bf16=true, actors on the CPU (launch/e2e_check.py).
#   6. e2e r2d2 transformer (170 s): configs/paper/mat_2m.yaml (R2D2 with a causal
#      transformer over Nature-CNN frame tokens, Pong, 80-step windows) for 120 s,
#      learner and replay on CUDA, bf16, actors on the CPU with the key/value cache,
#      replay.capacity=200000 and replay.min_size_to_sample=500 so that learning
#      starts within seconds.
#   Each e2e step prints one line "gpu_check: e2e {json}" (into the log, and again at
#   the end on the terminal): updates/s, tokens/s (steps learned from), samples/s,
#   env steps/s, the learner's wait fraction (over the run and in steady state),
#   the GPU's peak used memory (all processes) and the learner's torch allocator peak.
# Exit status: 0 when every step passed. Set PYTHON to choose the interpreter.
set -euo pipefail

LOG="$(realpath -m -- "${1:-gpu_check.log}")"
PY="${PYTHON:-python}"
cd "$(dirname -- "$0")/.."
: >"$LOG"
failed=0
work="$(mktemp -d)"
trap 'rm -rf "$work"; echo "gpu_check: $([ "$failed" = 0 ] && echo "all steps passed" || echo "FAILED"); log: $LOG"' EXIT

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

cat >"$work/prerequisites.py" <<'EOF'
import importlib.util
import sys

missing = []
if importlib.util.find_spec("pytest") is None:
    missing.append("pytest: pip install -e '.[gpu,dev]'")
try:
    import torch
except ImportError as exc:
    missing.append(f"torch: {exc}")
else:
    if not torch.backends.cuda.is_built():
        missing.append(f"torch {torch.__version__} is a CPU-only build: "
                       "pip install torch --index-url https://download.pytorch.org/whl/cu128")
    elif not torch.cuda.is_available():
        missing.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
                       "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
    else:
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
try:
    from gearflow.native import probe_cupy
except ImportError as exc:
    missing.append(f"gearflow: {exc}; pip install -e '.[gpu,dev]'")
else:
    probe = probe_cupy()
    print(f"cupy: {probe.detail}")
    if not probe.ok:
        missing.append(f"CuPy cannot run a kernel: {probe.detail}")
for m in missing:
    print(f"gpu_check: MISSING: {m}")
sys.exit(1 if missing else 0)
EOF

cat >"$work/cuda_tests.py" <<'EOF'
import sys

import pytest

ALLOWED_SKIPS = ("needs 2 GPUs",)  # an H200 machine has one


class Outcomes:
    def __init__(self):
        self.passed, self.skipped = 0, []

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.append((report.nodeid, reason))
        elif report.when == "call" and report.passed:
            self.passed += 1


seen = Outcomes()
rc = pytest.main(["-m", "cuda", "tests/test_native.py", "tests/test_device_replay.py", "-q", "-rs",
                  "-p", "no:cacheprovider"], plugins=[seen])
bad = [(n, r) for n, r in seen.skipped if not any(a in r for a in ALLOWED_SKIPS)]
for nodeid, reason in bad:
    print(f"gpu_check: a CUDA test was SKIPPED (counted as a failure): {nodeid}: {reason}")
print(f"gpu_check: {seen.passed} CUDA tests passed, {len(seen.skipped)} skipped ({len(bad)} not allowed)")
sys.exit(int(rc) or (1 if bad or seen.passed == 0 else 0))
EOF

if ! step "prerequisites" 90 "$PY" "$work/prerequisites.py"; then
  grep '^gpu_check: MISSING' "$LOG" >&2 || true
  echo "gpu_check: stopped: without these the CUDA tests would only skip (this script installs nothing)" >&2
  exit 1
fi
step "environment" 30 "$PY" -m gearflow info || true
if command -v nvidia-smi >/dev/null; then
  step "nvidia-smi" 10 nvidia-smi || true
fi
step "cuda tests" 240 "$PY" "$work/cuda_tests.py" || true
step "cuda benchmark" 180 "$PY" -m gearflow bench replay --device cuda --json || true
E2E_CUDA=(learner.device=cuda replay.device=cuda learner.bf16=true actor.device=cpu)
step "e2e pong_apex" 170 "$PY" launch/e2e_check.py pong_apex configs/pong_apex.yaml --seconds 120 \
  "${E2E_CUDA[@]}" || true
step "e2e r2d2 transformer" 170 "$PY" launch/e2e_check.py r2d2_transformer configs/paper/mat_2m.yaml \
  --seconds 120 "${E2E_CUDA[@]}" replay.capacity=200000 replay.min_size_to_sample=500 || true
grep '^gpu_check: e2e ' "$LOG" || echo "gpu_check: no end-to-end report (see the log)"
[ "$failed" = 0 ]
