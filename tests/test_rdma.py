"""One-sided RDMA READ gathers (gearflow.transport.rdma: fabric, replay) against real shared memory.

The loopback double reads the real segment a real Writer wrote (mapped separately, by path,
addressed by the shard's own addresses and rkey), so the gather planning, the chain, the
counter re-read and the seqlock rule all run as they do over a NIC; every batch is compared
with what the shared-memory Table gathers for the same keys, and a stamp column (partition,
step) checks every row. The pyverbs path is marked ``rdma`` and runs only where
``ibv_devices`` lists a device.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gearflow.errors import ConfigError, MissingDependencyError
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.transport.choice import choose_transport, parse_ibv_devices, rdma_devices
from gearflow.transport.rdma.fabric import LoopbackExport, LoopbackMemory, RemoteAccessError, plan_reads
from gearflow.transport.rdma.replay import RdmaSampler, RdmaShard, direct_call, segment_base, unpack
from gearflow.replay import (
    SharedStorage,
    Table,
    Writer,
    make_selector,
)
from gearflow.replay.storage import RESERVE, SHM_DIR

SPEC = {"stamp": "int64", "obs": "float32[3]", "frame": "uint8[2,4]", "done": "bool"}
STACKED = {"stamp": "int64", "frame": "uint8[4,2,4] stack=4", "obs": "float32[3]"}
NSTEP = 3


def stamp_of(p, t):
    return np.asarray(p, np.int64) * 1_000_000 + np.asarray(t, np.int64)


def step_values(p, t, stacked=False):
    """Columns of step t of partition p: every value identifies (p, t)."""
    p, t = np.broadcast_arrays(np.asarray(p, np.int64), np.asarray(t, np.int64))
    obs = np.stack([p, t, (p * 7919 + t * 31) % 65521], axis=-1).astype(np.float32)
    frame = ((p * 16 + t)[..., None] + np.arange(8)).astype(np.uint8).reshape(*p.shape, 2, 4)
    out = {"stamp": stamp_of(p, t), "obs": obs, "frame": frame}
    if not stacked:
        out["done"] = t % 5 == 0
    return out


def write_steps(w: Writer, steps: int, kind, stacked=False, episode=11, priority=None) -> None:
    """``steps`` steps on every stream of ``w``, with the kind's items, episodes of ``episode``."""
    for _ in range(steps):
        w.append(step_values(w.partitions, w.positions, stacked))
        L = w.episode_lengths()
        prio = np.full(w.num_streams, 1.0) if priority is None else priority(w.positions)
        if isinstance(kind, Transition):
            w.create_items(prio, np.minimum(L, NSTEP))
        else:  # sequence windows and episodes (chunks of a long episode) due after this step
            for n in kind.due_on_append(int(L[0])):
                w.create_items(prio, np.full(w.num_streams, n))
        if L[0] == episode:
            if isinstance(kind, Sequence):  # tail windows (shorter, padded) end at the episode's end
                for n in kind.due_at_end(int(L[0])):
                    w.create_items(prio, np.full(w.num_streams, n))
            w.end_episode()


@pytest.fixture
def rig(storage_factory):
    """``rig(kind, spec=SPEC, P=2, S=32, selector="prioritized")`` -> (table, writer, shard,
    sampler); everything closed at teardown."""
    made = []

    def make(kind, spec=SPEC, P=2, S=32, selector="prioritized", memory=None, writer_parts=None):
        st = storage_factory(spec, P=P, S=S)
        table = Table(SharedStorage.attach(st.name), kind, make_selector(selector, P * st.items_per_partition, seed=0),
                      sample_timeout_s=5.0)  # fmt: skip
        writers = [Writer(SharedStorage.attach(st.name), parts) for parts in (writer_parts or [np.arange(P)])]
        shard = RdmaShard.loopback(table)
        sampler = RdmaSampler(direct_call(shard), memory or LoopbackMemory(), timeout_s=5.0)
        made.append((table, writers, shard, sampler))
        return table, writers if writer_parts else writers[0], shard, sampler

    yield make
    for table, writers, shard, sampler in made:
        sampler.close()
        shard.close()
        for w in writers:
            w.storage.close()
        table.storage.close()


def table_gather(table: Table, keys: np.ndarray) -> dict[str, torch.Tensor]:
    """What the shared-memory Table's own gather returns for these keys (its _gather)."""
    slots = table._key_index.slots(keys)
    assert (slots >= 0).all(), "a returned key is not held by the table"
    rec = table.records(slots)
    layout = table.kind.layout(table.storage.spec, keys.size)
    out = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in layout.items()}
    table._gather(slots, rec, out)
    return out, rec


def assert_same_batch(table, batch):
    keys = batch.keys.numpy()
    want, rec = table_gather(table, keys)
    assert set(want) == set(batch.data)
    for name, value in want.items():
        assert torch.equal(batch.data[name], value), name
    return rec


# ---------------------------------------------------------------------------------- planning


def test_plan_reads_one_read_per_contiguous_run_per_column():
    rows = np.array([3, 4, 5, 9, 10, 40])
    cols = np.array([[1000, 8, 0], [50_000, 3, 4096]])
    plan = plan_reads(rows, cols, tail=np.array([[7, 64, 9000]]))
    np.testing.assert_array_equal(plan, [
        [1000 + 3 * 8, 24, 0], [1000 + 9 * 8, 16, 24], [1000 + 40 * 8, 8, 40],
        [50_000 + 9, 9, 4096], [50_000 + 27, 6, 4096 + 9], [50_000 + 120, 3, 4096 + 15],
        [7, 64, 9000],
    ])  # fmt: skip
    # a run longer than max_bytes is cut into pieces, each at most max_bytes
    plan = plan_reads(np.arange(10), np.array([[0, 8, 0]]), max_bytes=24)
    np.testing.assert_array_equal(plan[:, 1], [24, 24, 24, 8])
    np.testing.assert_array_equal(plan[:, 0], [0, 24, 48, 72])
    np.testing.assert_array_equal(plan[:, 2], [0, 24, 48, 72])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(0, 300), min_size=1, max_size=60, unique=True),
    row_bytes=st.sampled_from([1, 8, 24, 7056]),
    max_rows=st.integers(1, 40),
)
def test_plan_reads_covers_each_row_once_with_maximal_runs(rows, row_bytes, max_rows):
    rows = np.sort(np.array(rows, dtype=np.int64))
    cols = np.array([[10_000, row_bytes, 64], [10**9, 3, 0]])  # far apart: each read names its column
    max_bytes = max_rows * row_bytes
    plan = plan_reads(rows, cols, max_bytes=max_bytes)
    runs = np.diff(np.flatnonzero(np.diff(np.concatenate(([-2], rows, [10**6]))) != 1))  # lengths of runs
    for remote0, nbytes, local0 in cols.tolist():
        mine = plan[(plan[:, 0] >= remote0) & (plan[:, 0] < remote0 + 301 * nbytes)]
        most = max(1, max_bytes // nbytes)  # rows one read may carry
        got_remote, got_local = [], []
        for addr, length, local in mine.tolist():
            assert length % nbytes == 0 and 0 < length <= most * nbytes
            n = length // nbytes
            got_remote += [(addr - remote0) // nbytes + k for k in range(n)]
            got_local += [(local - local0) // nbytes + k for k in range(n)]
        assert got_remote == rows.tolist()  # every row once, in order
        assert got_local == list(range(rows.size))  # row i of rows lands at staging row i
        assert mine.shape[0] == int((-(-runs // most)).sum())  # runs are maximal: cut only at max_bytes


# ---------------------------------------------------------------------------------- the gather


KINDS = {
    "transition": (Transition(next_columns=("obs", "frame")), SPEC),
    "sequence": (Sequence(length=6, period=3), SPEC),
    "stacked_transition": (Transition(next_columns=("frame",)), STACKED),
    "stacked_sequence": (Sequence(length=5, period=2), STACKED),
    "episode": (Episode(max_episode_length=12), SPEC),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_rdma_gather_equals_the_table_gather(rig, name):
    kind, spec = KINDS[name]
    table, w, _shard, sampler = rig(kind, spec=spec, S=48)
    write_steps(w, 100, kind, stacked=spec is STACKED)  # the ring wraps (S=48)
    P = table.storage.num_partitions
    for _ in range(5):
        batch = sampler.sample(16)
        rec = assert_same_batch(table, batch)
        keys = batch.keys.numpy()
        stamp = batch.data["stamp"].numpy()
        first = stamp[:, 0] if stamp.ndim == 2 else stamp
        np.testing.assert_array_equal(first, stamp_of(keys % P, rec[0]))  # row 0 is the item's first step
        assert batch.weights.max().item() == pytest.approx(1.0)
        assert (batch.probabilities.numpy() > 0).all()
    assert sampler.memory.chains_posted == 5  # one chain (one signalled completion) per batch
    assert table.torn == 0 and sampler.torn == 0


def test_sampled_windows_are_padded_and_masked_like_the_table(rig):
    kind = Sequence(length=8, period=4)
    table, w, _shard, sampler = rig(kind, S=64)
    write_steps(w, 30, kind, episode=6)  # episodes of 6 steps: only tail windows, shorter than 8
    batch = sampler.sample(8)
    assert_same_batch(table, batch)
    lengths = batch.data["length"].numpy()
    assert set(lengths.tolist()) <= {6, 2} and not batch.data["mask"].all()  # windows at 0 and 4 of each episode
    np.testing.assert_array_equal(batch.data["mask"].numpy().sum(1), lengths)


def test_priority_updates_reach_the_shard_by_key(rig):
    table, w, _shard, sampler = rig(Transition(next_columns=("obs",)))
    write_steps(w, 20, Transition())
    batch = sampler.sample(4)
    keys = np.unique(batch.keys.numpy())
    assert sampler.update_priorities(torch.from_numpy(keys), torch.full((keys.size,), 50.0)) == keys.size
    slots = table._key_index.slots(keys)
    assert (table.selector.tree.leaves[slots] == pytest.approx(50.0 ** table.selector.alpha))


def test_the_learners_beta_reaches_the_shard(rig):
    """The learner anneals β through ``sampler.selector`` (SamplerLike declares it): the RDMA
    sampler sends it with each select and the shard's prioritized selector weighs with it
    (before: no ``selector``, AttributeError at the learner's first step with a β schedule)."""
    from gearflow.replay.protocols import SamplerLike

    table, w, _shard, sampler = rig(Transition(next_columns=("obs",)))
    write_steps(w, 20, Transition(), priority=lambda pos: 1.0 + pos.astype(np.float64))
    assert isinstance(sampler, SamplerLike) and sampler.selector.importance_sampled
    assert sampler.selector.name == "prioritized" and sampler.selector.beta is None
    sampler.sample(4)
    assert table.selector.beta == 0.4  # None: the shard's own
    sampler.selector.beta = 0.9
    batch = sampler.sample(8)
    assert table.selector.beta == 0.9
    w_want = (table.size * batch.probabilities.numpy()) ** -0.9
    np.testing.assert_allclose(batch.weights.numpy(), w_want / w_want.max(), rtol=1e-5)


# ---------------------------------------------------------------------------------- seqlock


class WriteBeforeRead(LoopbackMemory):
    """A loopback connection that, before its first chain, lets ``write()`` run: the items the
    shard just selected are overwritten between the select and the read, deterministically."""

    def __init__(self):
        super().__init__()
        self.write = None

    def read_chain(self, reads, rkey, fence_last=True):
        if self.write is not None:
            write, self.write = self.write, None
            write()
        super().read_chain(reads, rkey, fence_last)


def test_items_overwritten_between_select_and_read_are_redrawn(rig):
    kind = Transition(next_columns=("obs",))
    memory = WriteBeforeRead()
    table, (w0, w1), _shard, sampler = rig(kind, S=32, memory=memory, writer_parts=[[0], [1]])
    write_steps(w0, 40, kind)
    write_steps(w1, 40, kind)
    S = table.storage.steps_per_partition
    chosen = {}

    def overwrite_partition_0():  # a whole lap of partition 0 only: its selected items are gone
        chosen["reserve"] = table.storage.counters[:, RESERVE].copy()
        write_steps(w0, S, kind)

    memory.write = overwrite_partition_0
    batch = sampler.sample(32)
    keys = batch.keys.numpy()
    # the first select drew from both partitions: every row of partition 0 was torn and redrawn
    assert sampler.torn > 0 and table.torn == sampler.torn
    assert memory.chains_posted == 2  # the first chain, and the whole batch read again
    reserve = table.storage.counters[:, RESERVE]
    rec = assert_same_batch(table, batch)  # every returned key is live and its rows are its own
    assert (rec[0] >= reserve[keys % 2] - table.storage.trusted_steps).all()
    stamp = batch.data["stamp"].numpy()
    np.testing.assert_array_equal(stamp, stamp_of(keys % 2, rec[0]))
    np.testing.assert_array_equal(batch.data["next_obs"].numpy()[:, 1], rec[0] + rec[2] - 1)
    # the rows of partition 0 now come from the lap written between the select and the read
    p0 = keys % 2 == 0
    assert (rec[0][p0] >= chosen["reserve"][0]).all()
    # the redraw reweighed the whole batch against the table as it is now: max weight 1
    assert batch.weights.max().item() == pytest.approx(1.0)


def test_the_counters_are_read_after_the_rows_in_the_same_chain(rig):
    """The chain's last read is the fenced counter re-read: a writer that moves between the
    rows and the counters makes the read torn (detected), never the other way round."""
    kind = Transition(next_columns=("obs",))
    table, w, _shard, sampler = rig(kind)
    write_steps(w, 40, kind)
    sampler.sample(8)
    reads = sampler.reads_per_batch
    counters_addr = sampler.region.addr + sampler.layout["counters"][0]
    log = []
    original = LoopbackMemory.read_chain

    def spy(self, reads_, rkey, fence_last=True):
        log.append((reads_.copy(), fence_last))
        return original(self, reads_, rkey, fence_last)

    sampler.memory.read_chain = spy.__get__(sampler.memory)
    sampler.sample(8)
    (chain, fenced), = log
    assert fenced and chain[-1, 0] == counters_addr and chain[-1, 1] == table.storage.num_partitions * 64
    assert (chain[:-1, 0] != counters_addr).all() and reads > 1


def _writer_process(name, steps, q):
    st = SharedStorage.attach(name)
    try:
        w = Writer(st, np.arange(st.num_partitions), insert_timeout_s=30)
        q.put("started")
        write_steps(w, steps, Transition())
        q.put("done")
    except BaseException as exc:  # report, then fail
        q.put(repr(exc))
        raise
    finally:
        st.close()


def test_rows_written_by_another_process_are_never_torn(storage_factory):
    """A writer process laps a small ring while the learner samples over the loopback double:
    every row returned is self-consistent (its stamp, obs and frame name the same step of the
    key's partition; next_obs is the same item's last step)."""
    st = storage_factory(SPEC, P=2, S=16)
    kind = Transition(next_columns=("obs",))
    table = Table(SharedStorage.attach(st.name), kind, make_selector("uniform", 2 * 16, seed=1), sample_timeout_s=20)
    shard = RdmaShard.loopback(table)
    sampler = RdmaSampler(direct_call(shard), LoopbackMemory(), timeout_s=20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_writer_process, args=(st.name, 20_000, q), daemon=True)
    proc.start()
    try:
        assert q.get(timeout=60) == "started"
        batches = 0
        while batches < 30 or proc.is_alive() and batches < 300:
            batch = sampler.sample(16)
            batches += 1
            keys = batch.keys.numpy()
            d = {k: v.numpy() for k, v in batch.data.items()}
            p, t = d["stamp"] // 1_000_000, d["stamp"] % 1_000_000
            np.testing.assert_array_equal(p, keys % 2)
            values = step_values(p, t)
            for c in ("obs", "frame", "done"):
                np.testing.assert_array_equal(d[c], values[c], err_msg=c)
            t_next = d["next_obs"][:, 1].astype(np.int64)
            assert ((t_next - t >= 0) & (t_next - t < NSTEP)).all()
            np.testing.assert_array_equal(d["next_obs"][:, 0].astype(np.int64), p)
        proc.join(60)
        assert q.get(timeout=5) == "done"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        sampler.close()
        shard.close()
        table.storage.close()


# ---------------------------------------------------------------------------------- the NIC's checks


def test_a_wrong_rkey_or_an_out_of_region_read_is_refused(storage_factory):
    st = storage_factory(SPEC, P=2, S=16)
    st.columns["stamp"][:] = np.arange(32)
    base = segment_base(st)
    export = LoopbackExport(SHM_DIR / st.name, base)
    region = export.register(base, st.nbytes)
    mem = LoopbackMemory()
    mem.connect(export.accept(mem.endpoint()))
    local = np.zeros(4096, np.uint8)
    mem.register(local)
    at = base + st.column_offsets["stamp"]
    mem.read_chain(np.array([[at + 8 * 5, 16, 0]]), region.rkey)
    np.testing.assert_array_equal(local[:16].view(np.int64), [5, 6])

    with pytest.raises(RemoteAccessError, match=r"rkey 0x[0-9a-f]+ is not a region the peer registered"):
        mem.read_chain(np.array([[at, 8, 0]]), region.rkey ^ 1)
    with pytest.raises(RemoteAccessError, match="error state"):  # the queue pair is broken now
        mem.read_chain(np.array([[at, 8, 0]]), region.rkey)
    mem.connect(export.accept(mem.endpoint()))  # connect again: reads work
    mem.read_chain(np.array([[at, 8, 0]]), region.rkey)

    for addr, n in ((base + st.nbytes - 8, 16), (base - 8, 8), (base + st.nbytes, 1)):
        with pytest.raises(RemoteAccessError, match="outside the region"):
            mem.read_chain(np.array([[addr, n, 0]]), region.rkey)
        mem.connect(export.accept(mem.endpoint()))
    with pytest.raises(RemoteAccessError, match="beyond the 4096-byte registered buffer"):
        mem.read_chain(np.array([[at, 16, 4090]]), region.rkey)
    mem.connect(export.accept(mem.endpoint()))
    # a region registered over part of the segment: reads past its end are refused
    small = export.register(at, 8 * 4)
    mem.connect(export.accept(mem.endpoint()))
    mem.read_chain(np.array([[at, 32, 0]]), small.rkey)
    with pytest.raises(RemoteAccessError, match="outside the region"):
        mem.read_chain(np.array([[at, 40, 0]]), small.rkey)
    with pytest.raises(ValueError, match=r"\(n, 3\)"):
        mem.read_chain(np.array([at, 8, 0]), region.rkey)
    mem.close()
    export.close()


def test_a_sampler_with_a_wrong_rkey_raises(rig):
    kind = Transition(next_columns=("obs",))
    _table, w, _shard, sampler = rig(kind)
    write_steps(w, 20, kind)
    sampler.region = type(sampler.region)(sampler.region.addr, sampler.region.length, sampler.region.rkey ^ 0xFF)
    with pytest.raises(RemoteAccessError, match="is not a region the peer registered"):
        sampler.sample(4)


# ---------------------------------------------------------------------------------- coalescing


def _naive_runs(rows: np.ndarray) -> int:
    rows = sorted(set(rows.tolist()))
    return sum(1 for i, r in enumerate(rows) if i == 0 or r != rows[i - 1] + 1)


def test_the_chain_is_one_read_per_contiguous_run_per_column(rig):
    kind = Sequence(length=8, period=2)  # overlapping windows: neighbouring items share rows
    table, w, _shard, sampler = rig(kind, P=1, S=256)
    write_steps(w, 120, kind, episode=1000)
    C = len(table.storage.spec)
    for _ in range(4):
        batch = sampler.sample(32)
        rec = assert_same_batch(table, batch)
        rows = np.concatenate([np.arange(s, s + n) % 256 for s, n in zip(rec[0], rec[2])])  # P = 1
        runs = _naive_runs(rows)
        assert sampler.memory.last_chain == C * runs + 1  # + the counter re-read
        assert runs < len(np.unique(rows))  # coalesced: fewer reads than rows
    # every item of one contiguous stretch: a single read per column
    _table2, w2, _shard2, sampler2 = rig(Sequence(length=8, period=8), P=1, S=256, selector="fifo")
    write_steps(w2, 16, Sequence(length=8, period=8), episode=1000)  # two windows: rows 0..15
    sampler2.sample(2)
    assert sampler2.memory.last_chain == C + 1  # rows 0..15 (or one window twice): one run per column


# ---------------------------------------------------------------------------------- over TCP

TOKEN = "rdma-test-token-0123456789"


def test_end_to_end_over_a_real_loopback_socket(rig):
    """rdma.connect / rdma.select / rdma.update served by the transport's Service on 127.0.0.1,
    the learner's control channel a real authenticated Client; the reads go through the loopback
    double. The batch equals the Table's gather for the same keys; the queue pair is released when
    the learner's connection closes."""
    from gearflow.transport.client import Client
    from gearflow.transport.service import Service

    kind = Transition(next_columns=("obs",))
    table, (w0, w1), shard, _ = rig(kind, S=32, writer_parts=[[0], [1]])
    write_steps(w0, 40, kind)
    write_steps(w1, 40, kind)
    service = Service(host="127.0.0.1", port=0, token=TOKEN)
    shard.register_handlers(service)
    port = service.start()
    client = Client(("127.0.0.1", port), token=TOKEN, timeout_s=10)
    memory = WriteBeforeRead()
    try:
        sampler = RdmaSampler(client.call, memory, timeout_s=10)
        assert len(shard.export.connected) == 2  # the rig's in-process sampler and this one
        for _ in range(3):
            batch = sampler.sample(16)
            assert_same_batch(table, batch)
        # a torn batch over TCP: partition 1 lapped between the select and the read
        memory.write = lambda: write_steps(w1, 32, kind)
        batch = sampler.sample(16)
        rec = assert_same_batch(table, batch)
        assert sampler.torn > 0 and table.torn == sampler.torn
        np.testing.assert_array_equal(batch.data["stamp"].numpy(), stamp_of(batch.keys.numpy() % 2, rec[0]))
        keys = np.unique(batch.keys.numpy())
        assert sampler.update_priorities(keys, np.full(keys.size, 7.0)) == keys.size
        assert table.selector.tree.leaves[table._key_index.slots(keys)] == pytest.approx(7.0 ** table.selector.alpha)
        sampler.memory.close()
    finally:
        client.close()
    deadline = time.monotonic() + 10
    while len(shard.export.connected) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the service notices the closed connection in its loop
    service.stop()
    assert len(shard.export.connected) == 1  # this learner's queue pair went with its connection


def test_remote_actor_to_shard_service_to_an_rdma_learner(storage_factory):
    """The whole remote path: an actor writes through a RemoteWriter into a ShardService (real
    sockets), RdmaShard.serve adds the rdma.* handlers to that service (its table lock), and a
    learner reads batches with the loopback double; each equals the Table's gather for its
    keys, and each row's stamp is the step its key names."""
    from gearflow.transport.client import Client
    from gearflow.transport.actor import RemoteWriter
    from gearflow.transport.server.shard import ShardService

    st = storage_factory(SPEC, P=3, S=32)
    kind = Transition(next_columns=("obs",))
    table = Table(SharedStorage.attach(st.name), kind, make_selector("prioritized", 3 * 32, seed=0), sample_timeout_s=10)
    service = ShardService(table, token=TOKEN)
    shard = RdmaShard.serve(service, LoopbackExport(SHM_DIR / st.name, segment_base(table.storage)))
    port = service.start()
    remote = RemoteWriter(("127.0.0.1", port), num_streams=3, token=TOKEN, timeout_s=10)
    client = Client(("127.0.0.1", port), token=TOKEN, timeout_s=10)
    try:
        sampler = RdmaSampler(client.call, LoopbackMemory(), timeout_s=10)
        for _ in range(3):  # write a lap, read a few batches, write on: the ring wraps in between
            write_steps(remote, 20, kind)
            remote.flush()
            for _ in range(3):
                batch = sampler.sample(24)
                rec = assert_same_batch(table, batch)
                keys = batch.keys.numpy()
                np.testing.assert_array_equal(batch.data["stamp"].numpy(), stamp_of(keys % 3, rec[0]))
                np.testing.assert_array_equal(batch.data["next_obs"].numpy()[:, 1], rec[0] + rec[2] - 1)
        assert table.samples == 9 * 24
        sampler.memory.close()
    finally:
        client.close()
        remote.close()
        service.stop()
        shard.close()
        table.storage.close()


def test_a_select_waits_for_the_rate_limiter_without_holding_the_table_lock(storage_factory):
    from gearflow.replay import RateLimiter
    from gearflow.replay.rate_limiter import RateLimiterTimeout

    st = storage_factory(SPEC, P=2, S=32)
    kind = Transition(next_columns=("obs",))
    table = Table(SharedStorage.attach(st.name), kind, make_selector("uniform", 64, seed=0),
                  RateLimiter(min_size_to_sample=20), sample_timeout_s=10)  # fmt: skip
    shard = RdmaShard.loopback(table)
    w = Writer(SharedStorage.attach(st.name), np.arange(2))
    try:
        with pytest.raises(RateLimiterTimeout, match="blocked"):
            shard.select({"n": 4, "timeout_s": 0.05}, [])
        got, scans, waiting = {}, [], threading.Event()
        scan = table.scan

        def counted_scan():  # the select's second try: it is in its wait loop
            scans.append(1)
            if len(scans) >= 2:
                waiting.set()
            return scan()

        table.scan = counted_scan
        thread = threading.Thread(target=lambda: got.update(r=shard.select({"n": 4, "timeout_s": 20}, [])))
        thread.start()
        assert waiting.wait(20)
        with shard.lock:  # the waiting select does not hold the lock (held, this would wait 20 s and fail)
            write_steps(w, 12, kind)  # 24 items: the limiter lets the select through
        thread.join(30)
        meta, bufs = got["r"]
        assert meta["n"] == 4 and len(unpack(meta, bufs)["keys"]) == 4
    finally:
        shard.close()
        w.storage.close()
        table.storage.close()


# ---------------------------------------------------------------------------------- transport choice


def test_transport_auto_tcp_rdma_decision():
    yes, no = (True, "pyverbs at /x"), (False, "pyverbs is not importable (ModuleNotFoundError); apt-get install python3-pyverbs")
    devices, none = (["mlx5_0"], "listed by ibv_devices"), ([], "ibv_devices lists no device")
    assert choose_transport("tcp", pyverbs=no, devices=none).transport == "tcp"
    choice = choose_transport("auto", pyverbs=no, devices=devices)
    assert choice.transport == "tcp" and "not importable" in choice.reason
    choice = choose_transport("auto", pyverbs=yes, devices=none)
    assert choice.transport == "tcp" and "lists no device" in choice.reason
    choice = choose_transport("auto", pyverbs=yes, devices=devices)
    assert choice.transport == "rdma" and "mlx5_0" in choice.reason
    assert choose_transport("rdma", pyverbs=yes, devices=devices).transport == "rdma"
    with pytest.raises(MissingDependencyError, match="python3-pyverbs") as exc:
        choose_transport("rdma", pyverbs=no, devices=devices)
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="needs an RDMA device: ibv_devices lists no device"):
        choose_transport("rdma", pyverbs=yes, devices=none)
    with pytest.raises(ConfigError, match="auto, tcp, rdma"):
        choose_transport("infiniband")


def test_transport_auto_on_this_machine_says_why():
    choice = choose_transport("auto")
    names, how = rdma_devices()
    assert choice.reason.startswith("transport=auto") and choice.transport in ("tcp", "rdma")
    if not names:  # this development machine: no device, whatever pyverbs does
        assert choice.transport == "tcp" and ("not importable" in choice.reason or how in choice.reason)


def test_rdma_without_pyverbs_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError
    with pytest.raises(MissingDependencyError) as exc:
        choose_transport("rdma")
    msg = str(exc.value)
    assert "\n" not in msg and "pyverbs" in msg and "apt-get install python3-pyverbs" in msg
    assert choose_transport("auto").transport == "tcp"


def test_parse_ibv_devices_output():
    out = "    device          \t   node GUID\n    ------          \t----------------\n    mlx5_0          \tb8cef60300f1a2b4\n    mlx5_1          \tb8cef60300f1a2b5\n"
    assert parse_ibv_devices(out) == ["mlx5_0", "mlx5_1"]
    assert parse_ibv_devices("    device          \t   node GUID\n    ------          \t----------------\n") == []


def test_importing_gearflow_and_the_rdma_modules_never_imports_pyverbs():
    code = ("import sys, gearflow, gearflow.transport.rdma.fabric, gearflow.transport.rdma.replay; "
            "assert 'pyverbs' not in sys.modules, 'pyverbs imported'; print('ok')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------- real hardware

_AUTO = choose_transport("auto")
needs_rdma = pytest.mark.skipif(_AUTO.transport != "rdma", reason=f"no usable RDMA device: {_AUTO.reason}")


@pytest.mark.rdma
@needs_rdma
def test_verbs_gather_equals_the_table_gather(rig):  # pragma: no cover - needs an RDMA device
    from gearflow.transport.rdma.fabric import VerbsExport, VerbsMemory

    kind = Transition(next_columns=("obs",))
    table, w, _shard, _sampler = rig(kind)
    write_steps(w, 60, kind)
    verbs_shard = RdmaShard(table, VerbsExport())
    verbs = RdmaSampler(direct_call(verbs_shard), VerbsMemory(), timeout_s=5.0)
    try:
        for _ in range(3):
            assert_same_batch(table, verbs.sample(16))
        verbs.region = type(verbs.region)(verbs.region.addr, verbs.region.length, verbs.region.rkey ^ 0xFF)
        with pytest.raises(RemoteAccessError):
            verbs.sample(4)
    finally:
        verbs.close()
        verbs_shard.close()


@pytest.mark.rdma
@needs_rdma
def test_verbs_read_chain_and_a_wrong_rkey():  # pragma: no cover - needs an RDMA device
    from gearflow.transport.rdma.fabric import VerbsExport, VerbsMemory

    remote = np.arange(4096, dtype=np.int64)  # the "shard's" memory: 32 KiB
    export, mem = VerbsExport(), VerbsMemory()
    try:
        region = export.register(remote.ctypes.data, remote.nbytes)
        mem.connect(export.accept(mem.endpoint()))
        local = np.zeros(1024, np.int64)
        mem.register(local)
        reads = plan_reads(np.array([1, 2, 3, 100]), np.array([[region.addr, 8, 0]]),
                           tail=np.array([[region.addr + 8 * 4000, 64, 8 * 512]]))  # fmt: skip
        mem.read_chain(reads, region.rkey)
        assert mem.last_chain == 3 and mem.chains_posted == 1
        np.testing.assert_array_equal(local[:4], [1, 2, 3, 100])
        np.testing.assert_array_equal(local[512:520], np.arange(4000, 4008))
        with pytest.raises(RemoteAccessError):
            mem.read_chain(reads, region.rkey ^ 0xFF)
    finally:
        mem.close()
        export.close()


def test_rdma_bench_measures_both_paths_in_one_run():
    from gearflow.transport.rdma import bench as rdma_bench

    out = rdma_bench.workload("tiny", rdma_bench.VECTOR, Transition(next_columns=("obs",)), P=2, S=64, B=8,
                              steps=40, batches=2)  # fmt: skip
    assert out["table_sample_ms"] > 0 and out["rdma_sample_ms"] > 0 and out["learner_cpu_ms"] > 0
    assert 0 < out["reads_per_batch"] <= 4 * 16 + 1  # ≤ one read per row per column, + the counters


# ------------------------------------------------------ a transport added by its DataPath alone


def loopback_serve(shard_service):
    """RDMA's own node end (``serve_node``) over the loopback double's export."""
    from gearflow.transport.rdma.replay import serve_node

    st = shard_service.table.storage
    return serve_node(shard_service, LoopbackExport(SHM_DIR / st.name, segment_base(st)))


def loopback_sampler(shards, cfg):
    """RDMA's own learner end (``node_sampler``) reading through the loopback double."""
    from gearflow.transport.rdma.replay import node_sampler

    return node_sampler(shards, cfg, LoopbackMemory())


def test_a_transport_added_as_one_data_path_is_served_by_a_node_and_sampled_by_a_learner(tmp_path, monkeypatch):
    """``transport.kind`` names a transport that exists only as one ``DATA_PATHS`` entry (RDMA's
    node and learner ends over the loopback double): the config accepts it, a real shard node
    (``gearflow serve``'s ``ShardNode``, its actor a real process writing CartPole) starts its
    server end beside TCP, and a learner over ``transport.shards`` (``RemoteShards``) samples
    through its learner end: every batch equals the node table's own gather for its keys; the
    learner's queue pair is connected to the node's export, and nothing else wired it."""
    from gearflow.agent import make_agent
    from gearflow.config import load_config
    from gearflow.topology.shard_node import ShardNode
    from gearflow.transport import choice
    from gearflow.transport.learner.shards import RemoteShards
    from tests.test_train import CONFIG, TINY

    token = "data-path-test-token-0123456789"
    monkeypatch.setenv("GEARFLOW_TOKEN", token)
    with pytest.raises(ConfigError, match="transport.kind"):
        load_config(CONFIG, [*TINY, "transport.kind=rdma-loopback"])
    probe = lambda requested, **_: choice.TransportChoice("rdma-loopback", f"transport={requested}: the test's")  # noqa: E731
    monkeypatch.setitem(choice.DATA_PATHS, "rdma-loopback", choice.DataPath(
        probe, serve=f"{__name__}:loopback_serve", sampler=f"{__name__}:loopback_sampler"))  # fmt: skip
    cfg = load_config(CONFIG, [*TINY, "actor.num_actors=1", "transport.kind=rdma-loopback", f"run.dir={tmp_path / 'node'}"])
    node = ShardNode(cfg)
    shards = None
    try:
        assert isinstance(node.data_path, RdmaShard) and node.transport.transport == "rdma-loopback"
        address = node.start()
        lcfg = load_config(CONFIG, [*TINY, "transport.kind=rdma-loopback", f"transport.shards=[{address}]",
                                    f"run.dir={tmp_path / 'learner'}"])  # fmt: skip
        agent = make_agent(lcfg, _cartpole_spec(lcfg), torch.device("cpu"))
        shards = RemoteShards(lcfg, agent)
        assert isinstance(shards.sampler.inner, RdmaSampler)
        assert len(node.data_path.export.connected) == 1
        got = waits = 0
        while got < 3:
            try:
                batch = shards.sampler.sample(32, timeout_s=1.0)
            except TimeoutError:  # the node's actor is still filling min_size_to_sample
                node.roles.check()  # a dead actor fails the test (ActorFailed) instead of waiting on
                waits += 1
                assert waits < 600, "the node's actor filled no batch's worth of replay"
                continue
            with node.shard.lock:
                assert_same_batch(node.table, batch)
            got += 1
        assert node.table.samples >= 3 * 32
    finally:
        if shards is not None:
            shards.close()
        node.close()


def _cartpole_spec(cfg):
    from gearflow.envs import make_vec_env

    env = make_vec_env(cfg.env.copy() | {"num_envs": 1, "batch_size": 1}, seed=0)
    try:
        return env.env_spec
    finally:
        env.close()
