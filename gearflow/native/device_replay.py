"""Device-side sampling for a replay :class:`~gearflow.replay.table.Table` (``replay.device=cuda``).

The table stays the owner of ingest, eviction, rate limiting, checkpoints and
keys; its CPU selector stays the source of truth for ``len`` and checkpoints.
:class:`DeviceReplay` mirrors what sampling needs onto one GPU, fed by the
table's own ingest/evict/update calls, and draws and gathers whole batches
there:

    per slot (N = P * R, on device ``device_id``, written on ``stream`` only)
      masses  float64[N]    p ** alpha (prioritized) or 1.0 (uniform) for a live slot, 0 when dead
      sums    float64[NC]   per-4096-slot chunk sums (select.cu's two-level sum tree)
      start   int64[N]      absolute first step of the item in its partition
      seq     int64[N]      item sequence number in its partition (its key is seq * P + p)
      length  int32[N]      steps in the item (cut to the kind's window at ingest)

A sample, every device operation queued on :attr:`DeviceReplay.stream` under
``cupy.cuda.Device(device_id)``:

1. the stream waits (a reused event) for the work the consumer (torch's current
   stream on that device) has queued so far: it may still read the buffer set
   about to be refilled;
2. B uniforms → stratified proportional draw (uniform = mass 1 per live slot,
   the same kernel) → IS weights → each row's record (partition, start, seq,
   length) copied out of the mirrors *once*, into the :class:`DeviceDraw`, with
   a flag for an impossible slot (< 0 or ≥ N: the kernel's −1 when rounding
   makes an empty chunk look non-empty);
3. one gather kernel per column straight out of the shared-memory segment
   (``cudaHostRegister``-ed, mapped: zero-copy) into a preallocated buffer set,
   and the keys (``seq * P + p``), weights and probabilities copied into the
   same set, all from the draw's records; the count of impossible slots copied
   into pinned host memory;
4. one reused event recorded and waited for: **the sample's one host
   synchronization** (a blocking-sync event: the sampling thread sleeps in the
   driver instead of spinning a CPU core). The table then reads the RESERVE counters (the seqlock
   rule of ``Table.overwritten``, via :func:`~gearflow.replay.layout.torn_items` on the draw's
   records); torn items are evicted, impossible and torn rows redrawn
   (:meth:`DeviceReplay.redraw`: only those rows get new records) and the batch
   gathered again. Nothing is returned before every row passed.

Invariant: **the rows gathered are the rows of the keys returned.** Records,
gather and keys come from the same per-row records, which are written on the
same stream before the gather reads them; a redraw replaces the records of the
redrawn rows only, so a scan that reuses the slot of another row of the batch
(the record ring lapped) cannot change what that row's key names. Outputs
reach torch through DLPack over the buffer set: CUDA tensors, no copy, written
before the host synchronization and not written again until a later sample's
step 1 has waited for the consumer.

Buffer sets and streams: a set is refilled only after the replay stream has
waited for (a) the work torch's current stream on the device had queued when
the sample began (step 1: the consumer that reads batches on the stream it
samples from, the learner's legacy default stream) and (b) every event the
consumer recorded with :meth:`DeviceReplay.release` since the set's last fill
(``Sample.release(stream)``: the learner calls it after its step, on the
stream its step ran on; a consumer on a side stream or in a CUDA graph passes
that stream). Events are one per (set, consumer stream), made once and reused.
Sets replaced on a batch-size change are kept, their release events still
waited for, until ``num_buffers`` later samples have synchronized: their CuPy
memory never returns to the pool (and a later allocation on this stream)
while torch may still read it.

Example (GPU; ``Table(..., device="cuda")`` does exactly this)::

    dev = DeviceReplay(storage, Transition(("obs",)), selector, device=0)   # require_cupy, registers the segment
    table = Table(storage, Transition(("obs",)), selector, device=dev)
    batch = table.sample(256)          # batch.data["obs"]: cuda:0 uint8 (256, 4, 84, 84)

CuPy is passed in (``cupy=``) or imported by :func:`~gearflow.native.require_cupy`
on construction, never at import time; so is the compiled kernel code
(``gather=`` / ``select=``: a :class:`CudaGather` / :class:`CudaSelect`) and
the consumer's stream (``consumer_stream=``: a callable returning a raw
``cudaStream_t``, default torch's current stream on the device).
Every live priority 0 (prioritized): uniform draws over the selector's live
slots (P = 1/N, weights 1), as the CPU selector does.
Differences from the CPU selectors, by design: uniform draws are stratified
like prioritized ones (same marginal 1/N, lower variance); the device RNG
(CuPy's) is seeded from the selector's RNG state but is not part of a
checkpoint, so a restored device table does not repeat the exact draws.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gearflow.errors import ConfigError, MissingDependencyError
from gearflow.native import probe_cuda, probe_cupy, require_cupy
from gearflow.native.cuda_backend import dptr
from gearflow.native.device_buffers import BufferSets, DeviceBuffers, RawStream, torch_stream
from gearflow.native.gather import CudaGather, transition_rows
from gearflow.native.hostmem import register_storage
from gearflow.native.protocol import DEVICE_SELECTORS
from gearflow.native.select import CudaSelect, num_chunks
from gearflow.replay.layout import item_key, torn_items

log = logging.getLogger(__name__)

REPLAY_DEVICES = ("auto", "cpu", "cuda")
FLUSH_AT = 1 << 20  # queued ingest entries applied to the device without waiting for a draw
MAX_INVALID_ROUNDS = 8  # redraws of impossible slots in a row before the sample raises
MEMCPY_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost

__all__ = [
    "DEVICE_SELECTORS",
    "REPLAY_DEVICES",
    "DeviceBuffers",
    "DeviceDraw",
    "DeviceReplay",
    "cuda_device_index",
    "resolve_replay_device",
]


def cuda_device_index(name: str) -> int | None:
    """The device index of ``"cuda:N"`` (N), or None for ``"cuda"`` (the current device when the
    table is built). ValueError for anything else.

    >>> cuda_device_index("cuda:1"), cuda_device_index("cuda")
    (1, None)
    """
    if name == "cuda":
        return None
    head, sep, index = str(name).partition(":")
    if head != "cuda" or not sep or not index.isdigit():
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    return int(index)


def resolve_replay_device(name: str, selector: str | None = None) -> str:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` for ``replay.device=name`` (``auto``, ``cpu``, ``cuda``
    or ``cuda:N``; ``cuda`` is CuPy's current device when the table is built).

    ``auto`` picks ``cuda`` when CuPy can run a kernel, torch is a CUDA build
    and the selector samples on the device (``prioritized``/``uniform``), and
    logs why when it picks ``cpu``. ``cuda``/``cuda:N`` without them raises a
    one-line :class:`MissingDependencyError` saying why and how to install CuPy
    (or :class:`ConfigError` for a selector the device path does not have).
    """
    cuda = name == "cuda" or str(name).startswith("cuda:")
    if name not in REPLAY_DEVICES and not cuda:
        raise ConfigError(f"replay.device={name!r}: must be one of {', '.join(REPLAY_DEVICES)}, cuda:N")
    if cuda:
        try:
            cuda_device_index(name)
        except ValueError:
            raise ConfigError(f"replay.device={name!r}: a device index is a number (cuda:0, cuda:1, ...)") from None
    if name == "cpu":
        return "cpu"
    if selector is not None and selector not in DEVICE_SELECTORS:
        why = f"replay.selector={selector!r} samples on the CPU only (the GPU path has {', '.join(DEVICE_SELECTORS)})"
        if cuda:
            raise ConfigError(f"replay.device={name}: {why}")
        log.info("replay.device=auto: cpu (%s)", why)
        return "cpu"
    cupy, torch_cuda = probe_cupy(), probe_cuda()
    if cupy.ok and torch_cuda.ok:
        if name == "auto":
            log.info("replay.device=auto: cuda (%s; torch: %s)", cupy.detail, torch_cuda.detail)
            return "cuda"
        return name
    why = (
        f"needs CuPy and a CUDA GPU: {cupy.detail}"
        if not cupy.ok
        else f"hands batches to torch on the GPU, but torch cannot use CUDA: {torch_cuda.detail}"
    )
    if cuda:
        raise MissingDependencyError(f"replay.device={name} {why}")
    log.info("replay.device=auto: cpu (GPU replay %s)", why)
    return "cpu"


@dataclass
class DeviceDraw:
    """One batch's draws and the records of the drawn items, all device arrays of length B (CuPy).

    The records are copied out of the device mirrors when the row is drawn and never re-read:
    the gather, the seqlock check and the keys all use these, so each key names the item
    whose rows were gathered even if a later scan reuses the slot.
    """

    slots: Any  # int64 (B,) as drawn (may hold an impossible slot: see valid)
    probabilities: Any  # float64 (B,)
    weights: Any  # float32 (B,) importance weights, max 1
    parts: Any  # int64 (B,) partition of the slot (-1 where not valid)
    starts: Any  # int64 (B,) absolute first step of the item
    seqs: Any  # int64 (B,) item sequence number in its partition
    lengths: Any  # int32 (B,) steps in the item
    valid: Any  # bool (B,) 0 <= slot < N
    invalid: Any  # int64 (1,) count of rows not valid (copied to the host by gather)
    num_invalid: int | None = None  # that count on the host, once gather has synchronized


class _OnDevice:
    """``with self._on:`` = ``with cupy.cuda.Device(i), stream:`` (entered in that order). A fresh
    ``Device`` per entry: CuPy keeps the device to restore in the ``Device`` object, so one shared
    between threads (the prefetcher samples, another thread may flush) could restore the wrong one."""

    def __init__(self, cupy: Any, device_id: int, stream: Any) -> None:
        self.cupy, self.device_id, self.stream = cupy, device_id, stream
        self._local = threading.local()

    def __enter__(self) -> None:
        device = self.cupy.cuda.Device(self.device_id)
        device.__enter__()
        try:
            self.stream.__enter__()
        except BaseException:
            device.__exit__(None, None, None)
            raise
        self._local.__dict__.setdefault("devices", []).append(device)

    def __exit__(self, *exc: object) -> None:
        device = self._local.devices.pop()
        try:
            self.stream.__exit__(*exc)
        finally:
            device.__exit__(*exc)


def _mass_input(prioritized: bool, priorities: np.ndarray) -> np.ndarray:
    """What goes into the mass vector: raw priorities (p ** alpha in the kernel), or 1.0 per
    live item for the uniform selector."""
    return np.asarray(priorities, dtype=np.float64) if prioritized else np.ones(len(priorities))


def _check_selector(storage: Any, kind: Any, selector: Any) -> str:
    """The selector's name, or ValueError (before CuPy is imported or anything allocated)."""
    name = getattr(selector, "name", type(selector).__name__)
    if name not in DEVICE_SELECTORS:
        raise ValueError(
            f"device sampling supports the {' and '.join(DEVICE_SELECTORS)} selectors, "
            f"not {name!r}: use device='cpu' for it"
        )
    kind.layout(storage.spec, 1)  # validates the kind against the spec
    if getattr(kind, "gather_on_device", None) is None:
        raise ValueError(f"item kind {kind.name!r} has no device gather (gather_on_device): use device='cpu' for it")
    return name


def _device_id(cp: Any, device: int | None) -> int:
    """CuPy's current device (``None``) or ``device``, or ValueError if it does not exist."""
    count = int(cp.cuda.runtime.getDeviceCount())
    device_id = int(cp.cuda.runtime.getDevice()) if device is None else int(device)
    if not 0 <= device_id < count:
        raise ValueError(f"replay device cuda:{device_id} does not exist ({count} CUDA device(s) visible)")
    return device_id



@dataclass(frozen=True)
class DeviceColumns:
    """What an item kind's device gather hook works with: ``kind.gather_on_device(cols, draw,
    data)`` (:class:`~gearflow.replay.items.ItemKind`) fills ``data`` (the kind's layout as CuPy
    arrays: ``(B, *shape)``, ``(B, T, *shape)``, ``mask`` ``(B, T)``, ...) with the rows of
    ``draw``'s items (a :class:`DeviceDraw`: ``parts``, ``starts`` int64 (B,), ``lengths``
    int32 (B,)). It runs inside the table's ``with dev._on`` (its device and stream), so every
    kernel below is queued on the replay stream; nothing here synchronizes."""

    cupy: Any
    kernels: CudaGather
    columns: tuple  # per column: (name, device pointer of row 0, bytes per row: one frame of a stacked column)
    stacks: dict  # stacked-frame columns {name: K}
    num_partitions: int  # P
    steps_per_partition: int  # S
    offsets: Any  # device pointer of the steps' episode offsets (uint8[P * S]), None without stacks

    @classmethod
    def of(cls, cupy: Any, kernels: CudaGather, storage: Any, reg: Any) -> DeviceColumns:
        """Over ``storage``'s segment, registered as ``reg`` (:func:`~gearflow.native.hostmem.register_storage`)."""
        stacks = dict(storage.spec.stacked)
        columns = tuple((c.name, reg.device_pointer(storage.column_offsets[c.name]), c.nbytes) for c in storage.spec)
        offsets = reg.device_pointer(storage.step_offset_position) if stacks else None
        return cls(cupy, kernels, columns, stacks, storage.num_partitions, storage.steps_per_partition, offsets)

    def rows(self, ptr: int, row_bytes: int, rows: Any, dst: Any) -> None:
        """``dst[i]`` = storage row ``rows[i]`` (int64 (B,)) of the column at ``ptr``."""
        self.kernels.gather_rows(ptr, row_bytes, rows, dst,
                                 num_rows=self.num_partitions * self.steps_per_partition)  # fmt: skip

    def first_last_rows(self, parts: Any, starts: Any, lengths: Any) -> tuple[Any, Any]:
        """Storage rows (int64 (B,), (B,)) of each item's first and last step."""
        return transition_rows(parts, starts, lengths, self.steps_per_partition)

    def windows(self, ptr: int, row_bytes: int, parts: Any, starts: Any, lengths: Any, T: int, dst: Any,
                mask: Any) -> None:  # fmt: skip
        """Windows of ``T`` steps from each item's first step into ``dst`` (B, T, row bytes), zero
        past its length; ``mask`` (B, T) True on its steps."""
        S = self.steps_per_partition
        self.kernels.gather_windows(ptr, row_bytes, S, parts, starts, lengths, T, dst, mask,
                                    num_rows=self.num_partitions * S)  # fmt: skip

    def stack(self, name: str, ptr: int, row_bytes: int, parts: Any, at: Any, n: Any, steps: int, dst: Any) -> None:
        """The frame stacks of ``steps`` steps from ``at`` (int64 (B,)), ``n`` (int32 (B,)) of them
        real (the rest repeat the last), into ``dst`` (B, [steps,] K, *frame)."""
        K, B, S = self.stacks[name], parts.shape[0], self.steps_per_partition
        self.kernels.gather_stacks(ptr, row_bytes, S, K, self.offsets, parts, at, n, steps,
                                   dst.reshape(B, steps, K, -1), num_rows=self.num_partitions * S)  # fmt: skip


class DeviceReplay:
    """The GPU side of a table: device priority vector + records, zero-copy gather, seqlock check.

    Built over the table's ``storage``, ``kind`` and ``selector`` (one of
    :data:`DEVICE_SELECTORS`) on GPU ``device`` (default: CuPy's current device
    now; it is kept for the table's life); registers the whole shared-memory
    segment with CUDA until :meth:`close`. The table calls :meth:`insert`,
    :meth:`remove`, :meth:`update` and :meth:`load` as its own state changes, and
    :meth:`draw` / :meth:`buffers` / :meth:`gather` / :meth:`invalid` /
    :meth:`torn` / :meth:`redraw` / :meth:`batch` to sample. Every device
    operation is queued on :attr:`stream` under ``cupy.cuda.Device(device_id)``;
    :meth:`gather` is the one place that synchronizes (one reused event).
    """

    def __init__(
        self,
        storage: Any,
        kind: Any,
        selector: Any,
        *,
        device: int | None = None,
        cupy: Any = None,
        gather: CudaGather | None = None,
        select: CudaSelect | None = None,
        seed: int | None = None,
        consumer_stream: Callable[[], int | None] | None = None,
    ) -> None:
        name = _check_selector(storage, kind, selector)
        cp = require_cupy("replay.device=cuda") if cupy is None else cupy
        device_id = _device_id(cp, device)
        self.cupy, self.storage, self.kind, self.selector = cp, storage, kind, selector
        self.device_id = device_id
        self.prioritized = name == "prioritized"
        self._P, self._R, self._S = storage.num_partitions, storage.items_per_partition, storage.steps_per_partition
        N = self._P * self._R
        self._gather = gather or CudaGather(cp)
        self._select = select or CudaSelect(cp)
        self._consumer_stream = consumer_stream or (lambda: torch_stream(device_id))
        if seed is None:  # follow the selector's seed (public state), so seeded runs stay seeded
            seed = zlib.crc32(np.asarray(selector.state_dict()["rng_state"]).tobytes())
        with cp.cuda.Device(device_id):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._on = _OnDevice(cp, device_id, self.stream)
            # reused every sample (no event created per sample): "gathered" is the one host sync,
            # "consumer" orders this stream after the consumer's queued reads of the buffer sets
            self._gathered = cp.cuda.Event(block=True, disable_timing=True)  # the host sleeps on it
            self._consumer_done = cp.cuda.Event(disable_timing=True)
            self._consumer = RawStream(0)  # the consumer's stream, re-pointed per sample
            self._pinned = cp.cuda.alloc_pinned_memory(8)  # int64: impossible slots of the last gather
            self._status_host = np.frombuffer(self._pinned, dtype=np.int64, count=1)
            with self.stream:
                self._rng = cp.random.RandomState(seed)
                self._masses = cp.zeros(N, dtype=cp.float64)
                self._sums = cp.zeros(num_chunks(N), dtype=cp.float64)
                self._start = cp.zeros(N, dtype=cp.int64)
                self._seq = cp.full(N, -1, dtype=cp.int64)
                self._length = cp.zeros(N, dtype=cp.int32)
            self._reg = register_storage(cp, storage)  # last: nothing to undo if an allocation failed
        self.columns = DeviceColumns.of(cp, self._gather, storage, self._reg)  # what the kind's gather_on_device reads
        # the torn rule's bound: an item is intact while its first step is >= RESERVE - (S - stack reach)
        self._S_trust = storage.trusted_steps
        self._pending: list[tuple[np.ndarray, np.ndarray, tuple | None]] = []  # (slots, priorities, records)
        self._pending_n = 0
        # the output sets and their consumers' releases (gearflow/native/device_buffers.py)
        self.buffer_sets = BufferSets(cp, device_id, self._on, self.stream, kind, storage.spec, self._consumer_stream)
        self._invalid_rounds = 0

    # ------------------------------------------------------------------ mirror of the table's ingest
    # The table reports ingest/evict/update per partition; those calls are queued on the host and
    # applied in one batch (one scatter kernel, one record upload) before the next draw, so a scan
    # over many partitions costs a handful of launches, not a handful per partition. The queue
    # keeps the table's order; a slot's last entry wins, as in the selectors.
    def _alpha(self) -> float:
        return float(self.selector.alpha) if self.prioritized else 1.0

    def _queue(self, slots: np.ndarray, priorities: np.ndarray, records: tuple | None) -> None:
        if len(slots):  # copies: the caller may reuse its arrays before the queue is applied
            records = None if records is None else tuple(np.array(r) for r in records)
            self._pending.append((np.array(slots, dtype=np.int64), np.array(priorities, dtype=np.float64), records))
            self._pending_n += len(slots)
            if self._pending_n >= FLUSH_AT:  # a table that fills for long before its first sample
                self.flush()

    def insert(self, slots: np.ndarray, priorities: np.ndarray, starts: np.ndarray, seqs: np.ndarray,
               lengths: np.ndarray) -> None:  # fmt: skip
        """Items ingested into ``slots`` (host int64) with their records."""
        self._queue(slots, _mass_input(self.prioritized, priorities), (starts, seqs, lengths))

    def remove(self, slots: np.ndarray) -> None:
        """Items evicted: their mass becomes 0 (their records stay until the slot is reused)."""
        self._queue(slots, np.zeros(len(slots)), None)

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """New priorities of live slots (validated by the table); the uniform selector ignores them."""
        if self.prioritized:
            self._queue(slots, priorities, None)

    def flush(self) -> None:
        """Apply the queued ingest/evict/update calls to the device vectors (queued on the stream)."""
        if not self._pending:
            return
        with self._on:
            self._flush()

    def _flush(self) -> None:  # inside self._on
        if not self._pending:
            return
        pending, self._pending, self._pending_n = self._pending, [], 0
        cp = self.cupy
        slots = np.concatenate([s for s, _, _ in pending])
        prios = np.concatenate([p for _, p, _ in pending])
        self._select.update_priorities(self._masses, slots, prios, self._alpha(), chunk_sums=self._sums)
        inserted = [(s, r) for s, _, r in pending if r is not None]
        if inserted:
            rs = np.concatenate([s for s, _ in inserted])
            cols = [np.concatenate([r[i] for _, r in inserted]) for i in range(3)]
            _, first_reversed = np.unique(rs[::-1], return_index=True)
            last = len(rs) - 1 - first_reversed  # a slot ingested twice: its last record
            s_dev = cp.asarray(rs[last])
            for dst, col, dtype in zip((self._start, self._seq, self._length), cols, (np.int64, np.int64, np.int32)):
                dst[s_dev] = cp.asarray(np.ascontiguousarray(col[last], dtype=dtype))

    def load(self, live: np.ndarray, starts: np.ndarray, seqs: np.ndarray, lengths: np.ndarray) -> None:
        """Rebuild every mirror from the table's per-slot state (after a checkpoint restore). The
        masses come from the (already restored) selector: its sum tree's leaves, or 1.0 per live slot."""
        N = self._P * self._R
        self._pending, self._pending_n = [], 0  # superseded by the state loaded here
        if self.prioritized:
            masses = np.where(live, self.selector.tree.leaves[:N], 0.0)
        else:
            masses = live.astype(np.float64)
        cp = self.cupy
        with self._on:
            self._masses[...] = cp.asarray(np.ascontiguousarray(masses, dtype=np.float64))
            self._start[...] = cp.asarray(np.ascontiguousarray(starts, dtype=np.int64))
            self._seq[...] = cp.asarray(np.ascontiguousarray(seqs, dtype=np.int64))
            self._length[...] = cp.asarray(np.ascontiguousarray(lengths, dtype=np.int32))
            self._select.sum_chunks(self._masses, self._sums)

    # ------------------------------------------------------------------ sampling
    def _wait_for_consumer(self) -> None:
        """Make :attr:`stream` wait for the work the consumer has queued so far on its stream
        (torch's current stream on this device): it may still read the buffer set this sample
        refills, or memory it released to this stream's pool. One reused event; no host wait."""
        ptr = self._consumer_stream()
        if ptr is None:  # no CUDA consumer (CPU torch, the emulation): its code has already run
            return
        self._consumer.ptr = ptr
        self._consumer_done.record(self._consumer)
        self.stream.wait_event(self._consumer_done)

    def draw(self, batch_size: int, num_live: int) -> DeviceDraw:
        """Start a sample: wait for the consumer, apply queued ingest, queue ``batch_size`` draws
        among ``num_live`` live items (stratified, proportional to mass) with their records."""
        if num_live < 1:
            raise ValueError("cannot sample from an empty table")
        self._invalid_rounds = 0
        with self._on:
            self._wait_for_consumer()  # first: before anything this sample writes
            self._flush()
            return self._draw(batch_size, num_live)

    def _draw(self, batch_size: int, num_live: int) -> DeviceDraw:  # inside self._on
        u = self._rng.random_sample(batch_size)  # float64 (B,)
        if self.prioritized and not self.selector.tree.total > 0:
            # every live priority is 0: uniform among the live slots, as the CPU selector (and
            # Reverb's) does, P = 1/N, weights 1; stratified like every device draw
            cp = self.cupy
            strata = (cp.arange(batch_size, dtype=cp.float64) + u) / batch_size  # float64 (B,) in [0, 1)
            live = cp.asarray(np.ascontiguousarray(self.selector.live_slots, dtype=np.int64))  # (N,)
            slots, probs = self._select.sample_uniform(num_live, strata, live)
            return self._with_records(slots, probs, cp.ones(batch_size, dtype=cp.float32))
        slots, probs = self._select.sample_proportional(self._masses, u, chunk_sums=self._sums)
        return self._with_records(slots, probs, self._weights(probs, num_live))

    def _with_records(self, slots: Any, probs: Any, weights: Any) -> DeviceDraw:  # inside self._on
        """The draw with each row's record copied out of the mirrors now (the only read of them)."""
        cp, N = self.cupy, self._P * self._R
        valid = (slots >= 0) & (slots < N)  # bool (B,): the kernel's -1, or anything past the vector
        safe = cp.where(valid, slots, 0)  # never index the mirrors out of range (CuPy wraps -1)
        parts = cp.where(valid, safe // self._R, -1)
        invalid = cp.zeros(1, dtype=cp.int64)
        invalid[...] = (~valid).sum()
        return DeviceDraw(slots, probs, weights, parts, self._start[safe], self._seq[safe], self._length[safe],
                          valid, invalid)  # fmt: skip

    def _weights(self, probs: Any, num_live: int) -> Any:
        if not self.prioritized:
            return self.cupy.ones(probs.shape[0], dtype=self.cupy.float32)
        return self._select.importance_weights(probs, num_live, float(self.selector.beta))

    def redraw(self, draw: DeviceDraw, positions: np.ndarray, num_live: int) -> DeviceDraw:
        """``draw`` with fresh draws and records at ``positions`` (host int64) only; the other rows
        keep their records; weights re-normalised over the batch."""
        cp = self.cupy
        with self._on:
            self._flush()  # the table's scan (torn eviction) ingested: fresh draws see it
            fresh = self._draw(len(positions), num_live)
            pos = cp.asarray(np.ascontiguousarray(positions, dtype=np.int64))
            fields = ("slots", "probabilities", "parts", "starts", "seqs", "lengths", "valid")
            merged = {}
            for f in fields:
                a = getattr(draw, f).copy()
                a[pos] = getattr(fresh, f)
                merged[f] = a
            invalid = cp.zeros(1, dtype=cp.int64)
            invalid[...] = (~merged["valid"]).sum()
            return DeviceDraw(weights=self._weights(merged["probabilities"], num_live), invalid=invalid, **merged)

    def slots_at(self, draw: DeviceDraw, positions: np.ndarray) -> np.ndarray:
        """Host copy of the drawn slots at ``positions`` (the torn ones, to evict)."""
        cp = self.cupy
        with self._on:
            return cp.asnumpy(draw.slots[cp.asarray(np.asarray(positions, dtype=np.int64))])

    def release(self, out: DeviceBuffers, stream: Any = None) -> None:
        """The consumer has queued every read of the batch in ``out`` on ``stream`` (default:
        torch's current stream on the device): ``out`` is refilled only after that stream passed
        this point (:meth:`BufferSets.release`: one reused event per (set, stream); no wait)."""
        self.buffer_sets.release(out, stream)

    def buffers(self, batch_size: int, num_buffers: int) -> DeviceBuffers:
        """The next of ``num_buffers`` preallocated output sets. A batch stays valid for
        ``num_buffers - 1`` further samples, or until it is released (:meth:`release`) and
        its set comes round again: a set is refilled only after the sample's :meth:`draw`
        made the stream wait for torch's current stream, and after the stream waited for every
        release the consumer recorded on its own stream since the set's last fill."""
        return self.buffer_sets.next(batch_size, num_buffers)

    def gather(self, draw: DeviceDraw, out: DeviceBuffers) -> None:
        """Gather the drawn items' steps into ``out`` (zero-copy from the segment) from the draw's
        records, write its keys, weights and probabilities, then wait for it: the caller reads the
        RESERVE counters next, and they must postdate the copy. The sample's one host sync."""
        P, parts = self._P, draw.parts
        with self._on:
            self.kind.gather_on_device(self.columns, draw, {name: a for name, (a, _) in out.data.items()})
            out.keys[0][...] = item_key(draw.seqs, parts, P)  # int64 (B,): the key of the record gathered
            out.weights[0][...] = draw.weights
            out.probabilities[0][...] = draw.probabilities
            self.cupy.cuda.runtime.memcpyAsync(self._status_host.ctypes.data, dptr(draw.invalid), 8,
                                               MEMCPY_DEVICE_TO_HOST, self.stream.ptr)  # fmt: skip
            self._gathered.record(self.stream)
        self._gathered.synchronize()
        draw.num_invalid = int(self._status_host[0])
        self.buffer_sets.after_sync()  # this stream waited for the retired sets' consumers before the sync

    def invalid(self, draw: DeviceDraw) -> np.ndarray:
        """Host int64 positions of impossible slots (< 0 or ≥ N) in ``draw``, to redraw; empty
        without a device read when :meth:`gather` counted none (the usual case). Raises
        RuntimeError after :data:`MAX_INVALID_ROUNDS` rounds in a row that had some."""
        if draw.num_invalid is None:
            raise ValueError("invalid() needs the draw gathered first (gather() reads the count)")
        if not draw.num_invalid:
            return np.zeros(0, dtype=np.int64)
        self._invalid_rounds += 1
        if self._invalid_rounds > MAX_INVALID_ROUNDS:
            raise RuntimeError(
                f"device draw returned a slot outside [0, {self._P * self._R}) in {MAX_INVALID_ROUNDS} "
                "redraws in a row: the device priority vector is inconsistent with the table"
            )
        cp = self.cupy
        with self._on:
            return cp.asnumpy(cp.flatnonzero(~draw.valid)).astype(np.int64)

    def torn(self, draw: DeviceDraw, reserve: np.ndarray) -> np.ndarray:
        """Host int64 positions of items a writer may have overwritten during :meth:`gather`
        (from the draw's records); ``reserve`` is the partitions' RESERVE counters read after it
        returned. Rows with an impossible slot are left to :meth:`invalid`."""
        cp = self.cupy
        with self._on:
            parts = cp.where(draw.valid, draw.parts, 0)
            r = cp.asarray(np.ascontiguousarray(reserve, dtype=np.int64))
            bad = draw.valid & torn_items(parts, draw.starts, r, self._S_trust)  # stacks: their reach too
            return cp.asnumpy(cp.flatnonzero(bad)).astype(np.int64)

    def batch(self, out: DeviceBuffers):
        """(data, keys, weights, probabilities) as torch CUDA tensors over ``out`` (DLPack views
        made when the set was allocated: no copy, no device work, no synchronization)."""
        data = {name: tensor for name, (_, tensor) in out.data.items()}
        return data, out.keys[1], out.weights[1], out.probabilities[1]

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for queued work, drop the buffers, unregister the segment (before it is unmapped)."""
        if self._reg.closed:
            return
        self._pending, self._pending_n = [], 0
        with self.cupy.cuda.Device(self.device_id):
            self.stream.synchronize()
            self.buffer_sets.clear()
            self._reg.close()

    def __repr__(self) -> str:
        kind = "prioritized" if self.prioritized else "uniform"
        return f"DeviceReplay({kind}, {self._P * self._R} slots, cuda:{self.device_id}, {self._reg!r})"
