"""Replay over the TCP transport, real sockets on loopback, real shared memory.

* A TransitionAdder driven through a RemoteWriter → ShardService leaves the shard's table
  byte for byte as the same adder leaves a local table through a Writer, and a
  RemoteSampler then draws exactly the keys, data, probabilities and weights the local
  table draws (same selector seed); every sampled row is checked against the step its
  key names (a stamp in the obs column).
* The writer's errors: the same types and messages as a local Writer's, at the same call.
* Two shards: a learner samples both; keys route priority updates back to their shard;
  draw frequencies over the shards follow the priorities (chi-square, and a biased
  split fails the same bound).
* Back-pressure: a create_items held by the shard's rate limiter holds the writer (bounded
  in flight), and goes through once the learner samples; the parameter service.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from helpers_envs import Recvs

from gearflow.kinds.transition import Transition, TransitionAdder
from gearflow.params.protocol import ParameterSource
from gearflow.params.store import ParameterStore
from gearflow.replay import RateLimiter
from gearflow.replay.protocols import SamplerLike, WriterLike
from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED, REC_RESERVE, RESERVE
from gearflow.replay.writer import Writer
from gearflow.replay.layout import SHARD_SHIFT
from gearflow.transport.actor import RemoteParams, RemoteWriter
from gearflow.transport.learner import RemoteSampler

TOKEN = "test-token-0123456789"  # conftest.SHARD_TOKEN: shard_of's shards
APEX = {"obs": "float32[3]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}
COUNTERS = [RESERVE, COMMIT, PUBLISHED, EPISODES, REC_RESERVE]


def assert_same_storage(a, b):
    for name in a.columns:
        np.testing.assert_array_equal(a.columns[name].view(np.uint8), b.columns[name].view(np.uint8), err_msg=name)
    np.testing.assert_array_equal(a.counters[:, COUNTERS], b.counters[:, COUNTERS])
    np.testing.assert_array_equal(a.item_start, b.item_start)
    np.testing.assert_array_equal(a.item_length, b.item_length)
    np.testing.assert_array_equal(a.item_priority.view(np.int64), b.item_priority.view(np.int64))


@pytest.mark.parametrize("wire", [None, 0], ids=["gathered", "out-of-segment"])
def test_remote_writer_and_sampler_match_the_shared_memory_path(make_table, shard_of, tmp_path, wire, monkeypatch):
    """``wire=0``: the shard sends every column's rows straight out of its segment (the path
    of wide columns such as frames), not gathered into the table's buffers — with
    ``transport.integrity`` off only (on, the rows are gathered so that the MAC covers the bytes sent)."""
    if wire is not None:
        monkeypatch.setenv("GEARFLOW_INTEGRITY", "0")
    E, S, n = 4, 64, 3
    kw = dict(spec=APEX, P=E, S=S, selector="prioritized", kind=Transition(next_columns=("obs",)),
              selector_kwargs={"alpha": 0.6, "beta": 0.4})  # fmt: skip
    local, served = make_table(**kw), make_table(**kw)
    shard, port = shard_of(served, wire_min_row_bytes=wire)
    assert shard.wire.columns == ([] if wire is None else list(APEX))
    remote = RemoteWriter(("127.0.0.1", port), num_streams=E, token=TOKEN, timeout_s=10, max_in_flight=2)
    assert isinstance(remote, WriterLike)
    assert remote.partitions.tolist() == list(range(E))
    adders = [TransitionAdder(Writer(local.storage, np.arange(E), prefault=False), n, 0.9),
              TransitionAdder(remote, n, 0.9)]  # fmt: skip
    recvs = Recvs(E, b=3, seed=1, stamp=True, sort=True)
    for _ in range(150):  # ~ 2 laps of the 64-step rings
        r = recvs()
        for a in adders:
            a.add(*r)
    for a in adders:
        a.finish()
    remote.flush()  # waits for every batch's reply
    assert adders[0].items == adders[1].items > 100
    assert_same_storage(local.storage, served.storage)
    np.testing.assert_array_equal(remote.positions, adders[0].writer.positions)

    sampler = RemoteSampler([("127.0.0.1", port)], token=TOKEN, prefetch=0, timeout_s=10)
    assert isinstance(sampler, SamplerLike)
    for step in range(20):
        want = local.sample(32)
        got = sampler.sample(32)
        np.testing.assert_array_equal(got.keys.numpy(), want.keys.numpy())
        np.testing.assert_array_equal(got.probabilities.numpy(), want.probabilities.numpy())
        np.testing.assert_array_equal(got.weights.numpy(), want.weights.numpy())
        assert set(got.data) == set(want.data)
        for k in want.data:
            np.testing.assert_array_equal(got.data[k].numpy(), want.data[k].numpy(), err_msg=k)
        # every row is the step its key names: the item record's first row, stamped in obs[:, 0]
        keys = got.keys.numpy()
        st = local.storage
        P, R = st.num_partitions, st.items_per_partition
        p, seq = keys % P, keys // P
        start = st.item_start[p, seq % R]
        rows = p * S + start % S
        np.testing.assert_array_equal(got.data["obs"][:, 0].numpy(), st.columns["obs"][rows, 0])
        new = np.random.default_rng(step).random(32) + 0.1
        applied = sampler.update_priorities(got.keys, torch.from_numpy(new), wait=True)
        assert applied == local.update_priorities(want.keys, new)
    stats = sampler.stats()
    assert stats["replay/size"] == local.stats()["replay/size"]
    assert stats["replay/remote_partitions"] == E
    # a remote checkpoint, restored, samples what the shard's table samples
    from gearflow.replay.table_checkpoint import restore_checkpoint

    shard.checkpoint_dir = tmp_path
    (path,) = sampler.checkpoint("ckpt-1")
    restored = restore_checkpoint(path)
    try:
        assert restored.size == served.size
        np.testing.assert_array_equal(restored.sample(16).keys.numpy(), served.sample(16).keys.numpy())
    finally:
        restored.close()
    with pytest.raises(ValueError, match="a checkpoint name"):
        sampler.checkpoint("../escape")
    sampler.close()
    remote.close()


def test_remote_writer_errors_are_the_local_writers(make_table, shard_of):
    """Each bad call raises the local Writer's error type and message, at the same call."""
    E = 3
    local, served = make_table(spec=APEX, P=E, S=16), make_table(spec=APEX, P=E, S=16)
    _, port = shard_of(served)
    remote = RemoteWriter(("127.0.0.1", port), num_streams=E, token=TOKEN, timeout_s=10)
    ws = [Writer(local.storage, np.arange(E), prefault=False), remote]

    def rows(k, **over):
        d = {"obs": np.zeros((k, 3), np.float32), "action": np.zeros(k, np.int64), "ret": np.zeros(k, np.float32),
             "disc": np.zeros(k, np.float32), "version": np.zeros(k, np.int64)}  # fmt: skip
        d.update(over)
        return d

    for w in ws:
        w.append(rows(E))
        w.extend(rows(4), stream=1)
    bad_calls = [
        lambda w: w.append(rows(2), streams=[0, 0]),
        lambda w: w.append(rows(1), streams=[5]),
        lambda w: w.append(rows(2, obs=np.zeros((2, 4), np.float32)), streams=[0, 1]),
        lambda w: w.append(rows(2, action=np.zeros(2, np.int32)), streams=[0, 1]),
        lambda w: w.extend(rows(17), stream=0),
        lambda w: w.create_items([1.0, 2.0], 1),
        lambda w: w.create_items([1.0], 1, streams=[0, 1]),
        lambda w: w.create_items([float("nan")], 1, streams=[0]),
        lambda w: w.create_items([1.0], 0, streams=[0]),
        lambda w: w.create_items([1.0], 1, streams=[0], ends=[9]),
        lambda w: w.create_items([1.0, 1.0], [5, 6], streams=1),
        lambda w: w.end_episode(7),
    ]
    for i, call in enumerate(bad_calls):
        errors = []
        for w in ws:
            with pytest.raises(Exception) as info:
                call(w)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1], f"bad call {i}"
    for w in ws:  # a valid sequence afterwards: items in order, then one out of order
        w.create_items([1.0, 2.0], [3, 2], streams=1)
        w.end_episode(1)
        with pytest.raises(ValueError, match="crosses an episode boundary"):
            w.create_items([1.0], 2, streams=1)
    remote.flush()
    assert_same_storage(local.storage, served.storage)
    remote.close()


def test_two_shards_sample_like_one_table(make_table, shard_of):
    """Items of two shards with known priorities: the draw frequencies of each item follow
    p / Σp over both shards (chi-square); IS weights use the global count and total;
    priority updates reach the item's own shard."""
    E, S = 2, 64
    tables = [make_table(spec=APEX, P=E, S=S, selector="prioritized", selector_kwargs={"alpha": 1.0, "beta": 1.0})
              for _ in range(2)]  # fmt: skip
    ports = [shard_of(t)[1] for t in tables]
    prios = []
    for i, port in enumerate(ports):
        w = RemoteWriter(("127.0.0.1", port), num_streams=E, token=TOKEN, timeout_s=10)
        k = 10 * (i + 1)  # shard 1 holds twice as many items, with larger priorities
        w.extend({"obs": np.zeros((k, 3), np.float32), "action": np.arange(k), "ret": np.zeros(k, np.float32),
                  "disc": np.zeros(k, np.float32), "version": np.zeros(k, np.int64)}, stream=0)  # fmt: skip
        p = np.arange(1, k + 1, dtype=np.float64) * (i + 1)
        w.create_items(p, 1, streams=0, ends=np.arange(1, k + 1))
        w.close()
        prios.append(p)
    sampler = RemoteSampler([("127.0.0.1", p) for p in ports], token=TOKEN, prefetch=2, timeout_s=10, seed=3)
    all_p = np.concatenate(prios)
    expect = all_p / all_p.sum()
    counts = np.zeros(all_p.size)
    draws, B = 0, 64
    for _ in range(150):
        b = sampler.sample(B)
        keys = b.keys.numpy()
        shard = keys >> SHARD_SHIFT
        local = keys & ((1 << SHARD_SHIFT) - 1)
        item = local // E  # every item is in partition 0: seq = key // P
        idx = np.where(shard == 0, item, prios[0].size + item)
        np.add.at(counts, idx, 1)
        draws += B
        # probabilities are the global ones; IS weights from the global count N
        np.testing.assert_allclose(b.probabilities.numpy(), expect[idx], rtol=1e-9)
        w = (all_p.size * expect[idx]) ** -1.0
        np.testing.assert_allclose(b.weights.numpy(), w / w.max(), rtol=1e-5)

    def chi2(observed, p):
        e = p * observed.sum()
        return float(((observed - e) ** 2 / e).sum())

    dof = all_p.size - 1
    bound = dof + 6 * np.sqrt(2 * dof)  # ~6 sigma above the chi-square mean: never flakes
    assert chi2(counts, expect) < bound
    # the same bound rejects a split that ignores the priority totals (half the draws per shard)
    biased = np.concatenate([prios[0] / prios[0].sum() / 2, prios[1] / prios[1].sum() / 2])
    assert chi2(counts, biased) > bound
    # priority updates are routed by the key's shard bits
    b = sampler.sample(B)
    applied = sampler.update_priorities(b.keys, torch.full((B,), 5.0), wait=True)
    assert applied == B
    from gearflow.transport.server.shard import priority_total

    totals = [priority_total(t)[0] for t in tables]
    assert all(t > 0 for t in totals)
    sampler.close()


def test_create_items_held_by_the_rate_limiter_holds_the_remote_writer(make_table, shard_of):
    """samples_per_insert=1 with a small buffer: inserts beyond it wait on the shard until the
    learner samples; the writer blocks with a bounded number of batches in flight, and a
    rate-limited insert with no learner times out with RateLimiterTimeout, not a hang."""
    E = 1
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=4.0)
    table = make_table(spec=APEX, P=E, S=256, limiter=lim)
    _, port = shard_of(table)
    w = RemoteWriter(("127.0.0.1", port), num_streams=1, token=TOKEN, timeout_s=5, insert_timeout_s=0.5,
                     max_in_flight=2, max_delay_s=0.0)  # every create_items is sent at once  # fmt: skip

    def step(i):
        w.append({"obs": np.full((1, 3), i, np.float32), "action": np.array([i]), "ret": np.zeros(1, np.float32),
                  "disc": np.zeros(1, np.float32), "version": np.zeros(1, np.int64)})  # fmt: skip
        w.create_items([1.0], 1, streams=[0])

    t0 = time.monotonic()
    with pytest.raises(RateLimiterTimeout, match="rate limiter"):
        for i in range(40):  # 5 inserts are allowed; the 6th waits 0.5 s on the shard, then fails
            step(i)
    assert time.monotonic() - t0 < 5
    assert table.storage.counters[0, PUBLISHED] == 5
    # with a learner sampling, the writer goes on (held, not failed)
    w.insert_timeout_s = 10.0
    stop = threading.Event()
    sampler = RemoteSampler(("127.0.0.1", port), token=TOKEN, prefetch=0, timeout_s=10)

    def learn():
        while not stop.is_set():
            try:
                sampler.sample(1, timeout_s=0.2)
            except TimeoutError:
                pass

    th = threading.Thread(target=learn)
    th.start()
    try:
        for i in range(40, 80):
            step(i)
        w.flush()
    finally:
        stop.set()
        th.join()
    assert table.storage.counters[0, PUBLISHED] >= 5 + 40
    sampler.close()
    w.close()


def test_a_batch_failing_part_way_on_the_shard_resyncs_the_writer(make_table, shard_of):
    """One batch of ten append + create_items pairs; the shard's rate limiter lets five items
    through and times out the sixth, so the shard skips the rest of the batch. The error is
    raised once (its own type, with a note), and the writer continues from the shard's
    positions: later writes land where the mirror says, with no cascade of mismatches."""
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=4.0)
    table = make_table(spec=APEX, P=1, S=64, limiter=lim)
    _, port = shard_of(table)
    w = RemoteWriter(("127.0.0.1", port), num_streams=1, token=TOKEN, timeout_s=5, insert_timeout_s=0.3,
                     max_delay_s=60.0)  # one batch until flush  # fmt: skip

    def step(i, item=True):
        w.append({"obs": np.full((1, 3), i, np.float32), "action": np.array([i]), "ret": np.zeros(1, np.float32),
                  "disc": np.zeros(1, np.float32), "version": np.zeros(1, np.int64)})  # fmt: skip
        if item:
            w.create_items([1.0], 1, streams=[0])

    for i in range(10):
        step(i)
    assert w.positions.tolist() == [10]  # the mirror, before the shard has seen anything
    with pytest.raises(RateLimiterTimeout, match="rate limiter") as info:
        w.flush()
    assert any("session on partitions [0] was re-opened" in n for n in info.value.__notes__)
    c = table.storage.counters[0]
    assert c[PUBLISHED] == 5 and c[COMMIT] == 6  # the sixth step went in, its item and the rest did not
    assert w.positions.tolist() == [6]  # re-synced with the shard
    for i in range(6, 12):  # continues where the shard is: no "item ends after the last step" cascade
        step(i, item=False)
    sampler = RemoteSampler(("127.0.0.1", port), token=TOKEN, prefetch=0, timeout_s=10)
    for _ in range(3):
        sampler.sample(1)  # the limiter lets items in again
    w.create_items([2.0], 1, streams=[0])
    w.flush()
    assert c[COMMIT] == 12 and c[PUBLISHED] == 6
    assert table.storage.columns["obs"][11, 0] == 11  # step 11 holds what was appended as step 11
    sampler.close()
    w.close()

def test_remote_params_fetch_only_new_versions(shard_of, make_table):
    net = torch.nn.Linear(4, 2)
    store = ParameterStore.create(net)
    try:
        _, port = shard_of(make_table(spec=APEX, P=1, S=16), params=store)
        src = RemoteParams(("127.0.0.1", port), token=TOKEN, timeout_s=10)
        assert isinstance(src, ParameterSource)
        copy = torch.nn.Linear(4, 2)
        assert src.load_into(copy, min_version=0) is None  # nothing published yet
        with torch.no_grad():
            net.weight.fill_(3.0)
        v = store.publish(net)
        assert src.load_into(copy, min_version=0) == v
        assert torch.equal(copy.weight, net.weight) and torch.equal(copy.bias, net.bias)
        assert src.load_into(copy, min_version=v) is None
        assert src.fetches == 1
        with pytest.raises(ValueError, match="parameter 'weight' is \\[2, 4\\] in the store"):
            src.load_into(torch.nn.Linear(5, 2), min_version=0)
        src.close()
    finally:
        store.close()


def test_sampling_a_closed_shard_table_raises_table_closed_naming_it(make_table, shard_of):
    """A shard's clients get TableClosed by name (issue 33's closed table over the wire): before
    it was registered with the transport, a RemoteError('TableClosed: ...')."""
    from gearflow.replay.storage import TableClosed

    table = make_table(spec=APEX, P=1, S=64)
    w = Writer(table.storage, [0])
    for i in range(4):
        w.append({"obs": np.full((1, 3), i, np.float32), "action": np.array([i]), "ret": np.zeros(1, np.float32),
                  "disc": np.zeros(1, np.float32), "version": np.zeros(1, np.int64)})  # fmt: skip
        w.create_items([1.0], 1, streams=[0])
    _, port = shard_of(table)
    sampler = RemoteSampler(("127.0.0.1", port), token=TOKEN, prefetch=0, timeout_s=10)
    try:
        assert sampler.sample(2).keys.numel() == 2
        name = table.storage.name
        table.close()
        with pytest.raises(TableClosed, match=f"replay table {name} is closed"):
            sampler.sample(2)
    finally:
        sampler.close()


def test_remote_writer_items_over_overwritten_steps_raise_or_are_dropped_on_the_shard(make_table, shard_of):
    """Reverb's CreateItemRejectsExpiredCellRefs over the wire: the shard refuses an item whose
    first step its ring already overwrote, and ``expired="drop"`` (the n-step adder's choice for
    its queued items) drops it there instead, the items beside it published."""
    served = make_table(spec=APEX, P=2, S=8)
    _, port = shard_of(served)
    w = RemoteWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=10)
    k = 6  # twice per stream: steps 0..11 on an 8-step ring, steps 0..3 overwritten
    for stream in (0, 0, 1, 1):
        w.extend({"obs": np.zeros((k, 3), np.float32), "action": np.zeros(k, np.int64), "ret": np.zeros(k, np.float32),
                  "disc": np.zeros(k, np.float32), "version": np.zeros(k, np.int64)}, stream=stream)  # fmt: skip
    w.create_items([1.0, 2.0], 2, streams=0, ends=[3, 11], expired="drop")
    w.flush()
    served.scan()
    assert (served.inserts, served.size) == (1, 1)
    with pytest.raises(ValueError, match="already overwrote"):
        w.create_items([3.0], 2, streams=1, ends=[4])
        w.flush()
    served.scan()
    assert (served.inserts, served.size) == (1, 1)
    w.close()
