"""launch/e2e_check.py (the end-to-end steps of launch/gpu_check.sh) on the CPU: the config keys
it sets exist and its one-line report carries every figure, from a real (serial) run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "launch" / "gpu_check.sh")], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_e2e_check_reports_a_short_run(tmp_path):
    cmd = [sys.executable, "launch/e2e_check.py", "cpu_apex", "configs/cartpole_apex.yaml", "--seconds", "8",
           "run.serial=true", "learner.device=cpu", "replay.device=cpu", "learner.bf16=true", "actor.device=cpu",
           "replay.min_size_to_sample=200", "run.log_every_s=1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("gpu_check: e2e ")]
    report = json.loads(line[len("gpu_check: e2e "):])
    assert report["name"] == "cpu_apex" and report["stop_reason"] == "reached run.max_seconds=8.0"
    assert report["updates"] > 0 and report["updates_per_s"] > 0 and report["env_steps_per_s"] > 0
    assert report["tokens_per_s"] == pytest.approx(report["samples_per_s"])  # a transition is one token
    assert 0.0 <= report["learner_wait_fraction"] <= 1.0
    assert report["steady"]["rows"] >= 1 and report["steady"]["updates_per_s"] > 0
    assert (report["learner_device"], report["replay_device"], report["bf16"]) == ("cpu", "cpu", True)
    assert report["gpu"] is None  # no GPU here: no memory figures
