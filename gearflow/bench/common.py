"""What the benchmarks share: random steps for a spec, rows an agent can learn from (valid_rows: the
learner and cluster benchmarks), a prioritized table whose batches
go to one reused buffer (as the floors' do), and the slice-copy floor of an insert."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, make_selector
from gearflow.replay.storage import SHM_DIR


def random_steps(spec: TableSpec, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n`` steps of random values for every column of ``spec`` (``done``-like bools all False)."""
    out = {}
    for c in spec:
        if c.dtype == np.uint8:
            out[c.name] = rng.integers(0, 255, (n, *c.shape), dtype=np.uint8)
        elif c.dtype == np.bool_:
            out[c.name] = np.zeros((n, *c.shape), dtype=bool)
        else:
            out[c.name] = rng.standard_normal((n, *c.shape)).astype(c.dtype)
    return out


def valid_rows(spec, n: int, num_actions: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n`` stored rows of ``spec`` an agent can learn from: uint8 noise, integers in
    ``[0, num_actions)`` (valid actions), floats in ``[0, 1)`` (valid discounts, actions in a unit
    box), bools False (the learner and cluster benchmarks fill their tables with them)."""
    out = {}
    for col in spec:
        shape = (n, *col.row_shape)
        if col.dtype == np.uint8:
            out[col.name] = rng.integers(0, 255, shape, dtype=np.uint8)
        elif col.dtype == np.bool_:
            out[col.name] = np.zeros(shape, dtype=bool)
        elif np.issubdtype(col.dtype, np.integer):
            out[col.name] = rng.integers(0, max(1, num_actions), shape).astype(col.dtype)
        else:
            out[col.name] = rng.random(shape).astype(col.dtype)
    return out


def prioritized_table(spec: dict, P: int, S: int, kind, seed: int, R: int | None = None, **table_kwargs) -> Table:
    """A prioritized (α 0.6, β 0.4) table whose batches go to one reused output buffer."""
    storage = SharedStorage.create(TableSpec.parse(spec), P, S, R)
    selector = make_selector("prioritized", P * storage.items_per_partition, seed=seed, alpha=0.6, beta=0.4)
    return Table(storage, kind, selector, RateLimiter(min_size_to_sample=1), num_buffers=1, **table_kwargs)


def _shm_arrays(shapes: dict[str, tuple], dtypes: dict[str, np.dtype]) -> tuple[dict[str, np.ndarray], mmap.mmap]:
    """Arrays in a /dev/shm mapping, like a table's columns (4 KiB shared pages; numpy's own
    large arrays get transparent huge pages, which a shared segment here does not)."""
    sizes = {k: int(np.prod(shape)) * np.dtype(dtypes[k]).itemsize for k, shape in shapes.items()}
    total = sum(-(-n // 4096) * 4096 for n in sizes.values())
    path = SHM_DIR / f"gearflow_benchfloor_{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total)
    finally:
        os.close(fd)
        path.unlink()
    out, off = {}, 0
    for k, shape in shapes.items():
        out[k] = np.frombuffer(mm, dtype=dtypes[k], count=int(np.prod(shape)), offset=off).reshape(shape)
        off += -(-sizes[k] // 4096) * 4096
    return out, mm


def copy_floor(chunk: dict[str, np.ndarray], steps: int, shared: bool = True) -> float:
    """Seconds for slice copies of ``steps`` steps, in calls of len(chunk), into warm arrays:
    in shared memory as the table's (``shared``), or numpy's own (huge-page) memory."""
    n = len(next(iter(chunk.values())))
    shapes = {k: (steps, *v.shape[1:]) for k, v in chunk.items()}
    if shared:
        dst, _ = _shm_arrays(shapes, {k: v.dtype for k, v in chunk.items()})
    else:
        dst = {k: np.empty(shapes[k], dtype=v.dtype) for k, v in chunk.items()}
    for a in dst.values():
        a.fill(0)  # fault the pages in, as the table's ring is after its first lap
    start = time.perf_counter()
    for i in range(steps // n):
        for k, v in chunk.items():
            dst[k][i * n : (i + 1) * n] = v
    return time.perf_counter() - start  # the mapping goes with the last view of it
