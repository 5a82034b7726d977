"""Checkpoints: exact restore, consistency under a running writer, refusal of bad ones."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay import Writer
from gearflow.replay.storage import COMMIT, PUBLISHED, SharedStorage
from gearflow.replay.table_checkpoint import CheckpointError, restore_checkpoint, save_checkpoint

SPEC = {"obs": "float32[2]", "step": "int64"}


def fill(table, steps: int, item_steps: int, seed: int = 0) -> Writer:
    writer = Writer(table.storage, list(range(table.storage.num_partitions)))
    rng = np.random.default_rng(seed)
    P = table.storage.num_partitions
    for _ in range(steps):
        pos = writer.positions
        writer.append({"obs": np.stack([pos, pos], 1).astype(np.float32), "step": pos})
        ready = writer.episode_lengths() >= item_steps
        if ready.any():
            streams = np.flatnonzero(ready)
            writer.create_items(rng.random(streams.size) + 0.1, item_steps, streams=streams)
        if _ % 29 == 28:
            writer.end_episode(np.arange(P))
    return writer


@pytest.mark.parametrize("selector", ["uniform", "prioritized", "fifo", "max_heap", "top_k"])
@pytest.mark.parametrize("kind", [Transition(next_columns=("obs",)), Sequence(length=4, period=2)])
def test_restored_table_samples_exactly_the_same(make_table, tmp_path, selector, kind):
    table = make_table(spec=SPEC, P=2, S=64, kind=kind, selector=selector)
    fill(table, 150, 4)
    table.sample(8)
    table.update_priorities(table.sample(8).keys, np.arange(8) + 1.0)
    save_checkpoint(table, tmp_path / "ck")
    restored = restore_checkpoint(tmp_path / "ck")
    try:
        assert restored.stats() == table.stats()
        for _ in range(5):
            a, b = table.sample(16), restored.sample(16)
            assert torch.equal(a.keys, b.keys)
            assert torch.equal(a.weights, b.weights)
            for name in a.data:
                assert torch.equal(a.data[name], b.data[name]), name
    finally:
        restored.close()


def test_writers_continue_after_restore(make_table, tmp_path):
    table = make_table(spec=SPEC, P=2, S=64, kind=Transition(next_columns=("obs",)))
    fill(table, 40, 4)
    save_checkpoint(table, tmp_path / "ck")
    restored = restore_checkpoint(tmp_path / "ck")
    try:
        c_old, c_new = table.storage.counters, restored.storage.counters
        assert (c_new[:, COMMIT] == c_old[:, COMMIT]).all()
        assert (c_new[:, PUBLISHED] == c_old[:, PUBLISHED]).all()
        size = restored.size
        writer = Writer(restored.storage, [0, 1])
        assert (writer.positions == c_old[:, COMMIT]).all()
        for _ in range(5):
            pos = writer.positions
            writer.append({"obs": np.stack([pos, pos], 1).astype(np.float32), "step": pos})
        writer.create_items([1.0, 1.0], 4)
        restored.scan()
        assert restored.size == size + 2
        batch = restored.sample(64)
        assert torch.equal(batch.data["obs"][:, 0].long(), batch.data["step"])
    finally:
        restored.close()


def _writer_proc(name: str, steps: int, started) -> None:
    storage = SharedStorage.attach(name)
    try:
        writer = Writer(storage, [0])
        for i in range(steps):
            pos = writer.positions
            writer.append({"obs": np.stack([pos, pos], 1).astype(np.float32), "step": pos})
            if writer.episode_lengths()[0] >= 4:
                writer.create_items([1.0], 4)
            if i == 4 * storage.steps_per_partition:  # the ring has wrapped: every save races a lap
                started.set()
    finally:
        storage.close()


def test_checkpoint_while_a_writer_process_runs_restores_only_intact_items(make_table, tmp_path):
    """A real writer process laps the ring during the save (timing-dependent: whether any item
    is dropped varies; the deterministic test below proves the dropping)."""
    table = make_table(spec=SPEC, P=1, S=256, kind=Transition(next_columns=("obs",)))
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    proc = ctx.Process(target=_writer_proc, args=(table.storage.name, 20000, started), daemon=True)
    proc.start()
    try:
        assert started.wait(60)
        save_checkpoint(table, tmp_path / "ck")
    finally:
        proc.join(60)
    restored = restore_checkpoint(tmp_path / "ck")
    try:
        assert restored.size > 0
        for _ in range(20):
            batch = restored.sample(32)
            # every restored item is intact: its rows hold its own steps (P=1: key = seq = start)
            assert torch.equal(batch.data["obs"][:, 0].long(), batch.data["step"])
            assert torch.equal(batch.data["next_obs"][:, 0].long(), batch.data["step"] + 3)
            assert torch.equal(batch.data["step"], batch.keys)
    finally:
        restored.close()


def test_items_overwritten_during_the_copy_are_left_out(make_table, tmp_path, monkeypatch):
    """A writer runs between the copies of two columns: rows of saved items change under the
    save. Deterministic: the writer steps run inside the save, from a hook on ``np.save``."""
    S = 64
    table = make_table(spec=SPEC, P=1, S=S, kind=Transition(next_columns=("obs",)))
    writer = Writer(table.storage, [0])

    def step() -> None:  # step t holds obs (t, t) and step t; item k covers steps k..k+3
        pos = writer.positions
        writer.append({"obs": np.stack([pos, pos], 1).astype(np.float32), "step": pos})
        if writer.episode_lengths()[0] >= 4:
            writer.create_items([1.0], 4)

    for _ in range(100):
        step()
    table.scan()  # items 0..96 published; those starting before step 100 - 64 = 36 evicted
    assert table.size == 61

    save = np.save
    columns_saved = []

    def save_while_a_writer_runs(file, arr, *args, **kwargs):
        if len(columns_saved) == 1:  # "obs" is saved, "step" not yet
            for _ in range(10):  # steps 100..109 land on the rows of steps 36..45
                step()
        columns_saved.append(str(file))
        save(file, arr, *args, **kwargs)

    monkeypatch.setattr(np, "save", save_while_a_writer_runs)
    save_checkpoint(table, tmp_path / "ck")
    monkeypatch.undo()
    assert [p.rsplit("/", 1)[-1] for p in columns_saved] == ["obs.npy", "step.npy"]

    restored = restore_checkpoint(tmp_path / "ck")
    try:
        seen = set()
        for _ in range(20):
            batch = restored.sample(32)
            seen.update(batch.keys.tolist())
            assert torch.equal(batch.data["step"], batch.keys)  # item k starts at step k
            assert torch.equal(batch.data["obs"][:, 0].long(), batch.keys)
            assert torch.equal(batch.data["next_obs"][:, 0].long(), batch.keys + 3)
        # items 36..45 start on overwritten rows: left out; 46..96 kept
        assert min(seen) >= 46 and max(seen) == 96
        assert restored.size == 51
        # the items dropped during the copy count as evictions: size = inserts - evictions
        assert restored.size == restored.inserts - restored.evictions and restored.evictions == 13
        assert restored.storage.counters[0, COMMIT] == 100  # the steps written during the copy are not in it
    finally:
        restored.close()
    with np.load(tmp_path / "ck" / "table.npz") as t:
        assert t["dropped"].size == 10 and t["slot_live"].sum() == 51


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing"])
def test_corrupt_or_truncated_checkpoint_is_refused(make_table, tmp_path, damage):
    table = make_table(spec=SPEC, P=1, S=32, kind=Transition(next_columns=("obs",)))
    fill(table, 20, 4)
    path = save_checkpoint(table, tmp_path / "ck")
    target = path / "columns" / "obs.npy"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
        words = "corrupt"
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-7])
        words = "truncated"
    elif damage == "manifest":
        (path / "MANIFEST.json").unlink()
        words = "no MANIFEST"
    else:
        (path / "selector.npz").unlink()
        words = "missing"
    with pytest.raises(CheckpointError, match=words):
        restore_checkpoint(path)


def test_saving_again_replaces_the_checkpoint_atomically(make_table, tmp_path):
    table = make_table(spec=SPEC, P=1, S=32, kind=Transition(next_columns=("obs",)))
    fill(table, 20, 4)
    save_checkpoint(table, tmp_path / "ck")
    fill(table, 5, 4)
    save_checkpoint(table, tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    restored = restore_checkpoint(tmp_path / "ck")
    try:
        assert restored.inserts == table.inserts
    finally:
        restored.close()


def test_a_pickle_in_selector_npz_is_refused_and_never_run(make_table, tmp_path):
    """A checkpoint whose selector.npz holds an object array (a pickle: code that runs on load),
    manifest and all rewritten to match, is refused by name; the payload does not run."""
    from gearflow.replay.table_checkpoint import write_manifest

    table = make_table(spec=SPEC, P=1, S=32, kind=Transition(next_columns=("obs",)), selector="prioritized")
    fill(table, 20, 3)
    ck = save_checkpoint(table, tmp_path / "ck")
    ran = tmp_path / "payload_ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    with np.load(ck / "selector.npz") as f:
        state = {k: f[k] for k in f.files}
    state["rng_state"] = np.array([Payload()], dtype=object)
    np.savez(ck / "selector.npz", **state)
    (ck / "MANIFEST.json").unlink()
    write_manifest(ck)
    with pytest.raises(CheckpointError, match="selector.npz holds a pickled object array, refused"):
        restore_checkpoint(ck)
    assert not ran.exists()
