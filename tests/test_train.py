"""Tiny end-to-end runs through the real ``gearflow train`` entry point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gearflow.replay.storage import COMMIT, PREFIX, SharedStorage, gc_segments, list_segments

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "cartpole_apex.yaml")
TINY = [
    "replay.capacity=20000",
    "replay.min_size_to_sample=200",
    "learner.batch_size=32",
    "learner.publish_every=2",
    "actor.weight_sync_period=16",
    "env.num_envs=4",
    "env.batch_size=2",
    "run.log_every_s=0.5",
]

pytestmark = pytest.mark.slow


def train(tmp_path: Path, *overrides: str, timeout: float = 240) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={tmp_path / 'run'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary, proc.stderr


def test_train_end_to_end_updates_and_actors_get_new_weights(tmp_path):
    summary, log = train(tmp_path, "run.max_env_steps=8000")
    assert summary["stop_reason"] == "reached run.max_env_steps=8000"
    assert summary["actor/env_steps"] >= 8000
    assert summary["learner/updates"] > 0
    assert summary["learner/weights_version"] > 1
    assert summary["actor/weights_version_min"] > 1, "an actor never loaded newer weights"
    # 8 partitions of 2,500 steps and ~8,000 steps in all: no ring wraps, so no item was
    # overwritten, evicted or torn
    assert summary["replay/size"] == summary["replay/inserts"] > 0
    assert summary["replay/evictions"] == 0 and summary["replay/torn_resampled"] == 0
    assert "Traceback" not in log
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["learner/updates"] == summary["learner/updates"]


def test_train_serial_mode(tmp_path):
    summary, _ = train(tmp_path, "run.serial=true", "run.max_env_steps=1500")
    assert summary["learner/updates"] > 0
    assert summary["actor/weights_version_min"] > 1


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(c) for c in text.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def _wait_gone(pids: list[int], what: str, timeout: float = 60) -> None:
    """Wait until none of ``pids`` runs; the timeout only keeps a hang from stalling the suite."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            left = [(p, _cmdline(p)[:80]) for p in pids if _alive(p)]
            pytest.fail(f"{what}: {left}")
        time.sleep(0.1)


def test_sigkilled_actor_is_restarted_and_sigterm_stops_cleanly(tmp_path):
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={tmp_path / 'run'}",
           "run.max_env_steps=0", "run.max_seconds=120", "actor.num_actors=2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            actors = [c for c in _children(proc.pid) if "resource_tracker" not in _cmdline(c)]
            if len(actors) == 2 and metrics.exists() and '"replay/size": 0' not in metrics.read_text()[-2000:]:
                if metrics.read_text().count("\n") >= 2:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("the run did not start two actors and fill the replay in time")
        before = json.loads(metrics.read_text().splitlines()[-1])
        os.kill(actors[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = [json.loads(x) for x in metrics.read_text().splitlines()]
            if rows[-1]["actor/restarts"] >= 1 and rows[-1]["actor/env_steps"] > before["actor/env_steps"] + 500:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the killed actor was not restarted (or the run stalled)")
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]  # stopped by SIGTERM (checkpointed), not finished
    assert "actor 0 died (exit code -9); restarting it (1/3)" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stop_reason"] == "stopped by signal"
    assert summary["actor/restarts"] == 1
    # the replay kept what the killed actor had written
    assert summary["replay/inserts"] >= before["replay/inserts"]
    assert summary["replay/size"] >= before["replay/size"]
    _wait_gone(children, "child processes outlived the run")
    assert not [n for n, owner, _ in list_segments() if owner == proc.pid], "shared memory left behind"


def test_item_kind_mismatch_is_a_config_error_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, "replay.item=sequence", f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert "replay.item='sequence': agent agents.apex_dqn learns from transition items" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_actors_stop_when_the_learner_is_sigkilled(tmp_path):
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={tmp_path / 'run'}",
           "run.max_env_steps=0", "run.max_seconds=120"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    actors: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(actors) < 2:
            actors = [c for c in _children(proc.pid) if "resource_tracker" not in _cmdline(c)]
            time.sleep(0.2)
        assert len(actors) == 2, "the run did not start two actors"
        # both actors are in their env loops: every partition has committed steps
        (table,) = [n for n, owner, _ in list_segments() if owner == proc.pid and "_params_" not in n]
        st = SharedStorage.attach(table)
        try:
            while not (st.counters[:, COMMIT] > 0).all():
                assert proc.poll() is None and time.monotonic() < deadline, "the actors never wrote"
                time.sleep(0.05)
        finally:
            st.close()
        proc.kill()  # SIGKILL: the learner runs no cleanup at all
        proc.wait(timeout=30)
        _wait_gone(actors, "orphaned actors kept running")
    finally:
        if proc.poll() is None:
            proc.kill()
        for a in actors:
            if _alive(a):
                os.kill(a, signal.SIGKILL)
        # the dead learner's segments (its table and parameter store, both named with its pid)
        # are what `gearflow replay gc` is for; only this run's: other runs share /dev/shm
        proc.wait(timeout=30)
        removed = [n for prefix in (f"{PREFIX}_{proc.pid}_", f"{PREFIX}_params_{proc.pid}_")
                   for n, _ in gc_segments(prefix=prefix)]  # fmt: skip
    assert len(removed) == 2, removed
    assert not [n for n, owner, _ in list_segments() if owner == proc.pid]
