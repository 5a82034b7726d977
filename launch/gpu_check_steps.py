"""The Python steps of launch/gpu_check.sh: each appends one JSON line per result to the
check's results file as it goes (``--jsonl``; a killed step keeps what it measured).

    python launch/gpu_check_steps.py prerequisites --jsonl OUT/gpu_check.jsonl
    python launch/gpu_check_steps.py cuda-tests --jsonl OUT/gpu_check.jsonl [PYTEST ARGS]
    python launch/gpu_check_steps.py learner-bench --jsonl OUT/gpu_check.jsonl --out OUT/bench_learner.jsonl
    python launch/gpu_check_steps.py pairs --jsonl OUT/gpu_check.jsonl

``prerequisites`` imports everything the later steps import (gearflow from this checkout,
its C modules, omegaconf, gymnasium, envpool with a Pong env, the agents, pytest and the
tests' conftest) and only then the CUDA requirements in order: a CUDA build of torch, a
GPU it sees, CuPy compiling (NVRTC) and running a kernel. It exits 1 at the first missing
one, named (``gpu_check: MISSING: ...``), so that nothing after it runs only to skip.

``cuda-tests`` runs ``pytest -m cuda`` over the CUDA tests; a result line per test; a
skipped CUDA test fails the step (except the one that needs 2 GPUs).

``learner-bench`` runs ``gearflow bench learner --device cuda --json`` (its lines into ``--out``
and the results file) where that suite is registered; where it is not, one line says
``skipped: no learner bench`` and the step passes.

``pairs`` reads the end-to-end reports of the replay pairs (``NAME_replay_cpu`` and
``NAME_replay_cuda``, learner on cuda) from the results file and appends, per pair, the steady
updates/s of each, their ratio and the issue's target (pong_apex 1.2, halfcheetah_dpg 1.0).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout: gearflow need not be installed
    sys.path.insert(0, str(ROOT))

CUDA_TESTS = ["tests/test_native.py", "tests/test_device_replay.py"]
PAIR_TARGETS = {"pong_apex": 1.2, "halfcheetah_dpg": 1.0}  # replay cuda / replay cpu, steady updates/s
LEARNER_PHASE_S = 0.6  # gearflow bench learner --seconds in the GPU call: 3 rounds of 0.2 s per phase
ALLOWED_SKIPS = ("needs 2 GPUs",)  # an H200 machine has one


class Results:
    """Appends a JSON line per result to ``path`` (and prints it), flushed at once."""

    def __init__(self, path: str | None, step: str):
        self.path, self.step = path, step

    def __call__(self, **fields) -> dict:
        row = {"step": self.step, "t": round(time.time(), 3), **fields}
        line = json.dumps(row, default=str)
        print("gpu_check: result " + line, flush=True)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
        return row


def _import(result: Results, name: str, required: bool = True, failed: list | None = None) -> object | None:
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        result(check=f"import {name}", ok=False, required=required, detail=f"{type(exc).__name__}: {exc}")
        if failed is not None:
            failed.append(f"{type(exc).__name__}: {exc}")
        return None
    version = getattr(module, "__version__", None)
    where = getattr(module, "__file__", None)
    result(check=f"import {name}", ok=True, version=version, file=where, s=round(time.perf_counter() - t0, 3))
    return module


def prerequisites(args) -> int:
    result = Results(args.jsonl, "prerequisites")
    missing: list[str] = []
    result(check="python", ok=True, version=sys.version.split()[0], executable=sys.executable,
           pythonpath=os.environ.get("PYTHONPATH", ""), envpool_assets=os.environ.get("ENVPOOL_ASSETS_PATH", ""))
    # 1. everything the steps import, before any CUDA requirement
    for name in ("numpy", "yaml", "omegaconf", "gymnasium", "optree", "dm_env", "gearflow", "gearflow.config",
                 "gearflow.runner", "gearflow.native", "gearflow.native.bench_cuda", "gearflow.bench.replay_cuda",
                 "gearflow.tools.dryrun", "agents.apex_dqn", "agents.r2d2_transformer", "pytest", "hypothesis"):
        why: list[str] = []
        if _import(result, name, failed=why) is None:
            missing.append(f"{name} does not import ({why[0][:300]}); the device kit has the wheels the H200 "
                           "lacks (launch/device_kit.sh)")
    for name in ("gearflow.replay._hotpath", "agents._r2d2_decode", "gearflow.transport._mac"):  # numpy / TorchScript otherwise
        _import(result, name, required=False)
    why = []
    if _import(result, "envpool", failed=why) is not None:
        try:
            import envpool

            t0 = time.perf_counter()
            env = envpool.make("Pong-v5", env_type="gymnasium", num_envs=1)
            obs, _ = env.reset()
            env.close()
            result(check="envpool.make Pong-v5", ok=True, obs_shape=list(obs.shape), s=round(time.perf_counter() - t0, 3))
        except Exception as exc:  # noqa: BLE001
            result(check="envpool.make Pong-v5", ok=False, detail=f"{type(exc).__name__}: {exc}")
            missing.append(f"envpool cannot make Pong-v5 ({exc}): set ENVPOOL_ASSETS_PATH to the kit's envpool_assets")
        try:  # the halfcheetah_dpg pair's env (MuJoCo XML in the kit): named here, not required
            t0 = time.perf_counter()
            env = envpool.make("HalfCheetah-v4", env_type="gymnasium", num_envs=1)
            obs, _ = env.reset()
            env.close()
            result(check="envpool.make HalfCheetah-v4", ok=True, required=False, obs_shape=list(obs.shape),
                   s=round(time.perf_counter() - t0, 3))  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            result(check="envpool.make HalfCheetah-v4", ok=False, required=False, detail=f"{type(exc).__name__}: {exc}")
            print(f"gpu_check: note: the halfcheetah_dpg pair will fail: envpool cannot make HalfCheetah-v4 ({exc})",
                  flush=True)  # fmt: skip
    else:
        missing.append(f"envpool does not import ({why[0][:300]}): install the kit's wheels and set "
                       "ENVPOOL_ASSETS_PATH to its envpool_assets (launch/device_kit.sh)")
    try:  # the tests' conftest: what pytest imports first
        sys.path.insert(0, str(ROOT / "tests"))
        importlib.import_module("conftest")
        result(check="import tests/conftest.py", ok=True)
    except Exception as exc:  # noqa: BLE001
        result(check="import tests/conftest.py", ok=False, detail=f"{type(exc).__name__}: {exc}")
        missing.append(f"tests/conftest.py does not import: {exc}")
    finally:
        sys.path.remove(str(ROOT / "tests"))
    # 2. the CUDA requirements, in order: the first one missing stops the check
    torch = _import(result, "torch")
    if torch is None:
        missing.append("torch does not import")
    elif not missing:
        if not torch.backends.cuda.is_built():
            missing.append(f"torch {torch.__version__} is a CPU-only build: a CUDA build of torch is needed "
                           "(pip install torch --index-url https://download.pytorch.org/whl/cu130)")
        elif not torch.cuda.is_available():
            missing.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: "
                           "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
        else:
            result(check="torch cuda", ok=True, torch=torch.__version__, cuda=torch.version.cuda,
                   gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    if not missing:
        from gearflow.native import probe_cupy

        probe = probe_cupy()
        result(check="cupy kernel", ok=bool(probe.ok), detail=probe.detail)
        if not probe.ok:
            missing.append(f"CuPy cannot run a kernel: {probe.detail}")
    for m in missing:
        print(f"gpu_check: MISSING: {m}", flush=True)
    result(check="prerequisites", ok=not missing, missing=missing)
    return 1 if missing else 0


def cuda_tests(args) -> int:
    import pytest

    result = Results(args.jsonl, "cuda tests")

    class Outcomes:
        def __init__(self):
            self.passed, self.skipped, self.failed = 0, [], 0

        def pytest_runtest_logreport(self, report):
            if report.skipped:
                reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
                self.skipped.append((report.nodeid, reason))
                result(test=report.nodeid, outcome="skipped", reason=reason)
            elif report.when == "call":
                self.passed += report.passed
                self.failed += report.failed
                result(test=report.nodeid, outcome=report.outcome, s=round(report.duration, 3),
                       **({} if report.passed else {"detail": str(report.longrepr)[-2000:]}))
            elif report.failed:  # setup / teardown errors
                self.failed += 1
                result(test=report.nodeid, outcome=f"error in {report.when}", detail=str(report.longrepr)[-2000:])

    seen = Outcomes()
    os.chdir(ROOT)
    rc = pytest.main(["-m", "cuda", *CUDA_TESTS, "-q", "-rs", "-p", "no:cacheprovider", *args.pytest_args],
                     plugins=[seen])
    bad = [(n, r) for n, r in seen.skipped if not any(a in r for a in ALLOWED_SKIPS)]
    for nodeid, reason in bad:
        print(f"gpu_check: a CUDA test was SKIPPED (counted as a failure): {nodeid}: {reason}", flush=True)
    result(summary=True, passed=seen.passed, failed=seen.failed, skipped=len(seen.skipped), skipped_not_allowed=len(bad),
           pytest_exit=int(rc))
    return int(rc) or (1 if bad or seen.passed == 0 else 0)


def learner_bench(args) -> int:
    """``gearflow bench learner --device cuda --json`` where the suite exists (another issue builds it)."""
    import subprocess

    from gearflow.bench import SUITES

    result = Results(args.jsonl, "learner bench")
    if "learner" not in SUITES:
        print("gpu_check: learner bench skipped: no learner bench (gearflow bench has no 'learner' suite)", flush=True)
        result(status="skipped", reason="no learner bench")
        return 0
    # the bench budgets itself within the step's limit (GPU_CHECK_STEP_S, set by gpu_check.sh's
    # step) less 8 s for two interpreters' start-up and torch's CUDA context: a config past its
    # share is cut short, one not started in time skipped, the lines so far kept
    limit = float(os.environ.get("GPU_CHECK_STEP_S") or 0)
    budget = ["--seconds", str(LEARNER_PHASE_S), "--budget-s", str(max(limit - 8, 1))] if limit else []
    cmd = [sys.executable, "-m", "gearflow", "bench", "learner", "--device", "cuda", "--json", *budget,
           *args.pytest_args]  # fmt: skip
    lines = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        out = open(args.out, "a", encoding="utf-8") if args.out else None  # noqa: SIM115 - closed below
        try:
            for line in proc.stdout:
                print(line, end="", flush=True)
                if line.strip().startswith("{"):
                    lines += 1
                    if out:
                        out.write(line)
                        out.flush()
        finally:
            if out:
                out.close()
    result(status="ok" if proc.returncode == 0 else "failed", exit=proc.returncode, records=lines)
    return proc.returncode


def pairs(args) -> int:
    """Per replay pair in the results file: steady updates/s with replay cpu and cuda, the ratio, the target."""
    reports = {}
    if args.jsonl and Path(args.jsonl).is_file():
        for line in Path(args.jsonl).read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "updates_per_s" in row and "name" in row:
                reports[row["name"]] = row
    result = Results(args.jsonl, "replay pairs")
    for name, target in PAIR_TARGETS.items():
        cpu, cuda = reports.get(f"{name}_replay_cpu"), reports.get(f"{name}_replay_cuda")
        rates = [(r or {}).get("steady", {}).get("updates_per_s") for r in (cpu, cuda)]
        seconds = [(r or {}).get("steady", {}).get("seconds") for r in (cpu, cuda)]
        ratio = round(rates[1] / rates[0], 3) if all(rates) else None
        row = result(pair=name, replay_cpu_updates_per_s=rates[0], replay_cuda_updates_per_s=rates[1],
                     steady_s=seconds, ratio=ratio, target=target, met=ratio is not None and ratio >= target)  # fmt: skip
        print(f"gpu_check: pair {name}: replay cuda / cpu = {row['ratio']} (target {target}; steady updates/s "
              f"{rates[1]} / {rates[0]} over {seconds} s)", flush=True)  # fmt: skip
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["prerequisites", "cuda-tests", "learner-bench", "pairs"])
    parser.add_argument("--jsonl", default=None, help="results file (one JSON line per result, appended)")
    parser.add_argument("--out", default=None, help="learner-bench: its JSON lines also go here")
    parser.add_argument("pytest_args", nargs="*", help="cuda-tests: more pytest arguments; learner-bench: more bench arguments")
    args = parser.parse_intermixed_args(argv)
    steps = {"prerequisites": prerequisites, "cuda-tests": cuda_tests, "learner-bench": learner_bench, "pairs": pairs}
    try:
        return steps[args.step](args)
    except Exception:  # say where, in the results too
        Results(args.jsonl, args.step)(ok=False, crashed=traceback.format_exc()[-3000:])
        raise


if __name__ == "__main__":
    sys.exit(main())
