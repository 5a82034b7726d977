"""Greedy evaluation during training (issue 31, ``run.eval_every``): the ``eval`` role of the plan,
a process of its own reading the parameter store, its rows in ``metrics.jsonl`` (and TensorBoard at
the earlier step of the weights it evaluated), and a crash of it that never stops the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gearflow.config import eval_period, load_config
from gearflow.errors import ConfigError
from gearflow.run.metrics import MetricsLog, read_metrics
from gearflow.topology.plan import plan_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "cartpole_apex.yaml")
SMALL = ["actor.num_actors=1", "env.num_envs=4", "env.batch_size=2", "replay.capacity=20000",
         "replay.min_size_to_sample=200", "learner.batch_size=32", "run.stop_at_return=0"]  # fmt: skip
GUARD = 480  # only keeps a broken run from hanging the suite: every wait is on a file or a log line


def _wait(done, proc: subprocess.Popen | None, what: str, give_up=lambda: ""):
    """Poll ``done()`` until it is true; ``give_up()``: a reason (from the run's progress) it never will be."""
    deadline = time.monotonic() + GUARD
    while not (value := done()):
        if why := give_up():
            pytest.fail(f"{what}: {why}")
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) while waiting for {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def _eval_pids(run: Path) -> list[int]:
    log = run / "train.log"
    return [int(p) for p in re.findall(r"eval: process (\d+) plays", log.read_text())] if log.exists() else []


def _rows(run: Path) -> list[dict]:
    return read_metrics(run) if (run / "metrics.jsonl").exists() else []


def _evals(run: Path) -> list[dict]:
    return [r for r in _rows(run) if "eval/return_mean" in r]


def _last_steps(run: Path) -> int:
    return max((int(r["actor/env_steps"]) for r in _rows(run) if "learner/loss" in r), default=0)


def _trained_without(run: Path, steps: int, what: str):
    """A give-up: the run trained ``steps`` env steps more than now without ``what``."""
    start = _last_steps(run)
    return lambda: f"the run trained {steps} env steps without it" if _last_steps(run) > start + steps else ""


def _off(run: Path) -> str:
    log = run / "train.log"
    return "evaluation was switched off" if log.exists() and "evaluation is off" in log.read_text() else ""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


# ---------------------------------------------------------------------------- config and plan


def test_eval_every_is_env_steps_or_a_duration_and_off_by_default():
    assert eval_period(load_config(CONFIG)) is None
    assert eval_period(load_config(CONFIG, ["run.eval_every=0"])) is None
    assert eval_period(load_config(CONFIG, ["run.eval_every=null"])) is None
    assert eval_period(load_config(CONFIG, ["run.eval_every=20000"])) == ("steps", 20000)
    assert eval_period(load_config(CONFIG, ["run.eval_every=2m"])) == ("seconds", 120)
    with pytest.raises(ConfigError, match=r"run.eval_every='often': must be a number of env steps"):
        load_config(CONFIG, ["run.eval_every=often"])
    with pytest.raises(ConfigError, match=r"run.eval_episodes=0: must be ≥ 1"):
        load_config(CONFIG, ["run.eval_episodes=0"])
    with pytest.raises(ConfigError, match=r"run.eval_every.*not with transport.shards or launcher=ray"):
        load_config(CONFIG, ["run.eval_every=1000", "transport.shards=[127.0.0.1:5000]"])


@pytest.mark.parametrize("overrides,roles", [
    ([], ("replay", "params", "learner", "actors", "eval")),
    (["run.serial=true"], ("replay", "params", "learner", "serial_actor", "eval")),
    (["run.eval_every=0"], ("replay", "params", "learner", "actors")),
])  # fmt: skip
def test_the_plan_ends_with_the_eval_role(overrides, roles):
    assert plan_run(load_config(CONFIG, ["run.eval_every=5000", *overrides])).roles == roles


def test_eval_rows_reach_tensorboard_at_the_earlier_step_they_evaluated(tmp_path):
    """An eval row comes at the step of the weights it evaluated, before the last training row's:
    TensorBoard still draws it (one point per step and key)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsLog(tmp_path, tensorboard=True)
    sink.write({"actor/env_steps": 100, "learner/loss": 1.0})
    sink.write({"actor/env_steps": 200, "learner/loss": 0.9})
    sink.write({"actor/env_steps": 150, "eval/return_mean": 42.0})
    sink.write({"actor/env_steps": 200, "learner/loss": 0.5})  # a repeated step of a key: not drawn again
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/return_mean")] == [(150, 42.0)]
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("learner/loss")] == [(100, 1.0), (200, 0.9)]


# ---------------------------------------------------------------------------- the eval process


def test_an_eval_process_that_fails_for_good_switches_evaluation_off_and_never_raises():
    """The same error twice (here: a parameter store that does not exist) is not restarted again;
    check() never raises: the run would go on."""
    from gearflow.roles.evaluator import EvalProcess

    cfg = load_config(CONFIG, ["run.eval_every=10", "actor.max_restarts=5"])
    rows = []
    ev = EvalProcess(cfg, "gearflow-no-such-store", env_steps=lambda: 0, updates=lambda: 0, elapsed=lambda: 0.0,
                     emit=rows.append)  # fmt: skip
    try:
        ev.start()
        _wait(lambda: ev.check() == 0 and ev.off, None, "evaluation switched off")
        assert ev.restarts == 1 and "no-such-store" in ev.errors["eval"] and rows == []
    finally:
        ev.stop()
        ev.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_run_evaluates_in_its_own_process_and_survives_its_death(tmp_path):
    """gearflow train (local: one actor process, CartPole on EnvPool) with run.eval_every: eval rows
    in metrics.jsonl from a child process that is neither the learner nor an actor; SIGKILLed, it is
    restarted while the actor keeps stepping, and evaluations continue; the run ends by SIGTERM."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *SMALL, f"run.dir={run}", "run.eval_every=1000",
           "run.eval_episodes=2", "run.max_env_steps=0", "run.max_seconds=900", "run.progress=log",
           "run.log_every_s=0.5", "run.checkpoint_every=0", "run.tensorboard=false"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        far = 100_000  # env steps without what should have come long before: give up (no clock)
        (first,) = _wait(lambda: _eval_pids(run)[:1], proc, "the eval process", _trained_without(run, far, "it"))
        assert first != proc.pid and _parent(first) == proc.pid  # a child of the learner's process, of its own
        _wait(lambda: _evals(run), proc, "an eval row", _trained_without(run, far, "it"))
        actors = {c for c in _children(proc.pid) if c != first and "resource_tracker" not in _cmdline(c)}
        assert actors and first not in actors
        os.kill(first, signal.SIGKILL)
        at_kill, evals_at_kill = _last_steps(run), len(_evals(run))
        (second,) = _wait(lambda: _eval_pids(run)[1:2], proc, "the restarted eval process", lambda: _off(run))
        assert second != first and "the evaluation process died" in (run / "train.log").read_text()
        _wait(lambda: len(_evals(run)) > evals_at_kill + 1, proc, "evaluations after the restart",
              _trained_without(run, far, "them"))
        _wait(lambda: _last_steps(run) > at_kill + 2000, proc, "the actor stepping on")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GUARD) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    evals = _evals(run)
    keys = {"eval/return_mean", "eval/return_std", "eval/episodes", "eval/env_steps", "learner/updates"}
    assert all(keys <= set(r) and r["eval/episodes"] == 2 and r["eval/env_steps"] >= 2 for r in evals)
    assert [r["actor/env_steps"] for r in evals] == sorted(r["actor/env_steps"] for r in evals)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["actor/restarts"] == 0  # the actor never died
    r = subprocess.run([sys.executable, "-m", "gearflow", "plot", str(run), "--metric", "eval/return_mean",
                        "-o", str(tmp_path / "eval.png")], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
