"""gearflow.replay.table: every selector × item kind, eviction, priorities, rate limits, torn reads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from gearflow.replay import (
    RateLimiter,
    RateLimiterTimeout,
    SharedStorage,
    Table,
    TableSpec,
    Writer,
    make_selector,
)
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay.items import TORCH_DTYPES
from gearflow.replay.selectors import SELECTORS
from gearflow.replay.storage import H_INSERT_LIMIT, H_SAMPLES, PUBLISHED, RESERVE, SHM_DIR

from helpers_replay import SPEC, step_values  # noqa: E402


class Recorder:
    """Writes known steps with a :class:`Writer` and remembers every item it published."""

    def __init__(self, storage, partitions, **kw):
        self.w = Writer(storage, partitions, **kw)
        self.st = storage
        self.items: dict[
            tuple[int, int], tuple[int, int, float]
        ] = {}  # (p, seq) -> start, length, prio

    def append(self, stream):
        p = int(self.w.partitions[stream])
        t = int(self.w.positions[stream])
        v = step_values([p], [t])
        self.w.append(v, streams=[stream])
        return t

    def item(self, stream, num_steps, priority=None):
        p = int(self.w.partitions[stream])
        end = int(self.w.positions[stream])
        start = end - num_steps
        prio = float(1 + (start * 7 + p) % 11) if priority is None else float(priority)
        seq = int(self.st.counters[p, PUBLISHED])
        self.w.create_items([prio], num_steps, streams=stream)
        self.items[(p, seq)] = (start, num_steps, prio)

    def episode(self, stream, length, kind):
        """One episode of ``length`` steps with the items ``kind`` schedules."""
        for _ in range(length):
            self.append(stream)
            L = int(self.w.episode_lengths([stream])[0])
            if isinstance(kind, Transition):
                self.item(stream, min(3, L))
            else:
                for n in kind.due_on_append(L):
                    self.item(stream, n)
        if not isinstance(kind, Transition):
            for n in kind.due_at_end(int(self.w.episode_lengths([stream])[0])):
                self.item(stream, n)
        self.w.end_episode([stream])

    def key(self, p, seq):
        return seq * self.st.num_partitions + p


def check_batch(sample, rec: Recorder, kind, P, batch_size):
    """Every sampled row holds exactly what was written at its item's steps."""
    keys = sample.keys.numpy()
    assert sample.keys.dtype == torch.int64 and keys.shape == (batch_size,)
    assert sample.weights.dtype == torch.float32 and sample.weights.shape == (batch_size,)
    assert sample.probabilities.dtype == torch.float64 and sample.probabilities.shape == (
        batch_size,
    )
    assert (sample.probabilities > 0).all() and (sample.probabilities <= 1).all()
    assert (sample.weights > 0).all() and (sample.weights <= 1).all()
    d = {k: v.numpy() for k, v in sample.data.items()}
    for b, key in enumerate(keys.tolist()):
        p, seq = key % P, key // P
        start, n, _ = rec.items[(p, seq)]
        if isinstance(kind, Transition):
            first, last = step_values([p], [start]), step_values([p], [start + n - 1])
            for c in SPEC.names:
                np.testing.assert_array_equal(d[c][b], first[c][0], err_msg=f"{c} of key {key}")
            for c in kind.next_columns:
                np.testing.assert_array_equal(
                    d["next_" + c][b], last[c][0], err_msg=f"next_{c} of key {key}"
                )
        else:
            T = kind.max_length
            assert d["length"][b] == n
            np.testing.assert_array_equal(d["mask"][b], np.arange(T) < n)
            want = step_values(np.full(n, p), start + np.arange(n))
            for c in SPEC.names:
                np.testing.assert_array_equal(d[c][b][:n], want[c], err_msg=f"{c} of key {key}")
                assert not d[c][b][n:].any(), f"{c} of key {key}: padding not zero"
    return keys


KINDS = {
    "transition": Transition(next_columns=("obs", "frame")),
    "sequence": Sequence(length=4, period=2, burn_in=1),
    "episode": Episode(max_episode_length=6),
}


@pytest.mark.parametrize("kind_name", sorted(KINDS))
@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_sample_grid(make_table, selector, kind_name):
    kind = KINDS[kind_name]
    P = 2
    table = make_table(SPEC, P=P, S=32, kind=kind, selector=selector)
    rec = Recorder(table.storage, [0, 1])
    for length in (7, 12, 1, 5):
        rec.episode(0, length, kind)
    for length in (10, 9, 3):
        rec.episode(1, length, kind)
    n_items = len(rec.items)
    assert table.scan() == n_items and table.size == n_items
    assert table.stats()["replay/inserts"] == n_items and table.stats()["replay/evictions"] == 0
    prios = {rec.key(p, s): v[2] for (p, s), v in rec.items.items()}
    seen = set()
    B = 5
    for _ in range(6):
        sample = table.sample(B)
        keys = check_batch(sample, rec, table.kind, P, B)
        seen.update(keys.tolist())
        probs = sample.probabilities.numpy()
        if selector == "uniform":
            np.testing.assert_allclose(probs, 1 / n_items)
            assert (sample.weights == 1).all()
        elif selector == "prioritized":
            mass = {k: v**0.6 for k, v in prios.items()}
            total = sum(mass.values())
            np.testing.assert_allclose(probs, [mass[k] / total for k in keys.tolist()], rtol=1e-9)
            w = (n_items * probs) ** -0.4
            np.testing.assert_allclose(sample.weights.numpy(), w / w.max(), rtol=1e-6)
        elif selector in ("fifo", "lifo", "max_heap", "min_heap"):
            order = sorted(
                prios, key=lambda k: (k % P, k // P)
            )  # ingest order: partition by partition
            if selector == "fifo":
                assert keys.tolist() == order[:B]
            elif selector == "lifo":
                assert keys.tolist() == order[::-1][:B]
            else:
                sign = -1 if selector == "max_heap" else 1
                best = sorted(order, key=lambda k: sign * prios[k])  # stable: older first on ties
                assert keys.tolist() == best[:B]
            np.testing.assert_array_equal(probs, 1.0)
        elif selector == "top_k":  # k=1000 > items: uniform over all
            np.testing.assert_allclose(probs, 1 / n_items)
    if selector in ("uniform", "prioritized", "top_k"):
        assert {k % P for k in seen} == {0, 1}
    assert table.stats()["replay/samples"] == 6 * B
    assert table.storage.header[H_SAMPLES] == 6 * B


def test_items_after_a_restarted_writer_are_sampled_correctly(make_table):
    table = make_table(SPEC, P=1, S=16, selector="fifo")
    rec = Recorder(table.storage, [0])
    rec.episode(0, 4, KINDS["transition"])
    rec2 = Recorder(table.storage, [0])
    rec2.items = rec.items
    rec2.episode(0, 3, KINDS["transition"])
    s = table.sample(7)
    keys = check_batch(s, rec2, table.kind, 1, 7)
    assert keys.tolist() == list(range(7))
    assert [rec2.items[(0, k)][0] for k in keys.tolist()] == [0, 0, 0, 1, 4, 4, 4]


# ---------------------------------------------------------------------------- eviction
def live_items(table, rec):
    """Items of ``rec`` whose first step has not been overwritten (by the counters now)."""
    S = table.storage.steps_per_partition
    reserve = table.storage.counters[:, RESERVE]
    return {k: v for k, v in rec.items.items() if v[0] >= reserve[k[0]] - S}


def test_eviction_when_the_ring_laps(make_table):
    S = 16
    table = make_table(SPEC, P=2, S=S, R=64, selector="uniform")  # records do not lap here
    rec = Recorder(table.storage, [0, 1])
    kind = KINDS["transition"]
    rec.episode(0, 10, kind)
    assert table.scan() == 10 and table.size == 10
    rec.episode(0, 20, kind)  # partition 0 now at step 30: steps < 14 overwritten
    rec.episode(1, 5, kind)
    assert table.storage.counters[0, RESERVE] == 30
    table.scan()
    live = live_items(table, rec)
    assert {k[0] for k in set(rec.items) - set(live)} == {0}
    assert (
        table.size == len(live) == 14 + 5
    )  # the 2nd episode's items start at 10, 10, 10, 11, 12, 13, 14, ...
    st = table.stats()
    assert st["replay/inserts"] == 35 and st["replay/evictions"] == 35 - len(live)
    for _ in range(20):
        keys = check_batch(table.sample(8), rec, table.kind, 2, 8)
        assert all((k % 2, k // 2) in live for k in keys.tolist())
    # a multi-step item goes as soon as its *first* step is overwritten
    rec.append(0)  # step 30 overwrites step 14: the 3-step item [14, 17) goes
    table.scan()
    assert len(live_items(table, rec)) == len(live) - 1
    assert table.size == len(live) - 1 and table.stats()["replay/evictions"] == 35 - len(live) + 1
    assert table.partition_fill().tolist() == [1.0, 5 / 16]


def test_eviction_when_item_records_lap(make_table):
    # R = 4 item records per partition: only the newest 4 items stay, even though their steps do
    table = make_table(SPEC, P=1, S=32, R=4, selector="fifo")
    rec = Recorder(table.storage, [0])
    rec.episode(0, 3, KINDS["transition"])
    assert table.scan() == 3
    rec.episode(0, 6, KINDS["transition"])  # 6 more items: 9 published, the table lapped
    assert table.scan() == 4
    assert table.size == 4
    # the 3 ingested items whose record slots the newer ones reused; seqs 3, 4 were never ingested
    assert table.stats()["replay/evictions"] == 3 and table.stats()["replay/inserts"] == 7
    keys = check_batch(table.sample(4), rec, table.kind, 1, 4)
    assert keys.tolist() == [5, 6, 7, 8]


def test_evicted_items_are_never_sampled_under_continuous_writes(make_table):
    S = 16
    table = make_table(SPEC, P=1, S=S, selector="prioritized")
    rec = Recorder(table.storage, [0])
    kind = KINDS["transition"]
    for round_ in range(25):
        rec.episode(0, 3, kind)
        s = table.sample(4)
        keys = check_batch(s, rec, table.kind, 1, 4)
        live = live_items(table, rec)
        assert all((0, k) in live for k in keys.tolist())
        assert table.size == len(live)
        assert table.size == table.inserts - table.evictions


# ---------------------------------------------------------------------------- priorities
def _six_items(make_table, **kw):
    table = make_table(SPEC, P=2, S=16, selector="max_heap", **kw)
    rec = Recorder(table.storage, [0, 1])
    for t in range(3):
        rec.append(0)
        rec.append(1)
        rec.item(0, 1, priority=t + 1)  # keys 0, 2, 4
        rec.item(1, 1, priority=t + 4)  # keys 1, 3, 5
    table.scan()
    return table, rec


def test_update_priorities_by_key(make_table):
    table, _ = _six_items(make_table)
    assert table.sample(6).keys.tolist() == [5, 3, 1, 4, 2, 0]
    assert table.update_priorities(torch.tensor([0, 3]), torch.tensor([10.0, 0.5])) == 2
    assert table.sample(6).keys.tolist() == [0, 5, 1, 4, 2, 3]
    assert table.update_priorities(np.array([2, 2]), np.array([1.0, 20.0])) == 2  # last one wins
    assert table.sample(1).keys.tolist() == [2]


def test_update_priorities_ignores_evicted_and_unknown_keys(make_table):
    table, rec = _six_items(make_table)
    # partition 0 laps: its items (keys 0, 2, 4) are evicted
    for _ in range(16):
        rec.append(0)
    table.scan()
    assert table.size == 3
    applied = table.update_priorities(
        [0, 1, 2, 4, 5, 99 * 2, -2], [50.0, 0.1, 50.0, 50.0, 7.0, 50.0, 50.0]
    )
    assert applied == 2  # keys 1 and 5 only
    assert table.sample(3).keys.tolist() == [5, 3, 1]
    # a key whose record slot was reused by a newer item is ignored too
    table2 = make_table(SPEC, P=1, S=16, R=2, selector="max_heap")
    rec2 = Recorder(table2.storage, [0])
    for t in range(3):
        rec2.append(0)
        rec2.item(0, 1, priority=t)
    table2.scan()  # seqs 1, 2 live in slots 1, 0; seq 0 (slot 0) is gone
    assert table2.update_priorities([0], [100.0]) == 0
    assert table2.sample(2).keys.tolist() == [2, 1]


@pytest.mark.parametrize("bad", [float("nan"), -0.5, float("inf")])
def test_update_priorities_rejects_bad_values_atomically(make_table, bad):
    table, _ = _six_items(make_table)
    with pytest.raises(ValueError, match="priority must be finite and ≥ 0"):
        table.update_priorities([0, 1], [100.0, bad])
    assert table.sample(6).keys.tolist() == [5, 3, 1, 4, 2, 0]  # key 0 was not raised to 100


def test_update_priorities_rejects_mismatched_lengths(make_table):
    table, _ = _six_items(make_table)
    with pytest.raises(ValueError, match="2 keys but 3 priorities"):
        table.update_priorities([0, 1], [1.0, 2.0, 3.0])
    assert table.sample(6).keys.tolist() == [5, 3, 1, 4, 2, 0]


def test_prioritized_zero_priority_never_sampled(make_table):
    table = make_table(
        SPEC, P=1, S=16, selector="prioritized", selector_kwargs={"alpha": 1.0, "beta": 1.0}
    )
    rec = Recorder(table.storage, [0])
    for t in range(4):
        rec.append(0)
        rec.item(0, 1, priority=1.0)
    s = table.sample(8)
    table.update_priorities(torch.arange(4), torch.tensor([0.0, 0.0, 3.0, 1.0]))
    for _ in range(10):
        s = table.sample(8)
        assert set(s.keys.tolist()) <= {2, 3}
        np.testing.assert_allclose(
            s.probabilities.numpy(), np.where(s.keys.numpy() == 2, 0.75, 0.25)
        )


# ---------------------------------------------------------------------------- rate limiting
def test_sample_waits_for_min_size(make_table):
    table = make_table(SPEC, P=1, S=16, limiter=RateLimiter(min_size_to_sample=5))
    rec = Recorder(table.storage, [0])
    for _ in range(3):
        rec.append(0)
        rec.item(0, 1)
    t0 = time.monotonic()
    with pytest.raises(RateLimiterTimeout) as info:
        table.sample(1, timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert (
        str(info.value)
        == "sample of 1 blocked for 0.2 s: the table holds 3 items, min_size_to_sample=5"
    )
    assert table.samples == 0 and table.storage.header[H_SAMPLES] == 0

    def late_writer():
        time.sleep(0.15)
        for _ in range(2):
            rec.append(0)
            rec.item(0, 1)

    th = threading.Thread(target=late_writer)
    th.start()
    try:
        t0 = time.monotonic()
        s = table.sample(2, timeout_s=10)
        assert time.monotonic() - t0 >= 0.1
    finally:
        th.join()
    assert table.size == 5
    check_batch(s, rec, table.kind, 1, 2)


def test_sampler_blocks_by_samples_per_insert(make_table):
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=2.0, error_buffer=2.0)
    table = make_table(SPEC, P=1, S=16, limiter=lim)
    hdr = table.storage.header
    assert hdr[H_INSERT_LIMIT] == 2  # max_diff = 4: two items before any sample
    rec = Recorder(table.storage, [0], insert_timeout_s=0.1)
    for _ in range(3):
        rec.append(0)
    rec.item(0, 1)
    rec.item(0, 1)
    with pytest.raises(RateLimiterTimeout, match="rate limiter"):
        rec.item(0, 1)
    table.sample(2)
    assert hdr[H_INSERT_LIMIT] == 3 and hdr[H_SAMPLES] == 2
    table.sample(2)
    assert hdr[H_INSERT_LIMIT] == 4 and hdr[H_SAMPLES] == 4
    with pytest.raises(RateLimiterTimeout) as info:
        table.sample(1, timeout_s=0.1)
    assert "samples_per_insert=2.0: 4 items sampled after 2 inserted" in str(info.value)
    assert table.samples == 4 and hdr[H_INSERT_LIMIT] == 4  # the failed sample counted nothing
    rec.item(0, 1)  # allowed now
    s = table.sample(2)
    check_batch(s, rec, table.kind, 1, 2)
    assert hdr[H_INSERT_LIMIT] == 5 and table.stats()["replay/samples"] == 6


# ---------------------------------------------------------------------------- torn reads
class OverwritingTable(Table):
    """Runs ``during_gather`` once, inside the first gather (a writer racing the copy)."""

    during_gather = None

    def _gather(self, slots, rec, out, only=None, tensors=None):
        if self.during_gather is not None:
            fn, self.during_gather = self.during_gather, None
            fn()
        return super()._gather(slots, rec, out, only, tensors)


def _torn_setup(make_table, selector, kind):
    S = 16
    table = make_table(SPEC, P=1, S=S, selector=selector, kind=kind, table_cls=OverwritingTable)
    rec = Recorder(table.storage, [0])
    for _ in range(S):
        rec.append(0)
        rec.item(0, min(rec.w.positions[0], 3))  # starts 0, 0, 0, 1, 2, ..., 13
    table.scan()
    assert table.size == S

    def overwrite():  # steps 16..21 overwrite steps 0..5; the table does not scan
        for _ in range(6):
            rec.append(0)

    table.during_gather = overwrite
    return table, rec


def test_torn_items_are_resampled_fifo(make_table):
    kind = KINDS["transition"]
    table, rec = _torn_setup(make_table, "fifo", kind)
    s = table.sample(4)
    keys = check_batch(s, rec, table.kind, 1, 4)
    # items 0..7 start before step 6. fifo draws 0..3: torn; the table evicts them, rescans
    # (evicting 4..7 too, also overwritten) and redraws 8..11: intact
    assert keys.tolist() == [8, 9, 10, 11]
    assert table.stats()["replay/torn_resampled"] == 4
    assert table.stats()["replay/evictions"] == 8 and table.size == 8
    np.testing.assert_array_equal(s.weights.numpy(), 1.0)


@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_torn_items_are_resampled_uniform(make_table, kind_name):
    kind = KINDS[kind_name]
    table, rec = _torn_setup(make_table, "uniform", kind)
    s = table.sample(32)
    keys = check_batch(s, rec, table.kind, 1, 32)
    assert all(rec.items[(0, k)][0] >= 6 for k in keys.tolist())
    assert table.torn > 0 and table.stats()["replay/torn_resampled"] == table.torn
    # the torn items are gone from the table: later samples never see them
    table.scan()
    for _ in range(5):
        keys = check_batch(table.sample(16), rec, table.kind, 1, 16)
        assert all(rec.items[(0, k)][0] >= 6 for k in keys.tolist())


def test_torn_items_are_resampled_prioritized(make_table):
    kind = KINDS["transition"]
    table, rec = _torn_setup(make_table, "prioritized", kind)
    s = table.sample(16)
    check_batch(s, rec, table.kind, 1, 16)
    assert table.torn > 0
    assert s.weights.max() == 1.0


def test_torn_items_of_a_grouped_draw_are_resampled_per_batch(make_table):
    """sample_batches: the torn rows of any of its batches are redrawn; each batch's weights
    keep their own maximum (reweighed per batch of 8, not over the 24 rows)."""
    kind = KINDS["transition"]
    table, rec = _torn_setup(make_table, "prioritized", kind)
    batches = table.sample_batches(8, 3)
    assert table.torn > 0 and len(batches) == 3
    for s in batches:
        keys = check_batch(s, rec, table.kind, 1, 8)
        assert all(rec.items[(0, k)][0] >= 6 for k in keys.tolist())
        assert s.weights.max() == 1.0


def _weights_by_priority(sample, rec):
    """{priority: [weights of the batch's items with that priority]}"""
    out: dict[float, list[float]] = {}
    for k, w in zip(sample.keys.tolist(), sample.weights.tolist()):
        out.setdefault(rec.items[(0, k)][2], []).append(w)
    return out


def test_prioritized_weights_are_the_is_formula(make_table):
    # alpha 0.5, beta 1: masses 1, 2, 4 (priorities 1, 4, 16), P = 1/7, 2/7, 4/7, N = 3;
    # (N P)^-1 = 7/3, 7/6, 7/12, over the batch max 7/3: weights 1, 1/2, 1/4
    table = make_table(SPEC, P=1, S=16, selector="prioritized",
                       selector_kwargs={"alpha": 0.5, "beta": 1.0})  # fmt: skip
    rec = Recorder(table.storage, [0])
    for prio in (1.0, 4.0, 16.0):
        rec.append(0)
        rec.item(0, 1, priority=prio)
    s = table.sample(16)  # stratified: mass 1/7 > 2/16, so the lightest item is in the batch
    by = _weights_by_priority(s, rec)
    assert set(by) == {1.0, 4.0, 16.0}
    for prio, want_w, want_p in [(1.0, 1.0, 1 / 7), (4.0, 0.5, 2 / 7), (16.0, 0.25, 4 / 7)]:
        np.testing.assert_allclose(by[prio], want_w, rtol=1e-6)
    probs = dict(zip(s.keys.tolist(), s.probabilities.tolist()))
    np.testing.assert_allclose([probs[k] for k in (0, 1, 2)], [1 / 7, 2 / 7, 4 / 7], rtol=1e-12)


def test_torn_items_are_resampled_prioritized_weights_renormalised(make_table):
    # items 0..7 (starts 0..5) are torn by the overwrite, priority 1 (mass 1); items 8..15 stay,
    # priorities 4, 16, 4, 16, ... (masses 2, 4). alpha 0.5, beta 1. The batch holds only
    # items 8..15, all live in the same table: w = (N P)^-1 / max = sqrt(4 / priority),
    # i.e. 1 for priority 4 and 1/2 for priority 16, whichever draw an item came from.
    S = 16
    table = make_table(SPEC, P=1, S=S, selector="prioritized", kind=KINDS["transition"],
                       table_cls=OverwritingTable, selector_kwargs={"alpha": 0.5, "beta": 1.0})  # fmt: skip
    rec = Recorder(table.storage, [0])
    for i in range(S):
        rec.append(0)
        rec.item(0, min(rec.w.positions[0], 3), priority=1.0 if i < 8 else (4.0, 16.0)[i % 2])
    table.scan()
    table.during_gather = lambda: [rec.append(0) for _ in range(6)]  # steps 16..21 over 0..5
    s = table.sample(16)
    check_batch(s, rec, table.kind, 1, 16)
    assert table.torn > 0 and table.size == 8
    by = _weights_by_priority(s, rec)
    assert set(by) == {4.0, 16.0}
    np.testing.assert_allclose(by[4.0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(by[16.0], 0.5, rtol=1e-6)


class LappingTable(Table):
    """A sampler slowed by load: while it copies more than one row, the writer laps the whole
    ring (and makes items of the new steps), so every row of such a gather is torn; a
    one-row gather is left alone."""

    lap = None

    def _gather(self, slots, rec, out, only=None, tensors=None):
        if self.lap is not None and (slots.size if only is None else only.size) > 1:
            self.lap()
        return super()._gather(slots, rec, out, only, tensors)


@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_a_sampler_lapped_during_every_redraw_of_many_rows_still_completes_its_batch(make_table, selector):
    # redrawing all torn rows at once would lose them all again, round after round, until the
    # sample timed out; fewer rows a round after a round that lost them all wins
    S = 16
    table = make_table(SPEC, P=1, S=S, selector=selector, kind=KINDS["transition"], table_cls=LappingTable)
    rec = Recorder(table.storage, [0])

    def lap():
        for _ in range(S):
            rec.append(0)
            rec.item(0, 1)

    lap()
    table.scan()
    table.lap = lap
    s = table.sample(8, timeout_s=5)
    check_batch(s, rec, table.kind, 1, 8)  # every row what its item's steps held when copied
    assert table.torn >= 8 and table.stats()["replay/torn_resampled"] == table.torn


# ---------------------------------------------------------------------------- buffers & misc
def test_buffers_rotate_and_batches_are_copies(make_table):
    table = make_table(SPEC, P=1, S=16, selector="fifo", num_buffers=3)
    rec = Recorder(table.storage, [0])
    for _ in range(4):
        rec.append(0)
        rec.item(0, 1)
    batches = [table.sample(2) for _ in range(4)]
    ptrs = [b.data["obs"].data_ptr() for b in batches]
    assert len(set(ptrs[:3])) == 3 and ptrs[3] == ptrs[0]
    assert all(
        b.data["frame"].data_ptr() != batches[0].data["frame"].data_ptr() for b in batches[1:3]
    )
    # a new batch size gets fresh buffers
    b3 = table.sample(3)
    assert b3.data["obs"].shape == (3, 3) and b3.data["obs"].data_ptr() not in ptrs
    # batch 1 is still valid, and is a copy: overwriting the ring leaves it be
    before = batches[1].data["obs"].clone()
    for _ in range(16):
        rec.append(0)
    assert torch.equal(batches[1].data["obs"], before)
    shm_ptrs = {t.data_ptr() for t in table.storage.tensors.values()}
    assert not shm_ptrs & set(ptrs)


def test_table_validation_and_stats(make_table):
    with pytest.raises(ValueError, match="next column 'reward' is not in the table spec"):
        make_table(SPEC, kind=Transition(next_columns=("reward",)))
    table = make_table(SPEC, P=2, S=8)
    with pytest.raises(ValueError, match="batch_size must be ≥ 1, got 0"):
        table.sample(0)
    rec = Recorder(table.storage, [0, 1])
    for _ in range(4):
        rec.append(0)
    rec.item(0, 2)
    table.sample(3)
    st = table.stats()
    assert st["replay/size"] == 1 and st["replay/inserts"] == 1 and st["replay/samples"] == 3
    assert st["replay/steps"] == 4 and st["replay/fill"] == 0.25 and st["replay/fill_min"] == 0.0
    assert st["replay/bytes"] == table.storage.nbytes and st["replay/evictions"] == 0


def test_close_unlinks_segment():
    storage = SharedStorage.create(SPEC, 1, 4)
    with Table(storage, Transition(), make_selector("uniform", 4)):
        other = SharedStorage.attach(storage.name)
        other.close()
    assert not (SHM_DIR / storage.name).exists()
    with pytest.raises(FileNotFoundError):
        SharedStorage.attach(storage.name)


# ---------------------------------------------------------------------------- every supported dtype
ZOO_TYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16",
             "float32", "float64")  # fmt: skip
ZOO = TableSpec.parse(
    {
        **{f"c_{d}": f"{d}[2]" for d in ZOO_TYPES},
        "s_uint16": "uint16",
        "s_uint64": "uint64",
        "s_bool": "bool",
    }
)


def zoo_values(t):
    t = np.asarray(t, np.int64)
    out = {}
    for c in ZOO:
        if not c.shape:  # scalar columns (1-D storage)
            out[c.name] = (
                (t % 2 == 1)
                if c.dtype == np.bool_
                else np.asarray(np.iinfo(c.dtype).max, c.dtype) - t.astype(c.dtype)
            )
            continue
        if c.dtype == np.bool_:
            v = np.stack([t % 2 == 0, t % 3 == 0], -1)
        else:
            big = (
                np.iinfo(c.dtype).max if c.dtype.kind == "u" else 0
            )  # top bit set for unsigned types
            v = np.stack([t + 1, np.full_like(t, 7)], -1).astype(c.dtype)
            if big:
                v[:, 1] = big - t.astype(c.dtype)
        out[c.name] = v.astype(c.dtype)
    return out


@pytest.mark.parametrize("kind_name", sorted(KINDS))
def test_every_supported_dtype_is_sampled_bit_exact(make_table, kind_name):
    kind = (
        Transition(next_columns=tuple(ZOO.names)) if kind_name == "transition" else KINDS[kind_name]
    )
    table = make_table(ZOO, P=1, S=16, kind=kind, selector="fifo", table_cls=OverwritingTable)
    w = Writer(table.storage, [0])
    starts = []
    for t in range(16):
        w.append(zoo_values([t]))
        if t % 2 == 1:
            w.create_items([1.0], num_steps=2, streams=0)
            starts.append(t - 1)
    table.scan()
    # the torn path too: items 0..2 (steps 0..5) are overwritten during the first gather
    table.during_gather = lambda: [w.append(zoo_values([16 + i])) for i in range(6)]
    s = table.sample(4)
    assert table.torn > 0
    seqs = s.keys.tolist()
    assert seqs == [3, 4, 5, 3]  # fifo: torn 0, 1, 2 redrawn as the oldest live ones
    for b, seq in enumerate(seqs):
        start = starts[seq]
        want = zoo_values([start, start + 1])
        for c in ZOO:
            got = s.data[c.name][b]
            assert got.dtype == TORCH_DTYPES[c.dtype]
            if kind_name == "transition":
                np.testing.assert_array_equal(got.numpy(), want[c.name][0], err_msg=c.name)
                np.testing.assert_array_equal(s.data["next_" + c.name][b].numpy(), want[c.name][1])
            else:
                np.testing.assert_array_equal(got[:2].numpy(), want[c.name], err_msg=c.name)
                assert not got[2:].numpy().any()


def test_item_longer_than_the_sequence_window_is_cut_to_it(make_table):
    from gearflow.replay import Writer
    from gearflow.kinds.sequence import Sequence

    table = make_table(spec={"obs": "float32[1]"}, P=1, S=32, kind=Sequence(length=4, period=4))
    writer = Writer(table.storage, [0])
    for t in range(6):
        writer.append({"obs": np.array([[t]], np.float32)})
    writer.create_items([1.0], 6)  # six steps into a four-step window
    batch = table.sample(1)
    assert batch.data["length"].tolist() == [4]
    assert batch.data["mask"].tolist() == [[True] * 4]
    assert batch.data["obs"][0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
