"""ParameterStore: round trips, validation, other processes, torn-read freedom under load."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from gearflow.params import H_SEQ, ParameterStore
from gearflow.replay.storage import SHM_DIR, SharedStorage, gc_segments, list_segments


def make_params(fill: float = 0.0) -> dict[str, torch.Tensor]:
    return {
        "w": torch.full((256, 256), fill, dtype=torch.float32),
        "b": torch.full((512,), fill, dtype=torch.float64),
        "steps": torch.full((1000,), int(fill), dtype=torch.int64),
        "h": torch.full((3, 100), fill, dtype=torch.float16),  # integers exact up to 2048
        "scalar": torch.tensor(fill),
    }


def blank_like(store: ParameterStore) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(shape, dtype=dtype) for k, dtype, shape, _ in store.layout}


def checksum(state: dict[str, torch.Tensor]) -> float:
    return sum(float(t.double().sum()) * (i + 1) for i, t in enumerate(state.values()))


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


@pytest.fixture
def store():
    s = ParameterStore.create(make_params())
    try:
        yield s
    finally:
        s.close()


# ---------------------------------------------------------------- single process
def test_round_trip_and_versions(store):
    assert store.latest_version() == 0
    dst = make_params()
    assert store.load_into(dst) is None  # nothing published yet
    for v in (1, 2, 3):
        src = {k: torch.randn(t.shape).to(t.dtype) for k, t in make_params().items()}
        assert store.publish(src) == v
        assert store.latest_version() == v
        assert store.load_into(dst, min_version=v - 1) == v
        assert all(torch.equal(dst[k], src[k]) for k in src)
        assert store.load_into(dst, min_version=v) is None
    version, copy = store.read()
    assert version == 3 and all(torch.equal(copy[k], src[k]) for k in src)
    store.publish(make_params(7.0))
    assert all(torch.equal(copy[k], src[k]) for k in src), "read() must return a private copy"


def test_publish_with_explicit_version_continues_numbering(store):
    src = make_params(2.0)
    assert store.publish(src, version=41) == 41  # a resumed run continues at its checkpoint's version
    assert store.latest_version() == 41
    dst = make_params()
    assert store.load_into(dst, min_version=40) == 41 and all(torch.equal(dst[k], src[k]) for k in src)
    assert store.publish(make_params(3.0)) == 42
    with pytest.raises(ValueError, match="version 42 is not newer than the latest published version 42"):
        store.publish(make_params(4.0), version=42)
    assert store.read()[0] == 42 and torch.equal(store.read()[1]["w"], make_params(3.0)["w"])


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda p: p.__setitem__("w", torch.zeros(256, 255)), "'w'"),
        (lambda p: p.__setitem__("b", torch.zeros(512, dtype=torch.float32)), "'b'"),
        (lambda p: p.pop("steps"), "'steps'"),
        (lambda p: p.__setitem__("extra", torch.zeros(1)), "'extra'"),
    ],
    ids=["shape", "dtype", "missing", "unexpected"],
)
def test_mismatch_raises_and_leaves_store_unchanged(store, change, needle):
    store.publish(make_params(1.0))
    bad = make_params(9.0)
    change(bad)
    with pytest.raises(ValueError, match=needle):
        store.publish(bad)
    version, state = store.read()
    assert version == 1 and store.latest_version() == 1
    assert all(torch.equal(state[k], t) for k, t in make_params(1.0).items())
    # both slots are untouched (the one a failed write would have used is still zero)
    assert all(float(t.abs().sum()) == 0 for t in store.slots[0].values())
    with pytest.raises(ValueError, match=needle):
        store.load_into(bad)


def test_failed_copy_mid_publish_leaves_latest_version_readable(store):
    store.publish(make_params(1.0))
    broken = make_params(2.0)
    broken["scalar"] = torch.empty((), device="meta")  # right shape/dtype, copy_ fails late
    with pytest.raises(NotImplementedError):
        store.publish(broken)
    assert store.latest_version() == 1
    version, state = store.read()
    assert version == 1 and all(float(t.min()) == float(t.max()) == 1.0 for t in state.values())
    assert store.publish(make_params(3.0)) == 2  # reuses the half-written slot
    assert all(int(store.header[i]) % 2 == 0 for i in H_SEQ)
    version, state = store.read()
    assert version == 2 and all(float(t.min()) == float(t.max()) == 3.0 for t in state.values())


def test_module_template():
    torch.manual_seed(0)
    learner, actor = mlp(), mlp()
    with ParameterStore.create(learner) as s:
        assert s.publish(learner) == 1
        assert not all(torch.equal(a, b) for a, b in zip(learner.parameters(), actor.parameters()))
        weight = actor[0].weight
        assert s.load_into(actor) == 1
        assert actor[0].weight is weight  # copied in place, parameters stay the same objects
        for a, b in zip(learner.state_dict().values(), actor.state_dict().values()):
            assert torch.equal(a, b)
        x = torch.randn(5, 8)
        assert torch.equal(learner(x), actor(x))
        actor(x).sum().backward()  # still trainable leaf parameters
        assert actor[0].weight.grad is not None
        assert s.load_into(actor.state_dict(), min_version=1) is None
        with torch.no_grad():
            learner[2].bias.add_(1.0)
        assert s.publish(learner.state_dict()) == 2
        assert s.load_into(actor, min_version=1) == 2
        assert torch.equal(actor[2].bias, learner[2].bias)


def test_seqlock_retries_when_writer_reuses_the_slot(store, monkeypatch):
    """Deterministic interleaving: two publishes land while a reader copies out of a slot."""
    store.publish(make_params(1.0))
    calls = []

    def copy(slot):
        calls.append({k: t.clone() for k, t in slot.items()})
        if len(calls) == 1:  # mid-copy, the writer publishes twice: the 2nd reuses our slot
            store.publish(make_params(2.0))
            store.publish(make_params(3.0))

    version = store._read_consistent(copy)
    assert version == 3 and len(calls) == 2 and store.retries == 1
    assert all(float(t.min()) == float(t.max()) == 3.0 for t in calls[-1].values())

    monkeypatch.setattr("gearflow.params.store.MAX_RETRIES", 50)
    store.header[H_SEQ[int(store.header[2])]] += 1  # a writer in the middle of the latest slot
    with pytest.raises(RuntimeError, match="no consistent read"):
        store.read()
    store.header[H_SEQ[int(store.header[2])]] += 1


def test_no_shm_leak_and_gc_compatible():
    s = ParameterStore.create(make_params())
    path = SHM_DIR / s.name
    try:
        assert s.name.startswith("gearflow") and path.exists()
        other = ParameterStore.attach(s.name)
        other.close()  # a reader's close leaves the segment alone
        assert path.exists()
        assert (s.name, s.header[5], path.stat().st_size) in list(list_segments())
        assert s.name not in [n for n, _ in gc_segments(dry_run=True)]  # owner alive
        with pytest.raises(ValueError, match="not a gearflow table"):
            SharedStorage.attach(s.name)
    finally:
        s.close()
    assert not path.exists()
    s.close()  # idempotent
    with ParameterStore.create(make_params()) as s2:
        path2 = SHM_DIR / s2.name
        assert path2.exists()
    assert not path2.exists()
    with pytest.raises(FileNotFoundError):
        ParameterStore.attach(s2.name)


# ---------------------------------------------------------------- other processes
def _attach_child(name: str, results) -> None:
    with ParameterStore.attach(name) as s:
        dst = blank_like(s)
        version = s.load_into(dst)
        results.put((version, checksum(dst), s.load_into(dst, min_version=version)))


def _reader_child(name: str, target: int, ready, results, stop) -> None:
    torch.set_num_threads(1)  # OpenMP workers spinning on an oversubscribed box stall everyone
    with ParameterStore.attach(name) as s:
        dst = blank_like(s)
        loads = torn = decreasing = 0
        last = 0
        ready.put(True)
        while last < target and not stop.is_set():  # until the last version, or the test gives up
            v = s.load_into(dst, min_version=last)
            if v is None:
                time.sleep(0)  # yield: the writer shares the cores with us
                continue
            loads += 1
            if v <= last:
                decreasing += 1
            if any(float(t.min()) != v or float(t.max()) != v for t in dst.values()):
                torn += 1
            last = v
        results.put({"loads": loads, "torn": torn, "decreasing": decreasing, "last": last,
                     "retries": s.retries})


def _join_all(procs) -> None:
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)


def test_attach_from_spawned_process(store):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    src = {k: torch.randn(t.shape).to(t.dtype) for k, t in make_params().items()}
    store.publish(make_params(5.0))
    assert store.publish(src) == 2
    p = ctx.Process(target=_attach_child, args=(store.name, results))
    try:
        p.start()
        version, child_sum, again = results.get(timeout=30)
        assert version == 2 and again is None
        assert child_sum == pytest.approx(checksum(src), rel=1e-12)
    finally:
        _join_all([p])
    assert p.exitcode == 0


def test_concurrent_readers_never_see_torn_copies(store):
    n_versions, n_readers = 2000, 2
    ctx = mp.get_context("spawn")
    ready, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_reader_child, args=(store.name, n_versions, ready, results, stop))
             for _ in range(n_readers)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=30)
        params = make_params()
        for v in range(1, n_versions + 1):
            for t in params.values():
                t.fill_(v)
            assert store.publish(params) == v  # flat out: the most slot reuse under readers
        reports = []
        for _ in procs:
            try:  # a reader reports once it has loaded the last version; the timeout is a hang guard
                reports.append(results.get(timeout=300))
            except queue.Empty:
                pytest.fail(f"a reader did not report (got {reports})")
    finally:
        stop.set()
        torch.set_num_threads(threads)
        _join_all(procs)
    for r in reports:
        assert r["torn"] == 0, reports
        assert r["decreasing"] == 0, reports
        assert r["last"] == n_versions, reports
        assert r["loads"] >= 20, reports  # saw many distinct versions (~300-800 here)
    print("reader reports:", reports)
