"""A real Ape-X actor (EnvPool CartPole, the apex_dqn agent) over the transport.

The same actor, seeded alike, once writing its shared-memory partitions through a local
Writer and loading weights from a local ParameterStore, once through a RemoteWriter and
RemoteParams into a shard service on loopback: the two tables hold the same bytes (rows,
item records, counters) and the actor picks up the same weight versions at the same steps.
Then a learner samples the shard; and a stop while the last flush waits on the shard's
rate limiter ends the remote run quietly, as locally.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gearflow.actors import actor_class_for
from gearflow.actors.base import actor_epsilon
from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import make_vec_env
from gearflow.params import ParameterStore
from gearflow.replay import RateLimiter
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED, REC_RESERVE, RESERVE
from gearflow.replay.writer import Writer
from gearflow.transport.actor import RemoteParams, RemoteWriter, ShippingWriter
from gearflow.transport.learner import RemoteSampler
from gearflow.transport.server.shard import ShardService

pytest.importorskip("envpool")
TOKEN = "actor-test-token-77"
E, S = 8, 512


def setup(make_table, limiter=None):
    cfg = load_config(None, ["env.id=CartPole-v1", f"env.num_envs={E}", f"env.batch_size={E}", "actor.num_actors=1",
                             "actor.epsilon=0.5", "actor.weight_sync_period=200", "replay.capacity=4096"])  # fmt: skip
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, torch.device("cpu"))
    table = make_table(spec=agent.replay_columns(), P=E, S=S, kind=agent.item_kind(), limiter=limiter)
    return cfg, env, agent, table


def run(cfg, env, agent, writer, params, store, net, steps):
    torch.manual_seed(0)
    actor = actor_class_for(agent)(env, agent, writer, params, actor_epsilon(cfg, 0, E), cfg=cfg.actor,
                                   env_cfg=cfg.env, actor_index=0, seed=0)  # fmt: skip
    seen = []
    for k in range(3):  # the learner publishes between the chunks; the actor syncs every 200 steps
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * (k + 1))
        store.publish(net)
        actor.run(max_steps=steps)
        seen.append(actor.version)
    actor.close()
    writer.flush()
    return actor, seen


@pytest.mark.parametrize("remote_writer", [RemoteWriter, ShippingWriter])
def test_remote_actor_writes_what_the_local_actor_writes(make_table, remote_writer):
    tables, seen, items = [], [], []
    for remote in (False, True):
        cfg, env, agent, table = setup(make_table)
        torch.manual_seed(1)
        net = agent.make_network()
        store = ParameterStore.create(net)
        shard = None
        try:
            if remote:
                shard = ShardService(table, params=store, token=TOKEN)
                port = shard.start()
                writer = remote_writer(("127.0.0.1", port), num_streams=E, token=TOKEN, insert_timeout_s=10)
                params = RemoteParams(("127.0.0.1", port), token=TOKEN)
            else:
                writer, params = Writer(table.storage, np.arange(E)), ParameterStore.attach(store.name)
            actor, versions = run(cfg, env, agent, writer, params, store, net, 600)
            # the local actor and the shipping writer's run the C n-step adder; RemoteWriter's the numpy one
            assert actor.adder.native is (not remote or remote_writer is ShippingWriter)
            tables.append(table)
            seen.append(versions)
            items.append(actor.items)
            if remote:
                sampler = RemoteSampler(("127.0.0.1", port), token=TOKEN, timeout_s=10)
                batch = sampler.sample(64)
                assert batch.data["obs"].shape == (64, 4) and batch.data["next_obs"].shape == (64, 4)
                assert set(batch.data["version"].tolist()) <= {1, 2, 3}
                sampler.close()
                writer.close()
                params.close()
        finally:
            if shard is not None:
                shard.stop()
            store.close()
    assert seen[0] == seen[1] == [1, 2, 3]
    assert items[0] == items[1] > 200
    a, b = (t.storage for t in tables)
    for name in a.columns:
        np.testing.assert_array_equal(a.columns[name].view(np.uint8), b.columns[name].view(np.uint8), err_msg=name)
    fields = [RESERVE, COMMIT, PUBLISHED, EPISODES, REC_RESERVE]
    np.testing.assert_array_equal(a.counters[:, fields], b.counters[:, fields])
    np.testing.assert_array_equal(a.item_start, b.item_start)
    np.testing.assert_array_equal(a.item_priority, b.item_priority)


@pytest.mark.parametrize("remote_writer", [RemoteWriter, ShippingWriter])
def test_stop_while_the_shard_rate_limiter_holds_the_last_flush(make_table, remote_writer):
    """No learner samples, so the shard's rate limiter holds the inserts; a stop event ends the
    remote actor's run without an error (the items are dropped), as with a local writer."""
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=100.0)
    cfg, env, agent, table = setup(make_table, limiter=lim)
    shard = ShardService(table, token=TOKEN)
    port = shard.start()
    writer = remote_writer(("127.0.0.1", port), num_streams=E, token=TOKEN, insert_timeout_s=60)
    stop = threading.Event()
    try:
        actor = actor_class_for(agent)(env, agent, writer, None, actor_epsilon(cfg, 0, E), cfg=cfg.actor,
                                                       env_cfg=cfg.env, seed=0)
        timer = threading.Timer(1.5, stop.set)
        timer.start()
        actor.run(stop_event=stop)  # returns once stopped: never raises, never hangs
        actor.close()
        timer.join()
        assert 0 < table.storage.counters[:, PUBLISHED].sum() <= 101  # the limit: (1 + 100) / 1 items
    finally:
        writer.close()
        shard.stop()
