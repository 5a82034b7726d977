"""Columnar step storage in one POSIX shared-memory segment, split into partitions.

Layout of the segment ``/dev/shm/<name>`` (every block 4096-byte aligned, so the
whole segment can be registered with ``cudaHostRegister`` or an RDMA memory
region as it is)::

    header     int64[16] (magic, version, P, S, R, owner pid, spec length, size,
               insert limit, samples, closed, -, owner identity: boot id, PID namespace,
               process start time, run tag) then the spec as JSON
    counters   int64[P, 8]          one 64-byte cache line per partition:
               RESERVE   steps that may be being written: rows of steps < RESERVE - S
                         are gone or going (seqlock upper bound, bumped *before* a write)
               COMMIT    steps fully written (bumped *after* the write)
               PUBLISHED item records published (bumped *after* the records are written)
               EPISODES, WRITER_PID, HEARTBEAT_NS
               REC_RESERVE item records that may be being written: the records of items
                         < REC_RESERVE - R are gone or going (bumped *before* a record
                         slot is rewritten; the record ring's seqlock upper bound)
               WAIT_SINCE_NS when the partition's writer began to wait for the insert limit
                         (0: not waiting; writers take room in that order: inserts.py)
    item_start    int64[P, R]       absolute step index of each item record's first step
    item_length   int32[P, R]       steps in the item
    item_priority float64[P, R]     initial priority
    step_offset   uint8[P * S]      only with stacked-frame columns: each step's offset in its
                                    episode, min(offset, 255) (where a stack stops reaching back)
    <column c>    c.dtype[P * S, *c.row_shape]   partition p owns rows [p*S, (p+1)*S)
                                    (a stacked column's row is one frame: c.row_shape = c.shape[1:])

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

from gearflow.errors import GearflowError
from gearflow.replay.layout import step_rows  # the row rule (re-exported: its owner is layout)
from gearflow.replay.rate_limiter import NO_LIMIT
from gearflow.replay.spec import TableSpec

log = logging.getLogger(__name__)

# Where segments live. GEARFLOW_SHM_DIR overrides it (any tmpfs; actor processes inherit it);
# tests use it to run a real training run against a deliberately small tmpfs.
SHM_DIR = Path(os.environ.get("GEARFLOW_SHM_DIR") or "/dev/shm")
PREFIX = "gearflow"
MAGIC = 0x776F6C6672616567  # b"gearflow" little-endian
VERSION = 1
ALIGN = 4096
HEADER_FIELDS = 16
COUNTER_FIELDS = 8  # 64 bytes: one cache line per partition, no false sharing between writers

# header fields
H_MAGIC, H_VERSION, H_P, H_S, H_R, H_OWNER, H_SPEC_LEN, H_SIZE, H_INSERT_LIMIT, H_SAMPLES, H_CLOSED = range(11)
# H_CLOSED: 1 once the table's owner closed it. Table.close() also sets the insert limit to
# CLOSED_LIMIT, so a writer's one limit check (which every publish makes) fails and its slow
# path reads H_CLOSED: no extra load on the insert path
CLOSED_LIMIT = -1
# owner identity (the same fields in the parameter store's header): a PID alone cannot say
# whether a segment's owner is alive when /dev/shm is shared by several PID namespaces
# (containers) or survived a reboot, so gc needs the whole identity to remove a segment
H_BOOT_ID, H_PID_NS, H_START_TIME, H_RUN_TAG = range(12, 16)
# counter fields
RESERVE, COMMIT, PUBLISHED, EPISODES, WRITER_PID, HEARTBEAT_NS, REC_RESERVE, WAIT_SINCE_NS = range(8)
# WAIT_SINCE_NS: time.monotonic_ns() since which the partition's writer has waited for the insert
# limit (0: not waiting); writers take room in the order they began to wait (replay/inserts.py)



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
        ("step_offset", P * S if spec.stacked else 0),
    ):
        if nbytes:
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
        # stacked-frame columns: the offset of each step in its episode (None without them)
        self.step_offset = view("step_offset", np.uint8, (P * S,)) if "step_offset" in offsets else None
        self.step_offset_position = offsets.get("step_offset")  # its byte offset in the segment (GPU path)
        self.stack_reach = self.spec.stack_reach  # steps before an item's start its stacks read
        self.columns: dict[str, np.ndarray] = {
            c.name: view("col:" + c.name, c.dtype, (P * S, *c.row_shape)) for c in self.spec
        }
        self.tensors: dict[str, torch.Tensor] = {k: torch.from_numpy(v) for k, v in self.columns.items()}
        self.column_offsets = {c.name: offsets["col:" + c.name] for c in self.spec}

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def segment_nbytes(spec: TableSpec, num_partitions: int, steps_per_partition: int, items_per_partition: int) -> int:
        """Bytes of the segment :meth:`create` makes for this geometry (header and alignment included)."""
        spec_len = len(json.dumps(spec.to_dict()).encode())
        return _layout(spec, num_partitions, steps_per_partition, items_per_partition or steps_per_partition,
                       spec_len)[1]  # fmt: skip

    @classmethod
    def create(
        cls,
        spec: TableSpec,
        num_partitions: int,
        steps_per_partition: int,
        items_per_partition: int | None = None,
        name: str | None = None,
        reserve: bool = True,
        run_tag: int = 0,
    ) -> "SharedStorage":
        """Create a zero-filled segment. ``items_per_partition`` defaults to the steps per partition.

        ``reserve`` allocates every page of the segment now (``posix_fallocate``,
        ~0.25 s per GiB here): a table too large for /dev/shm fails here with a
        clear error instead of a SIGBUS mid-run, and the first lap of inserts
        pays only minor page faults. ``run_tag`` (:func:`run_tag`) marks the segment as
        one run's, so a resumed run removes only its own leftovers.
        """
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be ≥ 1, got {num_partitions}")
        if steps_per_partition < 2:
            raise ValueError(f"steps_per_partition must be ≥ 2, got {steps_per_partition}")
        if steps_per_partition < 2 + spec.stack_reach:
            raise ValueError(
                f"steps_per_partition must be ≥ {2 + spec.stack_reach} for stacks of "
                f"{spec.stack_reach + 1} frames, got {steps_per_partition}"
            )
        R = items_per_partition or steps_per_partition
        if R < 1:
            raise ValueError(f"items_per_partition must be ≥ 1, got {R}")
        spec_json = json.dumps(spec.to_dict()).encode()
        _, size = _layout(spec, num_partitions, steps_per_partition, R, len(spec_json))
        name = name or f"{PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        mm = create_segment(name, size, "replay table", reserve=reserve)
        header = np.frombuffer(mm, dtype=np.int64, count=HEADER_FIELDS)
        header[[H_P, H_S, H_R, H_OWNER, H_SPEC_LEN, H_SIZE]] = (
            num_partitions, steps_per_partition, R, os.getpid(), len(spec_json), size,
        )  # fmt: skip
        header[H_INSERT_LIMIT] = NO_LIMIT
        write_owner(header, run_tag)
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
        for attr in ("header", "counters", "item_start", "item_length", "item_priority", "step_offset"):
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
        """Storage rows of absolute ``steps`` of ``partition``: ``p * S + t % S`` (:func:`step_rows`)."""
        return step_rows(np.asarray(partition, dtype=np.int64), np.asarray(steps, dtype=np.int64),
                         self.steps_per_partition)  # fmt: skip

    def total_inserts(self) -> int:
        return int(self.counters[:, PUBLISHED].sum())

    @property
    def capacity(self) -> int:
        return self.num_partitions * self.steps_per_partition

    @property
    def trusted_steps(self) -> int:
        """Steps per partition behind RESERVE whose items a reader trusts: ``S`` less the
        steps a stack reaches back before an item's start. An item is intact while its first
        step is ``≥ RESERVE - trusted_steps`` (the eviction and the seqlock re-check rule)."""
        return self.steps_per_partition - self.stack_reach


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


class SharedMemoryError(GearflowError, MemoryError):
    """A shared-memory segment cannot be created (too large for the space left, or the
    directory is unusable); the message says how many bytes were needed and are free."""


def _human(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_segment(name: str, size: int, what: str, reserve: bool = True) -> mmap.mmap:
    """Create ``SHM_DIR/name`` of ``size`` bytes, every page reserved (``posix_fallocate``),
    mapped read-write. Not enough room is a :class:`SharedMemoryError` naming the bytes
    needed and free, raised before anything is left behind."""
    free = shm_free_bytes()
    if size > free:
        raise SharedMemoryError(
            f"the {what} needs {size} bytes ({_human(size)}) of shared memory; "
            f"{SHM_DIR} has {free} bytes ({_human(free)}) free"
        )
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise  # a name chosen by the caller that is taken: never another run's segment to reuse
    except OSError as exc:
        raise SharedMemoryError(f"cannot create the {what} {path}: {exc.strerror or exc}") from None
    try:
        os.ftruncate(fd, size)
        if reserve:
            os.posix_fallocate(fd, 0, size)  # no page of the segment is left to fault (SIGBUS) later
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException as exc:
        path.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            free = shm_free_bytes()
            raise SharedMemoryError(
                f"cannot reserve {size} bytes ({_human(size)}) for the {what} in {SHM_DIR} "
                f"({free} bytes free): {exc.strerror or exc}"
            ) from None
        raise
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- owner identity


def _boot_id() -> int:
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return int(text.replace("-", ""), 16) & (2**63 - 1) or 1
    except (OSError, ValueError):
        return 0


def _pid_ns(pid: int | str = "self") -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int | str = "self") -> int:
    """Start time of process ``pid`` in clock ticks after boot (/proc/PID/stat field 22); 0 if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # the name in (...) may hold spaces


def run_tag(run_dir: str | os.PathLike) -> int:
    """A run's tag (from its directory's real path), written in the header of its segments."""
    import zlib

    real = os.path.realpath(run_dir).encode()
    return (zlib.crc32(real) << 31 | zlib.crc32(real[::-1]) >> 1) or 1


def write_owner(header: np.ndarray, tag: int = 0) -> None:
    """Record this process as the owner of a segment (``H_OWNER`` holds the PID)."""
    header[[H_BOOT_ID, H_PID_NS, H_START_TIME, H_RUN_TAG]] = (
        _boot_id(), _pid_ns(), _start_time(os.getpid()), int(tag)
    )


def owner_status(head: np.ndarray) -> tuple[bool, str]:
    """(provably dead, why) of the owner recorded in a segment header.

    Dead when the machine has rebooted since (another boot id), or, in this PID namespace,
    no process has that PID or the one that has it started at another time (a reused PID).
    An owner in another PID namespace, or a header without an identity (an older gearflow),
    is never provably dead."""
    pid, boot, ns, start = (int(head[i]) for i in (H_OWNER, H_BOOT_ID, H_PID_NS, H_START_TIME))
    if not boot or not ns or not start:
        return False, f"pid {pid}: no owner identity recorded (older gearflow); remove with --force"
    if boot != _boot_id():
        return True, f"pid {pid}: the machine rebooted since"
    if ns != _pid_ns():
        return False, f"pid {pid} of another PID namespace (ns inode {ns}): cannot be proven dead from here"
    now = _start_time(pid) if pid > 0 else 0
    if now == 0:
        return True, f"pid {pid}: no such process"
    if now != start:
        return True, f"pid {pid}: reused by another process"
    return False, f"pid {pid}: alive"


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists in this PID namespace (PID only: see owner_status)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _headers(prefix: str) -> Iterator[tuple[str, np.ndarray, int]]:
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
        yield path.name, head, size


def list_segments(prefix: str = PREFIX) -> Iterator[tuple[str, int, int]]:
    """(name, owner pid, size) of gearflow segments in SHM_DIR."""
    for name, head, size in _headers(prefix):
        yield name, int(head[H_OWNER]), size


def gc_segments(
    prefix: str = PREFIX, dry_run: bool = False, include_live: bool = False, run: int | None = None,
    kept: list[tuple[str, str]] | None = None,
) -> list[tuple[str, int]]:
    """Remove segments whose owning process is provably gone (:func:`owner_status`; all of
    them with ``include_live``). ``run``: only the segments tagged with that :func:`run_tag`.
    ``kept``: gets (name, why) of each segment left in place."""
    removed = []
    for name, head, size in _headers(prefix):
        if run is not None and int(head[H_RUN_TAG]) != run:
            continue
        dead, why = owner_status(head)
        if include_live or dead:
            if not dry_run:
                (SHM_DIR / name).unlink(missing_ok=True)
            removed.append((name, size))
        else:
            log.debug("kept %s (%s)", name, why)
            if kept is not None:
                kept.append((name, why))
    return removed


# ---------------------------------------------------------------------- partition owners


class PartitionOwned(GearflowError):
    """A writer asked for a partition that a live writer already writes."""


class TableClosed(GearflowError, RuntimeError):
    """The replay table was closed: a sample, priority update or scan after (or blocked across)
    ``Table.close()``, or a writer publishing into a closed table's segment (Reverb's
    cancellation of a closed table)."""


def release_partitions(storage: "SharedStorage", partitions: np.ndarray) -> None:
    """Undo :func:`claim_partitions` for the partitions this process holds, so a writer in
    another process may take them over while this one lives (``Writer.close``)."""
    mine = partitions[storage.counters[partitions, WRITER_PID] == os.getpid()]
    storage.counters[mine, WRITER_PID] = 0


def claim_partitions(storage: "SharedStorage", partitions: np.ndarray) -> None:
    """Make this process the writer of ``partitions``: refused (:class:`PartitionOwned`) while
    another live process is recorded as a partition's writer; a dead writer's partition is
    taken over (the new writer continues after its last step)."""
    owners = storage.counters[partitions, WRITER_PID]
    me = os.getpid()
    for p, pid in zip(partitions.tolist(), owners.tolist()):
        if pid and pid != me and pid_alive(int(pid)):
            raise PartitionOwned(
                f"partition {p} of {storage.name} already has a live writer (pid {pid}); "
                "a second writer would mix its steps into the same ring"
            )
    storage.counters[partitions, WRITER_PID] = me
