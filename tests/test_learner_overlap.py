"""Sampling overlapped with learning: with a slowed sample (S) and a learn step of L < S, the real
``Learner.run`` over a ``Prefetcher`` of a real table runs at ~max(S, L) an update, not S + L, and
``learner/wait_fraction`` is the share of the loop the learner spent waiting for a batch
(~(S − L) / S), lock waits included: the learn step takes no lock the sampling side holds.

Both halves sleep (a gather's copies and a device's step release the GIL the same way), so the
figures hold on a loaded machine; a sleep only ever runs long, which moves the loop toward the sum."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from gearflow.bench.learner import filled_table
from gearflow.config import load_config
from gearflow.learner import Learner, Prefetcher, Progress
from tests.test_learner_host_reads import CARTPOLE

S, L, UPDATES = 0.1, 0.05, 30


class SlowSample:
    """A real table whose every sample takes ``S`` longer (a slow gather); everything else is the table's."""

    def __init__(self, table):
        self._table, self.took = table, []

    def sample(self, batch_size, timeout_s=None):
        t0 = time.perf_counter()
        time.sleep(S)
        batch = self._table.sample(batch_size, timeout_s)
        self.took.append(time.perf_counter() - t0)
        return batch

    def __getattr__(self, name):
        return getattr(self._table, name)


class SleepyAgent:
    """A learn step of ``L`` (a device busy for L), |TD| = 1 for every item; ``updates`` counted."""

    bf16 = False

    def __init__(self):
        self.net, self.took = torch.nn.Linear(2, 2), []

    def learner_network(self):
        return self.net

    def learn(self, batch):
        t0 = time.perf_counter()
        time.sleep(L)
        self.took.append(time.perf_counter() - t0)
        return {"learner/loss": torch.zeros(())}, torch.ones(len(batch.keys))


def test_a_slowed_sample_overlaps_the_learn_step_and_its_wait_is_counted():
    from gearflow.agent import make_agent
    from gearflow.params import ParameterStore

    cfg = load_config("configs/cartpole_apex.yaml", ["learner.batch_size=32", "learner.prefetch=2",
                                                     f"run.max_updates={UPDATES}", "run.log_every_s=1e9",
                                                     "run.checkpoint_every=0"])  # fmt: skip
    real = make_agent(cfg, CARTPOLE, torch.device("cpu"))
    table = filled_table(cfg, real, steps_per_partition=1024)
    agent, progress, stop = SleepyAgent(), Progress(), threading.Event()
    store = ParameterStore.create(agent.net)
    learner = Learner(cfg.learner, agent, SlowSample(table), store, progress, run=cfg.run, env_steps=lambda: 0,
                      actor_version=lambda: 0, stop=stop)  # fmt: skip
    before = table.selector.tree.total
    slow = SlowSample(table)
    pre = Prefetcher(slow, learner.lock, 32, 2, stop, progress)
    try:
        assert pre.next_batch() is not None  # the first batch: the loop is timed from here
        learner.learn_step(pre.next_batch())
        t0 = time.perf_counter()
        reason, _ = learner.run(pre.next_batch)
        per_update = (time.perf_counter() - t0) / (progress.updates - 1)
        row = learner.snapshot({})
    finally:
        pre.close()
    try:
        assert reason == f"reached run.max_updates={UPDATES}"
        # what the halves really took (a loaded machine oversleeps): a sample s, a learn step l
        s, l = float(np.median(slow.took)), float(np.median(agent.took))
        # overlapped: near max(s, l), not s + l (the sum less half the shorter: the old loop reached
        # ~max too here, its sleeps overlapping, but counted the wait below as learning)
        assert per_update < s + l - 0.5 * min(s, l), f"{per_update * 1e3:.1f} ms an update; s {s * 1e3:.1f}, l {l * 1e3:.1f}"
        # the learner's wait for batches, ~(s - l) / s of the loop, is counted as waiting, not
        # learning (the old loop: 0.0006, its learn steps waiting on the sampler's lock); a learn
        # step is the agent's own time and no lock wait
        assert row["learner/wait_fraction"] > 0.5 * (s - l) / s, (row["learner/wait_fraction"], s, l)
        assert progress.learn_s / progress.updates < l + 0.25 * (s - l), (progress.learn_s / progress.updates, s, l)
        # the write-backs reached the table (every |TD| 1: the tree's total moved)
        assert learner.lock.writeback.applied >= progress.updates - 3
        assert not np.isclose(table.selector.tree.total, before)
    finally:
        table.close()
        store.close()


def test_device_priorities_reach_a_device_table_with_a_device_side_wait_only(monkeypatch):
    """A CUDA learner's priorities to a CUDA table: the sampling side's stream waits for the
    learner's event (the table's stream then waits for that stream), never the host; to a host
    table the pinned copy is waited for on the host. Stand-ins for the CUDA event and stream: no
    GPU here (tests/test_device_replay.py's CUDA tests run the real ones)."""
    from gearflow.learner.access import PriorityWriteBack

    log = []

    class Event:
        def synchronize(self):
            log.append("host wait")

    class Stream:
        def wait_event(self, event):
            log.append("device wait")

    class Table:
        def __init__(self, device):
            self.device = device

        def update_priorities(self, keys, priorities):
            log.append("update")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    keys, prios = torch.arange(4), torch.ones(4)
    wb = PriorityWriteBack(Table("cuda"))
    wb.pending.append((keys, prios, Event(), None))  # as put() queues a CUDA tensor for a device table
    assert wb.apply() == 1 and log == ["device wait", "update"]
    log.clear()
    wb = PriorityWriteBack(Table("cpu"))
    wb.pending.append((keys, prios, Event(), prios))  # put()'s pinned copy for a host table
    assert wb.apply() == 1 and log == ["host wait", "update"]


def test_batches_ahead_wake_the_drawing_side_once_per_refill_and_lose_none():
    """The prefetcher's hand-over (BatchesAhead): every batch arrives once, in order, and the
    drawing side is woken about once per depth // 2 batches taken (a queue woken per batch woke it
    for every one: the GIL handed over each update), not more; a get with none there waits for
    the next put, and times out with queue.Empty."""
    import queue

    from gearflow.learner.batches import BatchesAhead

    depth, n = 8, 400
    ahead, wakes, stop = BatchesAhead(depth), [0], threading.Event()

    def draw():
        i = 0
        while i < n and not stop.is_set():
            if ahead.full():
                if ahead.wait_for_room(5.0):
                    wakes[0] += 1
                continue
            ahead.put(i)
            i += 1

    t = threading.Thread(target=draw, daemon=True)
    t.start()
    got = []
    for _ in range(n):  # a learner slower than the drawing side (which then waits for room)
        got.append(ahead.get(timeout=30))
        time.sleep(0.0002)
    stop.set()
    t.join(timeout=30)
    assert got == list(range(n))
    assert wakes[0] <= n / (depth // 2) + 2, wakes[0]
    with pytest.raises(queue.Empty):
        ahead.get(timeout=0.01)
    later = threading.Timer(0.05, ahead.put, args=("late",))
    later.start()
    assert ahead.get(timeout=30) == "late"
