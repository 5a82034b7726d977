"""Replay semantics the peers' own test suites expect (Reverb ``table_test.cc``,
``rate_limiter_test.cc``, ``item_selectors_test``, ``trajectory_writer_test``), translated to
gearflow's API: each test is named after the expectation it honours (issue 33)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_replay import SPEC, step_values

from gearflow.kinds.transition import Transition
from gearflow.replay import (
    RateLimiter,
    RateLimiterTimeout,
    SharedStorage,
    Table,
    TableClosed,
    TableSpec,
    TrajectoryWriter,
    Writer,
    make_selector,
)
from gearflow.replay import writer as writer_module
from gearflow.replay.storage import H_CLOSED, PUBLISHED, WRITER_PID, PartitionOwned

ROOT = Path(__file__).resolve().parents[1]


def _append(w: Writer, stream: int = 0, n: int = 1) -> None:
    for _ in range(n):
        p, t = int(w.partitions[stream]), int(w.positions[stream])
        w.append(step_values([p], [t]), streams=[stream])


@pytest.fixture(params=["c", "numpy"])
def item_path(request, monkeypatch):
    """Writer.create_items of one stream through the C ``stream_items`` and the numpy reference."""
    if request.param == "numpy":
        monkeypatch.setattr(writer_module, "_hotpath", None)
    elif writer_module._hotpath is None:
        pytest.skip("the C module was not built")
    return request.param


# ---------------------------------------------------------------------------- 1: expired cell refs
@pytest.mark.parametrize("streams", ["one", "batch"])
def test_create_item_rejects_expired_cell_refs(make_table, item_path, streams):
    """Reverb's CreateItemRejectsExpiredCellRefs: an item over steps the ring already overwrote
    is refused with an error naming it (before: published, counted as an insert, evicted at the
    next scan unseen), and nothing already stored is lost."""
    t = make_table(SPEC, P=1, S=8, R=16)
    w = Writer(t.storage, [0])
    _append(w, n=12)  # steps 0..11: the ring of 8 holds 4..11
    kw = {"streams": 0} if streams == "one" else {"streams": [0]}
    for ends, n in (([4], 1), ([5], 2), ([11], 8)):
        with pytest.raises(ValueError, match=r"item starting at step 3 of stream 0 refers to steps the ring already "
                                             r"overwrote: the stream holds steps >= 4 \(8 steps behind its next step 12\)"):
            w.create_items([1.0], n, ends=ends, **kw)
    assert int(t.storage.counters[0, PUBLISHED]) == 0  # nothing published by the refused calls
    w.create_items([1.0], 3, ends=[7], **kw)  # steps 4..6: the oldest held
    w.create_items([1.0], 2, ends=[8], **kw)  # steps 6, 7
    t.scan()
    assert (t.inserts, t.size, t.evictions) == (2, 2, 0)


def test_create_item_rejects_expired_cell_refs_of_stacked_frames(make_table):
    """With stacked frames a stack reaches k-1 steps before its item: the trusted window is
    S - (k-1) steps, and TrajectoryWriter.create_item refuses an item longer than that."""
    spec = TableSpec.parse({"obs": "uint8[4,2,2] stack=4", "action": "int64"})
    t = make_table(spec, P=1, S=8)
    w = TrajectoryWriter(t.storage, 0)
    for i in range(10):
        w.append({"obs": np.full((2, 2), i, np.uint8), "action": np.int64(i)})
    with pytest.raises(ValueError, match=r"item starting at step 4 of stream 0 refers to steps the ring already "
                                         r"overwrote: the stream holds steps >= 5"):
        w.create_item(1.0, 6)
    w.create_item(1.0, 5)
    t.scan()
    assert (t.inserts, t.size) == (1, 1)


# ---------------------------------------------------------------------------- 2: rate limiter stage 1
def test_unblocks_inserts_if_deleted_items_bring_size_below_min_size(make_table):
    """Reverb's UnblocksInsertsIfDeletedItemsBringsSizeBelowMinSize: inserts always go while
    size + n <= min_size_to_sample. Before, ring eviction took the table below its minimum
    while the writer was at its limit: the sample waited for size, the insert for samples."""
    lim = RateLimiter(min_size_to_sample=2, samples_per_insert=5, error_buffer=5)
    t = make_table(SPEC, P=1, S=8, limiter=lim)
    w = Writer(t.storage, [0], insert_timeout_s=0.3)
    for _ in range(3):  # the limit before any sample: floor((2 * 5 + 5) / 5) = 3 items
        _append(w)
        w.create_items([1.0], 1, streams=0)
    t.scan()
    assert t.size == 3 and not lim.can_insert(3, 0, 1)
    _append(w, n=12)  # the ring of 8 overwrote all three: evicted at the next scan
    t.scan()
    assert (t.size, t.evictions) == (0, 3)
    w.create_items([1.0], 1, streams=0)  # stage 1: 0 held + 1 <= 2
    _append(w)
    w.create_items([1.0], 1, streams=0)  # 1 + 1 <= 2
    _append(w)
    with pytest.raises(RateLimiterTimeout):  # 2 held + 1 > 2, and nothing sampled yet
        w.create_items([1.0], 1, streams=0)
    assert t.sample(1).keys.numel() == 1


def test_unblocks_inserts_if_deleted_items_bring_size_below_min_size_across_threads(make_table):
    """The deadlock itself: a learner blocked in sample (its wait scans) and a writer held at its
    limit while the ring evicts; both used to time out. Waits on progress only."""
    lim = RateLimiter(min_size_to_sample=2, samples_per_insert=5, error_buffer=5)
    t = make_table(SPEC, P=1, S=8, limiter=lim, sample_timeout_s=30.0)
    w = Writer(t.storage, [0], insert_timeout_s=30.0)
    for _ in range(3):
        _append(w)
        w.create_items([1.0], 1, streams=0)
    t.scan()
    got: list = []
    sampler = threading.Thread(target=lambda: got.append(t.sample(2)), daemon=True)
    _append(w, n=12)  # evicts all three at the sampler's next scan
    sampler.start()
    for _ in range(2):  # held at the limit until the sampler's scan publishes stage 1
        _append(w)
        w.create_items([1.0], 1, streams=0)
    sampler.join(60)
    assert not sampler.is_alive() and got and got[0].keys.numel() == 2


# ---------------------------------------------------------------------------- 3: all-zero priorities
def test_all_zero_priorities_results_in_uniform_sampling_of_a_table(make_table):
    """A learner whose TD errors all reached 0 keeps sampling: uniformly, weights 1 (Reverb's
    AllZeroPrioritiesResultsInUniformSampling), torn redraws included."""
    t = make_table(SPEC, P=1, S=16, selector="prioritized", selector_kwargs={"alpha": 0.6, "beta": 0.4})
    w = Writer(t.storage, [0])
    for _ in range(3):
        _append(w)
        w.create_items([1.0], 1, streams=0)
    s = t.sample(3)
    t.update_priorities(s.keys, torch.zeros(3))
    seen = np.concatenate([t.sample(30).keys.numpy() for _ in range(20)])
    assert set(seen.tolist()) == {0, 1, 2} and np.bincount(seen).min() > 120  # 200 expected each
    s = t.sample(4)
    assert s.probabilities.tolist() == [1 / 3] * 4 and s.weights.tolist() == [1.0] * 4


# ---------------------------------------------------------------------------- 4: a closed table
def test_sample_after_close_names_the_closed_table(make_table):
    """Reverb cancels a closed table's calls with an error naming it; gearflow raised
    IndexError / TypeError from the unmapped arrays."""
    t = make_table(SPEC, P=1, S=16)
    w = Writer(t.storage, [0])
    for _ in range(3):
        _append(w)
        w.create_items([1.0], 1, streams=0)
    t.sample(2)
    name = t.storage.name
    t.close()
    t.close()  # idempotent
    for call in (lambda: t.sample(1), lambda: t.sample(2), lambda: t.update_priorities([0], [1.0]),
                 t.scan, t.stats, lambda: t.can_sample(1)):  # fmt: skip
        with pytest.raises(TableClosed, match=f"replay table {name} is closed"):
            call()


def test_close_wakes_a_blocked_sample_with_table_closed(make_table):
    """A sample blocked by the rate limiter in another thread is woken by close() with
    TableClosed (before: TypeError: 'NoneType' object is not subscriptable)."""
    t = make_table(SPEC, P=1, S=16, limiter=RateLimiter(min_size_to_sample=5), sample_timeout_s=60.0)
    errors: list = []
    waiting = threading.Event()
    scans = [0]
    scan = t.scan

    def counted_scan():  # the sample's first scan, then its wait's: set once it waits
        scans[0] += 1
        if scans[0] >= 2:
            waiting.set()
        return scan()

    t.scan = counted_scan

    def sample():
        try:
            t.sample(1)
        except BaseException as exc:
            errors.append(exc)
        waiting.set()

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    assert waiting.wait(60) and th.is_alive()
    t.close()
    th.join(30)
    assert not th.is_alive() and len(errors) == 1 and isinstance(errors[0], TableClosed), errors
    assert "closed while a sample of 1 waited for the rate limiter" in str(errors[0])


# ---------------------------------------------------------------------------- 5: writers learn it
@pytest.mark.parametrize("limited", [False, True])
def test_writers_learn_that_the_table_closed(make_table, item_path, limited):
    """A writer attached by name refuses to publish into a closed table's segment (before: it
    kept appending and publishing into the unlinked segment without error)."""
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=1, error_buffer=100) if limited else None
    t = make_table(SPEC, P=2, S=16, limiter=lim)
    other = SharedStorage.attach(t.storage.name)  # as an actor process does
    try:
        w = Writer(other, [0], insert_timeout_s=30.0)
        tw = TrajectoryWriter(other, 1, insert_timeout_s=30.0)
        _append(w)
        w.create_items([1.0], 1, streams=0)
        tw.append({k: v[0] for k, v in step_values([1], [0]).items()})
        tw.create_item(1.0, 1)
        t.close()
        _append(w)
        for call in (lambda: w.create_items([1.0], 1, streams=0), lambda: w.create_items([1.0], 1, streams=[0]),
                     lambda: tw.create_item(1.0, 1)):  # fmt: skip
            with pytest.raises(TableClosed, match=f"replay table {t.storage.name} was closed"):
                call()
        assert other.counters[:, PUBLISHED].tolist() == [1, 1] and other.header[H_CLOSED] == 1
    finally:
        other.close()


# ---------------------------------------------------------------------------- 7: hand partitions over
def test_writer_close_hands_its_partitions_to_another_process(storage_factory):
    """Prefill in one process, continue in another while the first lives (offline data, then an
    actor): Writer.close() releases the partitions (before: PartitionOwned while it lived)."""
    st = storage_factory(SPEC, P=2, S=16)
    w = Writer(st, [0, 1], prefault=False)
    for _ in range(3):
        w.append({k: v for k, v in step_values([0, 1], [w.positions[0]] * 2).items()})
    w.create_items([1.0, 2.0], 2)
    w.close()
    assert st.counters[[0, 1], WRITER_PID].tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"this writer was closed: partitions \[0, 1\] were handed over"):
        w.append(step_values([0, 1], [3, 3]))
    with pytest.raises(ValueError, match="this writer was closed"):
        w.create_items([1.0, 1.0], 1)
    code = textwrap.dedent(f"""
        from gearflow.replay.storage import SharedStorage
        from gearflow.replay.writer import Writer
        st = SharedStorage.attach({st.name!r})
        w = Writer(st, [1], prefault=False)
        print(w.positions.tolist(), flush=True)
        w.close()
        st.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3]"  # continues after the first writer's last step
    # a live writer that did not close still holds its partition
    w2 = Writer(st, [0], prefault=False)
    code_refused = code.replace("Writer(st, [1]", "Writer(st, [0]")
    code_refused = textwrap.dedent(f"""
        import os
        from gearflow.replay.storage import SharedStorage, PartitionOwned
        from gearflow.replay.writer import Writer
        st = SharedStorage.attach({st.name!r})
        try:
            Writer(st, [0], prefault=False)
        except PartitionOwned as exc:
            print("refused", flush=True)
        st.close()
    """)
    out = subprocess.run([sys.executable, "-c", code_refused], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.stdout.strip() == "refused", out.stderr
    assert int(st.counters[0, WRITER_PID]) == os.getpid()
    w2.close()
    assert PartitionOwned  # the error a second live writer gets


# ---------------------------------------------------------------------------- the C n-step adder
_hotpath = writer_module._hotpath
needs_c = pytest.mark.skipif(_hotpath is None, reason="the C module was not built")
APEX = {"obs": "float32[3]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}
FRAMES = {"obs": "uint8[4,5,5] stack=4", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}


def _adders(storage_factory, spec, E, S, n):
    from gearflow.kinds.transition import TransitionAdder

    out = []
    for native in (False, True):
        st = storage_factory(spec, P=E, S=S)
        out.append((st, TransitionAdder(Writer(st, np.arange(E), prefault=False), n, 0.9, native=native)))
    return out


@needs_c
def test_adders_drop_and_count_items_the_ring_overtook_before_their_flush(storage_factory):
    """A tiny ring (S=8, n=3) overtakes items queued for the next flush: both adders drop them
    (counted in Writer.expired_items) instead of publishing what the table would evict unseen
    (C) or raising the writer's expired-item error (the numpy reference)."""
    from helpers_envs import Recvs

    (sa, ref), (sb, nat) = _adders(storage_factory, APEX, 8, 8, 3)
    recvs = Recvs(8, 4, 4, seed=803, p_end=0.08)
    for step in range(400):
        batch = recvs(version=step // 7)
        ref.add(*batch)
        nat.add(*batch)
    ref.finish()
    nat.finish()
    assert ref.writer.expired_items == nat.writer.expired_items > 0
    assert nat.items == ref.items == int(sb.counters[:, PUBLISHED].sum()) == int(sa.counters[:, PUBLISHED].sum())
    np.testing.assert_array_equal(sa.item_start, sb.item_start)


@needs_c
def test_c_adder_flush_that_exactly_reaches_the_limit_passes(storage_factory):
    """Mutant: nstep_publish's limit check `>=` instead of `>`. Reverb's CanInsert allows
    inserts + n <= limit, so a flush that lands exactly on the limit publishes at once, without
    waiting on the rate limiter."""
    from helpers_envs import Recvs

    from gearflow.replay.storage import H_INSERT_LIMIT

    (_, _), (sb, nat) = _adders(storage_factory, APEX, 2, 64, 1)
    nat.flush_every = 10**9
    recvs = Recvs(2, 2, 3, seed=5, p_end=0.0)
    for step in range(6):
        nat.add(*recvs(step))
    m = nat._native.pending  # items queued in the C path (NativeNStep)
    assert m > 0
    sb.header[H_INSERT_LIMIT] = m  # nothing published yet: exactly room for the m queued items
    waits = []
    nat.writer.wait_for_insert = lambda k: waits.append(k)
    assert nat.flush_items() == m and waits == []
    assert int(sb.counters[:, PUBLISHED].sum()) == m


@needs_c
def test_c_adder_caps_step_offsets_at_255_like_the_reference(storage_factory):
    """Mutant: the C adder's stacked-frame offset not capped (uint8 wraps at 256). An episode
    longer than 255 steps: every offset the C adder writes equals the numpy reference's."""
    from helpers_envs import Recvs

    (sa, ref), (sb, nat) = _adders(storage_factory, FRAMES, 1, 16, 3)
    recvs = Recvs(1, 1, 3, seed=2, p_end=0.0, obs=((4, 5, 5), np.uint8))
    for step in range(300):
        batch = recvs(version=1)
        ref.add(*batch)
        nat.add(*batch)
        np.testing.assert_array_equal(sa.step_offset, sb.step_offset, err_msg=f"step offsets after recv {step}")
    assert int(sb.step_offset.max()) == 255 and int(sb.counters[0, PUBLISHED]) > 0


@needs_c
def test_c_adder_max_q_lets_nan_win_in_a_later_column(storage_factory):
    """Mutant: the C adder's max over Q-values without "NaN wins". numpy's max is NaN when any
    column is: with NaN only in a later column (the acted one finite) both refuse the flush."""
    from helpers_envs import Recvs

    errors = []
    for st, adder in _adders(storage_factory, APEX, 2, 32, 1):
        recvs = Recvs(2, 2, 3, seed=1, p_end=0.0)
        adder.flush_every = 10**9
        for step in range(4):
            ids, obs, reward, term, trunc, first, actions, values, v = recvs(step)
            if step == 1:
                actions[:] = 0
                values[:, 0] = 1.0
                values[:, 2] = np.nan  # not the acted column: only the bootstrap max sees it
            adder.add(ids, obs, reward, term, trunc, first, actions, values, v)
        with pytest.raises(ValueError, match=r"priority must be finite and ≥ 0, got nan at index"):
            adder.flush_items()
        errors.append(adder.native)
    assert errors == [False, True]


# ---------------------------------------------------------------------------- one limit, two writers
def test_two_writers_share_one_insert_limit(make_table):
    """Mutant: a writer's insert limit counting only its own partitions. The limit is the
    table's: what another writer published counts too."""
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=1, error_buffer=3)
    t = make_table(SPEC, P=2, S=16, limiter=lim)
    a, b = Writer(t.storage, [0], insert_timeout_s=0.2), Writer(t.storage, [1], insert_timeout_s=0.2)
    assert lim.insert_limit(0) == 4
    _append(a, n=4)
    a.create_items(np.ones(4), 1, streams=0, ends=np.arange(1, 5))
    _append(b)
    with pytest.raises(RateLimiterTimeout, match="4 inserted, 0 sampled, limit 4"):
        b.create_items([1.0], 1, streams=0)
    t.sample(1)  # one sample: one more insert
    b.create_items([1.0], 1, streams=0)
    assert t.storage.counters[:, PUBLISHED].tolist() == [4, 1]


# ---------------------------------------------------------------------------- priority updates by key
@pytest.mark.parametrize("as_tensors", [False, True])
def test_update_of_a_key_whose_slot_was_reused_is_not_applied_to_the_new_item(make_table, as_tensors):
    """Mutant: the C update_by_key checking only that the slot is live. A key names one item:
    when the record ring reused its slot for a newer item, the update is skipped."""
    t = make_table(SPEC, P=1, S=64, R=4, selector="prioritized", selector_kwargs={"alpha": 1.0, "beta": 1.0})
    w = Writer(t.storage, [0])
    for _ in range(4):
        _append(w)
        w.create_items([1.0], 1, streams=0)
    t.scan()
    for _ in range(4):  # items 4..7 take slots 0..3: keys 0..3 name items the table no longer holds
        _append(w)
        w.create_items([2.0], 1, streams=0)
    t.scan()
    assert t.selector.tree.native == (writer_module._hotpath is not None)
    keys, prios = np.array([1, 2, 6]), np.array([50.0, 60.0, 70.0])
    if as_tensors:
        keys, prios = torch.from_numpy(keys), torch.from_numpy(prios)
    assert t.update_priorities(keys, prios) == 1
    np.testing.assert_array_equal(t.selector.tree.leaves[:4], [2.0, 2.0, 70.0, 2.0])


# ---------------------------------------------------------------------------- the device table's update
class _RecordingDevice:
    """A DeviceSampler stand-in (no GPU): what the table tells its device mirror."""

    def __init__(self, storage, selector):
        self.storage, self.selector, self.updates = storage, selector, []

    def insert(self, *a):
        pass

    def remove(self, *a):
        pass

    def load(self, *a):
        pass

    def close(self):
        pass

    def update_keys(self, keys, prios):
        self.updates.append((np.asarray(keys).tolist(), np.asarray(prios).tolist()))
        return len(keys)


def test_device_table_update_skips_keys_it_no_longer_holds(storage_factory):
    """Mutant: the device table's host-array update counting every key handed in. The keys go to
    the device as they are (its mark_updates kernel skips evicted keys: test_native's
    update_by_key case), and the count returned is of the keys the table still holds, as on the
    CPU path."""
    st = storage_factory(SPEC, P=1, S=8, R=8)
    sel = make_selector("prioritized", 8, seed=0)
    dev = _RecordingDevice(st, sel)
    t = Table(st, Transition(), sel, device=dev)
    w = Writer(st, [0])
    for _ in range(4):
        _append(w)
        w.create_items([1.0], 1, streams=0)
    _append(w, n=6)  # steps 0 and 1 overwritten: items 0, 1 evicted
    t.scan()
    assert t.size == 2
    assert t.update_priorities(np.array([0, 3, 1, 2]), np.array([5.0, 6.0, 7.0, 8.0])) == 2
    assert dev.updates == [([0, 3, 1, 2], [5.0, 6.0, 7.0, 8.0])]
    t.close()


# ---------------------------------------------------------------------------- the wire
def test_frame_shape_with_negative_dimensions_is_a_frame_error():
    """Mutant: the framing's non-negative-dimension check dropped. Shape [-2, -4] has a
    product of 8, which 8 buffer bytes would match: it must be refused by name."""
    import json

    from gearflow.transport.framing import FrameError, FrameLimits, parse_envelope

    env = json.dumps({"op": "replay.sample", "meta": {}, "bufs": [["uint8", [-2, -4]]]}).encode()
    with pytest.raises(FrameError, match=r"buffer 0: shape must be non-negative ints, got \[-2, -4\]"):
        parse_envelope(env, 1, 8, FrameLimits())
    ok = json.dumps({"op": "replay.sample", "meta": {}, "bufs": [["uint8", [2, 4]]]}).encode()
    assert parse_envelope(ok, 1, 8, FrameLimits())[2][0][1] == (2, 4)


# ---------------------------------------------------------------------------- RemoteSampler._mend
def test_remote_mend_renormalises_the_whole_batch_after_a_partial_torn_redraw():
    """Mutant: RemoteSampler's mend (BatchAssembly.mend) without its final re-normalisation.
    After one row of a shard's reply is redrawn, every row's probability is its mass at its draw
    over the shard's total now, and the IS weights are (N P)^-beta / max over the batch, as a
    local table's."""
    from gearflow.replay.protocols import SelectorInfo
    from gearflow.transport.learner.assembly import BatchAssembly

    selector = SelectorInfo("prioritized", True)
    selector.beta = 0.5
    assembly = BatchAssembly(selector, num_buffers=1)
    fresh_meta = {"total": 20.0, "count": 5}  # the shard changed since the first draw
    fresh = [np.array([99], np.int64), np.array([0.25]), np.array([1.0], np.float32), np.array([[7.0]], np.float32)]
    redrawn = []

    def redraw(n):
        redrawn.append(n)
        return fresh_meta, [a.copy() for a in fresh]

    keys = np.array([10, 11, 12, 13], np.int64)
    probs = np.array([0.1, 0.2, 0.3, 0.4])  # masses 1, 2, 3, 4 of a total of 10
    weights = np.ones(4, np.float32)
    data = np.arange(4, dtype=np.float32)[:, None]
    torn = np.array([0, 0, 1, 0], np.uint8)
    reply = (0, 4, {"total": 10.0, "count": 4, "torn": True}, [keys, probs, weights, data, torn])
    *_, bufs = assembly.mend(reply, "shard-0", redraw, 5.0, lambda: sum(redrawn))
    assert bufs[0].tolist() == [10, 11, 99, 13] and bufs[3][:, 0].tolist() == [0.0, 1.0, 7.0, 3.0]
    want_p = np.array([1.0, 2.0, 5.0, 4.0]) / 20.0
    np.testing.assert_allclose(bufs[1], want_p)
    w = (5 * want_p) ** -0.5
    np.testing.assert_allclose(bufs[2], w / w.max(), rtol=1e-6)
    assert redrawn == [1]


def test_remote_mend_wins_when_every_redraw_of_many_rows_is_torn_on_the_way():
    """Mutant: the mend redrawing every torn row in each round. A link so slow that any reply
    of more than one row is overwritten on its way loses all of them, round after round, until
    the timeout; after a round that lost every row it tried, the next asks for half as many."""
    from gearflow.replay.protocols import SelectorInfo
    from gearflow.transport.learner.assembly import BatchAssembly

    assembly = BatchAssembly(SelectorInfo("uniform", False), num_buffers=1)
    asked, next_key = [], iter(range(100, 10_000))

    def redraw(n):
        asked.append(n)
        keys = np.array([next(next_key) for _ in range(n)], np.int64)
        data = keys.astype(np.float32)[:, None]
        torn = np.full(n, 1 if n > 1 else 0, np.uint8)
        return {"total": 8.0, "count": 8, "torn": bool(torn.any())}, [keys, np.full(n, 0.125), np.ones(n, np.float32), data, torn]

    keys = np.arange(8, dtype=np.int64)
    reply = (0, 8, {"total": 8.0, "count": 8, "torn": True},
             [keys, np.full(8, 0.125), np.ones(8, np.float32), keys.astype(np.float32)[:, None], np.ones(8, np.uint8)])  # fmt: skip
    *_, bufs = assembly.mend(reply, "shard-0", redraw, 5.0, lambda: sum(asked))
    assert (bufs[0] >= 100).all() and len(set(bufs[0].tolist())) == 8  # every row redrawn, once each kept
    np.testing.assert_array_equal(bufs[3][:, 0], bufs[0].astype(np.float32))  # each row its own item's data
    assert asked[:4] == [8, 4, 2, 1] and max(asked[4:]) <= 2


# ---------------------------------------------------------------------------- data-parallel setup
def test_data_parallel_setup_broadcasts_buffers_of_an_agent_without_state_dict(monkeypatch):
    """Mutant: the data-parallel fallback broadcast skipping module.buffers(). An agent without
    state_dict/load_state_dict gets rank 0's parameters *and* buffers (BatchNorm's running
    statistics) on every rank."""
    from gearflow.distributed import DataParallel

    def make_agent(seed):
        torch.manual_seed(seed)

        class Agent:
            def __init__(self):
                self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
                self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)

        agent = Agent()
        agent.net.train()
        agent.net(torch.randn(16, 3) * (seed + 1))  # running statistics differ per rank
        return agent

    rank0, rank1 = make_agent(0), make_agent(1)
    source = iter([*rank0.net.parameters(), *rank0.net.buffers()])
    dp = DataParallel(1, 2, "127.0.0.1:1", "gloo")  # not joined: the broadcast is replaced below
    monkeypatch.setattr(dp, "_require_joined", lambda: None)
    # rank 1's side of each broadcast: the tensor takes rank 0's value, in the same order
    monkeypatch.setattr(dp, "_broadcast_tensor", lambda t: t.data.copy_(next(source)))
    dp.setup(rank1)
    for a, b in zip(rank0.net.state_dict().values(), rank1.net.state_dict().values()):
        assert torch.equal(a, b)
