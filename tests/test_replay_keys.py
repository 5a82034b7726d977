"""A sampled row always carries its own key: the item whose steps it holds.

Two deterministic interleavings (the two ways a key could name another item),
then the stamp stress of ``gearflow bench keys`` with a real writer process
at small and large rings and record rings, every row checked.
"""

from __future__ import annotations

import numpy as np
import pytest

from gearflow.bench.keys import CASES, check
from gearflow.kinds.transition import Transition
from gearflow.replay import Writer
from gearflow.replay.storage import PUBLISHED, REC_RESERVE

STAMP_SPEC = {"stamp": "int64", "obs": "uint8[8]"}


def _steps(first: int, n: int) -> dict[str, np.ndarray]:
    t = np.arange(first, first + n)
    return {"stamp": t, "obs": np.repeat((t % 251 + 1).astype(np.uint8)[:, None], 8, 1)}


def _write(w: Writer, n: int) -> None:
    """``n`` stamped steps of stream 0, one 1-step item per step (item seq = step), in calls of 8."""
    for k in range(0, n, 8):
        m = min(8, n - k)
        first = w.extend(_steps(int(w.positions[0]), m))
        w.create_items(np.ones(m), 1, streams=0, ends=first + np.arange(1, m + 1))


def test_redraw_keeps_the_records_of_rows_it_did_not_redraw(make_table):
    """A redraw's scan ingests new items into slots other rows of the batch still hold
    (record ring lapped): those rows keep the key of the item they gathered."""
    S, R = 64, 16
    table = make_table(STAMP_SPEC, P=1, S=S, R=R, kind=Transition(next_columns=()), selector="uniform")
    w = Writer(table.storage, [0])
    _write(w, 16)  # items 0..15 fill the record ring; steps 0..15
    table.scan()
    real_gather, calls = table._gather, []

    def gather_then_write(slots, rec, out, only=None, tensors=None):
        real_gather(slots, rec, out, only, tensors)
        if not calls:  # between the first gather and its seqlock check, a writer laps
            # the step ring past item 0's step (so some row is torn and redrawn) and
            # the record ring (so every slot now names a newer item)
            _write(w, 52)  # RESERVE 68: items 0..3 torn, 4..15 intact; slots hold items 52..67
        calls.append(slots.copy())

    table._gather = gather_then_write
    s = table.sample(64)
    assert len(calls) >= 2, "the injected lap must tear at least one row"
    assert table.torn >= 1
    keys, stamps = s.keys.numpy(), s.data["stamp"].numpy()
    np.testing.assert_array_equal(stamps, keys)  # P=1: key = seq = first step


def test_ingest_refuses_records_a_writer_is_rewriting(make_table):
    """A writer bumps REC_RESERVE before it rewrites record slots; a scan that copies a
    slot mid-rewrite (PUBLISHED not yet bumped) must not ingest it under the old key."""
    S, R = 64, 8
    table = make_table(STAMP_SPEC, P=1, S=S, R=R, kind=Transition(next_columns=()), selector="uniform")
    st = table.storage
    w = Writer(st, [0])
    _write(w, 8)  # items 0..7, published, not yet ingested
    # a second writer call is half done: it announced items 8..11 and rewrote the record
    # slots of items 0..3 (slot = seq % R) but has not published them
    w.extend(_steps(8, 4))
    st.counters[0, REC_RESERVE] = 12
    st.item_start[0, 0:4] = np.arange(8, 12)
    assert st.counters[0, PUBLISHED] == 8
    table.scan()
    assert table.size == 4  # items 4..7 only: the records of 0..3 were being rewritten
    s = table.sample(64)
    np.testing.assert_array_equal(s.data["stamp"].numpy(), s.keys.numpy())
    assert set(s.keys.tolist()) == {4, 5, 6, 7}


def test_writer_announces_record_slots_before_publishing(storage_factory):
    from gearflow.replay import TableSpec

    st = storage_factory(TableSpec.parse(STAMP_SPEC), P=2, S=32, R=8)
    w = Writer(st, [0, 1])
    w.append({"stamp": np.zeros(2, np.int64), "obs": np.ones((2, 8), np.uint8)})
    w.create_items([1.0, 1.0], 1)
    w.extend(_steps(1, 5), stream=1)
    w.create_items(np.ones(5), 1, streams=1, ends=np.arange(2, 7))
    np.testing.assert_array_equal(st.counters[:, PUBLISHED], [1, 6])
    np.testing.assert_array_equal(st.counters[:, REC_RESERVE], [1, 6])


# The stress: a writer process, every row checked. Every 8th sample waits, between its gather
# and its seqlock re-check, until the writer has lapped the ring (progress on the counters, not
# time), so every case redraws however loaded the machine is: the path where keys went wrong.
STRESS = [
    "transition_S8192_R=S",
    "transition_S8192_R256",
    "transition_append_S2048_R128",
    "sequence_S4096_R64",
    "episode_S4096",
    "transition_fifo_S2048",
]


@pytest.mark.parametrize("name", STRESS)
def test_stamp_stress_every_row_carries_its_own_key(name):
    res = check(CASES[name], seconds=2.5, min_redraws=1, max_seconds=300, lap_every=8)
    assert res["rows_checked"] > 0
    assert res["redrawn_items"] > 0, res
    assert res["bad_keys"] == 0, res
    assert res["torn_rows"] == 0, res


def test_stamp_stress_exercises_the_redraw_path():
    """The fifo case always draws the oldest items, which the writer overwrites first: it
    redraws without the forced laps too."""
    res = check(CASES["transition_fifo_S2048"], seconds=2.5, min_redraws=1, max_seconds=30)
    assert res["redrawn_items"] > 0, res
    assert res["bad_keys"] == 0 and res["torn_rows"] == 0, res


# ----------------------------------------------------------------------------- C vs reference
@pytest.mark.parametrize("selector", ["prioritized", "uniform", "fifo"])
@pytest.mark.parametrize("R", [None, 5])
def test_c_scan_equals_the_numpy_reference(storage_factory, monkeypatch, selector, R):
    """One storage, two tables: one scans with the C module, one with the numpy reference;
    after every scan of a random write sequence (ring and record-ring laps, episodes of any
    length, several partitions) they hold the same items, records and selector state."""
    import gearflow.replay.ingest as table_mod  # the scan (C or numpy reference) lives there
    from gearflow.kinds.sequence import Sequence
    from gearflow.replay import Table, TableSpec, make_selector

    if table_mod._hotpath is None:
        pytest.skip("the C module was not built")
    st = storage_factory(TableSpec.parse(STAMP_SPEC), P=3, S=24, R=R)
    kind = Sequence(length=4, period=2)
    cap = 3 * st.items_per_partition
    kw = {"alpha": 0.7} if selector == "prioritized" else {}
    a = Table(st, kind, make_selector(selector, cap, seed=0, **kw))
    b = Table(st, kind, make_selector(selector, cap, seed=0, **kw))
    w = Writer(st, [0, 1, 2])
    rng = np.random.default_rng(7)
    for step in range(400):
        s = int(rng.integers(3))
        w.append(_steps(int(w.positions[s]), 1), streams=[s])
        due = kind.due_on_append(int(w.episode_lengths([s])[0]))
        if due:
            w.create_items(rng.random(len(due)) * (rng.random() > 0.1), due, streams=[s] * len(due))
        if rng.random() < 0.08:
            tail = kind.due_at_end(int(w.episode_lengths([s])[0]))
            if tail:
                w.create_items(rng.random(len(tail)), tail, streams=[s] * len(tail))
            w.end_episode([s])
        if rng.random() < 0.3:
            a.scan()
            with monkeypatch.context() as m:
                m.setattr(table_mod, "_hotpath", None)
                b.scan()
            sa, sb = a.state(), b.state()
            for name in ("slot_live", "ingested", "live_lo", "seen_reserve"):
                np.testing.assert_array_equal(sa[name], sb[name], err_msg=f"{name} after step {step}")
            live = sa["slot_live"]
            for name in ("slot_seq", "slot_start", "slot_length"):
                np.testing.assert_array_equal(sa[name][live], sb[name][live], err_msg=name)
            assert (sa["inserts"], sa["evictions"]) == (sb["inserts"], sb["evictions"])
            assert sorted(a.selector._live_slots[: len(a.selector)]) == sorted(b.selector._live_slots[: len(b.selector)])
            if selector == "prioritized":
                np.testing.assert_allclose(a.selector.tree.leaves, b.selector.tree.leaves, rtol=1e-12)
                assert a.selector.tree.total == pytest.approx(b.selector.tree.total, rel=1e-12)
    assert a.evictions > 0 and a.size > 0
    a.storage = b.storage = None  # the fixture owns the segment


def test_update_priorities_c_path_rejects_bad_values_atomically(make_table):
    table = make_table(STAMP_SPEC, P=1, S=64, kind=Transition(next_columns=()), selector="prioritized")
    w = Writer(table.storage, [0])
    _write(w, 8)
    table.scan()
    leaves = table.selector.tree.leaves.copy()
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"priority must be finite and ≥ 0, got .* at index 1 \(1 bad of 3\)"):
            table.update_priorities(np.array([0, 1, 2]), np.array([1.0, bad, 2.0]))
        np.testing.assert_array_equal(table.selector.tree.leaves, leaves)
    # float32 priorities (a learner's TD errors) and evicted keys
    assert table.update_priorities(np.array([0, 1, 999]), np.array([4.0, 9.0, 1.0], np.float32)) == 2
    np.testing.assert_allclose(table.selector.tree.leaves[:2], np.array([4.0, 9.0]) ** table.selector.alpha)


# ----------------------------------------------------------------------------- gather threads
def test_gather_threads_measures_both_then_keeps_the_cheaper_and_retries():
    from gearflow.replay.table import GatherThreads

    g = GatherThreads(most=2)
    # each count measured WARMUP times in turn; the first (cold) gather of each is not counted
    for i in range(2 * GatherThreads.WARMUP):
        n = g.pick(256)
        assert n == (1, 2)[i % 2] and g.chosen(256) is None
        g.record(256, n, 1.0 if i < 2 else (0.010 if n == 1 else 0.001))
    assert g.chosen(256) == 2
    picks = []
    for _ in range(512):
        picks.append(g.pick(256))
        g.record(256, picks[-1], 0.010 if picks[-1] == 1 else 0.001)
    assert picks.count(2) > 490 and picks.count(1) >= 3  # the other is re-tried now and then
    for _ in range(40):  # the load changed: 2 threads became slow
        g.record(256, 2, 0.050)
    assert g.chosen(256) == 1
    # one thread must be clearly cheaper (MARGIN) to replace torch's own count
    h = GatherThreads(most=2)
    for i in range(2 * GatherThreads.WARMUP):
        n = h.pick(64)
        h.record(64, n, 0.0011 if n == 1 else 0.0012)
    assert h.chosen(64) == 2
    assert g.chosen(64) is None  # per batch size
    assert GatherThreads(3).pick(256) == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="num_threads must be an int ≥ 1 or None"):
            GatherThreads(bad)


def test_table_num_threads_is_the_gathers_thread_count(make_table):
    import torch

    seen = []
    table = make_table(STAMP_SPEC, P=1, S=64, kind=Transition(next_columns=()), num_threads=1)
    real = table.kind.gather

    class Spy(Transition):
        def gather(self, *a):
            seen.append(torch.get_num_threads())
            return real(*a)

    table.kind = Spy(next_columns=())
    w = Writer(table.storage, [0])
    _write(w, 8)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # conftest runs the tests on one thread: make the switch visible
    try:
        table.sample(4)
        assert seen == [1] and torch.get_num_threads() == 2  # restored after the gather
    finally:
        torch.set_num_threads(before)


def test_make_selector_names_a_missing_capacity():
    from gearflow.replay import make_selector

    with pytest.raises(ValueError, match=r"make_selector\('prioritized', capacity\): capacity must be .* got None"):
        make_selector("prioritized", None)
