"""A refill in one draw: ``Selector.sample(B, groups=K)``, ``Table.sample_batches`` and the
``Prefetcher`` drawing the ``depth - depth // 2`` batches of a refill in one table call.

Each of the K batches must be what its own ``sample(B)`` would be: stratified over the whole
mass (one row per stratum of total / B), importance weights normalised by its own maximum; the
batches handed to the learner must stay intact while it holds them (the refills' buffer sets are
used in turn)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from gearflow.bench.learner import filled_table
from gearflow.config import load_config
from gearflow.learner import Prefetcher
from gearflow.learner.access import ReplayAccess
from gearflow.replay.selectors import make_selector
from tests.test_learner_host_reads import CARTPOLE
from tests.test_selectors import fill, tree_impl  # noqa: F401 (the fixture)


def test_each_group_is_its_own_stratified_batch(tree_impl):
    selector = make_selector("prioritized", 64, seed=1, alpha=1.0)
    fill(selector, np.arange(64), np.ones(64))  # equal masses: stratum i of 8 is slots 8i .. 8i+7
    sel = selector.sample(8, groups=5)
    assert sel.slots.shape == (40,)
    for g in range(5):  # every group has one row in every stratum, in order (not one stratum of 40)
        np.testing.assert_array_equal(sel.slots[8 * g : 8 * g + 8] // 8, np.arange(8))
    # 64 rows in one batch of 64: each item once; as 4 groups of 16: each group its own 16 strata
    sel = selector.sample(16, groups=4)
    for g in range(4):
        np.testing.assert_array_equal(sel.slots[16 * g : 16 * g + 16] // 4, np.arange(16))


def test_each_group_is_weighted_by_its_own_maximum(tree_impl):
    priorities = np.array([0.1, 1.0, 2.0, 5.0, 0.5, 3.0, 8.0, 0.2])
    selector = make_selector("prioritized", 8, seed=2, alpha=0.6, beta=0.4)
    fill(selector, np.arange(8), priorities)
    masses = priorities**0.6
    sel = selector.sample(4, groups=6)
    np.testing.assert_allclose(sel.probabilities, masses[sel.slots] / masses.sum())
    raw = ((8 * sel.probabilities) ** -0.4).reshape(6, 4)
    np.testing.assert_allclose(sel.weights.reshape(6, 4), raw / raw.max(axis=1, keepdims=True), rtol=1e-6)
    assert (sel.weights.reshape(6, 4).max(axis=1) == np.float32(1.0)).all()


def test_grouped_draws_keep_the_distribution(tree_impl):
    """Large draws (≥ 256 rows: the C draw runs without the GIL) sample p ∝ priority^α."""
    from tests.test_selectors import assert_matches_distribution

    rng = np.random.default_rng(3)
    priorities = rng.uniform(0.1, 4.0, 50)
    selector = make_selector("prioritized", 50, seed=3, alpha=0.7)
    fill(selector, np.arange(50), priorities)
    slots = np.concatenate([selector.sample(128, groups=4).slots for _ in range(50)])
    masses = priorities**0.7
    assert_matches_distribution(np.bincount(slots, minlength=50), masses / masses.sum())


def test_groups_are_refused_where_a_draw_is_not_a_batch():
    fifo = make_selector("fifo", 8)
    fill(fifo, np.arange(8), np.ones(8))
    with pytest.raises(ValueError, match="one batch a call"):
        fifo.sample(2, groups=2)
    uniform = make_selector("uniform", 8)
    fill(uniform, np.arange(8), np.ones(8))
    assert uniform.sample(3, groups=4).slots.shape == (12,)
    with pytest.raises(ValueError, match="groups must be"):
        uniform.sample(3, groups=0)


@pytest.fixture
def cartpole_table():
    cfg = load_config("configs/cartpole_apex.yaml", ["learner.device=cpu"])
    from gearflow.agent import make_agent

    agent = make_agent(cfg, CARTPOLE, torch.device("cpu"))
    table = filled_table(cfg, agent, steps_per_partition=1024)
    yield cfg, agent, table
    table.close()


def _rows_match_keys(table, sample) -> None:
    """The batch's obs are the stored obs of its keys' items (first steps)."""
    slots = table.slots_of(sample.keys.numpy())
    assert (slots >= 0).all()
    rows, _ = table.rows_of(slots, table.records(slots))
    stored = table.storage.tensors["obs"][torch.from_numpy(rows["first"])]
    torch.testing.assert_close(sample.data["obs"], stored, rtol=0, atol=0)


def test_sample_batches_are_views_of_one_draw(cartpole_table):
    cfg, _, table = cartpole_table
    before = table.samples
    batches = table.sample_batches(32, 3)
    assert len(batches) == 3 and table.samples == before + 96
    base = batches[0].data["obs"].untyped_storage().data_ptr()
    for b in batches:
        assert b.data["obs"].shape == (32, 4) and b.keys.shape == (32,)
        assert b.data["obs"].untyped_storage().data_ptr() == base  # one buffer set
        assert b.weights.max() == 1.0  # each weighted on its own
        _rows_match_keys(table, b)
    assert table.sample_batches(32, 1)[0].keys.shape == (32,)
    with pytest.raises(ValueError, match="count must be"):
        table.sample_batches(32, 0)


def test_the_prefetcher_draws_a_refill_at_once_and_keeps_held_batches_intact(cartpole_table, monkeypatch):
    """Depth 8: every draw is a refill of 4 batches; each batch the learner took stays as it was
    drawn (and matches its keys) until the learner takes the next one, with the prefetch thread
    drawing as far ahead as it will in between (the refills' buffer sets in turn)."""
    _, _, table = cartpole_table
    calls = []
    real = table.sample_batches
    monkeypatch.setattr(table, "sample_batches", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    stop = threading.Event()
    pre = Prefetcher(table, ReplayAccess(table), 16, 8, stop)
    ahead, room = pre.ahead, pre.ahead.depth - pre.group
    try:
        assert pre.group == 4
        held, copy = None, None
        for _ in range(60):
            batch = pre.get(timeout=30)
            if held is not None:
                for k, v in copy.items():
                    torch.testing.assert_close(held.data[k], v, rtol=0, atol=0)
                _rows_match_keys(table, held)
            held, copy = batch, {k: v.clone() for k, v in batch.data.items()}
            with ahead._ready:  # the refill this get made due (if any) is in before the next get
                assert ahead._ready.wait_for(lambda: len(ahead) > room, 30)
        assert calls and set(calls) == {4}  # every draw a refill of 4 batches
    finally:
        stop.set()
        pre.close()


def test_a_learner_of_depth_2_draws_batch_by_batch(cartpole_table):
    _, _, table = cartpole_table
    stop = threading.Event()
    pre = Prefetcher(table, ReplayAccess(table), 16, 2, stop)
    try:
        assert pre.group == 1 and pre.group_ring is None
        assert pre.get(timeout=30).keys.shape == (16,)
    finally:
        stop.set()
        pre.close()


def test_a_redrawn_grouped_batch_is_reweighed_per_group(tree_impl):
    """The torn-row redraw's normalisation (``reweigh``) keeps each group's own maximum."""
    priorities = np.array([0.5, 1.0, 2.0, 4.0])
    selector = make_selector("prioritized", 4, seed=4, alpha=1.0, beta=1.0)
    fill(selector, np.arange(4), priorities)
    masses = np.array([0.5, 4.0, 1.0, 2.0, 2.0, 4.0])  # two groups of 3
    probs, weights = selector.reweigh(masses, 3)
    np.testing.assert_allclose(probs, masses / 7.5)
    raw = (4 * probs) ** -1.0
    np.testing.assert_allclose(weights, np.concatenate([raw[:3] / raw[:3].max(), raw[3:] / raw[3:].max()]), rtol=1e-6)
    np.testing.assert_allclose(selector.reweigh(masses)[1], raw / raw.max(), rtol=1e-6)  # one batch of 6


def test_a_rings_views_follow_its_sets_when_it_is_remade():
    """``BufferRing.parts`` views the set it is given: after the ring is remade for another batch
    size (its old sets dropped, their ids free for reuse), the views are of the new sets."""
    from gearflow.replay.host_batch import BufferRing

    ring = BufferRing(2)
    for rows in (64, 96, 64, 128):  # remade at every change
        layout = {"obs": ((rows, 4), torch.float32)}
        for _ in range(3):
            buf = ring.take(layout, rows)
            parts = ring.parts(buf, 32)
            assert len(parts) == rows // 32
            for i, part in enumerate(parts):
                assert part["obs"].data_ptr() == buf["obs"][32 * i].data_ptr()


def test_the_prefetcher_asks_the_table_whether_it_draws_groups(monkeypatch):
    """A FIFO table (its draws are not independent batches) is drawn batch by batch at any depth."""
    cfg = load_config("configs/cartpole_apex.yaml", ["learner.device=cpu", "replay.selector=fifo"])
    from gearflow.agent import make_agent

    table = filled_table(cfg, make_agent(cfg, CARTPOLE, torch.device("cpu")), steps_per_partition=1024)
    stop = threading.Event()
    try:
        assert not table.draws_groups
        with pytest.raises(ValueError, match="fifo selector draws one batch a call"):
            table.sample_batches(16, 2)
        pre = Prefetcher(table, ReplayAccess(table), 16, 8, stop)
        try:
            assert pre.group == 1 and pre.get(timeout=30).keys.shape == (16,)
        finally:
            stop.set()
            pre.close()
    finally:
        table.close()


def test_a_large_c_draw_lets_other_threads_run_and_a_small_one_does_not():
    """``_hotpath.sample_proportional`` releases the GIL for draws of ≥ 256 rows only. A thread
    that runs only while this one gives the GIL up (the switch interval set to 100 s: no forced
    switch; the C call made on ready arrays, no numpy call between) counts: it advances during a
    large draw, never during small ones."""
    import sys
    import time

    from gearflow.replay import selectors

    C = selectors._hotpath
    if C is None:
        pytest.skip("the C sum tree was not built (no compiler at install time)")
    n = 1 << 20
    selector = make_selector("prioritized", n, seed=5, alpha=1.0)
    fill(selector, np.arange(n), np.random.default_rng(5).uniform(0.1, 1.0, n))
    tree = selector.tree

    def arrays(rows):
        u = np.random.default_rng(rows).random(rows)
        return u, np.empty(rows, np.int64), np.empty(rows), np.empty(rows, np.float32)

    small, large = arrays(255), arrays(1 << 16)
    count, stop, started = [0], threading.Event(), threading.Event()

    def other():
        started.set()
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # gives the GIL back at once: it runs only where this test's thread lets it

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    started.wait()
    sys.setswitchinterval(100.0)
    try:
        before = count[0]
        for _ in range(200):
            C.sample_proportional(tree.levels, tree.fanout, small[0], n, 0.4, *small[1:])
        during_small = count[0] - before
        for _ in range(50):  # until the other thread ran during one (each call ~10 ms)
            before = count[0]
            C.sample_proportional(tree.levels, tree.fanout, large[0], n, 0.4, *large[1:], 1 << 12)
            if count[0] > before:
                break
        during_large = count[0] - before
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        thread.join()
    assert during_small == 0 and during_large > 0
