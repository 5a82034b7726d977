"""gearflow.kinds: one module per item kind, one registry (issue 29, point 2).

A kind written outside the package (``tests/pair_kind.py``: its item rule, adder, actor and
an agent, registered when imported) goes through every reader of the registry: config
validation (its name, its minimum steps), the actors' lookup (``make_actor`` builds its
actor, which writes a real table), sampling and a checkpoint round trip (``kind_from_dict``),
the dry run (its adder's minimum), and the GPU path (refused: it has no device gather).
"""

from __future__ import annotations

import numpy as np
import pair_kind
import pytest
import torch

from gearflow.actors import actor_class_for
from gearflow.actors.process import make_actor
from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import make_vec_env
from gearflow.errors import ConfigError
from gearflow.geometry import replay_geometry
from gearflow.kinds import kind_def, kind_from_dict, kind_names, register_kind, unregister_kind
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay import RateLimiter, SharedStorage, Table, make_selector
from gearflow.replay.spec import TableSpec
from gearflow.replay.table_checkpoint import restore_checkpoint, save_checkpoint

PAIR = ["agent.name=pair_kind", "replay.item=pair", "actor.num_actors=1", "env.num_envs=2", "env.batch_size=2",
        "replay.capacity=64", "replay.min_size_to_sample=1", "learner.batch_size=8"]  # fmt: skip


@pytest.fixture
def pair():
    """The ``pair`` kind registered for the test (as importing its module does), forgotten after."""
    register_kind(pair_kind.KIND)
    yield pair_kind
    unregister_kind("pair")


def test_builtin_kinds_are_one_module_each_and_round_trip_through_the_registry():
    assert kind_names()[:3] == ("transition", "sequence", "episode")
    for kind in (Transition(next_columns=("obs",)), Sequence(length=8, period=4, burn_in=2), Episode(max_episode_length=9)):
        d = kind_def(kind.name)
        assert d.item is type(kind)
        assert d.item.__module__ == d.adder.__module__ == d.actor.__module__ == f"gearflow.kinds.{kind.name}"
        assert kind_from_dict(kind.to_dict()) == kind
        assert callable(kind.gather_on_device)  # every built-in kind gathers on a GPU too


def test_unknown_kind_names_the_known_ones(pair):
    with pytest.raises(ValueError, match="unknown item kind 'frames'; known kinds: transition, sequence, episode, pair"):
        kind_def("frames")
    with pytest.raises(ConfigError, match="replay.item='frames': must be one of transition, sequence, episode, pair"):
        load_config(None, ["replay.item=frames"])


def test_config_validates_a_registered_kind_and_its_minimum_steps(pair):
    cfg = load_config(None, PAIR)
    assert cfg.replay.item == "pair"
    with pytest.raises(ConfigError, match="replay.capacity=1: gives 0 steps per partition .*need at least 2"):
        load_config(None, [*PAIR, "replay.capacity=1", "learner.batch_size=1"])
    unregister_kind("pair")  # the module stays imported: the name is gone with the registration
    with pytest.raises(ConfigError, match="replay.item='pair': must be one of transition, sequence, episode "):
        load_config(None, PAIR)


def test_a_registered_kind_is_acted_written_sampled_and_checkpointed(pair, tmp_path):
    cfg = load_config(None, PAIR)
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, torch.device("cpu"))
    kind = agent.item_kind()
    assert actor_class_for(agent) is pair.PairActor
    geom = replay_geometry(cfg, kind)
    storage = SharedStorage.create(TableSpec.parse(agent.replay_columns()), geom.num_partitions,
                                   geom.steps_per_partition, geom.items_per_partition)  # fmt: skip
    table = restored = None
    try:
        actor = make_actor(cfg, 0, agent, env, storage, geom.partitions_of(0), None, epsilon=0.5)
        with actor:
            assert type(actor) is pair.PairActor and isinstance(actor.adder, pair.PairAdder)
            actor.run(max_steps=60)
            assert actor.items > 20
        table = Table(storage, kind, make_selector("uniform", geom.num_partitions * geom.items_per_partition, seed=0),
                      RateLimiter(min_size_to_sample=1), sample_timeout_s=5.0)  # fmt: skip
        batch = table.sample(16)
        obs, reward = batch.data["obs"].numpy(), batch.data["reward"].numpy()
        assert obs.shape == (16, 2, *env.obs_shape) and reward.shape == (16, 2)
        np.testing.assert_array_equal(reward[:, 1], 1.0)  # the second step is never an episode's first
        rows = storage.columns["obs"].reshape(geom.num_partitions, geom.steps_per_partition, -1)
        for first, second in obs:  # each pair is two consecutive steps of one partition
            p, t = np.argwhere((rows == first).all(-1))[0]
            np.testing.assert_array_equal(rows[p, (t + 1) % geom.steps_per_partition], second)
        save_checkpoint(table, tmp_path / "ckpt")
        restored = restore_checkpoint(tmp_path / "ckpt")  # the kind comes back through the registry
        assert restored.kind == kind and restored.size == table.size > 0
        assert restored.sample(4).data["obs"].shape == (4, 2, *env.obs_shape)
    finally:
        for t in (restored, table):
            if t is not None:
                t.close()
                t.storage.unlink()
        if table is None:
            storage.close()
            storage.unlink()


def test_the_dry_run_reads_the_kinds_adder(pair):
    from gearflow.tools.dryrun import memory_plan

    plan = memory_plan(load_config(None, PAIR))
    assert plan["item"] == "pair"
    r = plan["replay"]
    assert r["actor"] == "PairActor + PairAdder" and r["min_steps_per_partition"] == 2 and not r["steps_too_few"]
    assert r["items_per_partition"] == r["steps_per_partition"] == 32  # Pair.records_per_partition


def test_the_gpu_path_refuses_a_kind_without_a_device_gather(pair, storage_factory):
    from gearflow.native.device_replay import DeviceReplay

    st = storage_factory({"obs": "float32[3]", "reward": "float32"}, P=1, S=8)
    with pytest.raises(ValueError, match="item kind 'pair' has no device gather"):
        DeviceReplay(st, pair.Pair(), make_selector("uniform", st.num_partitions * st.items_per_partition))
