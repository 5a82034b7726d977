"""A user's own agent, one file outside the package, trained through the real ``gearflow`` command
from the directory that holds it (the actor processes must import it too)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "custom_agent"


def gearflow_command() -> list[str]:
    """The installed console script (its sys.path[0] is its bin dir, not the cwd, unlike
    ``python -m``): what a user types. Falls back to ``python -m gearflow``."""
    script = Path(sys.executable).with_name("gearflow")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "gearflow"]


@pytest.mark.slow
def test_custom_agent_outside_the_package_trains_through_gearflow_train(tmp_path):
    for name in ("my_dqn.py", "my_dqn.yaml"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # found via the cwd alone
    cmd = [*gearflow_command(), "train", "my_dqn.yaml", "run.max_env_steps=6000", "run.max_seconds=200",
           "env.num_envs=4", "learner.batch_size=32", "actor.weight_sync_period=16",
           "run.log_every_s=0.5", "run.progress=log", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_env_steps=6000"
    assert summary["actor/restarts"] == 0, "an actor process died (could it import my_dqn?)"
    assert summary["learner/updates"] >= 200
    assert summary["learner/weights_version"] > 1
    assert summary["actor/weights_version_min"] > 1, "an actor never loaded newer weights"
    assert "Traceback" not in proc.stderr
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "name: my_dqn" in saved


def test_the_guide_shows_the_agent_it_tests():
    guide = (ROOT / "docs" / "custom_agent.md").read_text()
    agent = (EXAMPLE / "my_dqn.py").read_text()
    assert agent in guide, "docs/custom_agent.md no longer shows examples/custom_agent/my_dqn.py verbatim"
    assert (EXAMPLE / "my_dqn.yaml").read_text() in guide
    assert len(agent.splitlines()) <= 110


@pytest.mark.slow
@pytest.mark.parametrize("where", ["repo root, relative path", "another directory, absolute path"])
def test_the_agent_next_to_its_config_is_found_from_any_directory(tmp_path, where):
    """README: `gearflow train examples/custom_agent/my_dqn.yaml`; my_dqn.py is found next to the
    config, in the learner and in the spawned actors, whatever the current directory."""
    cwd, config = (ROOT, "examples/custom_agent/my_dqn.yaml") if where.startswith("repo") else (
        tmp_path, str(EXAMPLE / "my_dqn.yaml"))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [*gearflow_command(), "train", config, "run.max_env_steps=1500", "run.max_seconds=200",
           "replay.min_size_to_sample=200", "learner.batch_size=32", "run.progress=log",
           f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=cwd, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # the env steps were written by the actor processes: they imported my_dqn too (whether the
    # learner got to an update in 1,500 steps depends on the machine's load: not asserted)
    assert summary["stop_reason"] == "reached run.max_env_steps=1500"
    assert summary["actor/restarts"] == 0, "an actor process died (could it import my_dqn?)"


@pytest.mark.slow
def test_a_run_of_an_agent_next_to_its_config_resumes_and_evaluates_from_another_directory(tmp_path):
    """Trained from the repository root with the README's relative path, the run records where
    my_dqn.py was found (run.module_dirs in its config.yaml); `gearflow train --resume` and
    `gearflow eval` of it, started in another directory, import it from there."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = tmp_path / "run"
    common = ["run.max_seconds=200", "replay.min_size_to_sample=200", "learner.batch_size=32", "run.progress=log"]
    proc = subprocess.run([*gearflow_command(), "train", "examples/custom_agent/my_dqn.yaml", "run.max_env_steps=1500",
                           *common, f"run.dir={run}"], capture_output=True, text=True, timeout=280, cwd=ROOT,
                          env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(EXAMPLE) in (run / "config.yaml").read_text()  # run.module_dirs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([*gearflow_command(), "train", "--resume", str(run), "run.max_env_steps=3000"],
                          capture_output=True, text=True, timeout=280, cwd=elsewhere, env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_env_steps=3000"
    assert summary["actor/restarts"] == 0, "an actor process died (could it import my_dqn?)"
    proc = subprocess.run([*gearflow_command(), "eval", str(run), "--episodes", "2"], capture_output=True, text=True,
                          timeout=280, cwd=elsewhere, env=env, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["eval/episodes"] == 2
