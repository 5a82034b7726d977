"""Batches ahead on the learner's device (gearflow/learner/staging.py): the prefetch thread copies each
sample into a free slot of a ring of static buffer sets; a slot is refilled only after the step that
read it released it. On the CPU the ring copies synchronously (no events): the rotation runs here; on
a GPU (``cuda`` tests) with its side stream and events."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gearflow.agent import make_agent
from gearflow.bench.learner import filled_table
from gearflow.config import load_config
from gearflow.learner import Learner, Prefetcher, Progress
from gearflow.learner.staging import DeviceBatches, StagedSample
from gearflow.params import ParameterStore
from tests.test_learner_host_reads import CARTPOLE

UPDATES = 30


class Recording:
    """The real table; every sample's host data cloned as it was drawn, in order."""

    def __init__(self, table):
        self._table, self.drawn = table, []

    def sample(self, batch_size, timeout_s=None):
        batch = self._table.sample(batch_size, timeout_s)
        self.drawn.append({k: v.clone() for k, v in batch.data.items()})
        return batch

    def sample_batches(self, batch_size, count, timeout_s=None, ring=None):  # a refill's draw (prefetch 3: 2)
        batches = self._table.sample_batches(batch_size, count, timeout_s, ring)
        self.drawn.extend({k: v.clone() for k, v in batch.data.items()} for batch in batches)
        return batches

    def __getattr__(self, name):
        return getattr(self._table, name)


class Holding:
    """Holds each batch for a while and checks it did not change meanwhile (a slot refilled under it)."""

    bf16 = False

    def __init__(self, device):
        self.net, self.learned, self.device = torch.nn.Linear(4, 2).to(device), [], device

    def learner_network(self):
        return self.net

    def learn(self, batch):
        assert isinstance(batch, StagedSample) and batch.data["obs"].device.type == self.device.type
        first = {k: v.clone() for k, v in batch.data.items()}
        time.sleep(0.005)  # the prefetch thread runs meanwhile, with every other slot free
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        assert all(torch.equal(first[k], v) for k, v in batch.data.items()), "a held batch was overwritten"
        self.learned.append({k: v.cpu() for k, v in first.items()})
        return {}, torch.ones(batch.keys.shape[0], device=self.device)


def learn_through_a_ring(device: str, slots: int = 2):
    cfg = load_config("configs/cartpole_apex.yaml", ["learner.batch_size=16", "learner.prefetch=3",
                                                     f"run.max_updates={UPDATES}", "run.log_every_s=1e9",
                                                     "run.checkpoint_every=0"])  # fmt: skip
    table = filled_table(cfg, make_agent(cfg, CARTPOLE, torch.device("cpu")), steps_per_partition=1024)
    rec, agent, progress, stop = Recording(table), Holding(torch.device(device)), Progress(), threading.Event()
    store = ParameterStore.create(agent.net)
    try:
        learner = Learner(cfg.learner, agent, rec, store, progress, run=cfg.run, env_steps=lambda: 0,
                          actor_version=lambda: 0, device=torch.device(device), stop=stop)  # fmt: skip
        learner.lock.ring = ring = DeviceBatches(device, slots)  # a CPU ring: as a GPU learner's, synchronous
        pre = Prefetcher(rec, learner.lock, 16, 3, stop, progress)
        try:
            reason, _ = learner.run(pre.next_batch)
        finally:
            pre.close()
    finally:
        table.close()
        store.close()
    assert reason == f"reached run.max_updates={UPDATES}"
    return rec.drawn, agent.learned, ring


@pytest.mark.parametrize("slots", [2, 3])
def test_the_learner_reads_each_batch_as_drawn_and_slots_wait_for_their_release(slots):
    drawn, learned, ring = learn_through_a_ring("cpu", slots)
    assert len(learned) == UPDATES and ring.filled >= UPDATES and len(drawn) >= UPDATES
    for want, got in zip(drawn, learned):  # in order, each exactly what the table gathered
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert sum(s is not None for s in ring.slots) == slots  # static sets, all used, made once


def test_a_ring_needs_two_slots():
    with pytest.raises(ValueError, match="≥ 2 slots"):
        DeviceBatches("cpu", 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_ring_on_a_gpu_copies_on_its_stream_and_waits_for_the_step():
    drawn, learned, ring = learn_through_a_ring("cuda", 2)
    assert ring.stream is not None and len(learned) == UPDATES
    for want, got in zip(drawn, learned):
        assert all(torch.equal(want[k], got[k]) for k in want)
