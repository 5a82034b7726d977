"""Checkpoints: exact restore, consistency under a running writer, refusal of bad ones."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from gearflow.replay import Writer
from gearflow.replay.checkpoint import CheckpointError, restore_checkpoint, save_checkpoint
from gearflow.replay.items import Sequence, Transition
from gearflow.replay.storage import COMMIT, PUBLISHED, SharedStorage

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
            if i == 200:
                started.set()
    finally:
        storage.close()


def test_checkpoint_while_a_writer_runs_is_consistent(make_table, tmp_path):
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
            # every restored item is intact: obs and next_obs hold their own step numbers
            assert torch.equal(batch.data["obs"][:, 0].long(), batch.data["step"])
            assert torch.equal(batch.data["next_obs"][:, 0].long(), batch.data["step"] + 3)
    finally:
        restored.close()


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
