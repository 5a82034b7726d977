"""A researcher's own agent and env (issue 31): mistakes caught at the boundary (``actors/contract.py``),
reported by ``gearflow check-env`` one line each, and a run that crashed never reported as a success
(``roles/failures.py``): every case through the real ``gearflow`` command, with real EnvPool /
gymnasium envs and real actor processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gearflow.actors.contract import CheckedEnv, check_act, describe_failure
from gearflow.agent import ActOutput
from gearflow.envs import EnvSpec
from gearflow.errors import ContractError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# --------------------------------------------------------------------------- a user's modules

BAD_AGENTS = {
    # act() returns actions (k, 1): what the C51 user did
    "bad_shape": """
        def act(self, network, obs, epsilon, rng=None):
            out = super().act(network, obs, epsilon, rng)
            return ActOutput(actions=out.actions[:, None], values=out.values)
    """,
    # act() returns the (k, A, 51) value distribution as values
    "bad_values": """
        def act(self, network, obs, epsilon, rng=None):
            out = super().act(network, obs, epsilon, rng)
            return ActOutput(actions=out.actions, values=np.repeat(out.values[..., None], 51, axis=2))
    """,
    # the same exception at the same place every time
    "boom_agent": """
        def act(self, network, obs, epsilon, rng=None):
            raise RuntimeError("boom: the agent's act is broken")
    """,
    # a different message each time (the pid): not "the same failure twice", so restarted
    "flaky_agent": """
        def act(self, network, obs, epsilon, rng=None):
            raise RuntimeError(f"flaky failure in process {os.getpid()}")
    """,
}

DRIFT_ENV = """
import gymnasium
import numpy as np
from corridor import Corridor

DRIFT_AFTER = 30

class Drifting(gymnasium.vector.SyncVectorEnv):
    \"\"\"A vector env of its own whose observations become float64 after DRIFT_AFTER steps (the space
    says float32).\"\"\"
    steps = 0

    def step(self, actions):
        obs, *rest = super().step(actions)
        self.steps += 1
        return (obs.astype(np.float64) if self.steps > DRIFT_AFTER else obs, *rest)

def make(num_envs, seed, **kwargs):
    return Drifting([lambda: Corridor(**kwargs) for _ in range(num_envs)],
                    autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
"""

SAME_STEP_ENV = """
import gymnasium
from corridor import Corridor

def make(num_envs, seed, **kwargs):
    return gymnasium.vector.SyncVectorEnv([lambda: Corridor(**kwargs) for _ in range(num_envs)],
                                          autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP)
"""


def _workdir(tmp_path: Path) -> Path:
    """The examples (agent, env factory, configs) and the broken variants, as a user's directory."""
    d = tmp_path / "work"
    d.mkdir()
    for f in ("custom_agent/my_dqn.py", "custom_env/corridor.py"):
        shutil.copy(EXAMPLES / f, d)
    yaml = (EXAMPLES / "custom_env" / "corridor.yaml").read_text().replace("module_dirs: [../custom_agent]",
                                                                         "module_dirs: []")
    (d / "corridor.yaml").write_text(yaml)
    for name, body in BAD_AGENTS.items():
        (d / f"{name}.py").write_text("import os\nimport numpy as np\nfrom gearflow.agent import ActOutput\n"
                                      "from my_dqn import Config, Agent as _Agent\n\n\nclass Agent(_Agent):"
                                      + textwrap.indent(textwrap.dedent(body), "    "))
    (d / "drift_env.py").write_text(DRIFT_ENV)
    (d / "same_step_env.py").write_text(SAME_STEP_ENV)
    return d


def _gearflow(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(cwd)])}
    return subprocess.run([sys.executable, "-m", "gearflow", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout, check=False)  # fmt: skip


def _last_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------- the checks themselves

DISCRETE = EnvSpec((4,), np.dtype(np.float32), 2, None, "CartPole-v1")


def test_act_checks_name_the_field_expected_and_got():
    import gymnasium

    spec = EnvSpec((4,), np.dtype(np.float32), 2, gymnasium.spaces.Discrete(2), "CartPole-v1")
    q = np.zeros((3, 2), np.float32)
    check_act(ActOutput(actions=np.array([0, 1, 1]), values=q), 3, spec, "agent 'x': act()")  # fine
    for out, words in [
        (ActOutput(actions=np.zeros((3, 1), np.int64), values=q), "actions has shape (3, 1), expected (3,)"),
        (ActOutput(actions=np.zeros(3, np.float32), values=q), "actions has dtype float32, expected an integer"),
        (ActOutput(actions=np.array([0, 2, 1]), values=q), "holds 2, expected actions in [0, 2)"),
        (ActOutput(actions=np.array([0, 1, 1]), values=np.zeros((3, 2, 51))), "values has shape (3, 2, 51), expected (3, 2)"),
        (ActOutput(actions=np.array([0, 1, 1]), values=np.full((3, 2), np.nan)), "values holds NaN"),
        (ActOutput(actions=np.array([0, 1, 1]), q_action=np.zeros(3)), "q_action is given without q_bootstrap"),
        ((np.array([0, 1, 1]), q), "not an ActOutput"),
    ]:  # fmt: skip
        with pytest.raises(ContractError, match="agent 'x': act()") as err:
            check_act(out, 3, spec, "agent 'x': act()")
        assert words in str(err.value), (words, str(err.value))
    box = EnvSpec((3,), np.dtype(np.float32), None, gymnasium.spaces.Box(-2.0, 2.0, (1,), np.float32), "Pendulum-v1")
    check_act(ActOutput(actions=np.full((3, 1), 2.0, np.float32), q_action=np.zeros(3), q_bootstrap=np.zeros(3)),
              3, box, "a")  # fmt: skip
    for actions, words in [(np.zeros((3,), np.float32), "shape (3,), expected (3, 1)"),
                           (np.full((3, 1), 2.5, np.float32), "outside the env's Box [-2, 2]"),
                           (np.zeros((3, 1), np.int64), "expected a float dtype")]:  # fmt: skip
        with pytest.raises(ContractError) as err:
            check_act(ActOutput(actions=actions), 3, box, "a")
        assert words in str(err.value), (words, str(err.value))


def test_recv_checks_on_a_real_envpool_env():
    """A real EnvPool CartPole passes; its own batch with a wrong dtype, a reward of the wrong shape or
    a NaN reward is refused naming the env and the field."""
    from omegaconf import OmegaConf

    from gearflow.envs import make_vec_env

    env_cfg = OmegaConf.create({"id": "CartPole-v1", "num_envs": 4, "batch_size": 2, "seed": 0})
    env = CheckedEnv(make_vec_env(env_cfg, seed=0), env_cfg)
    try:
        env.async_reset()
        for _ in range(50):
            obs, reward, term, trunc, ids = env.recv()
            env.send(np.zeros(len(ids), np.int64), ids)
        from gearflow.actors.contract import check_recv

        for batch, words in [
            ((obs.astype(np.float64), reward, term, trunc, ids), "observations have dtype float64, expected float32"),
            ((obs, reward[:, None], term, trunc, ids), "reward has shape (2, 1), expected (2,)"),
            ((obs, np.full(2, np.nan, np.float32), term, trunc, ids), "reward holds NaN"),
            ((obs[:1], reward, term, trunc, ids), "observations have shape (1, 4), expected (2, 4)"),
            ((obs, reward, term, trunc, ids + 4), "is outside [0, 4)"),
        ]:  # fmt: skip
            with pytest.raises(ContractError, match="env 'CartPole-v1'") as err:
                check_recv(batch, env.spec, 4, env.label)
            assert words in str(err.value), (words, str(err.value))
    finally:
        env.close()


def test_an_observation_dtype_change_after_the_full_checks_is_still_named(tmp_path):
    """Past the first FULL_CHECKS recvs only the observations' dtype and shape are checked, every recv."""
    from omegaconf import OmegaConf

    from gearflow.actors.contract import FULL_CHECKS
    from gearflow.envs import make_vec_env

    d = _workdir(tmp_path)
    sys.path.insert(0, str(d))
    try:
        import drift_env

        drift_env.DRIFT_AFTER = FULL_CHECKS + 20
        env_cfg = OmegaConf.create({"id": "Corridor", "factory": "drift_env:make", "num_envs": 2, "seed": 0})
        env = CheckedEnv(make_vec_env(env_cfg, seed=0), env_cfg)
        try:
            env.async_reset()
            with pytest.raises(ContractError, match="env factory 'drift_env:make': observations have dtype float64"):
                for i in range(FULL_CHECKS + 40):
                    _, _, _, _, ids = env.recv()
                    env.send(np.ones(len(ids), np.int64), ids)
            assert i == FULL_CHECKS + 21  # the first drifted recv (the reset recv comes first)
        finally:
            env.close()
    finally:
        sys.path.remove(str(d))
        for m in ("drift_env", "corridor"):
            sys.modules.pop(m, None)


def test_a_failure_report_names_the_agent_module_and_line(tmp_path):
    d = _workdir(tmp_path)
    sys.path.insert(0, str(d))
    try:
        import boom_agent
        from omegaconf import OmegaConf

        cfg = OmegaConf.create({"agent": {"name": "boom_agent"}, "env": {"factory": None}})
        try:
            boom_agent.Agent.act(None, None, None, None)
        except RuntimeError as exc:
            report = describe_failure(exc, cfg)
    finally:
        sys.path.remove(str(d))
        sys.modules.pop("boom_agent", None)
    assert report["culprit"] == "agent module 'boom_agent'"
    assert report["where"].startswith(f"{d / 'boom_agent.py'}:") and report["where"].endswith(" in act")
    assert report["message"] == "RuntimeError: boom: the agent's act is broken" and not report["contract"]


# --------------------------------------------------------------------------- gearflow check-env


@pytest.mark.slow
def test_check_env_passes_the_examples(tmp_path):
    for config in ("custom_env/corridor.yaml", "custom_agent/my_dqn.yaml"):
        r = _gearflow(tmp_path, "check-env", str(EXAMPLES / config), "--steps", "50")
        assert r.returncode == 0, r.stdout + r.stderr[-2000:]
        assert "FAIL" not in r.stdout and r.stdout.strip().endswith("no problems found"), r.stdout
        assert "one learn step on a batch of 16" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("overrides, words", [
    (["agent.name=bad_shape"], ["agent module 'bad_shape'", "act() at bad_shape.py:", "ActOutput.actions has shape (4, 1), expected (4,)"]),
    (["agent.name=bad_values"], ["agent module 'bad_values'", "ActOutput.values has shape (4, 2, 51), expected (4, 2)"]),
    (["env.factory=drift_env:make"], ["env factory 'drift_env:make'", "observations have dtype float64, expected float32"]),
    (["env.factory=same_step_env:make"], ["env factory 'same_step_env:make': cannot be made", "AutoresetMode.NEXT_STEP"]),
    (["env.kwargs.width=3"], ["env factory 'corridor:make': cannot be made", "raised TypeError",
                              "unexpected keyword argument 'width'", "called with num_envs=, seed= and **env.kwargs"]),
])  # fmt: skip
def test_check_env_catches_each_mistake_in_one_line(tmp_path, overrides, words):
    d = _workdir(tmp_path)
    r = _gearflow(d, "check-env", "corridor.yaml", *overrides, "--steps", "50")
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1, r.stdout
    for w in words:
        assert w in fails[0], (w, fails[0])
    assert "Traceback" not in r.stdout + r.stderr


# --------------------------------------------------------------------------- gearflow train


SHORT = ["run.progress=log", "run.log_every_s=1", "env.num_envs=4", "replay.min_size_to_sample=200",
         "learner.batch_size=32"]  # fmt: skip


@pytest.mark.slow
def test_the_example_env_and_agent_train(tmp_path):
    d = _workdir(tmp_path)
    r = _gearflow(d, "train", "corridor.yaml", *SHORT, "run.max_env_steps=3000", f"run.dir={d / 'run'}")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_env_steps=3000"
    assert summary["actor/restarts"] == 0 and summary["learner/updates"] > 0
    assert summary["actor/weights_version_min"] > 1


@pytest.mark.slow
def test_an_agent_contract_violation_stops_the_run_at_once(tmp_path):
    """Issue 31, point 1: every actor died of actions (k, 1); the time limit used to come first and the
    run exited 0 ("done (reached run.max_seconds=40.0): 0 env steps"). Now: exit 3 at the first failure,
    one line naming the agent module, no restart."""
    d = _workdir(tmp_path)
    r = _gearflow(d, "train", "corridor.yaml", *SHORT, "agent.name=bad_shape", "run.max_seconds=120",
                  f"run.dir={d / 'run'}")  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    line = _last_line(r.stderr)
    assert line.startswith("gearflow train: error: actor "), line
    for w in ("agent module 'bad_shape'", "act() at bad_shape.py:", "ActOutput.actions has shape (4, 1), expected (4,)",
              "not restarted", f"continue with gearflow train --resume {d / 'run'}"):  # fmt: skip
        assert w in line, (w, line)
    assert "restarting it" not in r.stderr and "Traceback" not in r.stderr
    assert json.loads((d / "run" / "summary.json").read_text())["stop_reason"].startswith("actor failed")


@pytest.mark.slow
def test_the_same_failure_twice_is_not_restarted_again(tmp_path):
    """Issue 31, point 2: a deterministic failure was restarted actor.max_restarts times (~50 s), each
    traceback printed twice, ending with envs.send named. Now: one restart, then exit 3 naming the agent
    module and line; each traceback in the log once."""
    d = _workdir(tmp_path)
    r = _gearflow(d, "train", "corridor.yaml", *SHORT, "agent.name=boom_agent", "actor.num_actors=1",
                  "actor.max_restarts=5", "run.max_seconds=200", f"run.dir={d / 'run'}")  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    line = _last_line(r.stderr)
    assert "actor 0 failed twice with the same error at agent module 'boom_agent', " in line, line
    assert f"{d / 'boom_agent.py'}:" in line and " in act: RuntimeError: boom: the agent's act is broken" in line
    assert "a deterministic failure, not restarted again" in line
    assert r.stderr.count("restarting it (1/5)") == 1 and "(2/5)" not in r.stderr
    assert r.stderr.count("Traceback (most recent call last)") == 2  # two failures, each printed once


@pytest.mark.slow
def test_a_run_whose_actors_never_stepped_exits_non_zero_whatever_limit_came_first(tmp_path):
    """Failures that differ each time are restarted; when run.max_seconds ends a run that made no env
    step, it failed (exit 3), it did not finish."""
    d = _workdir(tmp_path)
    r = _gearflow(d, "train", "corridor.yaml", *SHORT, "agent.name=flaky_agent", "actor.num_actors=1",
                  "actor.max_restarts=1000", "run.max_seconds=25", f"run.dir={d / 'run'}")  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    line = _last_line(r.stderr)
    assert "no env step was made: the actors failed (" in line, line
    assert "actor 0's last error: RuntimeError: flaky failure in process" in line, line
    summary = json.loads((d / "run" / "summary.json").read_text())
    assert summary["actor/env_steps"] == 0 and summary["stop_reason"].startswith("actor failed: no env step")


@pytest.mark.slow
def test_an_env_whose_observation_dtype_changes_mid_run_is_named(tmp_path):
    d = _workdir(tmp_path)
    r = _gearflow(d, "train", "corridor.yaml", *SHORT, "env.factory=drift_env:make", "actor.num_actors=1",
                  "run.max_seconds=120", f"run.dir={d / 'run'}")  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    line = _last_line(r.stderr)
    for w in ("env factory 'drift_env:make'", "observations have dtype float64, expected float32", "not restarted"):
        assert w in line, (w, line)
    assert "restarting it" not in r.stderr


@pytest.mark.slow
def test_values_of_the_wrong_shape_are_refused_in_a_serial_run(tmp_path):
    """Issue 31, point 3: (k, A, 51) values were accepted silently, even with run.serial=true."""
    d = _workdir(tmp_path)
    r = _gearflow(d, "train", "corridor.yaml", *SHORT, "agent.name=bad_values", "run.serial=true",
                  "run.max_seconds=120", f"run.dir={d / 'run'}")  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    line = _last_line(r.stderr)
    assert "agent module 'bad_values'" in line and "ActOutput.values has shape (4, 2, 51), expected (4, 2)" in line
    assert "Traceback" not in r.stderr
