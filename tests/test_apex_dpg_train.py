"""Ape-X DPG end to end through the real entry points: ``gearflow train configs/pendulum_dpg.yaml``
(2 actor processes, float actions through the n-step adder and shared-memory replay, priorities
from the critics) improves Pendulum's return, ``gearflow eval`` of its checkpoint plays the
greedy policy (σ = 0) clearly better than random actions measured in the same test, and ``run.serial=true`` runs the same classes
in one process. Progress is asserted on returns, never on wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "pendulum_dpg.yaml")

pytestmark = pytest.mark.slow


def gearflow(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "gearflow", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


EPISODES, SEED = 8, 12345  # gearflow eval's episodes here and its default env seed


def evaluate(run: Path, *extra: str) -> dict:
    return json.loads(gearflow("eval", str(run), "--episodes", str(EPISODES), *extra).stdout.strip().splitlines()[-1])


def random_policy_return() -> float:
    """Mean return of uniform random actions over the eval's episodes and env seed (Pendulum-v1:
    200 steps, every env ends together); measured here: -1278 ± 361 (untrained greedy μ: -1427 ± 213)."""
    import envpool

    env = envpool.make_gymnasium("Pendulum-v1", num_envs=EPISODES, seed=SEED)
    env.reset()
    rng = np.random.default_rng(SEED)
    total = np.zeros(EPISODES)
    for _ in range(200):
        _, reward, _, _, _ = env.step(rng.uniform(-2.0, 2.0, (EPISODES, 1)).astype(np.float32))
        total += reward
    env.close()
    return float(total.mean())


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
    assert result["eval/episodes"] == EPISODES
    # improvement over random actions on the eval's episodes and seed (-1278 here). Measured at 3,500
    # updates on 2 loaded cores (load 8-15): greedy eval -201.6, -201.0, -201.3 (this test: 126 s;
    # by hand beside other runs 163-310 s), untrained greedy μ -1427, policy loss's sign flipped
    # -1763.6. The bar, random + 450 = -828, is ~630 below the trained runs and ~935 above the flipped one
    random = random_policy_return()
    print(f"greedy eval {result['eval/return_mean']:.1f} ± {result['eval/return_std']:.1f}, random {random:.1f}")
    assert result["eval/return_mean"] > random + 450, (result, f"random actions: {random:.1f}")


def test_serial_mode_learns_with_the_same_classes(tmp_path):
    run = tmp_path / "run"
    # serial: batches while the rate limiter allows them, else one recv (8 env steps, 8 items);
    # 64 rows at 4 samples per insert: 16 inserts per batch (tests/test_serial_batches.py: fewer)
    proc = gearflow("train", CONFIG, f"run.dir={run}", "run.serial=true", "run.max_env_steps=6000",
                    "replay.samples_per_insert=4", "learner.batch_size=64")  # fmt: skip
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_env_steps=6000"
    assert summary["learner/updates"] > 300 and summary["replay/inserts"] > 5000
    assert summary["learner/q_mean"] < 0  # Pendulum's rewards are ≤ 0: the critics learned their sign
