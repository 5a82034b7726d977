"""Device-side sampling for a replay :class:`~gearflow.replay.table.Table` (``replay.device=cuda``).

The table stays the owner of ingest, eviction, rate limiting, checkpoints and
keys; its CPU selector stays the source of truth for ``len`` and checkpoints.
:class:`DeviceReplay` mirrors what sampling needs onto the GPU, fed by the
table's own ingest/evict/update calls, and draws and gathers whole batches
there:

    per slot (N = P * R, device, one CuPy stream)
      masses  float64[N]    p ** alpha (prioritized) or 1.0 (uniform) for a live slot, 0 when dead
      sums    float64[NC]   per-4096-slot chunk sums (select.cu's two-level sum tree)
      start   int64[N]      absolute first step of the item in its partition
      seq     int64[N]      item sequence number in its partition (its key is seq * P + p)
      length  int32[N]      steps in the item (cut to the kind's window at ingest)

A sample is: B uniforms → stratified proportional draw (uniform = mass 1 per
live slot, so the same kernel) → IS weights → records looked up on the device
→ one gather kernel per column straight out of the shared-memory segment
(``cudaHostRegister``-ed, mapped: zero-copy) into preallocated device buffers
→ the stream is synchronized → the table reads its RESERVE counters and asks
:meth:`DeviceReplay.torn` which items a writer may have overwritten during the
copy (the seqlock rule of ``Table._torn`` via :func:`gather.torn_items`); those
are evicted and redrawn by the table, never returned. Outputs reach torch
through DLPack (``torch.from_dlpack``): the batch is CUDA tensors, no copy.

Example (GPU; ``Table(..., device="cuda")`` does exactly this)::

    dev = DeviceReplay(storage, Transition(("obs",)), selector)    # require_cupy, registers the segment
    table = Table(storage, Transition(("obs",)), selector, device=dev)
    batch = table.sample(256)          # batch.data["obs"]: cuda uint8 (256, 4, 84, 84)

CuPy is passed in (``cupy=``) or imported by :func:`~gearflow.native.require_cupy`
on construction, never at import time; so is the compiled kernel code
(``gather=`` / ``select=``: a :class:`CudaGather` / :class:`CudaSelect`).
Differences from the CPU selectors, by design: uniform draws are stratified
like prioritized ones (same marginal 1/N, lower variance); the device RNG
(CuPy's) is seeded from the selector's RNG state but is not part of a
checkpoint, so a restored device table does not repeat the exact draws.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from gearflow.errors import ConfigError, MissingDependencyError
from gearflow.native import probe_cuda, probe_cupy, require_cupy
from gearflow.native.cuda_backend import to_torch
from gearflow.native.gather import CudaGather, torn_items, transition_rows
from gearflow.native.hostmem import register_storage
from gearflow.native.select import CudaSelect, num_chunks

log = logging.getLogger(__name__)

REPLAY_DEVICES = ("auto", "cpu", "cuda")
FLUSH_AT = 1 << 20  # queued ingest entries applied to the device without waiting for a draw
DEVICE_SELECTORS = ("prioritized", "uniform")

__all__ = ["DEVICE_SELECTORS", "REPLAY_DEVICES", "DeviceDraw", "DeviceReplay", "resolve_replay_device"]


def resolve_replay_device(name: str, selector: str | None = None) -> str:
    """``"cpu"`` or ``"cuda"`` for ``replay.device=name`` (``auto``, ``cpu`` or ``cuda``).

    ``auto`` picks ``cuda`` when CuPy can run a kernel, torch is a CUDA build
    and the selector samples on the device (``prioritized``/``uniform``), and
    logs why when it picks ``cpu``. ``cuda`` without them raises a one-line
    :class:`MissingDependencyError` saying why and how to install CuPy (or
    :class:`ConfigError` for a selector the device path does not have).
    """
    if name not in REPLAY_DEVICES:
        raise ConfigError(f"replay.device={name!r}: must be one of {', '.join(REPLAY_DEVICES)}")
    if name == "cpu":
        return "cpu"
    if selector is not None and selector not in DEVICE_SELECTORS:
        why = f"replay.selector={selector!r} samples on the CPU only (the GPU path has {', '.join(DEVICE_SELECTORS)})"
        if name == "cuda":
            raise ConfigError(f"replay.device=cuda: {why}")
        log.info("replay.device=auto: cpu (%s)", why)
        return "cpu"
    cupy, torch_cuda = probe_cupy(), probe_cuda()
    if cupy.ok and torch_cuda.ok:
        if name == "auto":
            log.info("replay.device=auto: cuda (%s; torch: %s)", cupy.detail, torch_cuda.detail)
        return "cuda"
    why = (
        f"needs CuPy and a CUDA GPU: {cupy.detail}"
        if not cupy.ok
        else f"hands batches to torch on the GPU, but torch cannot use CUDA: {torch_cuda.detail}"
    )
    if name == "cuda":
        raise MissingDependencyError(f"replay.device=cuda {why}")
    log.info("replay.device=auto: cpu (GPU replay %s)", why)
    return "cpu"


@dataclass
class DeviceDraw:
    """One batch's draws, all device arrays of length B (CuPy)."""

    slots: Any  # int64 (B,)
    probabilities: Any  # float64 (B,)
    weights: Any  # float32 (B,) importance weights, max 1


class DeviceReplay:
    """The GPU side of a table: device priority vector + records, zero-copy gather, seqlock check.

    Built over the table's ``storage``, ``kind`` and ``selector`` (one of
    :data:`DEVICE_SELECTORS`); registers the whole shared-memory segment with
    CUDA until :meth:`close`. The table calls :meth:`insert`, :meth:`remove`,
    :meth:`update` and :meth:`load` as its own state changes, and
    :meth:`draw` / :meth:`gather` / :meth:`torn` / :meth:`redraw` /
    :meth:`batch` to sample. Every call queues on :attr:`stream`;
    :meth:`gather` is the one place that synchronizes it.
    """

    def __init__(
        self,
        storage: Any,
        kind: Any,
        selector: Any,
        *,
        cupy: Any = None,
        gather: CudaGather | None = None,
        select: CudaSelect | None = None,
        seed: int | None = None,
    ) -> None:
        name = getattr(selector, "name", type(selector).__name__)
        if name not in DEVICE_SELECTORS:
            raise ValueError(
                f"device sampling supports the {' and '.join(DEVICE_SELECTORS)} selectors, "
                f"not {name!r}: use device='cpu' for it"
            )
        kind.layout(storage.spec, 1)  # validates the kind against the spec before anything is allocated
        cp = require_cupy("replay.device=cuda") if cupy is None else cupy
        self.cupy, self.storage, self.kind, self.selector = cp, storage, kind, selector
        self.prioritized = name == "prioritized"
        self._P, self._R, self._S = storage.num_partitions, storage.items_per_partition, storage.steps_per_partition
        self._T = getattr(kind, "max_length", None)  # None: transitions (rows, not windows)
        N = self._P * self._R
        self._gather = gather or CudaGather(cp)
        self._select = select or CudaSelect(cp)
        if seed is None:  # follow the selector's seed (public state), so seeded runs stay seeded
            seed = zlib.crc32(np.asarray(selector.state_dict()["rng_state"]).tobytes())
        self.stream = cp.cuda.Stream(non_blocking=True)
        with self.stream:
            self._rng = cp.random.RandomState(seed)
            self._masses = cp.zeros(N, dtype=cp.float64)
            self._sums = cp.zeros(num_chunks(N), dtype=cp.float64)
            self._start = cp.zeros(N, dtype=cp.int64)
            self._seq = cp.full(N, -1, dtype=cp.int64)
            self._length = cp.zeros(N, dtype=cp.int32)
        self._reg = register_storage(cp, storage)  # last: nothing to undo if an allocation failed
        # per column: (name, device pointer of row 0, bytes per row)
        self._columns = [
            (c.name, self._reg.device_pointer(storage.column_offsets[c.name]), c.nbytes) for c in storage.spec
        ]
        self._pending: list[tuple[np.ndarray, np.ndarray, tuple | None]] = []  # (slots, priorities, records)
        self._pending_n = 0
        self._buffers: list[dict[str, tuple[Any, Any]]] = []  # [set][name] = (cupy array, torch view)
        self._buffer_key: tuple[int, int] = (-1, -1)
        self._next_buffer = 0

    # ------------------------------------------------------------------ mirror of the table's ingest
    # The table reports ingest/evict/update per partition; those calls are queued on the host and
    # applied in one batch (one scatter kernel, one record upload) before the next draw, so a scan
    # over many partitions costs a handful of launches, not a handful per partition. The queue
    # keeps the table's order; a slot's last entry wins, as in the selectors.
    def _priorities(self, priorities: np.ndarray) -> np.ndarray:
        """What goes into the mass vector: raw priorities (p ** alpha in the kernel), or 1.0 per
        live item for the uniform selector."""
        return np.asarray(priorities, dtype=np.float64) if self.prioritized else np.ones(len(priorities))

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
        self._queue(slots, self._priorities(priorities), (starts, seqs, lengths))

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
        pending, self._pending, self._pending_n = self._pending, [], 0
        cp = self.cupy
        slots = np.concatenate([s for s, _, _ in pending])
        prios = np.concatenate([p for _, p, _ in pending])
        with self.stream:
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
        with self.stream:
            self._masses[...] = cp.asarray(np.ascontiguousarray(masses, dtype=np.float64))
            self._start[...] = cp.asarray(np.ascontiguousarray(starts, dtype=np.int64))
            self._seq[...] = cp.asarray(np.ascontiguousarray(seqs, dtype=np.int64))
            self._length[...] = cp.asarray(np.ascontiguousarray(lengths, dtype=np.int32))
            self._select.sum_chunks(self._masses, self._sums)

    # ------------------------------------------------------------------ sampling
    def draw(self, batch_size: int, num_live: int) -> DeviceDraw:
        """Queue ``batch_size`` draws among ``num_live`` live items (stratified, proportional to mass)."""
        if num_live < 1:
            raise ValueError("cannot sample from an empty table")
        if self.prioritized and not self.selector.tree.total > 0:
            raise ValueError(f"cannot sample: all {num_live} live items have zero priority")
        self.flush()
        with self.stream:
            u = self._rng.random_sample(batch_size)  # float64 (B,)
            slots, probs = self._select.sample_proportional(self._masses, u, chunk_sums=self._sums)
            return DeviceDraw(slots, probs, self._weights(probs, num_live))

    def _weights(self, probs: Any, num_live: int) -> Any:
        if not self.prioritized:
            return self.cupy.ones(probs.shape[0], dtype=self.cupy.float32)
        return self._select.importance_weights(probs, num_live, float(self.selector.beta))

    def redraw(self, draw: DeviceDraw, positions: np.ndarray, num_live: int) -> DeviceDraw:
        """``draw`` with fresh draws at ``positions`` (host int64); weights re-normalised over the batch."""
        fresh = self.draw(len(positions), num_live)
        cp = self.cupy
        with self.stream:
            pos = cp.asarray(np.ascontiguousarray(positions, dtype=np.int64))
            slots, probs = draw.slots.copy(), draw.probabilities.copy()
            slots[pos], probs[pos] = fresh.slots, fresh.probabilities
            return DeviceDraw(slots, probs, self._weights(probs, num_live))

    def slots_at(self, draw: DeviceDraw, positions: np.ndarray) -> np.ndarray:
        """Host copy of the drawn slots at ``positions`` (the torn ones, to evict)."""
        with self.stream:
            return self.cupy.asnumpy(draw.slots[self.cupy.asarray(np.asarray(positions, dtype=np.int64))])

    def buffers(self, batch_size: int, num_buffers: int) -> dict[str, tuple[Any, Any]]:
        """The next of ``num_buffers`` preallocated output sets: name → (CuPy array, torch tensor
        over the same memory). A batch stays valid for ``num_buffers - 1`` further samples."""
        self._after_torch()
        if (batch_size, num_buffers) != self._buffer_key:
            from gearflow.replay.items import TORCH_DTYPES

            numpy_dtype = {t: d for d, t in TORCH_DTYPES.items()}
            layout = self.kind.layout(self.storage.spec, batch_size)
            with self.stream:
                self._buffers = []
                for _ in range(num_buffers):
                    arrays = {n: self.cupy.zeros(shape, dtype=numpy_dtype[t]) for n, (shape, t) in layout.items()}
                    self._buffers.append({n: (a, to_torch(a)) for n, a in arrays.items()})
            self._buffer_key, self._next_buffer = (batch_size, num_buffers), 0
        out = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % num_buffers
        return out

    def _after_torch(self) -> None:
        """Make this table's stream wait for the work torch has queued so far on its current stream:
        a learner's kernels may still read the older batch in the buffer set we are about to refill
        (on a CPU the same contract needs nothing: the caller's code has run)."""
        import torch

        if not torch.cuda.is_available():
            return
        cp = self.cupy
        event = cp.cuda.Event(disable_timing=True)
        event.record(cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream))
        self.stream.wait_event(event)

    def _records(self, slots: Any) -> tuple[Any, Any, Any]:
        """(parts int64, starts int64, lengths int32) of the drawn slots, on the device."""
        return slots // self._R, self._start[slots], self._length[slots]

    def gather(self, draw: DeviceDraw, out: dict[str, tuple[Any, Any]]) -> None:
        """Gather the drawn items' steps into ``out`` (zero-copy from the segment), then wait for it:
        the caller reads the RESERVE counters next, and they must postdate the copy."""
        parts, starts, lengths = self._records(draw.slots)
        P, S = self._P, self._S
        g = self._gather
        with self.stream:
            if self._T is None:  # transitions: every column at the first step, next_<c> at the last
                first, last = transition_rows(parts, starts, lengths.astype(self.cupy.int64), S)
                for name, ptr, row_bytes in self._columns:
                    g.gather_rows(ptr, row_bytes, first, out[name][0], num_rows=P * S)
                for name in self.kind.next_columns:
                    ptr, row_bytes = next((p, rb) for n, p, rb in self._columns if n == name)
                    g.gather_rows(ptr, row_bytes, last, out["next_" + name][0], num_rows=P * S)
            else:  # windows of T steps, padded with zeros past each item's length, mask (B, T)
                mask = out["mask"][0]
                for name, ptr, row_bytes in self._columns:
                    g.gather_windows(ptr, row_bytes, S, parts, starts, lengths, self._T, out[name][0], mask,
                                     num_rows=P * S)  # fmt: skip
                out["length"][0][...] = lengths
        self.stream.synchronize()

    def torn(self, draw: DeviceDraw, reserve: np.ndarray) -> np.ndarray:
        """Host int64 positions of items a writer may have overwritten during :meth:`gather`;
        ``reserve`` is the partitions' RESERVE counters read after it returned."""
        cp = self.cupy
        with self.stream:
            parts, starts, _ = self._records(draw.slots)
            bad = torn_items(parts, starts, cp.asarray(np.ascontiguousarray(reserve, dtype=np.int64)), self._S)
            return cp.asnumpy(cp.flatnonzero(bad)).astype(np.int64)

    def batch(self, draw: DeviceDraw, out: dict[str, tuple[Any, Any]]):
        """(data, keys, weights, probabilities) as torch CUDA tensors (DLPack, no copy)."""
        with self.stream:
            keys = self._seq[draw.slots] * self._P + draw.slots // self._R  # int64 (B,)
            data = {name: tensor for name, (_, tensor) in out.items()}
            result = data, to_torch(keys), to_torch(draw.weights), to_torch(draw.probabilities)
        self.stream.synchronize()  # keys: one small kernel; done before torch's stream uses it
        return result

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for queued work, drop the buffers, unregister the segment (before it is unmapped)."""
        if self._reg.closed:
            return
        self._pending, self._pending_n = [], 0
        self.stream.synchronize()
        self._buffers, self._buffer_key = [], (-1, -1)
        self._reg.close()

    def __repr__(self) -> str:
        kind = "prioritized" if self.prioritized else "uniform"
        return f"DeviceReplay({kind}, {self._P * self._R} slots, {self._reg!r})"
