"""Device-side sampling for a replay :class:`~gearflow.replay.table.Table` (``replay.device=cuda``).

The table stays the owner of ingest, eviction, rate limiting, checkpoints and keys; liveness
(``len``, the live slots) stays on the host in its :class:`~gearflow.replay.device_table.DeviceSelector`.
The priorities live only here: :class:`DeviceReplay` holds the table's priority vector and record
mirrors on one GPU, fed by the table's own ingest/evict calls and by priority write-backs by key
(device tensors applied on the device: no host round trip, no CPU sum tree), and draws and
gathers whole batches there::

    per slot (N = P * R, on device ``device_id``, written on ``stream`` only)
      masses  float64[N]    p ** alpha (prioritized) or 1.0 (uniform) for a live slot, 0 when dead
      sums    float64[NC]   per-4096-slot chunk sums (select.cu's two-level sum tree)
      live    float64[N]    1.0 per live slot (the no-mass fallback; the uniform selector: masses)
      start   int64[N]      absolute first step of the item in its partition
      seq     int64[N]      item sequence number in its partition (its key is seq * P + p)
      length  int32[N]      steps in the item (cut to the kind's window at ingest)
      winner  uint64[N]     the write-back's de-duplication tags

**A sample** (:meth:`next_batch`), every device operation on :attr:`stream`: batches are drawn
``ahead`` samples before they are returned. Each queued batch is, in its own buffer set
(:mod:`gearflow.native.device_buffers`):

1. the set's refill guard: the stream waits (device-side) for the consumer's releases of it
   (or, for a consumer that never releases, for torch's current stream);
2. queued ingest/evictions applied (one kernel reading the entries in place from mapped host
   memory: an upload from pageable memory would first wait for the stream);
3. one fused draw (``draw_items``: B stratified proportional draws, the uniforms made in the
   kernel, each row's record copied out of the mirrors);
4. the kind's gather kernels straight out of the shared-memory segment (zero-copy);
5. ``finish_batch``: the seqlock check of every row against RESERVE read by the device after the
   gather, keys, probabilities, IS weights, and the status word (impossible rows, torn rows,
   priorities applied / refused) written into pinned host memory;
6. its event recorded.

The host returns the oldest queued batch after its event (**the sample's one host sync**, a
blocking-sync event, normally already passed: the batch was queued ``ahead`` samples before) and
one read of its status word: nothing else of the batch crosses to the host. A batch with torn or
impossible rows (the status says so) takes the rare path: the torn items are evicted through the
table, only those rows are redrawn (the others keep their records), the batch is gathered and
checked again; it is never returned before every row passed.

**A priority write-back** (:meth:`update_keys`) of device keys and priorities: the replay stream
waits (device-side) for the caller's stream, then three launches: keys mapped to the slots still
holding them, duplicates resolved on the device (a repeated key: its last entry), masses written
and their chunks re-summed. No host sync, nothing copied to the host. A priority that is not
finite and >= 0 is not applied; the count comes back in the status word of the next batch drawn
and the sample that returns that batch raises ValueError naming it.

Invariant: **the rows gathered are the rows of the keys returned.** Records, gather and keys
come from the same per-row records, written on the same stream before the gather reads them; a
redraw replaces the records of the redrawn rows only. Outputs reach torch through DLPack over
the buffer set: CUDA tensors, no copy, written before the batch's event and not written again
until the set comes round and the stream has waited for its consumer.

Locking: the replay's own lock covers its queue, ingest queue and write-back state only, never a
host wait: a sampling thread waiting for a batch does not block a write-back from another thread.

Example (GPU; ``Table(..., device="cuda")`` does exactly this)::

    dev = DeviceReplay(storage, Transition(("obs",)), selector, device=0)   # require_cupy, registers the segment
    table = Table(storage, Transition(("obs",)), selector, device=dev)
    batch = table.sample(256)          # batch.data["obs"]: cuda:0 uint8 (256, 4, 84, 84)
    table.update_priorities(batch.keys, td_errors.abs())   # CUDA tensors: applied on the device

CuPy is passed in (``cupy=``) or imported by :func:`~gearflow.native.require_cupy` on
construction, never at import time; so is the compiled kernel code (``gather=`` / ``select=``:
a :class:`CudaGather` / :class:`CudaSelect`) and the consumer's stream (``consumer_stream=``: a
callable returning a raw ``cudaStream_t``, default torch's current stream on the device).
Differences from the CPU selectors, by design: uniform draws are stratified like prioritized
ones (same marginal 1/N, lower variance); the draws' uniforms come from a counter-based hash
seeded from the selector's RNG state, which is not part of a checkpoint, so a restored device
table does not repeat the exact draws; priorities are applied ``ahead`` batches later than on
the CPU path (the batches already drawn keep their draws).
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gearflow.errors import ConfigError, MissingDependencyError
from gearflow.native import probe_cuda, probe_cupy, require_cupy
from gearflow.native.cuda_backend import dptr
from gearflow.native.device_buffers import (
    BufferSets,
    DeviceBuffers,
    DeviceDraw,
    torch_stream,
)
from gearflow.native.device_ingest import IngestQueue
from gearflow.native.device_inputs import WriteBackInputs
from gearflow.native.gather import CudaGather, transition_rows
from gearflow.native.hostmem import register_storage
from gearflow.native.protocol import DEVICE_SELECTORS
from gearflow.native.select import REPLAY_FIELDS, CudaSelect, descriptor, num_chunks

log = logging.getLogger(__name__)

REPLAY_DEVICES = ("auto", "cpu", "cuda")
MAX_INVALID_ROUNDS = 8  # redraws of impossible slots in a row before the sample raises
RESERVE = 0  # gearflow.replay.storage's RESERVE counter field (checked against it by the tests)
_NONE = np.zeros(0, dtype=np.int64)

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


def _mirror(cp: Any, N: int, NC: int, prioritized: bool) -> dict[str, Any]:
    """The device mirror of a table's per-slot state (the replay descriptor's arrays), zeroed on
    CuPy's current stream: masses and their chunk sums, liveness and its sums (uniform: the masses
    themselves, 1 per live slot), each slot's item record (start, seq -1: none, length), the
    write-back winners, the write-back status (priorities applied, refused: running counts)."""
    masses, sums = cp.zeros(N, dtype=cp.float64), cp.zeros(NC, dtype=cp.float64)
    live = (cp.zeros(N, dtype=cp.float64), cp.zeros(NC, dtype=cp.float64)) if prioritized else (masses, sums)
    return {"masses": masses, "sums": sums, "live": live[0], "live_sums": live[1], "start": cp.zeros(N, dtype=cp.int64),
            "seq": cp.full(N, -1, dtype=cp.int64), "length": cp.zeros(N, dtype=cp.int32),
            "winner": cp.zeros(N, dtype=cp.uint64), "prio_status": cp.zeros(2, dtype=cp.uint64)}  # fmt: skip


class DeviceReplay:
    """The GPU side of a table: device priority vector + records, zero-copy gather, seqlock check.

    Built over the table's ``storage``, ``kind`` and ``selector`` (one of
    :data:`DEVICE_SELECTORS`; a restored selector's priorities and live slots are taken over) on
    GPU ``device`` (default: CuPy's current device now; it is kept for the table's life);
    registers the whole shared-memory segment with CUDA until :meth:`close`. The table calls
    :meth:`insert`, :meth:`remove` and :meth:`load` as its own state changes,
    :meth:`update_keys` for write-backs, and :meth:`next_batch` / :meth:`bad_rows` /
    :meth:`redraw` / :meth:`batch` to sample. ``ahead``: batches drawn before they are asked for
    (their buffer sets are extra: a returned batch stays valid for ``num_buffers - 1`` further
    samples, as on the CPU path).
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
        ahead: int = 1,
    ) -> None:
        name = _check_selector(storage, kind, selector)
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead must be an integer >= 0, got {ahead!r}")
        cp = require_cupy("replay.device=cuda") if cupy is None else cupy
        device_id = _device_id(cp, device)
        self.cupy, self.storage, self.kind, self.selector = cp, storage, kind, selector
        self.device_id, self.ahead = device_id, ahead
        self.prioritized = name == "prioritized"
        self._P, self._R, self._S = storage.num_partitions, storage.items_per_partition, storage.steps_per_partition
        N = self._P * self._R
        self._N, self._NC = N, num_chunks(N)
        self._gather = gather or CudaGather(cp)
        self._select = select or CudaSelect(cp)
        self._consumer_stream = consumer_stream or (lambda: torch_stream(device_id))
        if seed is None:  # follow the selector's seed (public state), so seeded runs stay seeded
            seed = zlib.crc32(np.asarray(selector.state_dict()["rng_state"]).tobytes())
        self._seed, self._counter = int(seed), 0  # the draws' uniforms: (seed, draw number)
        self._lock = threading.RLock()  # queue, ingest queue, write-back state; never held over a host wait
        with cp.cuda.Device(device_id):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._on = _OnDevice(cp, device_id, self.stream)
            self._inputs = WriteBackInputs(cp, device_id, self.stream, self._consumer_stream)
            with self.stream:
                m = _mirror(cp, N, self._NC, self.prioritized)
                self._scratch = cp.zeros(1024, dtype=cp.int64)  # a write-back's slots
            self._arrays = m  # what the descriptor points at: alive as long as it is
            self._masses, self._sums, self._live, self._live_sums = m["masses"], m["sums"], m["live"], m["live_sums"]
            self._start, self._seq, self._length, self._winner = m["start"], m["seq"], m["length"], m["winner"]
            self._reg = register_storage(cp, storage)  # last: nothing to undo if an allocation failed
            counters = self._reg.device_pointer(storage.counters.ctypes.data - storage.header.ctypes.data)
            self._desc = descriptor(cp, REPLAY_FIELDS, {**m, "counters": counters, "N": N, "NC": self._NC, "P": self._P,
                                                        "R": self._R, "counter_fields": storage.counters.shape[1],
                                                        "reserve_field": RESERVE, "trusted_steps": storage.trusted_steps})  # fmt: skip
        self._desc_ptr = dptr(self._desc)
        vectors = [(dptr(self._masses), dptr(self._sums), N, self._NC)]
        if self.prioritized:
            vectors.append((dptr(self._live), dptr(self._live_sums), N, self._NC))
        self._ingest = IngestQueue(cp, self._select, self._desc_ptr, vectors, self._alpha, self._lock, self._on)
        # the torn rule's bound (finish_batch): an item is intact while its first step is >= RESERVE - this
        self._S_trust = storage.trusted_steps
        self.columns = DeviceColumns.of(cp, self._gather, storage, self._reg)  # what the kind's gather_on_device reads
        # the buffer sets and their consumers' releases (gearflow/native/device_buffers.py)
        self.buffer_sets = BufferSets(cp, device_id, self._on, self.stream, kind, storage.spec, self._consumer_stream)
        self._queue: deque[DeviceBuffers] = deque()  # batches drawn ahead, oldest first
        self._tag = 0  # write-back number (winner tags: tag << 32 | entry)
        self._seen = (0, 0)  # priorities applied / refused as of the last status read
        self._invalid_rounds = 0
        self._take_over(selector)

    # ------------------------------------------------------------------ mirror of the table's ingest
    # queued on the host, applied in one kernel before the next draw (gearflow/native/device_ingest.py)
    def _alpha(self) -> float:
        return float(self.selector.alpha) if self.prioritized else -1.0  # -1: masses are 1 (uniform)

    def insert(self, slots: np.ndarray, priorities: np.ndarray, starts: np.ndarray, seqs: np.ndarray,
               lengths: np.ndarray) -> None:  # fmt: skip
        """Items ingested into ``slots`` (host int64) with their raw priorities and records."""
        self._ingest.put(slots, priorities, (starts, seqs, lengths))

    def remove(self, slots: np.ndarray) -> None:
        """Items evicted: their mass and liveness become 0 (their records stay until the slot is reused)."""
        self._ingest.put(slots, np.zeros(len(slots)), None)

    def flush(self) -> None:
        """Apply the queued ingest/evictions now (queued on the stream; every draw and write-back
        applies them first anyway)."""
        self._ingest.flush()

    def _take_over(self, selector: Any) -> None:
        """Live slots and (prioritized) masses of a selector that already holds items (a restored
        table's): uploaded once, before any sample."""
        live_slots = np.asarray(selector.live_slots, dtype=np.int64)
        if not live_slots.size:
            return
        live = np.zeros(self._N)
        live[live_slots] = 1.0
        masses = np.where(live > 0, selector.tree.leaves[: self._N], 0.0) if self.prioritized else live
        cp = self.cupy
        with self._on:
            self._masses[...] = cp.asarray(np.ascontiguousarray(masses))
            if self.prioritized:
                self._live[...] = cp.asarray(live)
            self._resum_all()

    def _resum_all(self) -> None:  # inside self._on
        self._select.sum_chunks(self._masses, self._sums)
        if self.prioritized:
            self._select.sum_chunks(self._live, self._live_sums)

    def load(self, live: np.ndarray, starts: np.ndarray, seqs: np.ndarray, lengths: np.ndarray) -> None:
        """Rebuild the mirrors from the table's per-slot state (a checkpoint restore, or the table's
        own state loaded back): records and liveness uploaded, the masses kept where a slot stays
        live (they came from the restored selector or this table's write-backs), 0 elsewhere.
        Batches drawn ahead are dropped (they were drawn from the state before)."""
        cp = self.cupy
        with self._lock, self._on:
            self._ingest.drop()  # superseded by the state loaded here
            self._drop_queue()
            mask = cp.asarray(np.ascontiguousarray(live, dtype=np.float64))
            self._masses *= mask
            if self.prioritized:
                self._live[...] = mask
            self._start[...] = cp.asarray(np.ascontiguousarray(starts, dtype=np.int64))
            self._seq[...] = cp.asarray(np.ascontiguousarray(seqs, dtype=np.int64))
            self._length[...] = cp.asarray(np.ascontiguousarray(lengths, dtype=np.int32))
            self._resum_all()

    def masses(self) -> np.ndarray:
        """Host copy of the mass vector (float64[N], p ** alpha; a checkpoint's priorities): queued
        ingest applied, then one wait for the stream."""
        with self._lock, self._on:
            self._ingest.apply()
            self.stream.synchronize()
            return self.cupy.asnumpy(self._masses)

    def load_masses(self, masses: np.ndarray) -> None:
        """Replace the mass vector (float64[N], p ** alpha; dead slots must be 0)."""
        cp = self.cupy
        with self._lock, self._on:
            self._drop_queue()
            self._masses[...] = cp.asarray(np.ascontiguousarray(masses, dtype=np.float64))
            self._resum_all()

    # ------------------------------------------------------------------ priority write-back
    def update_keys(self, keys: Any, priorities: Any) -> int:
        """New priorities by key (int64 keys; float32 or float64 priorities, the same length).
        Device arrays (CUDA torch tensors, CuPy arrays) are read where they are, after the replay
        stream waited for torch's current stream (their producer): three launches, no host
        sync; a priority that is not finite and >= 0 is skipped, counted in the next batch drawn and
        raised (ValueError) by the sample that returns it.
        Host arrays (checked by the table first) are uploaded. Keys of evicted
        items are ignored; a repeated key takes its last priority. Returns the entries handed in."""
        K, f32, stage = self._inputs.prepare(keys, priorities)  # checked (ValueError) before anything is queued
        if K == 0:
            return 0
        cp = self.cupy
        with self._lock, self._on:
            self._ingest.apply()  # a key ingested since the last draw is on the device before it is looked up
            k_ptr, p_ptr, keep = stage()
            if self._scratch.shape[0] < K:
                self._scratch = cp.zeros(max(K, 2 * self._scratch.shape[0]), dtype=cp.int64)
            self._tag += 1
            if self._tag >= 2**31:  # the tags would reach the winners of long ago: start over
                self._winner[...] = 0
                self._tag = 1
            self._select.update_by_key(self._desc_ptr, k_ptr, p_ptr, K, f32, self._tag << 32,
                                       self._alpha(), dptr(self._scratch), dptr(self._masses), self._N,
                                       dptr(self._sums) if self.prioritized else None, self._NC)  # fmt: skip
            self._inputs.keep_alive(*keep)
        return K

    # ------------------------------------------------------------------ sampling
    def next_batch(self, batch_size: int, num_live: int, num_buffers: int) -> DeviceBuffers:
        """The next batch of ``batch_size`` items among ``num_live`` live ones: the oldest one drawn
        ahead (queued now, with the ones ahead of it, when there is none of this size), after its
        event (the sample's one host sync: usually passed already) and with its status read. Its
        set is one of ``num_buffers + ahead``. See :meth:`bad_rows` before returning it."""
        if num_live < 1:
            raise ValueError("cannot sample from an empty table")
        with self._lock:
            if self._queue and self._queue[0].batch_size != batch_size:
                self._drop_queue()
            with self._on:
                self._ingest.apply()  # every draw below sees the table's last scan
                while len(self._queue) < 1 + self.ahead:
                    self._enqueue(self.buffer_sets.next(batch_size, num_buffers + self.ahead), num_live)
            out = self._queue.popleft()
        self._wait(out)  # outside the lock
        self._invalid_rounds = 0
        return out

    def _enqueue(self, out: DeviceBuffers, num_live: int) -> None:  # inside self._lock and self._on
        self._counter += 1
        B = out.batch_size
        self._select.draw_items(self._desc_ptr, dptr(out.desc), B, seed=self._seed, counter=self._counter)
        self._gather_and_finish(out, num_live)
        self._queue.append(out)

    def _gather_and_finish(self, out: DeviceBuffers, num_live: int) -> None:  # inside self._on
        self.kind.gather_on_device(self.columns, out.draw, {name: a for name, (a, _) in out.data.items()})
        beta = float(self.selector.beta) if self.prioritized else 0.0
        self._select.finish_batch(self._desc_ptr, dptr(out.desc), out.batch_size, num_live, beta)
        out.event.record(self.stream)
        out.in_flight = True

    def _wait(self, out: DeviceBuffers) -> None:
        """The batch's event, then its status: the one host wait of a sample (none when the event
        has passed already). Refused priorities since the last read raise ValueError."""
        if not out.event.done:
            out.event.synchronize()
        out.in_flight = False
        self.buffer_sets.after_sync()
        applied, refused = (int(v) for v in out.status[2:4])
        if refused > self._seen[1]:
            new = refused - self._seen[1]
            self._seen = (applied, refused)
            raise ValueError(f"update_priorities: {new} priorit{'y' if new == 1 else 'ies'} handed in since the last "
                             "sample were not finite and >= 0; they were not applied (the others were)")  # fmt: skip
        self._seen = (applied, refused)

    def _drop_queue(self) -> None:  # inside self._lock
        """Forget the batches drawn ahead (a batch-size change, a restore); their sets come round
        again after the stream (a later batch's event) has passed them."""
        for out in self._queue:
            out.in_flight = False
        self._queue.clear()

    def bad_rows(self, out: DeviceBuffers) -> tuple[np.ndarray, np.ndarray]:
        """Host int64 positions of ``out``'s impossible rows (slot outside the table: redrawn) and
        torn rows (a writer overwrote them during the gather: evicted and redrawn), from its
        status word; two empty arrays without a device read in the usual case. Raises
        RuntimeError after :data:`MAX_INVALID_ROUNDS` rounds in a row with impossible rows."""
        impossible, torn = int(out.status[0]), int(out.status[1])
        if not impossible and not torn:
            return _NONE, _NONE
        if impossible:
            self._invalid_rounds += 1
            if self._invalid_rounds > MAX_INVALID_ROUNDS:
                raise RuntimeError(
                    f"device draw returned a slot outside [0, {self._N}) in {MAX_INVALID_ROUNDS} "
                    "redraws in a row: the device priority vector is inconsistent with the table"
                )
        with self._on:
            flags = self.cupy.asnumpy(out.draw.flags)  # the rare path: a device read
        return np.flatnonzero(flags & 1).astype(np.int64), np.flatnonzero(flags & 2).astype(np.int64)

    def drawn_at(self, out: DeviceBuffers, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of ``out``'s drawn slots and their items' seqs at ``positions`` (the torn
        rows: their items are evicted where their slots still hold them)."""
        at = np.asarray(positions, dtype=np.int64)
        with self._on:
            return self.cupy.asnumpy(out.draw.slots)[at], self.cupy.asnumpy(out.draw.seqs)[at]

    def redraw(self, out: DeviceBuffers, positions: np.ndarray, num_live: int) -> None:
        """Fresh draws and records at ``positions`` (host int64) of ``out`` only (the other rows
        keep theirs), queued ingest applied first (the table's scan after a torn eviction), the
        whole batch gathered and finished again, then waited for (its status read)."""
        if num_live < 1:
            raise ValueError("cannot sample from an empty table")
        cp = self.cupy
        with self._lock, self._on:
            self._ingest.apply()
            rows = cp.asarray(np.ascontiguousarray(positions, dtype=np.int64))
            self._counter += 1
            self._select.draw_items(self._desc_ptr, dptr(out.desc), len(positions), rows=dptr(rows),
                                    seed=self._seed, counter=self._counter)  # fmt: skip
            self._gather_and_finish(out, num_live)
        self._wait(out)

    def release(self, out: DeviceBuffers, stream: Any = None) -> None:
        """The consumer has queued every read of the batch in ``out`` on ``stream`` (default:
        torch's current stream on the device): ``out`` is refilled only after that stream passed
        this point (:meth:`BufferSets.release`: one reused event per (set, stream); no wait)."""
        self.buffer_sets.release(out, stream)

    def batch(self, out: DeviceBuffers):
        """(data, keys, weights, probabilities) as torch CUDA tensors over ``out`` (DLPack views
        made when the set was allocated: no copy, no device work, no synchronization); the set
        counts as handed out until the consumer releases it."""
        out.handed_out = True
        data = {name: tensor for name, (_, tensor) in out.data.items()}
        return data, out.keys[1], out.weights[1], out.probabilities[1]

    @property
    def priority_counts(self) -> dict[str, int]:
        """Write-back entries applied and refused, as of the last batch's status word."""
        return {"applied": self._seen[0], "refused": self._seen[1]}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for queued work, drop the buffers, unregister the segment (before it is unmapped)."""
        if self._reg.closed:
            return
        with self._lock:
            self._ingest.drop()
            self._queue.clear()
            with self.cupy.cuda.Device(self.device_id):
                self.stream.synchronize()
                self._inputs.clear()
                self.buffer_sets.clear()
                self._ingest.close()
                self._reg.close()

    def __repr__(self) -> str:
        kind = "prioritized" if self.prioritized else "uniform"
        return f"DeviceReplay({kind}, {self._N} slots, cuda:{self.device_id}, ahead {self.ahead}, {self._reg!r})"
