"""gearflow.replay.writer: rows, counters (seqlock), item records, resume, rate limiting."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gearflow.replay import RateLimiter, RateLimiterTimeout, TrajectoryWriter, Writer
from gearflow.replay.storage import (
    COMMIT,
    EPISODES,
    H_INSERT_LIMIT,
    HEARTBEAT_NS,
    PUBLISHED,
    RESERVE,
    WRITER_PID,
    SharedStorage,
)

from helpers_replay import SPEC, step_values  # noqa: E402


def expect_rows(st: SharedStorage, p: int, steps):
    """Assert the storage rows of absolute ``steps`` of partition ``p`` hold what was written."""
    steps = np.asarray(steps)
    rows = st.rows(p, steps)
    want = step_values(np.full(steps.shape, p), steps)
    for name, arr in want.items():
        np.testing.assert_array_equal(st.columns[name][rows], arr, err_msg=f"column {name}")


def counters(st, p):
    return tuple(int(x) for x in st.counters[p, [RESERVE, COMMIT, PUBLISHED]])


@pytest.fixture
def st(storage_factory):
    return storage_factory(SPEC, P=3, S=8)


# ---------------------------------------------------------------------------- construction
def test_writer_rejects_bad_partitions(st):
    with pytest.raises(ValueError, match="at least one partition"):
        Writer(st, [])
    with pytest.raises(ValueError, match=r"partitions must be distinct, got \[1, 1\]"):
        Writer(st, [1, 1])
    with pytest.raises(ValueError, match=r"partitions \[0, 3\] out of range \[0, 3\)"):
        Writer(st, [0, 3])
    w = Writer(st, [2, 0])
    assert w.num_streams == 2 and w.positions.tolist() == [0, 0]
    assert st.counters[[2, 0], WRITER_PID].tolist() == [__import__("os").getpid()] * 2
    with pytest.raises(ValueError, match=r"streams \[2\] out of range \[0, 2\)"):
        w.append(step_values([0], [0]), streams=[2])


# ---------------------------------------------------------------------------- append / extend
def test_append_writes_rows_and_advances_counters(st):
    w = Writer(st, [2, 0])  # stream 0 → partition 2, stream 1 → partition 0
    for t in range(11):  # wraps the 8-step ring
        pos = w.append(step_values([2, 0], [t, t]))
        assert pos.tolist() == [t, t]
        assert counters(st, 2) == (t + 1, t + 1, 0) and counters(st, 0) == (t + 1, t + 1, 0)
    expect_rows(st, 2, range(3, 11))
    expect_rows(st, 0, range(3, 11))
    assert (
        counters(st, 1) == (0, 0, 0) and not st.columns["obs"][8:16].any()
    )  # partition 1 untouched
    # a subset of streams
    pos = w.append(step_values([0], [11]), streams=[1])
    assert pos.tolist() == [11] and w.positions.tolist() == [11, 12]
    assert counters(st, 0)[:2] == (12, 12) and counters(st, 2)[:2] == (11, 11)
    expect_rows(st, 0, range(4, 12))
    with pytest.raises(ValueError, match="streams must be distinct"):
        w.append(step_values([0, 0], [1, 1]), streams=[1, 1])


def test_extend_writes_rows_across_the_ring_end(st):
    w = Writer(st, [1])
    assert w.extend({k: v for k, v in step_values(np.ones(5, int), np.arange(5)).items()}) == 0
    assert counters(st, 1) == (5, 5, 0)
    expect_rows(st, 1, range(5))
    # 6 more steps: rows 5,6,7 then wrap to 0,1,2
    assert w.extend(step_values(np.ones(6, int), np.arange(5, 11))) == 5
    assert counters(st, 1) == (11, 11, 0) and w.positions.tolist() == [11]
    expect_rows(st, 1, range(3, 11))
    assert st.columns["action"][8:16].tolist() == [80 + 1, 90 + 1, 100 + 1, 31, 41, 51, 61, 71]
    # a whole ring in one go, starting mid-ring
    assert w.extend(step_values(np.ones(8, int), np.arange(11, 19))) == 11
    expect_rows(st, 1, range(11, 19))
    with pytest.raises(ValueError, match="extend of 9 steps exceeds the partition's 8 steps"):
        w.extend(step_values(np.ones(9, int), np.arange(19, 28)))
    assert counters(st, 1) == (19, 19, 0)
    assert not st.columns["obs"][:8].any() and not st.columns["obs"][16:].any()


def test_bad_append_or_extend_changes_nothing(st):
    w = Writer(st, [0, 1])
    w.append(step_values([0, 1], [0, 0]))
    before = {k: v.copy() for k, v in st.columns.items()}
    cbefore = st.counters.copy()
    bad = step_values([0, 1], [1, 1])
    bad["obs"] = bad["obs"].astype(np.float64)
    with pytest.raises(ValueError, match="column 'obs': expected dtype float32, got float64"):
        w.append(bad)
    bad = step_values([0, 1], [1, 1])
    bad["frame"] = np.ones((2, 2, 4), np.uint8) * 255
    bad["action"] = np.zeros(3, np.int64)  # wrong length, validated before any column is written
    with pytest.raises(ValueError, match=r"column 'action': expected shape \[2\], got \[3\]"):
        w.append(bad)
    ext = step_values(np.zeros(4, int), np.arange(1, 5))
    del ext["done"]
    with pytest.raises(ValueError, match=r"missing column\(s\) \['done'\]"):
        w.extend(ext)
    np.testing.assert_array_equal(st.counters, cbefore)
    for k, v in before.items():
        np.testing.assert_array_equal(st.columns[k], v)
    assert w.positions.tolist() == [1, 1]
    w.append(step_values([0, 1], [1, 1]))  # and the writer carries on where it was
    expect_rows(st, 0, [0, 1])
    assert counters(st, 0) == (2, 2, 0)


# ---------------------------------------------------------------------------- items
def records(st, p, seqs):
    R = st.items_per_partition
    slot = np.asarray(seqs) % R
    return list(
        zip(
            st.item_start[p, slot].tolist(),
            st.item_length[p, slot].tolist(),
            st.item_priority[p, slot].tolist(),
        )
    )


def test_create_items_one_stream_int(st):
    w = Writer(st, [0, 2])
    w.extend(step_values(np.full(6, 2), np.arange(6)), stream=1)
    # many items of one stream: ends given, in order
    w.create_items([1.0, 2.0, 0.5], num_steps=[2, 3, 1], streams=1, ends=[3, 5, 6])
    assert counters(st, 2) == (6, 6, 3) and counters(st, 0) == (0, 0, 0)
    assert records(st, 2, range(3)) == [(1, 2, 1.0), (2, 3, 2.0), (5, 1, 0.5)]
    # default ends: the last num_steps steps
    w.create_items([3.0], num_steps=1, streams=1)
    assert records(st, 2, [3]) == [(5, 1, 3.0)]
    assert counters(st, 2)[2] == 4


def test_create_items_several_streams(st):
    w = Writer(st, [0, 1, 2])
    for t in range(5):
        w.append(step_values([0, 1, 2], [t] * 3))
    w.create_items([1.0, 2.0, 3.0], num_steps=[3, 2, 5])  # one per stream, ending now
    assert [counters(st, p)[2] for p in range(3)] == [1, 1, 1]
    assert records(st, 0, [0]) == [(2, 3, 1.0)]
    assert records(st, 1, [0]) == [(3, 2, 2.0)]
    assert records(st, 2, [0]) == [(0, 5, 3.0)]
    # several items per stream, given out of order within the call: grouped and sorted
    w.create_items(
        [7.0, 5.0, 6.0, 9.0], num_steps=[1, 1, 1, 2], streams=[2, 0, 2, 0], ends=[5, 5, 4, 5]
    )
    assert [counters(st, p)[2] for p in range(3)] == [3, 1, 3]
    assert records(st, 0, [1, 2]) == [(3, 2, 9.0), (4, 1, 5.0)]
    assert records(st, 2, [1, 2]) == [(3, 1, 6.0), (4, 1, 7.0)]
    with pytest.raises(ValueError, match=r"2 priorities for 3 streams \(pass streams=\)"):
        w.create_items([1.0, 1.0], num_steps=1)
    with pytest.raises(ValueError, match="2 priorities for 1 streams"):
        w.create_items([1.0, 1.0], num_steps=1, streams=[0])


def test_create_items_ring_of_records_wraps(storage_factory):
    st = storage_factory(SPEC, P=1, S=8, R=3)
    w = Writer(st, [0])
    w.extend(step_values(np.zeros(8, int), np.arange(8)))
    for t in range(1, 6):
        w.create_items([float(t)], num_steps=1, streams=0, ends=[t])
    assert counters(st, 0)[2] == 5
    assert records(st, 0, [2, 3, 4]) == [(2, 1, 3.0), (3, 1, 4.0), (4, 1, 5.0)]
    with pytest.raises(ValueError, match="more than 3 items for one stream in one call"):
        w.create_items(np.ones(4), num_steps=1, streams=0, ends=[5, 6, 7, 8])
    with pytest.raises(ValueError, match="more than 3 items for one stream in one call"):
        w.create_items(np.ones(4), num_steps=1, streams=[0, 0, 0, 0], ends=[5, 6, 7, 8])
    assert counters(st, 0)[2] == 5


def test_items_never_cross_an_episode_boundary(st):
    w = Writer(st, [0, 1])
    for t in range(3):
        w.append(step_values([0, 1], [t, t]))
    w.end_episode(streams=[0])
    assert st.counters[:2, EPISODES].tolist() == [1, 0]
    for t in range(3, 5):
        w.append(step_values([0, 1], [t, t]))
    assert w.episode_lengths().tolist() == [2, 5]
    w.create_items([1.0, 1.0], num_steps=[2, 5])  # exactly the episode: fine
    with pytest.raises(ValueError) as info:
        w.create_items([1.0, 1.0], num_steps=[3, 3])
    assert (
        "item of 3 steps crosses an episode boundary: stream 0 has 2 steps in its current episode"
        in str(info.value)
    )
    with pytest.raises(ValueError, match="episode boundary"):
        w.create_items([1.0], num_steps=3, streams=0, ends=[5])
    assert [counters(st, p)[2] for p in range(2)] == [1, 1]


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_priority_rejected(st, bad):
    w = Writer(st, [0, 1])
    w.append(step_values([0, 1], [0, 0]))
    with pytest.raises(ValueError, match="priority must be finite and ≥ 0") as info:
        w.create_items([1.0, bad], num_steps=1)
    assert "1 bad of 2" in str(info.value)
    with pytest.raises(ValueError, match="priority"):
        w.create_items([bad], num_steps=1, streams=0)
    assert st.counters[:, PUBLISHED].tolist() == [0, 0, 0]
    w.create_items([0.0, 1.0], num_steps=1)  # zero is a valid priority
    assert st.counters[:, PUBLISHED].tolist() == [1, 1, 0]


def test_item_length_and_end_checks(st):
    w = Writer(st, [0])
    w.extend(step_values(np.zeros(8, int), np.arange(8)))
    with pytest.raises(ValueError, match=r"num_steps must be in \[1, 8\], got 0"):
        w.create_items([1.0], num_steps=0, streams=0)
    with pytest.raises(ValueError, match=r"num_steps must be in \[1, 8\], got 9"):
        w.create_items([1.0], num_steps=9, streams=0)
    with pytest.raises(ValueError, match="an item ends after the last appended step"):
        w.create_items([1.0], num_steps=1, streams=0, ends=[9])
    assert counters(st, 0)[2] == 0


def test_out_of_order_items_rejected(st):
    w = Writer(st, [0, 1])
    for t in range(6):
        w.append(step_values([0, 1], [t, t]))
    w.create_items([1.0], num_steps=2, streams=0, ends=[5])  # starts at 3
    with pytest.raises(
        ValueError, match="items of a stream must be created in order of their first step"
    ):
        w.create_items([1.0], num_steps=1, streams=0, ends=[3])  # starts at 2 < 3
    with pytest.raises(ValueError, match="in order of their first step"):
        w.create_items(
            [1.0, 1.0], num_steps=1, streams=0, ends=[6, 5]
        )  # decreasing within the call
    with pytest.raises(ValueError, match="in order of their first step"):
        w.create_items(
            [1.0, 1.0], num_steps=[1, 4], streams=[1, 0], ends=[6, 6]
        )  # stream 0 starts at 2
    assert counters(st, 0)[2] == 1 and counters(st, 1)[2] == 0
    w.create_items([1.0], num_steps=3, streams=0)  # same first step as the last item: fine
    assert records(st, 0, [1]) == [(3, 3, 1.0)]


# ---------------------------------------------------------------------------- resume
def test_second_writer_resumes_after_the_first(st):
    w = Writer(st, [0, 1])
    for t in range(5):
        w.append(step_values([0, 1], [t, t]))
    w.create_items([1.0, 1.0], num_steps=2)
    w2 = Writer(st, [1, 0])  # same partitions, other order
    assert w2.positions.tolist() == [5, 5]
    assert w2.episode_lengths().tolist() == [0, 0]
    with pytest.raises(
        ValueError, match="episode boundary"
    ):  # cannot reach into the old writer's steps
        w2.create_items([1.0], num_steps=1, streams=0)
    w2.append(step_values([1, 0], [5, 5]))
    w2.create_items([2.0], num_steps=1, streams=1)
    assert counters(st, 0) == (6, 6, 2) and counters(st, 1) == (6, 6, 1)
    assert records(st, 0, [0, 1]) == [(3, 2, 1.0), (5, 1, 2.0)]
    expect_rows(st, 0, range(6))


def test_second_writer_continues_from_reserve_after_a_torn_write(st):
    w = Writer(st, [0])
    w.extend(step_values(np.zeros(3, int), np.arange(3)))
    st.counters[0, RESERVE] = 5  # a writer that died mid-write of steps 3, 4
    w2 = Writer(st, [0])
    assert w2.positions.tolist() == [5]
    assert counters(st, 0) == (5, 5, 0)  # COMMIT catches up: the torn steps are skipped, not reused
    assert w2.extend(step_values(np.zeros(2, int), np.arange(5, 7))) == 5
    expect_rows(st, 0, [0, 1, 2, 5, 6])
    assert counters(st, 0) == (7, 7, 0)


# ---------------------------------------------------------------------------- TrajectoryWriter
def test_trajectory_writer(st):
    tw = TrajectoryWriter(st, partition=1)
    for t in range(4):
        v = step_values([1], [t])
        step = {"obs": v["obs"][0].tolist(), "frame": v["frame"][0], "action": int(v["action"][0]),
                "done": bool(v["done"][0])}  # fmt: skip
        assert tw.append(step) == t
    assert tw.position == 4 and tw.episode_length == 4
    expect_rows(st, 1, range(4))
    tw.create_item(priority=1.5, num_steps=4)
    assert records(st, 1, [0]) == [(0, 4, 1.5)]
    tw.end_episode()
    assert tw.episode_length == 0 and st.counters[1, EPISODES] == 1
    with pytest.raises(ValueError, match="episode boundary"):
        tw.create_item(priority=1.0, num_steps=1)
    assert tw.extend(step_values(np.ones(3, int), np.arange(4, 7))) == 4
    tw.create_item(priority=0.25, num_steps=2)
    assert records(st, 1, [1]) == [(5, 2, 0.25)]
    assert counters(st, 1) == (7, 7, 2)
    with pytest.raises(ValueError, match=r"column 'obs': expected shape \[3\], got \[2\]"):
        tw.append(
            {"obs": [1.0, 2.0], "frame": np.zeros((2, 4), np.uint8), "action": 0, "done": False}
        )
    assert counters(st, 1) == (7, 7, 2)
    t0 = time.monotonic_ns()
    tw.flush()
    assert st.counters[1, HEARTBEAT_NS] >= t0 and st.counters[0, HEARTBEAT_NS] == 0


# ---------------------------------------------------------------------------- rate limiting
def test_writer_blocks_on_rate_limiter_and_times_out(make_table):
    # spi=1, error_buffer=1, min size 1: max_diff = 2, so 2 items may go in before any sample
    table = make_table(
        SPEC, P=2, S=8, limiter=RateLimiter(1, samples_per_insert=1.0, error_buffer=1.0)
    )
    st = table.storage
    assert st.header[H_INSERT_LIMIT] == 2
    w = Writer(SharedStorage.attach(st.name), [0, 1], insert_timeout_s=0.2)
    try:
        for t in range(3):
            w.append(step_values([0, 1], [t, t]))
        w.create_items([1.0, 1.0], num_steps=1)
        assert st.counters[:, PUBLISHED].tolist() == [1, 1]
        slot_before = (st.item_start.copy(), st.item_priority.copy())
        t0 = time.monotonic()
        with pytest.raises(RateLimiterTimeout) as info:
            w.create_items([5.0], num_steps=1, streams=0)
        elapsed = time.monotonic() - t0
        # it waited its timeout; the upper bound only tells "timed out" from "hung" (a loaded
        # machine may deschedule the writer for seconds)
        assert 0.2 <= elapsed < 30
        msg = str(info.value)
        assert (
            "blocked for 0.2 s by the rate limiter" in msg
            and "2 inserted, 0 sampled, limit 2" in msg
        )
        assert isinstance(info.value, TimeoutError)
        assert st.counters[:, PUBLISHED].tolist() == [1, 1]  # nothing published
        np.testing.assert_array_equal(st.item_start, slot_before[0])
        np.testing.assert_array_equal(st.item_priority, slot_before[1])
        # sampling raises the limit: now the insert goes through at once
        table.sample(2)
        assert st.header[H_INSERT_LIMIT] == 4
        w.create_items([5.0], num_steps=1, streams=0)
        assert st.counters[:, PUBLISHED].tolist() == [2, 1]
        assert records(st, 0, [1]) == [(2, 1, 5.0)]
    finally:
        w.storage.close()


def test_a_writer_waiting_for_a_large_room_is_not_starved_by_one_taking_small_pieces(make_table):
    """Writer A publishes one item at a time as fast as room appears; writer B needs room for 8
    at once (16 envs ending their episodes together flush many items). Each sample makes room
    for one item. Before, A took every bit of room as it appeared and B waited for ever (one
    actor of a HalfCheetah run wrote nothing for 660 s); now A waits behind B, who waited first."""
    import threading

    from gearflow.replay.inserts import InsertAborted
    from gearflow.replay.storage import WAIT_SINCE_NS

    # spi 1, error buffer 8: the limit is samples + 9; the room can reach 15 with nothing inserted
    table = make_table(SPEC, P=2, S=64, R=64, limiter=RateLimiter(1, samples_per_insert=1.0, error_buffer=8.0))
    st = table.storage
    stop, b_done, errors = threading.Event(), threading.Event(), []
    a = Writer(SharedStorage.attach(st.name), [0], insert_timeout_s=120)
    b = Writer(SharedStorage.attach(st.name), [1], insert_timeout_s=120)
    a.abort = stop.is_set
    room = lambda: int(st.header[H_INSERT_LIMIT]) - int(st.counters[:, PUBLISHED].sum())  # noqa: E731

    def run_a():
        try:
            t = 0
            while not stop.is_set():
                a.append(step_values([0], [t]))
                a.create_items([1.0], num_steps=1)
                t += 1
        except InsertAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def run_b():
        try:
            for t in range(8):
                b.append(step_values([0], [t]))
            b.create_items(np.ones(8), num_steps=1, streams=np.zeros(8, np.int64), ends=np.arange(1, 9))
            b_done.set()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def wait(cond):
        deadline = time.monotonic() + 60  # a hang guard only: every wait ends on progress
        while not cond():
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(1e-4)

    ta, tb = threading.Thread(target=run_a), threading.Thread(target=run_b)
    try:
        ta.start()
        wait(lambda: room() == 0)  # A took the first room
        tb.start()
        wait(lambda: st.counters[1, COMMIT] == 8)  # B wrote its steps: its items wait for room next
        samples = 0
        while not b_done.is_set() and samples < 400:
            # sample once A has taken the room, or once A waits (behind B)
            wait(lambda: room() == 0 or st.counters[0, WAIT_SINCE_NS] != 0 or b_done.is_set())
            table.sample(1)
            samples += 1
        assert b_done.is_set(), f"B got no room for its 8 items in {samples} samples"
    finally:
        stop.set()
        ta.join(30)
        tb.join(30)
        a.storage.close()
        b.storage.close()
    assert not errors, errors
    assert st.counters[1, PUBLISHED] == 8 and st.counters[:, WAIT_SINCE_NS].tolist() == [0, 0]


def test_a_writer_that_died_waiting_does_not_hold_the_others(make_table):
    """A waiter's stamp left behind (its process killed while it waited, heartbeat stale) is not
    waited for: a writer with room publishes at once, and the stale stamp is cleared."""
    from gearflow.replay.storage import WAIT_SINCE_NS

    table = make_table(SPEC, P=2, S=16, limiter=RateLimiter(1, samples_per_insert=1.0, error_buffer=8.0))
    st = table.storage
    st.counters[1, WAIT_SINCE_NS] = 1  # waited since long ago...
    st.counters[1, HEARTBEAT_NS] = time.monotonic_ns() - 10 * 10**9  # ...and last re-checked 10 s ago
    w = Writer(SharedStorage.attach(st.name), [0], insert_timeout_s=2)
    try:
        w.append(step_values([0], [0]))
        w.create_items([1.0], num_steps=1)  # RateLimiterTimeout if it waited behind the dead writer
        assert st.counters[0, PUBLISHED] == 1 and st.counters[1, WAIT_SINCE_NS] == 0
    finally:
        w.storage.close()


def test_append_of_large_rows_in_c_writes_what_the_slice_copies_write(storage_factory, monkeypatch):
    """Rows of 2,800 bytes go through _hotpath.put_rows (one memcpy a row); the slice-copy
    loop it replaced is the reference: the same batches give the same table, ring wraps and
    a non-contiguous batch (the loop's path) included."""
    import gearflow.replay.writer as writer_mod

    if writer_mod._put_rows is None:
        pytest.skip("the C module is not built")
    spec = {"obs": "float32[700]", "action": "int64"}
    P, S = 3, 8
    tables = [storage_factory(spec, P=P, S=S) for _ in range(2)]
    writers = [Writer(st, np.arange(P), prefault=False) for st in tables]
    rng = np.random.default_rng(0)
    calls = []
    monkeypatch.setattr(writer_mod, "_put_rows", lambda *a: (calls.append(1), writer_mod._hotpath.put_rows(*a)))
    for step in range(3 * S):
        streams = rng.choice(P, size=rng.integers(1, P + 1), replace=False)
        wide = rng.standard_normal((streams.size, 800)).astype(np.float32)
        obs = wide[:, :700] if step % 5 == 0 else np.ascontiguousarray(wide[:, :700])
        batch = {"obs": obs, "action": rng.integers(0, 9, streams.size)}
        monkeypatch.setattr(writer_mod, "_put_rows", None)
        writers[0].append(batch, streams=streams)  # the reference: slice copies
        monkeypatch.setattr(writer_mod, "_put_rows", lambda *a: (calls.append(1), writer_mod._hotpath.put_rows(*a)))
        writers[1].append(batch, streams=streams)
    assert 0 < len(calls) < 3 * S  # the contiguous batches went through C, the others not
    for name in spec:
        np.testing.assert_array_equal(tables[0].columns[name], tables[1].columns[name])
    np.testing.assert_array_equal(tables[0].counters, tables[1].counters)
    col = tables[1].columns["obs"]
    with pytest.raises(IndexError, match=r"put_rows: row 24 out of range \[0, 24\)"):
        writer_mod._hotpath.put_rows(col, np.array([0, 24]), np.zeros((2, 700), np.float32))
    with pytest.raises(ValueError, match="put_rows: src: expected 1 rows of 2800 contiguous bytes"):
        writer_mod._hotpath.put_rows(col, np.array([0]), np.zeros((1, 600), np.float32))
