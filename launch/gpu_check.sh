#!/usr/bin/env bash
# GPU check of the CUDA path in one call (<= 480 s with the device kit's install): prerequisites,
# the environment, the CUDA tests, the CUDA replay and learner benchmarks, the replay cpu vs cuda
# pair end to end on pong_apex and halfcheetah_dpg, and gato_80m's learner memory beside its
# plan; every log and result under one folder.
#
#   launch/gpu_check.sh [--out DIR] [--budget S] [--plan] [--tests-s S] [--bench-s S]
#                       [--learner-s S] [--pair-s S] [--steady-s S] [--gato-s S] [--bench-scale X]
#
#   --out DIR       where everything goes (default ./gpu_check_out): gpu_check.log (all
#                   output), gpu_check.jsonl (one JSON line per result, appended and flushed
#                   as each is measured: a killed check keeps what it measured),
#                   bench_cuda.jsonl, bench_learner.jsonl, e2e_<name>/ (each run's metrics.jsonl)
#   --budget S      the whole check's wall-clock limit (default 465): a step never gets more
#                   than what is left, and is skipped (noted) only when what is left is less than
#                   both its own limit and 20 s (a 10-s step runs with 10 s, a 100-s step with
#                   25 s left runs with 25 s). The defaults' limits add up to the budget, so
#                   every step runs even if each took its whole limit; with the device kit's
#                   install (2-15 s) the call stays under 480 s.
#   --plan          run nothing: list each step with the limit it would get at this budget if
#                   every step before it took its whole limit (the worst case), into
#                   gpu_check.jsonl too ("status": "planned" or "skipped")
#   --tests-s S     limit of the CUDA tests (default 60)
#   --bench-s S     limit of the CUDA replay benchmark (default 40)
#   --learner-s S   limit of gearflow bench learner --device cuda (default 40)
#   --pair-s S      limit of each of the four replay pair runs (default 58: the run's deadline
#                   is this - 15 s, for start-up and shut-down)
#   --steady-s S    a pair run stops once its steady updates span this many seconds (default 30)
#   --gato-s S      limit of the gato_80m run (default 48; its deadline this - 15 s)
#   --bench-scale X gearflow bench replay --scale (default 1: 10^6 / 10^7 priorities)
#
# Works from a checkout without installing gearflow: the repository root goes on PYTHONPATH
# (for the helpers, pytest's conftest and the spawned actors). On a machine without network,
# install the device kit first (launch/device_kit.sh prints the whole command; README,
# "GPU replay"). Set PYTHON to choose the interpreter (the H200: PYTHON=python3).
#
# Steps (limits at the defaults: 25 + 10 + 5 + 60 + 40 + 40 + 4 x 58 + 5 + 48 = 465 s at most,
# each cut to what the budget has left; the first H200 call took 14, ~3, 1, 28 and 13 s for
# the first five):
#   1. prerequisites (25 s): imports everything the steps use (gearflow, its C modules,
#      omegaconf, gymnasium, envpool making Pong-v5, the agents, pytest + conftest), then a
#      CUDA build of torch that sees a GPU, then CuPy compiling (NVRTC) and running a kernel.
#      The first one missing is named ("gpu_check: MISSING: ...") and the check STOPS, exit 1:
#      without them the CUDA tests would only skip. (HalfCheetah-v4's XML is checked, not
#      required: without it only the halfcheetah_dpg pair fails.)
#   2. environment (10 s): gearflow info. 3. nvidia-smi (5 s; says so where it is missing).
#   4. cuda tests (60 s): pytest -m cuda tests/test_native.py tests/test_device_replay.py, a
#      JSON line per test; a skipped CUDA test fails the step (except the one that needs 2 GPUs).
#   5. cuda benchmark (40 s): gearflow bench replay --device cuda --json (zero-copy gather GB/s
#      vs pinned cudaMemcpy, aligned and unaligned rows, rows at several work-item sizes; the
#      device sample and write-back at 10^6 and 10^7 vs the CPU selector's; Table(device="cuda")
#      end to end, rows verified), into bench_cuda.jsonl.
#   6. learner benchmark (40 s): gearflow bench learner --device cuda --json --seconds 0.6
#      --budget-s (the step's limit less 8 s: the do-nothing loop first, then pong_apex,
#      halfcheetah_dpg, mat_2m, gato_80m, each an equal share of what is left; a config past its
#      share is cut to one round and its eager form), into bench_learner.jsonl ("skipped: no
#      learner bench" where the suite is not registered).
#   7-10. the replay pairs (launch/e2e_check.py, learner on cuda, actors on the CPU, fp32, 5,000
#      items before learning): pong_apex with replay.device=cpu then cuda; halfcheetah_dpg (12
#      actors) the same; each stops after --steady-s of steady updates (a progress line every
#      2 s), its deadline --pair-s - 15 s.
#   11. replay pairs (5 s): per pair, steady updates/s with replay cuda / cpu against the targets
#      (pong_apex 1.2, halfcheetah_dpg 1.0).
#   12. gato_80m (configs/paper/gato_80m.yaml, its actors on the GPU, learner and replay on
#      cuda, bf16, learning from 200 windows): the learner's own GPU memory (this process, per
#      nvidia-smi; the actors' apart) beside the dry run's plan (plan_vs_learner).
#   Each e2e report: updates/s, tokens/s, samples/s, env steps/s, steady rates, learner wait
#   fraction, GPU memory. A run stopped at its limit gets SIGTERM (it shuts down and reports;
#   SIGKILL 10 s later), then `gearflow replay gc` removes the shared memory of dead runs.
# Exit status: 0 when every step passed; 1 when one failed or prerequisites are missing.
set -euo pipefail

OUT=gpu_check_out BUDGET=465 TESTS_S=60 BENCH_S=40 LEARNER_S=40 PAIR_S=58 STEADY_S=30 GATO_S=48 BENCH_SCALE=1 PLAN=0
MIN_STEP_S=20  # a step is skipped only when it would get less than this and less than its own limit
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --plan) PLAN=1; shift ;;
    --tests-s) TESTS_S=$2; shift 2 ;;
    --bench-s) BENCH_S=$2; shift 2 ;;
    --learner-s) LEARNER_S=$2; shift 2 ;;
    --pair-s) PAIR_S=$2; shift 2 ;;
    --steady-s) STEADY_S=$2; shift 2 ;;
    --gato-s) GATO_S=$2; shift 2 ;;
    --bench-scale) BENCH_SCALE=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-python}"
mkdir -p "$OUT"
OUT="$(realpath -- "$OUT")"
LOG="$OUT/gpu_check.log" JSONL="$OUT/gpu_check.jsonl"
cd "$(dirname -- "$0")/.."
ROOT="$PWD"
case ":${PYTHONPATH:-}:" in *":$ROOT:"*) ;; *) export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" ;; esac
export PYTHONUNBUFFERED=1
: >"$LOG"
: >"$JSONL"
START=$SECONDS
failed=0
if [ "$PLAN" = 1 ]; then
  trap 'echo "gpu_check: plan: $([ "$failed" = 0 ] && echo "every step runs" || echo "some steps SKIPPED"), at most ${PLANNED} s of the ${BUDGET}-s budget"' EXIT
else
  trap 'echo "gpu_check: $([ "$failed" = 0 ] && echo "all steps passed" || echo "FAILED") in $((SECONDS - START)) s; results: $JSONL; log: $LOG"' EXIT
fi

result() {  # result JSON-OBJECT-BODY: one line into the results file, flushed by the shell's append
  printf '{"step": %s, "t": %s, %s}\n' "$1" "$(date +%s)" "$2" >>"$JSONL"
}

PLANNED=0  # --plan: the seconds the steps listed so far may take at most (their limits)
elapsed() { if [ "$PLAN" = 1 ]; then echo "$PLANNED"; else echo $((SECONDS - START)); fi; }

step() {  # step NAME LIMIT COMMAND...: run under min(LIMIT, what the budget has left)
  local name=$1 want=$2 limit=$2 rc=0 left t0 floor
  shift 2
  left=$((BUDGET - $(elapsed)))
  [ "$limit" -gt "$left" ] && limit=$left
  floor=$MIN_STEP_S
  [ "$want" -lt "$floor" ] && floor=$want  # a short step needs only its own limit
  if [ "$limit" -lt "$floor" ] || [ "$limit" -le 0 ]; then
    echo "gpu_check: $name SKIPPED (${left}s of the ${BUDGET}s budget left, it needs ${floor}s)"
    result "\"$name\"" "\"status\": \"skipped\", \"reason\": \"budget\", \"left_s\": $left, \"limit_s\": $want"
    failed=1
    return 1
  fi
  if [ "$PLAN" = 1 ]; then
    echo "gpu_check: plan: $name, limit ${limit}s from ${PLANNED}s: $*"
    result "\"$name\"" "\"status\": \"planned\", \"limit_s\": $limit, \"from_s\": $PLANNED"
    PLANNED=$((PLANNED + limit))
    return 0
  fi
  echo "gpu_check: $name (limit ${limit}s, $((SECONDS - START))s elapsed)"
  printf '\n===== %s: %s (limit %ss, %s)\n' "$name" "$*" "$limit" "$(date -Is)" >>"$LOG"
  t0=$SECONDS
  # GPU_CHECK_STEP_S: the limit the step got (a step that budgets itself reads it)
  GPU_CHECK_STEP_S=$limit timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1 || rc=$?  # SIGTERM: a run stops cleanly
  local status=ok
  if [ "$rc" != 0 ]; then
    status=failed
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status=timed_out
    echo "gpu_check: $name FAILED ($status, exit $rc)"
    failed=1
  fi
  printf '===== %s: %s (exit %s, %ss)\n' "$name" "$status" "$rc" "$((SECONDS - t0))" >>"$LOG"
  result "\"$name\"" "\"status\": \"$status\", \"exit\": $rc, \"s\": $((SECONDS - t0)), \"limit_s\": $limit"
  return "$rc"
}

if ! step "prerequisites" 25 "$PY" launch/gpu_check_steps.py prerequisites --jsonl "$JSONL"; then
  grep '^gpu_check: MISSING' "$LOG" >&2 || tail -20 "$LOG" >&2
  echo "gpu_check: stopped: without these the CUDA steps would only skip (this script installs nothing)" >&2
  exit 1
fi
step "environment" 10 "$PY" -m gearflow info || true
step "nvidia-smi" 5 bash -c 'command -v nvidia-smi >/dev/null || { echo "nvidia-smi: not on PATH"; exit 0; }; nvidia-smi' \
  || true
step "cuda tests" "$TESTS_S" "$PY" launch/gpu_check_steps.py cuda-tests --jsonl "$JSONL" || true
# bench lines go to the log and, one JSON record per line as measured, to bench_*.jsonl
step "cuda benchmark" "$BENCH_S" bash -c '"$1" -m gearflow bench replay --device cuda --json --scale "$2" \
  | tee "$3"' _ "$PY" "$BENCH_SCALE" "$OUT/bench_cuda.jsonl" || true
step "learner benchmark" "$LEARNER_S" "$PY" launch/gpu_check_steps.py learner-bench --jsonl "$JSONL" \
  --out "$OUT/bench_learner.jsonl" || true

e2e() {  # e2e NAME LIMIT CONFIG [E2E_CHECK OPTIONS AND KEY=VALUE ...]: deadline LIMIT - 15 s
  local name=$1 limit=$2 config=$3
  shift 3
  step "e2e $name" "$limit" "$PY" launch/e2e_check.py "$name" "$config" --seconds "$((limit - 15))" \
    --jsonl "$JSONL" --run-dir "$OUT/e2e_$name" "$@" || true
  # a run killed at its limit leaves its shared-memory segments (replay, parameters): the next
  # run should not find the memory taken (removes only segments whose owner is dead)
  [ "$PLAN" = 1 ] || "$PY" -m gearflow replay gc >>"$LOG" 2>&1 || true
}
# the replay pairs: the same run with the replay on the CPU, then on the GPU
PAIR=(--steady-s "$STEADY_S" --progress-s 2 learner.device=cuda actor.device=cpu replay.min_size_to_sample=5000)
for replay in cpu cuda; do
  e2e "pong_apex_replay_$replay" "$PAIR_S" configs/pong_apex.yaml "${PAIR[@]}" "replay.device=$replay"
done
for replay in cpu cuda; do
  e2e "halfcheetah_dpg_replay_$replay" "$PAIR_S" configs/halfcheetah_dpg.yaml "${PAIR[@]}" actor.num_actors=12 \
    "replay.device=$replay"
done
step "replay pairs" 5 "$PY" launch/gpu_check_steps.py pairs --jsonl "$JSONL" || true
# gato_80m's actors act on the GPU, as the config has them (80M parameters on CPU actors would
# not fill the replay in a minute): the learner's own memory is told apart from theirs
e2e gato_80m "$GATO_S" configs/paper/gato_80m.yaml --plan learner.device=cuda replay.device=cuda \
  learner.bf16=true replay.capacity=200000 replay.min_size_to_sample=200
[ "$PLAN" = 1 ] || grep -E '^gpu_check: (e2e|pair) ' "$LOG" || echo "gpu_check: no end-to-end report (see $LOG)"
[ "$failed" = 0 ]
