"""The table's ingest and evictions on their way to a :class:`~gearflow.native.device_replay.DeviceReplay`:
:class:`IngestQueue`. The table reports them per partition as it scans; they are queued on the
host and applied in one kernel before the next draw or write-back (entries de-duplicated on the
host, the last per slot, read in place by the kernel from mapped host memory), so a scan over many
partitions costs a few launches and no upload.

    ingest = IngestQueue(cupy, select, desc_ptr, vectors, alpha, lock, on)
    ingest.put(slots, priorities, (starts, seqs, lengths))   # an insert (records None: an eviction)
    with lock, on:
        ingest.apply()                                       # before a draw: queued on the stream
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from gearflow.native.hostmem import MappedArea

__all__ = ["FLUSH_AT", "STAGING_AREAS", "IngestQueue"]

FLUSH_AT = 1 << 20  # queued ingest entries applied to the device without waiting for a draw
STAGING_AREAS = 8  # ingest staging areas in flight before a flush waits for the oldest


class IngestQueue:
    """Ingest/evict entries queued for the device mirrors of one replay: ``select`` (the
    :class:`~gearflow.native.select.CudaSelect` kernels) applies them to the replay whose
    descriptor is at ``desc_ptr`` and re-sums ``vectors`` (``(values, sums, N, NC)`` pointers);
    ``alpha()`` the priority exponent (-1: uniform); ``lock`` and ``on`` (the replay's lock and its
    device-and-stream context) are taken by :meth:`put`'s flush and :meth:`flush`; :meth:`apply`
    runs inside both."""

    def __init__(self, cupy: Any, select: Any, desc_ptr: int, vectors: list[tuple], alpha: Callable[[], float],
                 lock: Any, on: Any) -> None:  # fmt: skip
        self.cupy, self._select, self._desc_ptr, self._vectors, self._alpha = cupy, select, desc_ptr, vectors, alpha
        self._lock, self._on = lock, on
        self._pending: list[tuple[np.ndarray, np.ndarray, tuple | None]] = []  # (slots, priorities, records)
        self._pending_n = 0
        self._staging: deque[tuple[MappedArea, Any]] = deque()  # (area, event after its apply_ingest)

    def put(self, slots: np.ndarray, priorities: np.ndarray, records: tuple | None) -> None:
        """Queue items ingested into ``slots`` with their raw priorities and records ``(starts,
        seqs, lengths)``, or evicted (``records`` None: mass and liveness 0, records kept)."""
        if len(slots):  # copies: the caller may reuse its arrays before the queue is applied
            records = None if records is None else tuple(np.array(r) for r in records)
            with self._lock:
                self._pending.append((np.array(slots, dtype=np.int64), np.array(priorities, dtype=np.float64), records))
                self._pending_n += len(slots)
                if self._pending_n >= FLUSH_AT:  # a table that fills for long before its first sample
                    self.flush()

    def flush(self) -> None:
        """Apply the queued entries now (queued on the stream)."""
        with self._lock, self._on:
            self.apply()

    def drop(self) -> None:
        """Forget the queued entries (a state loaded over them, or the replay closing)."""
        self._pending, self._pending_n = [], 0

    def apply(self) -> bool:  # inside the lock and the device context
        """Pack the queued entries, the last per slot, into a staging area (int64 [6, n]: select.py
        INGEST_ROWS, read in place by the kernel) and queue apply_ingest + the chunk re-sums;
        False when nothing was queued."""
        if not self._pending:
            return False
        pending, self._pending, self._pending_n = self._pending, [], 0
        slots = np.concatenate([s for s, _, _ in pending])
        n = slots.size
        _, first_reversed = np.unique(slots[::-1], return_index=True)
        last = np.sort(n - 1 - first_reversed)  # each slot's last entry, in the table's order
        k = last.size
        area, event = self._staging_area(6 * 8 * k)
        entries = area.host[: 6 * 8 * k].view(np.int64).reshape(6, k)
        entries[0] = slots[last]
        entries[1] = np.concatenate([p for _, p, _ in pending])[last].view(np.int64)
        live = np.concatenate([np.full(s.size, r is not None) for s, _, r in pending])[last]
        entries[5] = live
        for row, i in ((2, 0), (3, 1), (4, 2)):  # start, seq, length (0 for an eviction: not written)
            col = np.concatenate([np.zeros(s.size, np.int64) if r is None else np.asarray(r[i], np.int64)
                                  for s, _, r in pending])  # fmt: skip
            entries[row] = col[last]
        self._select.apply_ingest(self._desc_ptr, area.device_ptr, k, self._alpha(), tuple(self._vectors))
        event.record(self._on.stream)
        self._staging.append((area, event))
        return True

    def _staging_area(self, nbytes: int) -> tuple[MappedArea, Any]:  # inside the lock and the device context
        """A staging area no queued kernel reads any more (its apply_ingest's event passed), at
        least ``nbytes``, and its event: a few reused in turn (made once each); the oldest is
        waited for only when :data:`STAGING_AREAS` flushes are in flight (no sample in between)."""
        if self._staging and (self._staging[0][1].done or len(self._staging) >= STAGING_AREAS):
            area, event = self._staging.popleft()
            if not event.done:
                event.synchronize()
            area.ensure(nbytes)
            return area, event
        return MappedArea(self.cupy, max(nbytes, 4096)), self.cupy.cuda.Event(disable_timing=True)

    def close(self) -> None:
        """Free the staging areas (the caller waited for its stream first)."""
        self.drop()
        for area, _ in self._staging:
            area.close()
        self._staging.clear()
