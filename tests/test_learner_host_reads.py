"""No host sync in the steady learner loop: over 100 updates of DQN, DPG and R2D2 on a CPU learner
(the real ``Learner.run`` over a ``Prefetcher`` of a filled replay table, weights published to a
parameter store), the learner's thread reads no tensor back to the host outside metric rows.

A host read is what would wait for the device on a GPU (gearflow/learner/syncs.py): ``.item()``,
``float(t)``, ``if t:`` (``aten._local_scalar_dense``, seen by a dispatch mode) and ``.tolist()``,
``.numpy()``, ``.cpu()`` (counted where Python calls them)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gearflow.agent import make_agent
from gearflow.bench.learner import filled_table
from gearflow.config import load_config
from gearflow.envs import EnvSpec
from gearflow.learner import Learner, Prefetcher, Progress
from gearflow.learner.syncs import HostReads
from gearflow.params import ParameterStore


class Box:
    """A continuous action space as the DPG agent reads it."""

    def __init__(self, low, high):
        self.low, self.high, self.shape = np.asarray(low, np.float32), np.asarray(high, np.float32), (len(low),)


CARTPOLE = EnvSpec(obs_shape=(4,), obs_dtype=np.dtype(np.float32), num_actions=2)
MASKED = EnvSpec(obs_shape=(2,), obs_dtype=np.dtype(np.float32), num_actions=2)
CHEETAH = EnvSpec(obs_shape=(17,), obs_dtype=np.dtype(np.float32), num_actions=None, action_space=Box([-1] * 6, [1] * 6))

AGENTS = {  # config, its env's spec, small sizes (the loop is what is measured, not the network)
    "dqn": ("configs/cartpole_apex.yaml", CARTPOLE, ["learner.batch_size=32", "agent.target_update_period=7"]),
    "dpg": ("configs/halfcheetah_dpg.yaml", CHEETAH, ["learner.batch_size=32", "agent.hidden_sizes=[32,32]"]),
    "r2d2": ("configs/cartpole_masked_r2d2.yaml", MASKED,
             ["learner.batch_size=4", "agent.d_model=16", "agent.target_update_period=7"]),
}
WARMUP, STEADY = 10, 100


def loop_parts(name: str, *overrides: str):
    path, spec, small = AGENTS[name]
    cfg = load_config(path, [*small, "learner.publish_every=5", "learner.device=cpu", "run.log_every_s=1e9",
                             "run.checkpoint_every=0", *overrides])  # fmt: skip
    agent = make_agent(cfg, spec, torch.device("cpu"))
    agent.setup_learner()
    table = filled_table(cfg, agent, steps_per_partition=1024)
    store = ParameterStore.create(agent.learner_network())
    return cfg, agent, table, store


@pytest.mark.parametrize("name", sorted(AGENTS))
def test_the_steady_loop_reads_nothing_back_from_the_learners_tensors(name):
    cfg, agent, table, store = loop_parts(name, f"run.max_updates={WARMUP + STEADY}")
    progress, stop = Progress(), threading.Event()
    learner = Learner(cfg.learner, agent, table, store, progress, run=cfg.run, env_steps=lambda: 0,
                      actor_version=lambda: 0, stop=stop)  # fmt: skip
    pre = Prefetcher(table, learner.lock, int(cfg.learner.batch_size), int(cfg.learner.prefetch), stop, progress)
    try:
        with HostReads() as reads:

            def next_batch():
                if progress.updates == WARMUP:  # steady: the optimizer's state and the first publications made
                    reads.reset()
                return pre.next_batch()

            reason, metrics = learner.run(next_batch)
            steady = (reads.host_reads, reads.aten_ops, list(reads.sites))
            reads.reset()
            row = learner.snapshot(metrics)  # a metric row: here the learner's numbers are read
            at_row = reads.host_reads
    finally:
        pre.close()
        table.close()
        store.close()
    assert reason == f"reached run.max_updates={WARMUP + STEADY}" and progress.updates == WARMUP + STEADY
    host_reads, aten_ops, sites = steady
    assert host_reads == 0, f"{host_reads / STEADY:.2f} host reads per update, first at {sites}"
    assert aten_ops > 20 * STEADY  # the counter saw the learn steps
    assert at_row >= 1 and np.isfinite(row["learner/loss"]) and isinstance(row["learner/loss"], float)
