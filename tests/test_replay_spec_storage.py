"""gearflow.replay.spec and gearflow.replay.storage: parsing, validation, layout, attach, gc."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re

import numpy as np
import pytest
import torch
from conftest import seg_prefix, shm_name

from gearflow.replay.spec import Column, TableSpec
from gearflow.replay.storage import (
    ALIGN,
    COUNTER_FIELDS,
    H_INSERT_LIMIT,
    H_OWNER,
    H_P,
    H_R,
    H_S,
    HEADER_FIELDS,
    NO_LIMIT,
    SHM_DIR,
    SharedStorage,
    _layout,
    gc_segments,
    list_segments,
)

SPEC = TableSpec.parse(
    {"obs": "float32[3]", "frame": "uint8[2,4]", "action": "int64", "done": "bool"}
)


# ---------------------------------------------------------------------------- spec: parsing
@pytest.mark.parametrize(
    "text, shape, dtype",
    [
        ("uint8[4,84,84]", (4, 84, 84), np.uint8),
        ("int64", (), np.int64),
        ("float32[]", (), np.float32),
        (" float16 [ 2 , 3 ] ", (2, 3), np.float16),
        ("bool[5]", (5,), np.bool_),
        ("int8[ ]", (), np.int8),
        ("uint8[4,84,]", (4, 84), np.uint8),
    ],
)
def test_parse_type_strings(text, shape, dtype):
    col = TableSpec.parse({"x": text})["x"]
    assert col == Column("x", shape, np.dtype(dtype))
    assert col.nbytes == int(np.prod(shape)) * np.dtype(dtype).itemsize


def test_parse_tuple_form_and_round_trip():
    spec = TableSpec.parse({"obs": ((4, 84, 84), "uint8"), "r": ((), np.float32)})
    assert spec["obs"].shape == (4, 84, 84) and spec["obs"].dtype == np.uint8
    assert spec["obs"].nbytes == 28224
    assert spec.step_nbytes == 28224 + 4
    assert spec.names == ("obs", "r")
    assert TableSpec.parse(spec.to_dict()) == spec
    assert spec.to_dict() == {"obs": "uint8[4,84,84]", "r": "float32[]"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("uint8[4,84", "cannot parse type 'uint8[4,84'"),
        ("uint8(4)", "cannot parse type 'uint8(4)'"),
        ("Float32", "cannot parse type 'Float32'"),
        ("uint8[a]", "cannot parse type 'uint8[a]'"),
        ("uint8[4 84]", "cannot parse type 'uint8[4 84]'"),
        ("uint8[4,,84]", "cannot parse type 'uint8[4,,84]'"),  # not silently uint8[4,84]
        ("uint8[,]", "cannot parse type 'uint8[,]'"),  # not silently a scalar
        ("uint8[-1]", "cannot parse type 'uint8[-1]'"),
        ("floaty32", "unknown dtype 'floaty32'"),
        ("complex64", "unsupported dtype complex64"),
        ("object", "unsupported dtype object"),
        ("uint8[0]", "shape (0,) must be positive ints"),
        ("uint8[3,0]", "shape (3, 0) must be positive ints"),
    ],
)
def test_parse_bad_type_strings(text, message):
    with pytest.raises(ValueError) as info:
        TableSpec.parse({"obs": text})
    assert "'obs'" in str(info.value)
    assert message in str(info.value)


def test_spec_rejects_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="column 'a' appears twice"):
        TableSpec([Column("a", (), np.dtype("int64")), Column("a", (2,), np.dtype("uint8"))])
    for bad in ("1obs", "obs-x", "a b", ""):
        with pytest.raises(
            ValueError, match=re.escape(f"column name {bad!r} is not an identifier")
        ):
            TableSpec.parse({bad: "int64"})
    with pytest.raises(ValueError, match="at least one column"):
        TableSpec.parse({})


# ---------------------------------------------------------------------------- spec: validation
def _batch(n, **override):
    b = {
        "obs": np.zeros((n, 3), np.float32),
        "frame": np.zeros((n, 2, 4), np.uint8),
        "action": np.zeros(n, np.int64),
        "done": np.zeros(n, bool),
    }
    b.update(override)
    return b


def test_check_batch_accepts_exact_arrays_and_returns_them():
    b = _batch(4)
    out, n = SPEC.check_batch(b, n=4)
    assert n == 4 and set(out) == set(SPEC.names)
    assert all(out[k] is b[k] for k in b)  # no copies on the hot path
    out, n = SPEC.check_batch(b)  # n inferred
    assert n == 4


def test_check_batch_wrong_dtype_names_column_expected_and_actual():
    with pytest.raises(ValueError) as info:
        SPEC.check_batch(_batch(4, obs=np.zeros((4, 3), np.float64)), n=4)
    assert str(info.value) == "column 'obs': expected dtype float32, got float64"
    with pytest.raises(ValueError, match=r"column 'frame': expected dtype uint8, got int64"):
        SPEC.check_batch(_batch(2, frame=np.zeros((2, 2, 4), np.int64)), n=2)
    t = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"column 'action': expected dtype int64, got int32"):
        SPEC.check_batch(_batch(2, action=t), n=2)


def test_check_batch_wrong_shape_names_column_expected_and_actual():
    with pytest.raises(ValueError) as info:
        SPEC.check_batch(_batch(4, obs=np.zeros((4, 4), np.float32)), n=4)
    assert str(info.value) == "column 'obs': expected shape [4, 3], got [4, 4]"
    with pytest.raises(ValueError) as info:
        SPEC.check_batch(_batch(4, frame=np.zeros((3, 2, 4), np.uint8)), n=4)
    assert str(info.value) == "column 'frame': expected shape [4, 2, 4], got [3, 2, 4]"
    with pytest.raises(ValueError) as info:  # scalar column
        SPEC.check_batch(_batch(4, action=np.zeros((4, 1), np.int64)), n=4)
    assert str(info.value) == "column 'action': expected shape [4], got [4, 1]"
    with pytest.raises(ValueError) as info:  # inferred n: first column is unbatched
        SPEC.check_batch(_batch(4, obs=np.zeros(3, np.float32)))
    assert str(info.value) == "column 'obs': expected shape [n, 3], got [3]"


def test_check_batch_missing_and_unknown_columns():
    b = _batch(2)
    del b["done"]
    with pytest.raises(ValueError, match=r"missing column\(s\) \['done'\]") as info:
        SPEC.check_batch(b, n=2)
    assert "unknown" not in str(info.value)
    b["rewrd"] = np.zeros(2, np.float32)
    with pytest.raises(ValueError) as info:
        SPEC.check_batch(b, n=2)
    msg = str(info.value)
    assert "missing column(s) ['done']" in msg and "unknown column(s) ['rewrd']" in msg
    assert "spec is {'obs': 'float32[3]'" in msg
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['extra'\]"):
        SPEC.check_batch(_batch(2, extra=np.zeros(2)), n=2)


def test_check_batch_converts_python_values():
    out, n = SPEC.check_batch(
        {
            "obs": [[1, 2, 3], [4, 5, 6]],
            "frame": np.zeros((2, 2, 4), np.uint8),
            "action": [7, 8],
            "done": [True, 0],
        }
    )
    assert n == 2
    assert out["obs"].dtype == np.float32 and out["obs"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert out["action"].dtype == np.int64 and out["action"].tolist() == [7, 8]
    assert out["done"].dtype == np.bool_ and out["done"].tolist() == [True, False]


@pytest.mark.parametrize(
    "column, value, words",
    [
        ("action", [1.5, 2.0], "expected dtype int64, got float64"),
        ("done", [2, 0], "expected dtype bool, got int64"),
        ("action", [[1], 2], "cannot make an array"),
    ],
)
def test_check_batch_rejects_lossy_python_values(column, value, words):
    steps = {"obs": [[1, 2, 3], [4, 5, 6]], "frame": np.zeros((2, 2, 4), np.uint8),
             "action": [7, 8], "done": [True, False]}  # fmt: skip
    steps[column] = value
    with pytest.raises(ValueError, match=f"column '{column}'.*{words}"):
        SPEC.check_batch(steps, n=2)


def test_check_step_scalars_and_errors():
    step = SPEC.check_step(
        {"obs": [0.5, 1, 2], "frame": np.ones((2, 4), np.uint8), "action": 3, "done": True}
    )
    assert step["obs"].shape == (1, 3) and step["obs"].dtype == np.float32
    assert (
        step["action"].shape == (1,) and step["action"].dtype == np.int64 and step["action"][0] == 3
    )
    assert step["done"].dtype == np.bool_ and bool(step["done"][0])
    assert step["frame"].shape == (1, 2, 4)
    good = {
        "obs": np.zeros(3, np.float32),
        "frame": np.zeros((2, 4), np.uint8),
        "action": 1,
        "done": False,
    }
    with pytest.raises(ValueError) as info:
        SPEC.check_step({**good, "obs": np.zeros(4, np.float32)})
    assert str(info.value) == "column 'obs': expected shape [3], got [4]"
    with pytest.raises(ValueError) as info:
        SPEC.check_step({**good, "frame": np.zeros((2, 4), np.float32)})
    assert str(info.value) == "column 'frame': expected dtype uint8, got float32"
    with pytest.raises(ValueError, match=r"missing column\(s\) \['action'\]"):
        SPEC.check_step({k: v for k, v in good.items() if k != "action"})
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['nope'\]"):
        SPEC.check_step({**good, "nope": 1})


# ---------------------------------------------------------------------------- storage
def _attach_and_write(name, q):
    st = SharedStorage.attach(name)
    try:
        got = st.columns["obs"][:4].copy()
        st.columns["obs"][4:8] = np.arange(12, dtype=np.float32).reshape(4, 3) + 100
        st.counters[1, 1] = 99
        q.put(got.tolist())
    finally:
        st.close()


def test_create_attach_same_bytes(storage_factory):
    st = storage_factory(SPEC, P=2, S=8)
    other = SharedStorage.attach(st.name)
    try:
        assert other.owner is False and st.owner is True
        assert other.spec == st.spec
        assert (other.num_partitions, other.steps_per_partition, other.items_per_partition) == (
            2,
            8,
            8,
        )
        assert other.nbytes == st.nbytes == os.stat(SHM_DIR / st.name).st_size
        assert other.columns["obs"].shape == (16, 3) and other.columns["frame"].shape == (16, 2, 4)
        assert other.header[H_INSERT_LIMIT] == NO_LIMIT
        assert (other.header[[H_P, H_S, H_R, H_OWNER]] == [2, 8, 8, os.getpid()]).all()
        # zero filled
        assert not any(a.any() for a in other.columns.values()) and not other.counters.any()
        # writes in one mapping are seen in the other, numpy and torch views alike
        st.columns["frame"][3] = np.arange(8, dtype=np.uint8).reshape(2, 4)
        st.item_priority[1, 5] = 2.5
        st.counters[0, 2] = 7
        assert other.columns["frame"][3].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert other.tensors["frame"][3].flatten().tolist() == list(range(8))
        assert other.item_priority[1, 5] == 2.5 and other.counters[0, 2] == 7
        other.columns["obs"][15] = [1.5, -2.0, 3.0]
        assert st.columns["obs"][15].tolist() == [1.5, -2.0, 3.0]
        assert st.tensors["obs"][15].tolist() == [1.5, -2.0, 3.0]
        assert st.rows(1, 11).item() == 8 + 3 and st.rows(
            np.array([0, 1]), np.array([8, 17])
        ).tolist() == [0, 9]
        assert st.capacity == 16
    finally:
        other.close()


def test_attach_in_another_process_sees_same_bytes(storage_factory):
    st = storage_factory(SPEC, P=2, S=8)
    st.columns["obs"][:4] = np.arange(12, dtype=np.float32).reshape(4, 3)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_attach_and_write, args=(st.name, q))
    proc.start()
    try:
        got = q.get(timeout=30)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    assert got == np.arange(12, dtype=np.float32).reshape(4, 3).tolist()
    assert (
        st.columns["obs"][4:8].tolist()
        == (np.arange(12, dtype=np.float32).reshape(4, 3) + 100).tolist()
    )
    assert st.counters[1, 1] == 99


def test_layout_alignment():
    spec = TableSpec.parse({"obs": "uint8[4,84,84]", "a": "int64", "b": "bool", "c": "float16[3]"})
    for P, S, R in [(1, 2, 1), (3, 17, 5), (8, 1000, 333)]:
        spec_len = len(json.dumps(spec.to_dict()).encode())
        offsets, size = _layout(spec, P, S, R, spec_len)
        assert all(off % ALIGN == 0 for off in offsets.values()), offsets
        assert size % ALIGN == 0
        assert offsets["counters"] >= HEADER_FIELDS * 8 + spec_len
        # blocks in order, none overlapping
        blocks = [
            ("counters", P * COUNTER_FIELDS * 8), ("item_start", P * R * 8), ("item_length", P * R * 4),
            ("item_priority", P * R * 8), *(("col:" + c.name, P * S * c.nbytes) for c in spec),
        ]  # fmt: skip
        ends = [offsets[k] + n for k, n in blocks]
        starts = [offsets[k] for k, _ in blocks]
        assert all(e <= s for e, s in zip(ends, starts[1:]))
        assert ends[-1] <= size


def test_storage_column_offsets_aligned(storage_factory):
    st = storage_factory(
        TableSpec.parse({"a": "int8", "b": "float64[3]", "c": "uint8[5]"}), P=3, S=7, R=5
    )
    assert all(off % ALIGN == 0 for off in st.column_offsets.values())
    base = np.frombuffer(st._mm, dtype=np.uint8).ctypes.data
    for name, arr in st.columns.items():
        assert (arr.ctypes.data - base) == st.column_offsets[name]
        assert arr.ctypes.data % ALIGN == 0
    for arr in (st.counters, st.item_start, st.item_length, st.item_priority):
        assert (arr.ctypes.data - base) % ALIGN == 0
    assert st.item_start.shape == (3, 5) and st.item_length.dtype == np.int32


def test_create_rejects_bad_sizes_and_existing_name(storage_factory):
    with pytest.raises(ValueError, match="num_partitions must be ≥ 1, got 0"):
        SharedStorage.create(SPEC, 0, 8)
    with pytest.raises(ValueError, match="steps_per_partition must be ≥ 2, got 1"):
        SharedStorage.create(SPEC, 1, 1)
    name = shm_name("dup")
    storage_factory(SPEC, P=1, S=4, name=name)
    with pytest.raises(FileExistsError):
        SharedStorage.create(SPEC, 1, 4, name=name)


def test_attach_missing_name():
    name = shm_name("missing")
    with pytest.raises(FileNotFoundError) as info:
        SharedStorage.attach(name)
    assert str(info.value) == f"no shared-memory table named {name!r} in {SHM_DIR}"


def test_attach_rejects_non_table(tmp_path):
    name = shm_name("junk")
    path = SHM_DIR / name
    path.write_bytes(b"\x01" * 8192)
    try:
        with pytest.raises(ValueError, match="is not a gearflow table"):
            SharedStorage.attach(name)
    finally:
        path.unlink()


def _noop():
    pass


def _dead_pid() -> int:
    proc = mp.get_context("spawn").Process(target=_noop)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    return proc.pid


def test_gc_segments_removes_dead_owner_keeps_live(storage_factory):
    prefix = seg_prefix() + "gc"
    dead = storage_factory(SPEC, P=1, S=4, name=f"{prefix}_dead")
    live = storage_factory(SPEC, P=1, S=4, name=f"{prefix}_live")
    pid = _dead_pid()
    dead.header[H_OWNER] = pid
    listed = {name: owner for name, owner, _ in list_segments(prefix)}
    assert listed == {dead.name: pid, live.name: os.getpid()}

    # dry run: reports, removes nothing
    report = gc_segments(prefix, dry_run=True)
    assert report == [(dead.name, dead.nbytes)]
    assert (SHM_DIR / dead.name).exists() and (SHM_DIR / live.name).exists()

    assert gc_segments(prefix) == [(dead.name, dead.nbytes)]
    assert not (SHM_DIR / dead.name).exists()
    assert (SHM_DIR / live.name).exists()
    assert gc_segments(prefix) == []

    # include_live, dry run first
    assert gc_segments(prefix, dry_run=True, include_live=True) == [(live.name, live.nbytes)]
    assert (SHM_DIR / live.name).exists()
    assert gc_segments(prefix, include_live=True) == [(live.name, live.nbytes)]
    assert not (SHM_DIR / live.name).exists()


def test_list_segments_skips_files_that_are_not_tables():
    prefix = seg_prefix() + "odd"
    paths = [SHM_DIR / f"{prefix}_{i}" for i in range(3)]
    try:
        paths[0].write_bytes(b"")  # being created: not truncated yet
        paths[1].write_bytes(b"abcde")  # not a multiple of 8 bytes
        paths[2].write_bytes(b"\0" * 200)  # no magic
        assert list(list_segments(prefix)) == []
        assert gc_segments(prefix, include_live=True) == []
        assert all(p.exists() for p in paths)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


def test_close_drops_views_and_unlink_removes_name(storage_factory):
    st = SharedStorage.create(SPEC, 1, 4, name=shm_name("close"))
    path = SHM_DIR / st.name
    try:
        other = SharedStorage.attach(st.name)
        other.close()
        assert other.columns == {} and other.counters is None
        st.close()
        assert path.exists()
    finally:
        st.unlink()
    assert not path.exists()
    st.unlink()  # idempotent
