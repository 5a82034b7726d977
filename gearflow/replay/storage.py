"""Columnar step storage in one POSIX shared-memory segment, split into partitions.

Layout of the segment ``/dev/shm/<name>`` (every block 4096-byte aligned, so the
whole segment can be registered with ``cudaHostRegister`` or an RDMA memory
region as it is)::

    header     int64[16] (magic, version, P, S, R, owner pid, spec length, size,
               insert limit, samples, ...) then the spec as JSON
    counters   int64[P, 8]          one 64-byte cache line per partition:
               RESERVE   steps that may be being written: rows of steps < RESERVE - S
                         are gone or going (seqlock upper bound, bumped *before* a write)
               COMMIT    steps fully written (bumped *after* the write)
               PUBLISHED item records published
               EPISODES, WRITER_PID, HEARTBEAT_NS
    item_start    int64[P, R]       absolute step index of each item record's first step
    item_length   int32[P, R]       steps in the item
    item_priority float64[P, R]     initial priority
    <column c>    c.dtype[P * S, *c.shape]   partition p owns rows [p*S, (p+1)*S)

Step ``t`` (absolute, per partition) of partition ``p`` lives in row
``p * S + t % S``: each partition is a ring, and an item's steps are
consecutive in one partition. Exactly one writer owns a partition; the only
cross-process synchronisation is the order of the counter stores (x86-TSO:
stores become visible in program order), so the insert path takes no lock.

    storage = SharedStorage.create(spec, num_partitions=4, steps_per_partition=1000)
    other = SharedStorage.attach(storage.name)      # in another process: zero-copy views
    other.columns["obs"]                            # numpy view [4000, 4, 84, 84]
    storage.unlink()                                # owner removes the segment
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from gearflow.replay.spec import TableSpec

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "gearflow"
MAGIC = 0x776F6C6672616567  # b"gearflow" little-endian
VERSION = 1
ALIGN = 4096
HEADER_FIELDS = 16
COUNTER_FIELDS = 8  # 64 bytes: one cache line per partition, no false sharing between writers

# header fields
H_MAGIC, H_VERSION, H_P, H_S, H_R, H_OWNER, H_SPEC_LEN, H_SIZE, H_INSERT_LIMIT, H_SAMPLES = range(10)
# counter fields
RESERVE, COMMIT, PUBLISHED, EPISODES, WRITER_PID, HEARTBEAT_NS = range(6)

NO_LIMIT = np.iinfo(np.int64).max


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(spec: TableSpec, P: int, S: int, R: int, spec_len: int) -> tuple[dict[str, int], int]:
    """Byte offset of every block and the total size."""
    offsets: dict[str, int] = {}
    pos = _align(HEADER_FIELDS * 8 + spec_len)
    for name, nbytes in (
        ("counters", P * COUNTER_FIELDS * 8),
        ("item_start", P * R * 8),
        ("item_length", P * R * 4),
        ("item_priority", P * R * 8),
    ):
        offsets[name] = pos
        pos = _align(pos + nbytes)
    for c in spec:
        offsets["col:" + c.name] = pos
        pos = _align(pos + P * S * c.nbytes)
    return offsets, pos


class SharedStorage:
    """A table's steps and item records in one shared-memory segment.

    Use :meth:`create` in the owning process and :meth:`attach` elsewhere.
    ``columns`` (numpy) and ``tensors`` (torch) are zero-copy views of the
    same bytes, ``[P * S, *shape]`` per column.
    """

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.owner = owner
        self._mm = mm
        header = np.frombuffer(mm, dtype=np.int64, count=HEADER_FIELDS)
        if header[H_MAGIC] != MAGIC or header[H_VERSION] != VERSION:
            raise ValueError(f"shared-memory segment {name!r} is not a gearflow table (v{VERSION})")
        self.header = header
        P, S, R, spec_len = (int(header[i]) for i in (H_P, H_S, H_R, H_SPEC_LEN))
        spec_bytes = bytes(mm[HEADER_FIELDS * 8 : HEADER_FIELDS * 8 + spec_len])
        self.spec = TableSpec.parse(json.loads(spec_bytes.decode()))
        self.num_partitions, self.steps_per_partition, self.items_per_partition = P, S, R
        offsets, size = _layout(self.spec, P, S, R, spec_len)
        self.nbytes = size

        def view(key: str, dtype, shape) -> np.ndarray:
            count = int(np.prod(shape, dtype=np.int64))
            return np.frombuffer(mm, dtype=dtype, count=count, offset=offsets[key]).reshape(shape)

        self.counters = view("counters", np.int64, (P, COUNTER_FIELDS))
        self.item_start = view("item_start", np.int64, (P, R))
        self.item_length = view("item_length", np.int32, (P, R))
        self.item_priority = view("item_priority", np.float64, (P, R))
        self.columns: dict[str, np.ndarray] = {
            c.name: view("col:" + c.name, c.dtype, (P * S, *c.shape)) for c in self.spec
        }
        self.tensors: dict[str, torch.Tensor] = {k: torch.from_numpy(v) for k, v in self.columns.items()}
        self.column_offsets = {c.name: offsets["col:" + c.name] for c in self.spec}

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(
        cls,
        spec: TableSpec,
        num_partitions: int,
        steps_per_partition: int,
        items_per_partition: int | None = None,
        name: str | None = None,
        reserve: bool = True,
    ) -> "SharedStorage":
        """Create a zero-filled segment. ``items_per_partition`` defaults to the steps per partition.

        ``reserve`` allocates every page of the segment now (``posix_fallocate``,
        ~0.25 s per GiB here): a table too large for /dev/shm fails here with a
        clear error instead of a SIGBUS mid-run, and the first lap of inserts
        pays only minor page faults.
        """
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be ≥ 1, got {num_partitions}")
        if steps_per_partition < 2:
            raise ValueError(f"steps_per_partition must be ≥ 2, got {steps_per_partition}")
        R = items_per_partition or steps_per_partition
        if R < 1:
            raise ValueError(f"items_per_partition must be ≥ 1, got {R}")
        spec_json = json.dumps(spec.to_dict()).encode()
        offsets, size = _layout(spec, num_partitions, steps_per_partition, R, len(spec_json))
        name = name or f"{PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            if reserve:
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise MemoryError(
                f"cannot create a {size / 2**30:.2f} GiB shared-memory table in {SHM_DIR}: {exc}"
            ) from exc
        os.close(fd)
        header = np.frombuffer(mm, dtype=np.int64, count=HEADER_FIELDS)
        header[[H_P, H_S, H_R, H_OWNER, H_SPEC_LEN, H_SIZE]] = (
            num_partitions, steps_per_partition, R, os.getpid(), len(spec_json), size,
        )  # fmt: skip
        header[H_INSERT_LIMIT] = NO_LIMIT
        mm[HEADER_FIELDS * 8 : HEADER_FIELDS * 8 + len(spec_json)] = spec_json
        header[H_VERSION] = VERSION
        header[H_MAGIC] = MAGIC  # last: a half-made segment is never mistaken for a table
        del header
        log.debug("created %s: %d partitions × %d steps, %.1f MiB", name, num_partitions,
                  steps_per_partition, size / 2**20)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "SharedStorage":
        """Map an existing segment by name (zero-copy)."""
        return cls(name, map_segment(name, "shared-memory table"), owner=False)

    def close(self) -> None:
        """Drop this process's mapping (views handed out keep it alive until freed)."""
        for attr in ("columns", "tensors"):
            setattr(self, attr, {})
        for attr in ("header", "counters", "item_start", "item_length", "item_priority"):
            setattr(self, attr, None)
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it is freed

    def unlink(self) -> None:
        """Remove the segment's name (the owner does this on close)."""
        (SHM_DIR / self.name).unlink(missing_ok=True)

    def prefault(self, partitions) -> float:
        """Map this process's pages of ``partitions`` now (``MADV_POPULATE_WRITE``).

        A writer's first lap through its ring otherwise takes a page fault per 4 KiB
        in the middle of its env loop (on a VM, ~0.5 GB/s of rows for the whole
        first lap). Returns the seconds spent; a kernel without the call (< 5.14)
        is left to fault lazily.
        """
        start = time.perf_counter()
        advice = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux ≥ 5.14; Python 3.11 lacks the name
        page = mmap.PAGESIZE
        S = self.steps_per_partition
        try:
            for c in self.spec:
                base, row = self.column_offsets[c.name], c.nbytes
                for p in np.asarray(partitions, dtype=np.int64).reshape(-1).tolist():
                    lo = (base + p * S * row) // page * page
                    hi = -(-(base + (p + 1) * S * row) // page) * page
                    self._mm.madvise(advice, lo, min(hi, self.nbytes) - lo)
        except (OSError, ValueError):
            pass
        return time.perf_counter() - start

    # ------------------------------------------------------------------ helpers
    def rows(self, partition: np.ndarray | int, steps: np.ndarray | int) -> np.ndarray:
        """Storage rows of absolute ``steps`` of ``partition``: ``p * S + t % S``."""
        S = self.steps_per_partition
        return np.asarray(partition, dtype=np.int64) * S + np.asarray(steps, dtype=np.int64) % S

    def total_inserts(self) -> int:
        return int(self.counters[:, PUBLISHED].sum())

    @property
    def capacity(self) -> int:
        return self.num_partitions * self.steps_per_partition


def map_segment(name: str, what: str = "shared-memory segment") -> mmap.mmap:
    """Map the whole of an existing ``/dev/shm/<name>`` read-write (shared)."""
    try:
        fd = os.open(SHM_DIR / name, os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} named {name!r} in {SHM_DIR}") from None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_segments(prefix: str = PREFIX) -> Iterator[tuple[str, int, int]]:
    """(name, owner pid, size) of gearflow segments in /dev/shm."""
    for path in sorted(SHM_DIR.glob(f"{prefix}*")):
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_FIELDS * 8)
                size = os.fstat(f.fileno()).st_size  # not path.stat(): the name may go meanwhile
        except OSError:
            continue
        if len(raw) < HEADER_FIELDS * 8:  # not (yet) a table: frombuffer would reject odd sizes
            continue
        head = np.frombuffer(raw, dtype=np.int64)
        if head[H_MAGIC] != MAGIC:
            continue
        yield path.name, int(head[H_OWNER]), size


def gc_segments(prefix: str = PREFIX, dry_run: bool = False, include_live: bool = False) -> list[tuple[str, int]]:
    """Remove segments whose owning process is gone (all of them with ``include_live``)."""
    removed = []
    for name, owner, size in list_segments(prefix):
        if include_live or not _pid_alive(owner):
            if not dry_run:
                (SHM_DIR / name).unlink(missing_ok=True)
            removed.append((name, size))
    return removed
