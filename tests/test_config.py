"""gearflow.config: defaults ← YAML ← overrides, validation messages, agent schemas, docs."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import gearflow.config as config_mod
from agents import apex_dqn
from gearflow.config import (
    GROUPS,
    ActorConfig,
    EnvConfig,
    GearflowConfig,
    LearnerConfig,
    ReplayConfig,
    RunConfig,
    explain,
    field_docs,
    load_config,
    save_config,
    validate,
)
from gearflow.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = ROOT / "configs" / "cartpole_apex.yaml"


def _error(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def _flatten(data, prefix=""):
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _write_yaml(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# ------------------------------------------------------------------ layering


def test_defaults_load_without_a_file():
    cfg = load_config(None)
    for group, cls in GROUPS.items():
        expected = dataclasses.asdict(cls())
        if group == "run":
            expected["name"] = "gearflow"  # empty name and no file: the fallback
        assert OmegaConf.to_container(cfg[group]) == expected, group
    assert OmegaConf.to_container(cfg.agent) == {
        **dataclasses.asdict(apex_dqn.Config()),
        "name": "agents.apex_dqn",
    }


def test_yaml_values_override_defaults():
    cfg = load_config(CARTPOLE)
    yaml_leaves = _flatten(OmegaConf.to_container(OmegaConf.load(CARTPOLE)))
    assert yaml_leaves  # the example file sets something
    for key, value in yaml_leaves.items():
        assert OmegaConf.to_container(cfg)[key.split(".")[0]] is not None
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == value, key
    # values the file differs from the defaults on really changed
    assert cfg.learner.batch_size == 128 != LearnerConfig().batch_size
    assert cfg.agent.hidden_sizes == [128, 128] != apex_dqn.Config().hidden_sizes
    # keys the file does not set keep their defaults
    assert cfg.replay.timeout_s == ReplayConfig().timeout_s
    assert cfg.agent.max_grad_norm == apex_dqn.Config().max_grad_norm


def test_overrides_override_yaml():
    cfg = load_config(
        CARTPOLE,
        ["replay.capacity=50000", "agent.lr=0.001", "env.num_envs=4", "run.seed=1", "run.seed=2"],
    )
    assert cfg.replay.capacity == 50000
    assert cfg.agent.lr == 0.001
    assert cfg.env.num_envs == 4
    assert cfg.run.seed == 2  # the last override wins
    assert cfg.learner.batch_size == 128  # from the YAML, untouched


def test_int_field_accepts_exponent_notation():
    cfg = load_config(None, ["replay.capacity=2e5"])
    assert cfg.replay.capacity == 200000
    assert type(cfg.replay.capacity) is int
    cfg = load_config(None, ["replay.capacity=2.5e3"])  # 2500: integral, so accepted
    assert cfg.replay.capacity == 2500 and type(cfg.replay.capacity) is int


def test_int_field_accepts_exponent_notation_from_yaml(tmp_path):
    path = _write_yaml(tmp_path / "c.yaml", "replay:\n  capacity: 2e5\nrun:\n  max_env_steps: 1.0e6\n")
    cfg = load_config(path)
    assert cfg.replay.capacity == 200000 and type(cfg.replay.capacity) is int
    assert cfg.run.max_env_steps == 1_000_000 and type(cfg.run.max_env_steps) is int


@pytest.mark.parametrize("value", ["2500.5", "2.5", "2.5e-1", "1e400"])
def test_non_integral_float_for_int_field_is_an_error(value):
    msg = _error(None, [f"replay.capacity={value}"])
    assert f"override 'replay.capacity={value}'" in msg
    assert "replay.capacity" in msg
    assert "Integer" in msg


def test_float_field_keeps_float():
    cfg = load_config(None, ["replay.alpha=1", "agent.lr=3e-4"])
    assert cfg.replay.alpha == 1.0 and isinstance(cfg.replay.alpha, float)
    assert cfg.agent.lr == pytest.approx(3e-4)


def test_env_kwargs_take_any_key(tmp_path):
    path = _write_yaml(tmp_path / "k.yaml", "env:\n  kwargs:\n    frame_skip: 4\n")
    cfg = load_config(path, ["env.kwargs.noop_max=30"])
    assert OmegaConf.to_container(cfg.env.kwargs) == {"frame_skip": 4, "noop_max": 30}


# ----------------------------------------------------------------- validation

# (overrides, blamed key, words in the message). Every check() in validate() is here;
# test_every_validate_check_has_a_case keeps this list in step with the source.
VALIDATION_CASES = [
    (["replay.capacity=-1"], "replay.capacity", "must be a positive number of steps"),
    (["replay.capacity=0"], "replay.capacity", "must be a positive number of steps"),
    (["replay.item=frames"], "replay.item", "must be one of transition, sequence, episode"),
    (["replay.selector=random"], "replay.selector", "must be one of uniform, prioritized"),
    (["replay.alpha=-0.1"], "replay.alpha", "must be ≥ 0"),
    (["replay.beta=1.5"], "replay.beta", "must be in [0, 1]"),
    (["replay.beta=-0.1"], "replay.beta", "must be in [0, 1]"),
    (["replay.top_k=0"], "replay.top_k", "must be ≥ 1"),
    (["replay.sequence_length=0"], "replay.sequence_length", "must be ≥ 1"),
    (["replay.sequence_period=0"], "replay.sequence_period", "must be ≥ 1"),
    (["replay.burn_in=80"], "replay.burn_in", "must be in [0, sequence_length)"),
    (["replay.burn_in=-1"], "replay.burn_in", "must be in [0, sequence_length)"),
    (["replay.max_episode_length=0"], "replay.max_episode_length", "must be ≥ 1"),
    (["replay.min_size_to_sample=0"], "replay.min_size_to_sample", "must be ≥ 1"),
    (["replay.samples_per_insert=-1"], "replay.samples_per_insert", "must be ≥ 0 (0 disables)"),
    (["replay.error_buffer=-1"], "replay.error_buffer", "must be ≥ 0"),
    (["replay.timeout_s=0"], "replay.timeout_s", "must be > 0 seconds"),
    (["replay.device=tpu"], "replay.device", "must be one of auto, cpu, cuda"),
    (["replay.device=cuda", "replay.selector=fifo"], "replay.device",
     "samples on the GPU with the prioritized or uniform selector only, not replay.selector='fifo'"),
    (["learner.batch_size=0"], "learner.batch_size", "must be ≥ 1"),
    (["learner.batch_size=200000"], "learner.batch_size", "is larger than replay.capacity (100000)"),
    (["learner.device=tpu"], "learner.device", "must be one of auto, cpu, cuda"),
    (["learner.device=cuda:x"], "learner.device", "must be one of auto, cpu, cuda or cuda:N"),
    (["replay.device=cuda:1", "learner.device=cuda:0"], "replay.device",
     "assembles batches on cuda:1, but the learner trains on cuda:0"),
    (["learner.prefetch=0"], "learner.prefetch", "must be ≥ 1"),
    (["learner.publish_every=0"], "learner.publish_every", "must be ≥ 1"),
    (["learner.device_batches=1"], "learner.device_batches", "must be 0 (off) or ≥ 2 (one the learner reads, one being filled)"),
    (["env.num_envs=0"], "env.num_envs", "must be ≥ 1"),
    (["env.batch_size=9"], "env.batch_size", "must be in [0, env.num_envs]"),
    (["env.batch_size=-1"], "env.batch_size", "must be in [0, env.num_envs]"),
    (["env.backend=ale"], "env.backend", "must be one of auto, envpool, gymnasium"),
    (["actor.num_actors=0"], "actor.num_actors", "must be ≥ 1"),
    (["actor.epsilon=1.5"], "actor.epsilon", "must be in [0, 1]"),
    (["actor.epsilon_alpha=-1"], "actor.epsilon_alpha", "must be ≥ 0"),
    (["actor.n_step=0"], "actor.n_step", "must be ≥ 1"),
    (["actor.gamma=1.01"], "actor.gamma", "must be in [0, 1]"),
    (["actor.weight_sync_period=0"], "actor.weight_sync_period", "must be ≥ 1"),
    (["actor.max_restarts=-1"], "actor.max_restarts", "must be ≥ 0"),
    (["actor.nice=20"], "actor.nice", "must be in [0, 19]"),
    (["actor.nice=-1"], "actor.nice", "must be in [0, 19]"),
    (["actor.remote_actors=3"], "actor.remote_actors", "must be in [0, actor.num_actors=2]"),
    (["actor.remote_actors=-1"], "actor.remote_actors", "must be in [0, actor.num_actors=2]"),
    (["actor.remote_actors=1", "run.serial=true"], "actor.remote_actors",
     "needs actor processes (not run.serial=true or run.mode=offline)"),
    (["transport.port=70000"], "transport.port", "must be in [0, 65535] (0: any free port)"),
    (["transport.loop=tokio"], "transport.loop", "must be one of auto, uvloop, asyncio"),
    (["transport.kind=ib"], "transport.kind", "must be one of auto, tcp, rdma"),
    (["transport.limits.max_connections=0"], "transport.limits.max_connections", "must be ≥ 1"),
    (["transport.limits.max_preauth=0"], "transport.limits.max_preauth", "must be ≥ 1"),
    (["transport.limits.max_in_flight=0"], "transport.limits.max_in_flight", "must be ≥ 1"),
    (["transport.limits.max_queued_bytes=0"], "transport.limits.max_queued_bytes", "must be ≥ 1"),
    (["transport.limits.max_batch=0"], "transport.limits.max_batch", "must be ≥ 1"),
    (["transport.limits.max_reply_bytes=-1"], "transport.limits.max_reply_bytes", "must be ≥ 1"),
    (["transport.limits.max_frame_bytes=1000"], "transport.limits.max_frame_bytes", "must be ≥ 65568 (a header and an envelope)"),
    (["transport.node_timeout_s=-1"], "transport.node_timeout_s", "must be a finite number of seconds ≥ 0 (0: the default, 15)"),
    (["transport.limits.auth_timeout_s=0"], "transport.limits.auth_timeout_s", "must be a finite number of seconds > 0"),
    (["transport.limits.max_wait_s=inf"], "transport.limits.max_wait_s", "must be a finite number of seconds > 0"),
    (["transport.limits.refusal_log_interval_s=-1"], "transport.limits.refusal_log_interval_s", "must be a finite number of seconds > 0"),
    (["transport.shards=[localhost]"], "transport.shards",
     "must be a list of HOST:PORT strings (the addresses gearflow serve logs)"),
    (["transport.shards=[h:1]", "run.serial=true"], "transport.shards",
     "samples remote shards: not with run.serial=true or run.mode=offline"),
    (["actor.ladder_offset=-1"], "actor.ladder_offset", "must be ≥ 0"),
    (["actor.ladder_offset=1", "actor.ladder_total=2"], "actor.ladder_total",
     "must be 0 or ≥ actor.ladder_offset + actor.num_actors (3)"),
    (["learner.world_size=0"], "learner.world_size", "must be ≥ 1"),
    (["learner.world_size=2"], "learner.world_size", 
     "> 1 needs transport.shards: data-parallel learners sample shard services (gearflow serve)"),
    (["learner.rank=2", "learner.world_size=2", "transport.shards=[h:1]"], "learner.rank", "must be in [0, learner.world_size=2)"),
    (["learner.world_size=3", "transport.shards=[h:1]"], "learner.batch_size", "must be a multiple of learner.world_size=3"),
    (["learner.dist_address=nowhere"], "learner.dist_address", "must be HOST:PORT"),
    (["learner.dist_backend=mpi"], "learner.dist_backend", "must be one of auto, gloo, nccl"),
    (["launcher=slurm"], "launcher", "must be local or ray"),
    (["launcher=ray", "run.serial=true"], "launcher",
     "=ray places actors and shard nodes: not with run.serial=true or run.mode=offline"),
    (["cluster.shards=0"], "cluster.shards", "must be ≥ 1"),
    (["cluster.learners=0"], "cluster.learners", "must be ≥ 1"),
    (["cluster.learner_gpus=-1"], "cluster.learner_gpus", "must be ≥ 0"),
    (["cluster.max_restarts=-1"], "cluster.max_restarts", "must be ≥ 0"),
    (["cluster.file_sync_s=0"], "cluster.file_sync_s", "must be > 0"),
    (["launcher=ray", "cluster.learners=3"], "learner.batch_size", "must be a multiple of cluster.learners=3"),
    (
        ["replay.capacity=100", "learner.batch_size=1"],
        "replay.capacity",
        "gives 6 steps per partition (2 actors × 8 envs); need at least 8",
    ),
    (["replay.capacity=1000", "replay.min_size_to_sample=1001"], "replay.min_size_to_sample",
     "is larger than replay.capacity (1000)"),
    (["run.max_env_steps=-1"], "run.max_env_steps", "must be ≥ 0"),
    (["run.max_seconds=-1"], "run.max_seconds", "must be ≥ 0"),
    (["run.max_updates=-1"], "run.max_updates", "must be ≥ 0"),
    (["run.log_every_s=0"], "run.log_every_s", "must be > 0"),
    (["run.checkpoint_every=10x"], "run.checkpoint_every", "must be a number of updates (500), a duration (90s, 10m, 2h) or 0 (off)"),
    (["run.checkpoint_every=2.5"], "run.checkpoint_every", "must be a number of updates"),
    (["run.eval_every=often"], "run.eval_every", "must be a number of env steps (50000), a duration (90s, 10m, 2h), 0 or null (off)"),
    (["run.eval_episodes=0"], "run.eval_episodes", "must be ≥ 1"),
    (["run.eval_every=1000", "transport.shards=[127.0.0.1:5000]"], "run.eval_every",
     "evaluates from this machine's parameter store: not with transport.shards or launcher=ray yet "
     "(evaluate their checkpoints with gearflow eval)"),
    (["run.keep_checkpoints=0"], "run.keep_checkpoints", "must be ≥ 1"),
    (["run.progress=fancy"], "run.progress", "must be one of"),
    (["run.mode=replay"], "run.mode", "must be one of online, offline"),
    (["run.mode=offline"], "run.dataset", "run.mode=offline needs a dataset file (HDF5)"),
    (["run.dataset=d.hdf5"], "run.dataset", "is only read when run.mode=offline"),
    (["run.mode=offline", "run.dataset=d.hdf5"], "run.max_env_steps",
     "run.mode=offline takes no env steps: set run.max_env_steps=0 and stop with run.max_updates or run.max_seconds"),
    (["run.mode=offline", "run.dataset=d.hdf5", "run.max_env_steps=0"], "run.max_updates",
     "run.mode=offline needs run.max_updates or run.max_seconds to stop"),
    (["run.mode=offline", "run.dataset=d.hdf5", "run.max_env_steps=0", "run.max_updates=10",
      "replay.samples_per_insert=4"], "replay.samples_per_insert",
     "run.mode=offline inserts nothing after loading the dataset: the samples-per-insert limit must be 0"),
    (["env.id=CartPol-v1"], "env.id", "unknown environment id (not in EnvPool nor gymnasium)"),
    (
        ["env.id=CartPol-v1", "env.backend=envpool"],
        "env.id",
        "unknown EnvPool task id; close matches: CartPole-v1",
    ),
]


VALIDATION_PARAMS = [pytest.param(*case, id="+".join(case[0])) for case in VALIDATION_CASES]


def _expected_source(overrides, key, source_of):
    """The source the message must name: where the blamed key was set, else ``defaults``."""
    for item in overrides:
        if item.split("=", 1)[0] == key:
            return source_of(item)
    return "defaults"


@pytest.mark.parametrize("overrides,key,words", VALIDATION_PARAMS)
def test_validation_error_from_override(overrides, key, words):
    msg = _error(None, overrides)
    source = _expected_source(overrides, key, lambda item: f"override '{item}'")
    assert msg.startswith(f"{source}: {key}="), msg
    assert words in msg


@pytest.mark.parametrize("overrides,key,words", VALIDATION_PARAMS)
def test_validation_error_from_yaml(tmp_path, overrides, key, words):
    path = tmp_path / "bad.yaml"
    OmegaConf.save(OmegaConf.from_dotlist(overrides), path)
    msg = _error(path, [])
    source = _expected_source(overrides, key, lambda item: str(path))
    assert msg.startswith(f"{source}: {key}="), msg
    assert words in msg


def test_validation_names_the_override_over_the_yaml(tmp_path):
    path = _write_yaml(tmp_path / "ok.yaml", "replay:\n  capacity: 5000\n")
    msg = _error(path, ["replay.capacity=-1"])
    assert msg.startswith("override 'replay.capacity=-1': replay.capacity=-1:"), msg
    assert str(path) not in msg


def _validate_checks() -> list[tuple[str, str]]:
    """(key, leading text of the reason) of every check(...) call in validate()."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(validate)))
    checks = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check":
            key = node.args[1].value
            why = node.args[2]
            if isinstance(why, ast.JoinedStr):
                why = why.values[0]
            stem = why.value if isinstance(why, ast.Constant) else ""  # computed reason
            checks.append((key, stem.strip()))
    return checks


def test_every_validate_check_has_a_case():
    checks = _validate_checks()
    assert len(checks) >= 35
    for key, stem in checks:
        assert any(k == key and stem in words for _, k, words in VALIDATION_CASES), (key, stem)


def test_env_backend_envpool_without_envpool(monkeypatch):
    monkeypatch.setattr(config_mod, "envpool_ids", lambda: frozenset())
    msg = _error(None, ["env.backend=envpool"])
    assert msg.startswith("defaults: env.id='CartPole-v1':"), msg
    assert "envpool is not installed" in msg


def test_valid_special_cases_pass():
    # a custom factory skips the env id check
    cfg = load_config(None, ["env.id=MyEnv-v0", "env.factory=mypkg.envs:make"])
    assert cfg.env.factory == "mypkg.envs:make"
    cfg = load_config(None, ["replay.burn_in=0", "replay.beta=1", "actor.epsilon=0"])
    assert cfg.replay.burn_in == 0


# ------------------------------------------------------------- unknown / wrong


REPLAY_KEYS = ", ".join(f.name for f in dataclasses.fields(ReplayConfig))


@pytest.mark.parametrize(
    "dotted,full_key,close,valid_in,valid",
    [
        ("replay.capacityy=5", "replay.capacityy", "capacity", "'replay'", REPLAY_KEYS),
        ("env.kwargss.x=1", "env.kwargss", "kwargs", "'env'", "id, backend, num_envs"),
        ("agent.lrr=0.1", "agent.lrr", "lr", "'agent'", "network, hidden_sizes"),
    ],
)
@pytest.mark.parametrize("via", ["override", "yaml"])
def test_unknown_key(tmp_path, via, dotted, full_key, close, valid_in, valid):
    if via == "override":
        msg, source = _error(None, [dotted]), f"override '{dotted}'"
    else:
        path = tmp_path / "typo.yaml"
        OmegaConf.save(OmegaConf.from_dotlist([dotted]), path)
        msg, source = _error(path), str(path)
    assert msg.startswith(f"{source}: unknown key '{full_key}'"), msg
    assert f"(did you mean '{close}'?)" in msg
    assert f"valid keys in {valid_in}: {valid}" in msg


def test_unknown_group_in_yaml(tmp_path):
    path = _write_yaml(tmp_path / "g.yaml", "replays:\n  capacity: 5\n")
    msg = _error(path)
    assert msg.startswith(f"{path}: unknown group 'replays'"), msg
    assert "valid groups: env, actor, replay, learner, agent, run" in msg


def test_unknown_group_in_override():
    msg = _error(None, ["replays.capacity=5"])
    assert msg.startswith("override 'replays.capacity=5': unknown key 'replays'"), msg
    assert "(did you mean 'replay'?)" in msg
    assert "valid keys in the top level: env, actor, replay, learner, agent, run" in msg


@pytest.mark.parametrize(
    "override,key,words",
    [
        ("replay.capacity=abc", "replay.capacity", "Value 'abc' of type 'str' could not be converted to Integer"),
        ("replay.capacity=true", "replay.capacity", "could not be converted to Integer"),
        ("run.serial=maybe", "run.serial", "Value 'maybe' is not a valid bool"),
        ("replay.alpha=high", "replay.alpha", "could not be converted to Float"),
        ("agent.hidden_sizes=[1.5,2]", "agent.hidden_sizes[0]", "could not be converted to Integer"),
    ],
)
def test_wrong_type_in_override(override, key, words):
    msg = _error(None, [override])
    assert msg.startswith(f"override '{override}': {key}: "), msg
    assert words in msg


def test_wrong_type_in_yaml(tmp_path):
    path = _write_yaml(tmp_path / "t.yaml", "learner:\n  batch_size: lots\n")
    msg = _error(path)
    assert msg.startswith(f"{path}: learner.batch_size: "), msg
    assert "Value 'lots'" in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert _error(path) == f"{path}: config file not found"


def test_malformed_yaml(tmp_path):
    path = _write_yaml(tmp_path / "m.yaml", "replay: [1, 2\n")
    msg = _error(path)
    assert msg.startswith(f"{path}: not valid YAML:"), msg


def test_yaml_top_level_list(tmp_path):
    path = _write_yaml(tmp_path / "l.yaml", "- replay\n- env\n")
    assert _error(path) == f"{path}: the top level must be a mapping of groups, got list"


def test_empty_yaml_is_the_defaults(tmp_path):
    path = _write_yaml(tmp_path / "empty.yaml", "")
    cfg = load_config(path)
    assert cfg.replay.capacity == ReplayConfig().capacity
    assert cfg.run.name == "empty"


@pytest.mark.parametrize("item", ["replay.capacity", "=5", "replay.capacity:5"])
def test_override_without_equals(item):
    msg = _error(None, [item])
    assert msg == f"override '{item}': expected KEY=VALUE, e.g. replay.capacity=200000"


# ---------------------------------------------------------------------- agent


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a uniquely named module into tmp_path (on sys.path); returns its import name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(source: str) -> str:
        name = f"user_agent_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


USER_AGENT = '''
    from dataclasses import dataclass, field
    from typing import Any, Dict, List, Optional


    @dataclass
    class Config:
        width: int = 64
        """Hidden width of the user's network."""
        tau: float = 0.005
        """Polyak factor of the target network."""
        activation: str = "relu"
        """Activation function."""
        layers: List[int] = field(default_factory=lambda: [1, 2])
        """Layer sizes."""
        extras: Dict[str, Any] = field(default_factory=dict)
        """Free-form options."""
        schedule: Optional[Dict[str, float]] = None
        """Optional schedule."""
'''


@pytest.mark.parametrize("via", ["override", "yaml"])
def test_agent_module_that_does_not_exist(tmp_path, via):
    if via == "override":
        msg, source = _error(None, ["agent.name=no_such_agent_pkg.dqn"]), "override 'agent.name=no_such_agent_pkg.dqn'"
    else:
        path = _write_yaml(tmp_path / "a.yaml", "agent:\n  name: no_such_agent_pkg.dqn\n")
        msg, source = _error(path), str(path)
    assert msg.startswith(f"{source}: agent.name: cannot import agent module 'no_such_agent_pkg.dqn'"), msg


def test_user_agent_module_fields_are_typed(user_module):
    name = user_module(USER_AGENT)
    cfg = load_config(
        None,
        [
            f"agent.name={name}",
            "agent.width=1e3",
            "agent.tau=1",
            "agent.layers=[8,16]",
            "agent.extras.anything=x",
            "agent.schedule.lr=0.5",
        ],
    )
    assert cfg.agent.name == name
    assert cfg.agent.width == 1000 and type(cfg.agent.width) is int
    assert cfg.agent.tau == 1.0 and isinstance(cfg.agent.tau, float)
    assert cfg.agent.activation == "relu"
    assert list(cfg.agent.layers) == [8, 16]
    assert OmegaConf.to_container(cfg.agent.extras) == {"anything": "x"}
    assert OmegaConf.to_container(cfg.agent.schedule) == {"lr": 0.5}
    assert "lr" not in cfg.agent  # apex_dqn's fields are not there
    text = explain(cfg)
    assert "Hidden width of the user's network." in text
    assert "Polyak factor of the target network." in text


def test_user_agent_module_from_yaml(tmp_path, user_module):
    name = user_module(USER_AGENT)
    path = _write_yaml(tmp_path / "u.yaml", f"agent:\n  name: {name}\n  width: 32\n")
    cfg = load_config(path)
    assert cfg.agent.width == 32 and cfg.agent.name == name


def test_user_agent_rejects_unknown_and_mistyped_keys(user_module):
    name = user_module(USER_AGENT)
    msg = _error(None, [f"agent.name={name}", "agent.widht=3"])
    assert msg.startswith("override 'agent.widht=3': unknown key 'agent.widht'"), msg
    assert "(did you mean 'width'?)" in msg
    assert "valid keys in 'agent': width, tau, activation, layers, extras, schedule, name" in msg
    # apex_dqn's keys are unknown to this agent
    assert "unknown key 'agent.lr'" in _error(None, [f"agent.name={name}", "agent.lr=0.1"])
    msg = _error(None, [f"agent.name={name}", "agent.width=wide"])
    assert msg.startswith("override 'agent.width=wide': agent.width: "), msg


@pytest.mark.parametrize(
    "source",
    ["X = 1\n", "Config = dict\n", "class Config:\n    width: int = 3\n"],
    ids=["no-Config", "Config-not-a-class", "Config-not-a-dataclass"],
)
def test_agent_module_without_config_dataclass(user_module, source):
    name = user_module(source)
    msg = _error(None, [f"agent.name={name}"])
    assert msg == f"override 'agent.name={name}': agent.name: module '{name}' has no Config dataclass"


@pytest.mark.parametrize("yaml_text", ["agent: apex\n", "agent:\n"])
def test_agent_group_must_be_a_mapping(tmp_path, yaml_text):
    path = _write_yaml(tmp_path / "a.yaml", yaml_text)
    msg = _error(path)
    assert msg.startswith(f"{path}: agent must be a mapping with a 'name' key"), msg


def test_agent_override_must_be_a_mapping():
    msg = _error(None, ["agent=rename"])
    assert msg.startswith("override 'agent=rename': agent must be a mapping"), msg


# ----------------------------------------------------------------------- docs


@pytest.mark.parametrize(
    "cls",
    [EnvConfig, ActorConfig, ReplayConfig, LearnerConfig, RunConfig, GearflowConfig, apex_dqn.Config],
    ids=lambda c: f"{c.__module__}.{c.__qualname__}",
)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
    assert not missing, f"{cls.__qualname__} fields without a docstring: {missing}"


def test_field_docs_are_normalised():
    docs = field_docs(ActorConfig)
    assert docs["gamma"] == "Discount factor."
    assert all("\n" not in text and "  " not in text for text in docs.values())


def test_groups_cover_the_top_level():
    assert set(GROUPS) | {"agent", "launcher"} == {f.name for f in dataclasses.fields(GearflowConfig)}


# ------------------------------------------------------------- save / reload


def test_save_then_load_is_identical(tmp_path):
    cfg = load_config(CARTPOLE, ["run.seed=7", "env.kwargs.frame_skip=4", "replay.capacity=2e5"])
    saved = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert saved == tmp_path / "run" / "config.yaml" and saved.is_file()
    assert [p.name for p in saved.parent.iterdir()] == ["config.yaml"]  # no temp file left
    again = load_config(saved)
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
    assert again.run.name == "cartpole_apex"  # kept from the original, not "config"


def test_run_name_defaults_to_file_stem(tmp_path):
    assert load_config(CARTPOLE).run.name == "cartpole_apex"
    path = _write_yaml(tmp_path / "my_run.yml", "run:\n  seed: 1\n")
    assert load_config(path).run.name == "my_run"
    assert load_config(CARTPOLE, ["run.name=custom"]).run.name == "custom"
    assert load_config(None).run.name == "gearflow"


# ---------------------------------------------------------- shipped configs

SHIPPED = sorted([*ROOT.glob("configs/**/*.yaml"), *ROOT.glob("configs/**/*.yml")])


def test_configs_exist():
    assert CARTPOLE in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.run.name
    assert explain(cfg)


@pytest.mark.parametrize(
    "text,want",
    [("500", ("updates", 500.0)), ("90s", ("seconds", 90.0)), ("10m", ("seconds", 600.0)),
     ("2h", ("seconds", 7200.0)), ("0", ("off", 0.0)), ("0s", ("off", 0.0)), (" 1.5m ", ("seconds", 90.0)),
     ("1.5", None), ("m", None), ("-5", None), ("5d", None)],
)
def test_parse_period(text, want):
    assert config_mod.parse_period(text) == want


def test_a_gpu_by_index_is_a_valid_device():
    cfg = load_config(CARTPOLE, ["learner.device=cuda:1", "replay.device=cuda:1", "actor.device=cpu"])
    assert (cfg.learner.device, cfg.replay.device) == ("cuda:1", "cuda:1")


# ------------------------------------------------------------------ run.module_dirs


def test_module_dirs_find_an_agent_module_and_are_recorded(tmp_path, monkeypatch):
    """An agent module in a directory named by run.module_dirs (relative to the YAML file) is
    imported; the file's own directory is recorded too; a saved config reads back the same."""
    name = f"agent_{uuid.uuid4().hex[:8]}"  # never imported before: only module_dirs can find it
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / f"{name}.py").write_text((Path(__file__).parents[1] / "examples" / "custom_agent" / "my_dqn.py").read_text())
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    cfg_dir = tmp_path / "cfgs"
    cfg_dir.mkdir()
    path = _write_yaml(cfg_dir / "mine.yaml", f"agent:\n  name: {name}\nrun:\n  module_dirs: [../lib]\n")
    cfg = load_config(path)
    assert cfg.agent.name == name and list(cfg.run.module_dirs) == [str(lib.resolve())]
    assert str(lib.resolve()) in sys.path and str(cfg_dir.resolve()) in sys.path  # both searched
    plain = _write_yaml(cfg_dir / "plain.yaml", "run:\n  seed: 3\n")  # no module_dirs: its directory recorded
    assert list(load_config(plain).run.module_dirs) == [str(cfg_dir.resolve())]
    monkeypatch.chdir(tmp_path)
    assert list(load_config(plain, ["run.module_dirs=[lib]"]).run.module_dirs) == [str(lib.resolve()), str(cfg_dir.resolve())]
    saved = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert OmegaConf.to_container(load_config(saved)) == OmegaConf.to_container(cfg)


@pytest.mark.parametrize("value", ["lib", "[1]", "['']"])
def test_module_dirs_must_be_a_list_of_paths(value):
    with pytest.raises(ConfigError, match=r"run.module_dirs must be a list of directory paths"):
        load_config(None, [f"run.module_dirs={value}"])


def test_an_agent_module_nowhere_on_the_path_is_one_line(tmp_path):
    path = _write_yaml(tmp_path / "x.yaml", f"agent:\n  name: agent_{uuid.uuid4().hex[:8]}\n")
    with pytest.raises(ConfigError, match=r"agent.name: cannot import agent module 'agent_"):
        load_config(path)
