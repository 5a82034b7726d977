"""The run plan (which roles a process runs for which config), the one lifecycle the roles go
through (start / check / drain / stop / finish / close), and the agent settings the builder hands
to agents instead of the whole config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gearflow.agent import AgentSettings, agent_settings, make_agent
from gearflow.config import load_config
from gearflow.errors import ConfigError, GearflowError
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay.storage import list_segments
from gearflow.roles.actor_processes import ActorFailed
from gearflow.topology.lifecycle import Closes, Lifecycle
from gearflow.topology.plan import MODES, ROLES, learner_config, plan_run, shard_node_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "cartpole_apex.yaml")


def _cfg(*overrides: str):
    return load_config(CONFIG, list(overrides))


# ---------------------------------------------------------------------------- the plan

PLANS = [  # (overrides, command, mode, roles, local actors, remote actor indices)
    ([], "train", "local", ("replay", "params", "learner", "actors"), 2, ()),
    (["actor.num_actors=3", "actor.remote_actors=2"], "train", "local",
     ("replay", "params", "learner", "actors", "remote_actors"), 1, (1, 2)),
    (["run.serial=true"], "train", "serial", ("replay", "params", "learner", "serial_actor"), 0, ()),
    (["run.eval_every=20000"], "train", "local", ("replay", "params", "learner", "actors", "eval"), 2, ()),
    (["run.serial=true", "run.eval_every=5m"], "train", "serial", ("replay", "params", "learner", "serial_actor", "eval"), 0, ()),
    (["run.mode=offline", "run.dataset=d.h5", "run.max_env_steps=0", "run.max_updates=5", "replay.samples_per_insert=0",
      "run.eval_every=100"], "train", "offline", ("replay", "params", "learner", "dataset", "eval"), 0, ()),
    (["run.eval_every=20000"], "serve", "serve", ("replay", "params", "shard_service", "actors"), 2, ()),
    (["run.mode=offline", "run.dataset=d.h5", "run.max_env_steps=0", "run.max_updates=5", "replay.samples_per_insert=0"], "train", "offline",
     ("replay", "params", "learner", "dataset"), 0, ()),
    (["transport.shards=[127.0.0.1:5000]"], "train", "shards", ("shards", "learner"), 0, ()),
    (["transport.shards=[127.0.0.1:5000]", "learner.world_size=2"], "train", "shards",
     ("data_parallel", "shards", "learner"), 0, ()),
    (["launcher=ray"], "train", "ray", ("ray_shards", "ray_actor_groups", "ray_learners"), 0, ()),
    (["launcher=ray", "run.dry_run=true"], "train", "dry_run", ("dry_run",), 0, ()),
    (["run.dry_run=true"], "train", "dry_run", ("dry_run",), 0, ()),
    ([], "serve", "serve", ("replay", "params", "shard_service", "actors"), 2, ()),
    (["actor.remote_actors=1"], "serve", "serve", ("replay", "params", "shard_service", "actors"), 1, (1,)),
]  # fmt: skip


@pytest.mark.parametrize("overrides,command,mode,roles,local,remote", PLANS)
def test_plan_names_the_roles_of_each_config(overrides, command, mode, roles, local, remote):
    plan = plan_run(_cfg(*overrides), command)
    assert (plan.mode, plan.roles, plan.local_actors, plan.remote_actors) == (mode, roles, local, remote)
    assert plan.mode in MODES and set(plan.roles) <= set(ROLES)
    assert plan.learns == ("learner" in roles)


def test_plan_of_a_shard_node_without_its_own_actors():
    plan = plan_run(_cfg(), "serve", actors=False)  # Ray's shard role: its actor group starts them
    assert (plan.mode, plan.roles, plan.local_actors) == ("shard", ("replay", "params", "shard_service"), 0)


@pytest.mark.parametrize("overrides,message", [
    (["run.serial=true"], "gearflow serve runs actor processes: not with run.serial=true or run.mode=offline"),
    (["transport.shards=[127.0.0.1:5000]"], "transport.shards is a learner's key"),
])  # fmt: skip
def test_plan_refuses_what_a_shard_node_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_run(_cfg(*overrides), "serve")


def test_plan_refuses_resume_on_ray_and_unknown_commands():
    with pytest.raises(GearflowError, match="--resume with launcher=ray is not supported yet"):
        plan_run(_cfg("launcher=ray"), resume=True)
    assert plan_run(_cfg(), resume=True).mode == "local"
    with pytest.raises(ValueError, match="command 'eval': must be one of train, serve"):
        plan_run(_cfg(), "eval")


def test_ray_role_configs_are_a_shard_plan_and_a_shards_plan(tmp_path):
    cfg = _cfg("launcher=ray", "cluster.shards=2", "cluster.learners=2", "actor.num_actors=3",
               "transport.port=7000", f"run.dir={tmp_path}")  # fmt: skip
    node = shard_node_config(cfg, 1)
    assert (node.actor.ladder_offset, node.actor.ladder_total, node.transport.port) == (3, 6, 0)
    assert node.run.dir == os.path.join(str(tmp_path), "shard-1") and node.launcher == "local"
    assert plan_run(node, "serve", actors=False).mode == "shard"
    learner = learner_config(cfg, 1, ["10.0.0.1:1", "10.0.0.2:2"], "10.0.0.1:3")
    assert (learner.learner.world_size, learner.learner.rank, learner.learner.dist_address) == (2, 1, "10.0.0.1:3")
    assert plan_run(learner).roles == ("data_parallel", "shards", "learner")
    assert learner.run.dir == os.path.join(str(tmp_path), "learner-1") and learner.run.progress == "log"
    assert cfg.launcher == "ray" and not cfg.transport.shards, "the driver's config is left as it was"


# ---------------------------------------------------------------------------- the lifecycle


class Recorder:
    """A role that writes each call into a shared list (its check can fail, its close can raise)."""

    def __init__(self, name: str, calls: list, *, fail_check: int = 0, fail_close: bool = False,
                 fail_stop: bool = False, fail_start: bool = False):  # fmt: skip
        self.name, self.calls = name, calls
        self.fail_check, self.fail_close, self.fail_stop, self.fail_start = fail_check, fail_close, fail_stop, fail_start
        self.checks = 0
        self.errors = {7: f"{name}'s traceback"}

    def start(self):
        self.calls.append(("start", self.name))
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")

    def check(self) -> int:
        self.calls.append(("check", self.name))
        self.checks += 1
        if self.fail_check and self.checks >= self.fail_check:
            raise ActorFailed(f"{self.name} failed", actor=7)
        return 1

    def drain(self, progress):
        self.calls.append(("drain", self.name))

    def stop(self, drain=lambda: None):
        drain()
        self.calls.append(("stop", self.name))
        if self.fail_stop:
            raise RuntimeError(f"{self.name} cannot stop")

    def finish(self, reason: str):
        self.calls.append(("finish", self.name, reason))

    def close(self):
        self.calls.append(("close", self.name))
        if self.fail_close:
            raise RuntimeError(f"{self.name} cannot close")


def _calls(calls, what):
    return [c[1] for c in calls if c[0] == what]


def test_lifecycle_starts_in_build_order_and_stops_and_closes_last_built_first():
    calls: list = []
    roles = Lifecycle()
    for name in "abc":
        roles.add(Recorder(name, calls))
    roles.start()
    assert roles.check() == 3  # each restarted one
    roles.drain(None)
    roles.stop(None)
    roles.stop(None)  # once only
    roles.finish("done")
    roles.close()
    roles.close()  # once only
    assert _calls(calls, "start") == _calls(calls, "check") == _calls(calls, "drain")[:3] == list("abc")
    assert _calls(calls, "stop") == _calls(calls, "close") == list("cba")
    assert [c for c in calls if c[0] == "finish"] == [("finish", n, "done") for n in "abc"]
    # a role stopping keeps the others' reports flowing (its drain callback drains every role)
    first_stop = calls.index(("stop", "c"))
    assert _calls(calls[:first_stop], "drain")[-3:] == list("abc")


def test_a_failing_check_stops_the_checks_and_names_its_role():
    calls: list = []
    roles = Lifecycle()
    _, b, _ = (roles.add(Recorder(n, calls, fail_check=2 if n == "b" else 0)) for n in "abc")
    assert roles.check() == 3 and roles.failed is None
    with pytest.raises(ActorFailed, match="b failed"):
        roles.check()
    assert roles.failed is b
    assert _calls(calls, "check") == ["a", "b", "c", "a", "b"], "c was checked after b failed"


def test_close_reaches_every_role_after_a_failure_and_raises_the_first():
    calls: list = []
    roles = Lifecycle()
    for n in "abcd":
        roles.add(Recorder(n, calls, fail_close=n in "bc", fail_stop=n == "c"))
    with pytest.raises(RuntimeError, match="c cannot stop"):
        roles.stop(None)
    assert _calls(calls, "stop") == list("dcba"), "a failed stop kept the others running"
    with pytest.raises(RuntimeError, match="c cannot close"):  # closed first of the two
        roles.close()
    assert _calls(calls, "close") == list("dcba")
    assert len(roles) == 0


def test_closes_registers_a_part_and_returns_it():
    roles = Lifecycle()

    class Resource:
        closed = 0

        def close(self):
            self.closed += 1

    r = Resource()
    assert roles.closes(r, "resource") is r
    (role,) = roles
    assert isinstance(role, Closes) and role.name == "resource" and role.check() == 0
    roles.stop(None)
    roles.close()
    assert r.closed == 1


# ---------------------------------------------------------------------------- the builder


@pytest.mark.parametrize("overrides,roles", [
    (["actor.remote_actors=1", "transport.token=0123456789abcdef0123"], ["replay", "params", "LocalLauncher", "RemoteActors"]),
    (["run.serial=true"], ["replay", "params", "serial_actor"]),
    (["run.serial=true", "run.eval_every=1000"], ["replay", "params", "serial_actor", "eval"]),
])  # fmt: skip
def test_the_builder_makes_the_roles_the_plan_names(tmp_path, overrides, roles):
    """The runner's roles are what its plan names, built (not started) in build order; closing
    them leaves no segment."""
    from gearflow.roles.actor_processes import LocalLauncher
    from gearflow.topology.learn import Runner

    before = _own_segments()
    runner = Runner(load_config(CONFIG, ["replay.capacity=2000", "env.num_envs=2", "env.batch_size=2", "replay.min_size_to_sample=64",
                                         "learner.batch_size=32", f"run.dir={tmp_path}", *overrides]))  # fmt: skip
    try:
        runner.connect_components()
        assert [getattr(r, "name", "") or type(r).__name__ for r in runner.roles] == roles
        assert runner.roles.roles[0].obj is runner.table and runner.roles.roles[1].obj is runner.params
        assert (runner.launcher is not None) == ("LocalLauncher" in roles)
        assert runner.launcher is runner.roles.first(LocalLauncher)
        assert (runner.serial_actor is not None) == ("serial_actor" in roles)
    finally:
        runner.roles.close()
    assert _own_segments() <= before


# ---------------------------------------------------------------------------- the runner's lifecycle

SERIAL = ["run.serial=true", "replay.capacity=2000", "replay.min_size_to_sample=64", "learner.batch_size=32",
          "env.num_envs=2", "env.batch_size=2", "run.max_env_steps=20000", "run.log_every_s=0.5",
          "run.progress=log", "run.tensorboard=false"]  # fmt: skip


def _own_segments() -> set[str]:
    return {n for n, owner, _ in list_segments() if owner == os.getpid()}


@pytest.mark.slow
def test_a_role_that_fails_its_check_stops_the_run_and_every_role_is_closed(tmp_path):
    """A real serial run (table, parameter store, learner, serial actor) with one more role whose
    check fails on its third call: the run stops as for a failed actor (final checkpoint, the
    role's own error in the message), the role is stopped, then closed, and no segment is left."""
    from gearflow.topology.learn import Runner

    calls: list = []
    failing = Recorder("monitor", calls, fail_check=3)
    before = _own_segments()
    runner = Runner(load_config(CONFIG, [*SERIAL, f"run.dir={tmp_path / 'run'}"]), roles=(failing,))
    with pytest.raises(ActorFailed, match=r"monitor failed; its last error: monitor's traceback; final checkpoint"):
        runner.run()
    assert _calls(calls, "check") == ["monitor"] * 3
    # finish: the run ended by itself (a failure too; only a signal skips it, as the shard nodes' run.stop did)
    assert [c[0] for c in calls if c[0] != "drain"] == ["start", "check", "check", "check", "stop", "finish", "close"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"] == "actor failed: monitor failed"
    assert len(runner.roles) == 0 and _own_segments() <= before, "a role or a segment was left open"


@pytest.mark.slow
def test_a_role_that_cannot_start_still_has_every_role_closed(tmp_path):
    from gearflow.topology.learn import Runner

    calls: list = []
    before = _own_segments()
    runner = Runner(load_config(CONFIG, [*SERIAL, f"run.dir={tmp_path / 'run'}"]),
                    roles=(Recorder("monitor", calls, fail_start=True),))  # fmt: skip
    with pytest.raises(RuntimeError, match="monitor cannot start"):
        runner.run()
    assert [c[0] for c in calls if c[0] != "drain"] == ["start", "stop", "close"]
    assert len(runner.roles) == 0 and _own_segments() <= before


# ---------------------------------------------------------------------------- agent settings


def test_agents_get_their_settings_as_values_not_the_whole_config():
    import numpy as np

    from gearflow.envs import EnvSpec

    cfg = _cfg("actor.gamma=0.9", "actor.n_step=5", "run.seed=11", "learner.bf16=true")
    settings = agent_settings(cfg)
    assert settings == AgentSettings(gamma=0.9, n_step=5, seed=11, bf16=True, kind=Transition())
    agent = make_agent(cfg, EnvSpec((4,), np.dtype(np.float32), 2), "cpu")
    assert (agent.gamma, agent.n_step, agent.bf16) == (0.9, 5, True)
    # an agent written against the old contract (full_cfg.actor.gamma) is told what it gets now
    with pytest.raises(AttributeError, match=r"an agent gets AgentSettings \(gamma, n_step, seed, bf16, .*read "
                                             r"settings.gamma instead of full_cfg.actor.gamma"):
        getattr(settings, "actor")  # noqa: B009 - the attribute access is what is tested
    with pytest.raises(AttributeError, match="AgentSettings has no attribute 'nstep'"):
        getattr(settings, "nstep")  # noqa: B009
    # the item kind's parameters are the kind's: an agent reads them there
    with pytest.raises(AttributeError, match=r"'sequence_length': the item kind's parameters are its own "
                                             r"\(settings.kind: Transition"):
        getattr(settings, "sequence_length")  # noqa: B009


# ---------------------------------------------------------------------------- the item kind, named once


@pytest.mark.parametrize("agent,overrides,kind", [
    ("agents.apex_dqn", [], Transition()),
    ("agents.r2d2_transformer", ["replay.item=sequence", "replay.sequence_length=16", "replay.sequence_period=8",
                                 "replay.burn_in=4"], Sequence(length=16, period=8, burn_in=4)),
    ("agents.decision_transformer", ["replay.item=episode", "replay.max_episode_length=64"],
     Episode(max_episode_length=64)),
])  # fmt: skip
def test_the_item_kind_is_made_once_from_the_config_and_the_agent_learns_from_it(agent, overrides, kind):
    """``replay.item`` names the kind, the kind reads its own parameters (``make_kind``); the agent
    is handed that object and returns it (it builds no kind of its own), or refuses another."""
    import numpy as np

    from gearflow.envs import EnvSpec
    from gearflow.kinds.registry import make_kind

    cfg = load_config(None, [f"agent.name={agent}", *overrides])
    assert make_kind(cfg.replay) == kind
    spec = EnvSpec((4,), np.dtype(np.float32), 2)
    a = make_agent(cfg, spec, "cpu")
    assert a.item_kind() is a.kind and a.item_kind() == kind
    other = "sequence" if kind.name != "sequence" else "transition"
    with pytest.raises(ConfigError, match=f"replay.item='{other}': agent {agent} learns from {kind.name} items"):
        make_agent(load_config(None, [f"agent.name={agent}", *overrides, f"replay.item={other}"]), spec, "cpu")
