"""launch/e2e_check.py (the end-to-end steps of launch/gpu_check.sh) on the CPU: the config keys
it sets exist and its one-line report carries every figure, from a real (serial) run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["gpu_check.sh", "device_kit.sh"])
def test_launch_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def _gpu_check_plan(tmp_path, *args):
    """``gpu_check.sh --plan``: each step with the limit it would get if every step before it
    took its whole limit (nothing runs); the rows of its results file and its exit status."""
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), "--plan", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    rows = [json.loads(ln) for ln in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    return rows, proc


def test_gpu_check_runs_every_step_at_its_defaults_even_the_short_ones(tmp_path):
    """The first H200 call skipped `environment` (15 s) and `nvidia-smi` (10 s) with 346 s of the
    budget left: a step was skipped whenever its limit was under 20 s. A step is skipped only when
    what is left is less than both its own limit and 20 s. At the defaults every step of the issue
    is planned with its whole limit even if each before it took all of its own (the worst case),
    and the budget plus the kit's install stays within one 480-s call."""
    rows, proc = _gpu_check_plan(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {r["step"]: r for r in rows}
    assert all(r["status"] == "planned" for r in rows), [r for r in rows if r["status"] != "planned"]
    assert list(steps) == ["prerequisites", "environment", "nvidia-smi", "cuda tests", "cuda benchmark",
                           "learner benchmark", "e2e pong_apex_replay_cpu", "e2e pong_apex_replay_cuda",
                           "e2e halfcheetah_dpg_replay_cpu", "e2e halfcheetah_dpg_replay_cuda", "replay pairs",
                           "e2e gato_80m"]  # fmt: skip
    want = {"prerequisites": 25, "environment": 10, "nvidia-smi": 5, "cuda tests": 60, "cuda benchmark": 40,
            "learner benchmark": 40, "replay pairs": 5, "e2e gato_80m": 48}  # fmt: skip
    assert {k: steps[k]["limit_s"] for k in want} == want  # whole limits: nothing cut
    assert all(steps[k]["limit_s"] == 58 for k in steps if "_replay_" in k)
    end = rows[-1]["from_s"] + rows[-1]["limit_s"]
    assert end <= 465 and 465 + 15 <= 480, end  # the kit installs in 2-15 s
    assert "every step runs" in proc.stdout
    assert "--steady-s 30" in proc.stdout and "--seconds 43" in proc.stdout  # a pair run: 30 s steady by 43 s
    # a short budget: the steps that still fit run (whole or cut), the rest are skipped and named
    rows, proc = _gpu_check_plan(tmp_path, "--budget", "120")
    assert proc.returncode == 1
    status = {r["step"]: r["status"] for r in rows}
    assert status["environment"] == status["nvidia-smi"] == status["cuda tests"] == "planned"
    assert {r["step"]: r["limit_s"] for r in rows if r["status"] == "planned"}["cuda benchmark"] == 20  # cut
    assert status["learner benchmark"] == "skipped" and "learner benchmark SKIPPED" in proc.stdout


def _steps_module():
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import gpu_check_steps
    finally:
        sys.path.remove(str(ROOT / "launch"))
    return gpu_check_steps


def test_learner_bench_step_skips_cleanly_where_the_suite_is_not_registered(tmp_path, monkeypatch):
    """The learner suite is another issue's: until it is registered the step says so and passes;
    once it is, the step runs it and keeps its JSON lines."""
    from gearflow import bench

    steps = _steps_module()
    jsonl, out = tmp_path / "r.jsonl", tmp_path / "bench_learner.jsonl"
    monkeypatch.setattr(bench, "SUITES", {k: v for k, v in bench.SUITES.items() if k != "learner"})
    assert steps.main(["learner-bench", "--jsonl", str(jsonl), "--out", str(out)]) == 0
    (row,) = [json.loads(ln) for ln in jsonl.read_text().splitlines()]
    assert row["status"] == "skipped" and row["reason"] == "no learner bench" and not out.exists()


def test_learner_bench_step_budgets_the_bench_within_its_limit(tmp_path, monkeypatch):
    """gpu_check.sh's step hands its limit on (GPU_CHECK_STEP_S): the bench gets short phases and
    a budget 8 s under it (a limit of 40 s: --budget-s 32), so a slow config is cut, not the step."""
    import io
    import subprocess

    steps = _steps_module()
    seen = []

    class Proc:
        def __init__(self, cmd, **_):
            seen.append(cmd)
            self.stdout, self.returncode = io.StringIO('{"bench": "learner"}\n'), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.setenv("GPU_CHECK_STEP_S", "40")
    assert steps.main(["learner-bench", "--jsonl", str(tmp_path / "r.jsonl")]) == 0
    cmd = seen[0]
    assert cmd[cmd.index("--budget-s") + 1] == "32.0" and cmd[cmd.index("--seconds") + 1] == str(steps.LEARNER_PHASE_S)
    monkeypatch.delenv("GPU_CHECK_STEP_S")
    steps.main(["learner-bench", "--jsonl", str(tmp_path / "r.jsonl")])
    assert "--budget-s" not in seen[1]  # run by hand: the bench's own defaults


def test_replay_pairs_step_reports_the_ratio_against_the_target(tmp_path):
    steps = _steps_module()
    jsonl = tmp_path / "r.jsonl"
    reports = [("pong_apex_replay_cpu", 125.0), ("pong_apex_replay_cuda", 160.0), ("halfcheetah_dpg_replay_cpu", 175.0)]
    jsonl.write_text("".join(json.dumps({"name": n, "updates_per_s": 1.0, "steady": {"updates_per_s": u, "seconds": 31.0}})
                             + "\n" for n, u in reports) + "not json\n")  # fmt: skip
    assert steps.main(["pairs", "--jsonl", str(jsonl)]) == 0
    rows = {r["pair"]: r for r in map(json.loads, jsonl.read_text().splitlines()[4:])}
    assert rows["pong_apex"]["ratio"] == 1.28 and rows["pong_apex"]["target"] == 1.2 and rows["pong_apex"]["met"]
    assert rows["halfcheetah_dpg"]["ratio"] is None and not rows["halfcheetah_dpg"]["met"]  # the cuda run is missing
    assert rows["pong_apex"]["steady_s"] == [31.0, 31.0]


def test_e2e_run_stops_after_its_steady_seconds_and_reports_them(tmp_path):
    """``--steady-s``: a run may stop once its rows after the first learner update span that many
    seconds; the steady means leave out the first of those rows (it began before learning did)."""
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import e2e_check
    finally:
        sys.path.remove(str(ROOT / "launch"))
    rows = [{"time/elapsed_s": 5.0 * i, "learner/updates": max(0, 40 * (i - 3)), "learner/updates_per_s": 8.0 * max(0, i - 3),
             "actor/env_steps_per_s": 100.0} for i in range(1, 12)]  # fmt: skip
    assert e2e_check.steady_span(rows[:4]) == 0.0  # one steady row (t=20): no span yet
    assert e2e_check.stop_reason(rows[:9], steady_s=30) == ""  # steady rows t=20..45: 25 s
    assert e2e_check.stop_reason(rows[:10], steady_s=30) == "reached 30 s of steady updates"  # t=20..50
    assert e2e_check.steady_span(rows) == 35.0
    assert e2e_check.stop_reason(rows, steady_rows=4) == "reached 4 steady rows"
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = e2e_check.steady_rates(path)
    assert got["rows"] == 7 and got["seconds"] == 35.0
    assert got["updates_per_s"] == pytest.approx(sum(8.0 * (i - 3) for i in range(5, 12)) / 7)


def test_envpool_ids_without_envpool_assets_is_no_ids_not_a_crash(tmp_path):
    """envpool without its assets raises FileNotFoundError on import (the H200: envpool's wheel but
    no envpool-assets); a config whose env gymnasium has still loads."""
    code = ("from gearflow.config import envpool_ids, load_config; assert envpool_ids() == frozenset(); "
            "print(load_config('configs/cartpole_apex.yaml', []).env.id)")  # fmt: skip
    env = {**os.environ, "ENVPOOL_ASSETS_PATH": str(tmp_path)}  # an empty folder: no atari/roms
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "CartPole-v1"
    assert "envpool cannot be imported (FileNotFoundError" in proc.stderr


@pytest.mark.slow
def test_e2e_check_reports_a_short_run(tmp_path):
    """Runs until two steady rows exist (90 s deadline), not for a fixed time: next to a CPU hog
    the build alone took the old 8 s, leaving 0 updates and 0 steady rows."""
    jsonl = tmp_path / "results.jsonl"
    cmd = [sys.executable, "launch/e2e_check.py", "cpu_apex", "configs/cartpole_apex.yaml", "--seconds", "90",
           "--steady-rows", "2", "--jsonl", str(jsonl), "--run-dir", str(tmp_path / "run"), "--progress-s", "2", "run.serial=true", "learner.device=cpu", "replay.device=cpu", "learner.bf16=true", "actor.device=cpu",
           "replay.min_size_to_sample=200", "run.log_every_s=1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("gpu_check: e2e ")]
    report = json.loads(line[len("gpu_check: e2e "):])
    assert report["name"] == "cpu_apex" and report["stop_reason"] == "reached 2 steady rows"
    assert report["updates"] > 0 and report["updates_per_s"] > 0 and report["env_steps_per_s"] > 0
    assert report["tokens_per_s"] == pytest.approx(report["samples_per_s"])  # a transition is one token
    assert 0.0 <= report["learner_wait_fraction"] <= 1.0
    assert report["steady"]["rows"] >= 1 and report["steady"]["updates_per_s"] > 0
    assert (report["learner_device"], report["replay_device"], report["bf16"]) == ("cpu", "cpu", True)
    assert report["gpu"] is None  # no GPU here: no memory figures
    # as it went: progress lines (a kill keeps them), then the same report; the run's own rows
    rows = [json.loads(ln) for ln in jsonl.read_text().splitlines()]
    assert rows[-1] == report and len([r for r in rows if "progress" in r]) >= 2
    assert any(r["progress"].get("learner/updates", 0) > 0 for r in rows if "progress" in r)
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_gpu_memory_is_split_between_the_learner_process_and_the_others(tmp_path, monkeypatch):
    """gato_80m on the H200: 26.8 GiB used on the GPU with eight actor processes running their
    80M-parameter models there, 5.3 GiB allocated by the learner: the report could not say which
    was which. ProcessMemory reads nvidia-smi's per-process figures (here a stand-in script on
    PATH that prints what the driver would) and keeps the learner's (this process) and the
    others' peaks apart."""
    sys.path.insert(0, str(ROOT / "launch"))
    try:
        import e2e_check
    finally:
        sys.path.remove(str(ROOT / "launch"))
    me = os.getpid()
    table = tmp_path / "apps.csv"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\n[ "$1" = "--query-compute-apps=pid,used_memory" ] || exit 3\ncat "{table}"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    mem = e2e_check.ProcessMemory()
    assert mem.available and mem.pid == me
    table.write_text(f"{me}, 5400\n{me + 1}, 2600\n{me + 2}, 2600\n")
    mem.poll()
    table.write_text(f"{me}, 5000\n{me + 1}, 2700\n{me + 2}, 2700\n{me + 3}, [N/A]\n")
    mem.poll()
    assert mem.report() == {"learner_process_peak_gib": round(5400 / 1024, 3),
                            "other_processes_peak_gib": round(5400 / 1024, 3), "other_processes": 2}  # fmt: skip
    plan = {"learner_total_gib": 4.0}
    gpu = {"torch_max_allocated_gib": 5.2, **mem.report()}
    assert e2e_check.plan_vs_learner(plan, gpu) == {"plan_gib": 4.0, "torch_max_allocated_gib": 5.2, "ratio": 1.3,
                                                   "learner_process_peak_gib": round(5400 / 1024, 3)}  # fmt: skip
    assert e2e_check.plan_vs_learner({"error": "no plan"}, gpu) is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert not e2e_check.ProcessMemory().available
    assert e2e_check.ProcessMemory().report()["learner_process_peak_gib"] is None
