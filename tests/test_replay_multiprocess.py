"""Writers in other processes (spawn), the table sampling in this one, over real shared memory.

Each step's columns encode (partition, absolute step) plus a checksum column, and each
writer creates one n-step transition per stream per step on a fixed schedule, so the
record of item ``seq`` of a partition is known here without reading shared memory:
every sampled row is checked against exactly what its item's steps must hold.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from gearflow.kinds.transition import Transition
from gearflow.replay import SharedStorage, TableSpec, Writer, make_selector
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED, RESERVE, WRITER_PID
from gearflow.replay.table import Table

SPEC = {"obs": "float32[3]", "frame": "uint8[2,4]", "checksum": "int64"}
EPISODE = 37  # steps per episode
NSTEP = 3  # item length (shorter at an episode's start)


def encode(p, t):
    """Columns of step ``t`` of partition ``p``."""
    p, t = np.broadcast_arrays(np.asarray(p, np.int64), np.asarray(t, np.int64))
    obs = np.stack([p, t, (p * 7919 + t * 31) % 65521], axis=-1).astype(np.float32)
    frame = ((p * 16 + t * 3)[..., None] + np.arange(8)).astype(np.uint8).reshape(*p.shape, 2, 4)
    checksum = p * 1_000_003 + t * 7 + frame.reshape(*p.shape, 8).astype(np.int64).sum(-1)
    return {"obs": obs, "frame": frame, "checksum": checksum}


def item_of(seq, base_seq, base_pos):
    """(start, length) of item ``seq`` for a writer that began at item ``base_seq``, step ``base_pos``."""
    j = np.asarray(seq) - base_seq
    n = np.minimum(j % EPISODE + 1, NSTEP)
    return base_pos + j + 1 - n, n


def writer_main(name, partitions, steps, q, pause_every=4, hold_at=None, hold=None):
    """One actor: appends ``steps`` steps to each of its partitions, one item per stream per step.

    With ``hold_at``, it reports ``("held", pid, positions)`` after that many steps and waits
    for the event ``hold`` (the test decides when it goes on, not the scheduler)."""
    st = SharedStorage.attach(name)
    try:
        w = Writer(st, partitions, insert_timeout_s=30)
        q.put(
            (
                "start",
                os.getpid(),
                w.positions.tolist(),
                st.counters[partitions, PUBLISHED].tolist(),
            )
        )
        for i in range(steps):
            if i == hold_at:
                q.put(("held", os.getpid(), w.positions.tolist(), None))
                if not hold.wait(120):
                    raise TimeoutError("the test never released the writer")
            w.append(encode(w.partitions, w.positions))
            L = w.episode_lengths()
            w.create_items(1.0 + (w.positions % 5), np.minimum(L, NSTEP))
            if L[0] == EPISODE:
                w.end_episode()
            if i % pause_every == 0:
                w.flush()
                time.sleep(0.001)
        q.put(("done", os.getpid(), w.positions.tolist(), None))
    except BaseException as exc:  # report, then fail the process
        q.put(("error", os.getpid(), repr(exc), None))
        raise
    finally:
        st.close()


def verify(sample, P, bases):
    """Assert every row of ``sample`` is what its item's steps hold; returns (p, seq, start)."""
    keys = sample.keys.numpy()
    p, seq = keys % P, keys // P
    start = np.empty_like(seq)
    n = np.empty_like(seq)
    for b in range(keys.size):  # the writer run that published this item
        base_seq, base_pos = max((x for x in bases[p[b]] if x[0] <= seq[b]), key=lambda x: x[0])
        start[b], n[b] = item_of(seq[b], base_seq, base_pos)
    first, last = encode(p, start), encode(p, start + n - 1)
    d = {k: v.numpy() for k, v in sample.data.items()}
    for c in SPEC:
        np.testing.assert_array_equal(d[c], first[c], err_msg=c)
    np.testing.assert_array_equal(d["next_obs"], last["obs"])
    # self-consistency, independent of the schedule: the checksum matches the row's own content
    t = d["obs"][:, 1].astype(np.int64)
    assert (d["obs"][:, 0].astype(np.int64) == p).all()
    np.testing.assert_array_equal(d["checksum"], encode(p, t)["checksum"])
    return p, seq, start


def _spawn(ctx, *args, **kwargs):
    proc = ctx.Process(target=writer_main, args=args, kwargs=kwargs, daemon=True)
    proc.start()
    return proc


def _stop(procs):
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


class Messages:
    """The writers' reports, by (kind, pid): processes report in whatever order they run."""

    def __init__(self, q):
        self.q, self.seen = q, {}

    def _read(self, timeout):
        msg = self.q.get(timeout=timeout)  # a failure bound: a writer that never reports
        assert msg[0] != "error", msg
        self.seen[(msg[0], msg[1])] = msg

    def has(self, kind, pid):
        """Whether ``pid`` has reported ``kind`` yet (reads what is queued, waits for nothing)."""
        while (kind, pid) not in self.seen and not self.q.empty():
            self._read(timeout=10)  # queued: it arrives at once
        return (kind, pid) in self.seen

    def expect(self, kind, pid, timeout=120):
        """The ``kind`` report of process ``pid`` (waiting for it; other reports are kept)."""
        while (kind, pid) not in self.seen:
            self._read(timeout)
        return self.seen[(kind, pid)]


@pytest.fixture
def table():
    storage = SharedStorage.create(TableSpec.parse(SPEC), num_partitions=4, steps_per_partition=128,
                                   items_per_partition=512)  # fmt: skip
    t = Table(storage, Transition(next_columns=("obs",)), make_selector("uniform", 4 * 512, seed=0),
              sample_timeout_s=60)  # fmt: skip
    yield t
    t.close()


def test_two_writer_processes_while_sampling(table):
    P, S, STEPS = 4, 128, 2500
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    msgs = Messages(q)
    hold = ctx.Event()  # both writers wait half-way until the sampler has drawn 10 batches
    procs = []
    try:
        procs = [
            _spawn(ctx, table.storage.name, [0, 1], STEPS, q, hold_at=STEPS // 2, hold=hold),
            _spawn(ctx, table.storage.name, [2, 3], STEPS, q, hold_at=STEPS // 2, hold=hold),
        ]
        starts = [msgs.expect("start", proc.pid) for proc in procs]
        assert all(m[2] == [0, 0] and m[3] == [0, 0] for m in starts)
        bases = {p: [(0, 0)] for p in range(P)}
        sampled_parts = set()
        batches_during = 0
        while any(proc.is_alive() for proc in procs):
            s = table.sample(64)
            # after the gather, nothing sampled may start before RESERVE - S (seqlock)
            p, _, _ = verify(s, P, bases)
            sampled_parts.update(p.tolist())
            batches_during += 1
            if batches_during == 10:
                hold.set()
        done = [msgs.expect("done", proc.pid) for proc in procs]
        for proc in procs:
            proc.join(10)
            assert proc.exitcode == 0
        assert all(m[2] == [STEPS, STEPS] for m in done), done
    finally:
        _stop(procs)
    assert batches_during >= 10, f"only {batches_during} batches overlapped the writers"
    assert sampled_parts == {0, 1, 2, 3}
    c = table.storage.counters
    assert c[:, RESERVE].tolist() == [STEPS] * P and c[:, COMMIT].tolist() == [STEPS] * P
    assert c[:, PUBLISHED].tolist() == [STEPS] * P
    assert c[:, EPISODES].tolist() == [STEPS // EPISODE] * P
    assert sorted(set(c[:, WRITER_PID].tolist())) == sorted(proc.pid for proc in procs)
    # settled: exactly the items whose first step is still in the ring are live
    table.scan()
    live = 0
    for p in range(P):
        first, _ = item_of(np.arange(STEPS), 0, 0)
        live += int((first >= STEPS - S).sum())
    assert table.size == live
    for _ in range(10):
        _, _, start = verify(table.sample(64), P, {p: [(0, 0)] for p in range(P)})
        assert (start >= STEPS - S).all()
    st = table.stats()
    assert st["replay/steps"] == P * STEPS and st["replay/size"] == live


def test_killed_writer_is_replaced_and_old_data_stays_sampleable():
    P, S = 2, 256
    storage = SharedStorage.create(TableSpec.parse(SPEC), num_partitions=P, steps_per_partition=S,
                                   items_per_partition=1024)  # fmt: skip
    table = Table(
        storage, Transition(), make_selector("uniform", P * 1024, seed=1), sample_timeout_s=60
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    msgs = Messages(q)
    never = ctx.Event()
    procs = []
    try:
        try:
            # writes 200 steps per partition (sampled meanwhile), then waits until killed
            a = _spawn(ctx, storage.name, [0, 1], 10**9, q, hold_at=200, hold=never)
            procs.append(a)
            msgs.expect("start", a.pid)
            bases = {p: [(0, 0)] for p in range(P)}
            while not msgs.has("held", a.pid):
                assert a.is_alive()
                verify(table.sample(32), P, bases)
            os.kill(a.pid, signal.SIGKILL)
            a.join(10)
            assert a.exitcode == -signal.SIGKILL
            c = storage.counters
            old_pos = np.maximum(c[:, RESERVE], c[:, COMMIT]).copy()
            old_pub = c[:, PUBLISHED].copy()
            assert old_pos.tolist() == [200, 200]  # nothing overwritten yet (S = 256)

            # the dead writer's items are still there
            for _ in range(5):
                verify(table.sample(32), P, bases)
            table.scan()
            assert table.size == int(old_pub.sum())

            # a new writer process on the same partitions continues after the dead one
            new_steps = 120
            b = _spawn(ctx, storage.name, [0, 1], new_steps, q)
            procs.append(b)
            msg = msgs.expect("start", b.pid)
            assert msg[2] == old_pos.tolist() and msg[3] == old_pub.tolist()
            for p in range(P):
                bases[p].append((int(old_pub[p]), int(old_pos[p])))
            while b.is_alive():
                verify(table.sample(32), P, bases)
            b.join(10)
            assert b.exitcode == 0
            assert msgs.expect("done", b.pid)[2] == (old_pos + new_steps).tolist()
        finally:
            _stop(procs)
        assert c[:, COMMIT].tolist() == c[:, RESERVE].tolist() == (old_pos + new_steps).tolist()
        assert c[:, PUBLISHED].tolist() == (old_pub + new_steps).tolist()
        assert c[:, WRITER_PID].tolist() == [b.pid, b.pid]
        # old items whose steps were not overwritten are still sampled, overwritten ones never
        limit = old_pos + new_steps - S
        old_seen = new_seen = 0
        for _ in range(40):
            p, seq, start = verify(table.sample(64), P, bases)
            assert (start >= limit[p]).all()
            old = seq < old_pub[p]
            old_seen += int(old.sum())
            new_seen += int((~old).sum())
        assert old_seen > 0 and new_seen > 0
        assert (limit > 0).all() and table.stats()["replay/evictions"] > 0
    finally:
        table.close()
