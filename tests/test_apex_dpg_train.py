"""Ape-X DPG end to end through the real entry points: ``gearflow train configs/pendulum_dpg.yaml``
(2 actor processes, float actions through the n-step adder and shared-memory replay, priorities
from the critics) improves Pendulum's return, ``gearflow eval`` of its checkpoint plays the
greedy policy (σ = 0) better than the untrained one, and ``run.serial=true`` runs the same classes
in one process. Progress is asserted on returns, never on wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "pendulum_dpg.yaml")

pytestmark = pytest.mark.slow


def gearflow(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "gearflow", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def evaluate(run: Path, *extra: str) -> dict:
    return json.loads(gearflow("eval", str(run), "--episodes", "8", *extra).stdout.strip().splitlines()[-1])


def test_train_improves_pendulum_and_eval_plays_the_greedy_policy(tmp_path):
    run = tmp_path / "run"
    proc = gearflow("train", CONFIG, f"run.dir={run}", "run.max_updates=3500", "run.log_every_s=1")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] in ("reached run.max_updates=3500", "reached run.stop_at_return=-200")
    assert summary["actor/weights_version_min"] > 1, "an actor never loaded newer weights"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r["actor/return_last100"] for r in rows if r.get("actor/episodes", 0) >= 16)
    assert first < -900  # the untrained policy and early noise: Pendulum's random returns are ~-1200
    result = evaluate(run)
    assert result["eval/episodes"] == 8
    # 3,500 updates: the greedy policy swings up; the untrained one scores ~-1200, and a policy that
    # descends Q (its loss's sign flipped) about -1600. At 2,500 updates one run evaluated at -798
    # (too close to the edge: the five measured runs crossed -600 between 3,000 and 4,000 updates)
    assert result["eval/return_mean"] > -800, result


def test_serial_mode_learns_with_the_same_classes(tmp_path):
    run = tmp_path / "run"
    # serial: one recv (8 env steps, 8 items), then one batch when the rate limiter allows it, so a
    # batch must allow ≥ 8 inserts: 64 rows at 4 samples per insert allow 16
    proc = gearflow("train", CONFIG, f"run.dir={run}", "run.serial=true", "run.max_env_steps=6000",
                    "replay.samples_per_insert=4", "learner.batch_size=64")  # fmt: skip
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_env_steps=6000"
    assert summary["learner/updates"] > 300 and summary["replay/inserts"] > 5000
    assert summary["learner/q_mean"] < 0  # Pendulum's rewards are ≤ 0: the critics learned their sign
