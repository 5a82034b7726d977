"""The replay table's ingest half: scan the partitions' counters, ingest new item records into
the selector (and the device sampler, when there is one), evict items whose steps the ring
overwrote; the per-slot records, counters, checkpoint state and stats.

:class:`~gearflow.replay.table.Table` is this plus sampling: a writer-facing half and a
learner-facing half over the same slot arrays (one object, so the hot paths read them as
plain attributes). Slot of item ``seq`` of partition ``p``: ``p * R + seq % R``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from gearflow.replay.layout import record_slot
from gearflow.replay.storage import COMMIT, PUBLISHED, REC_RESERVE, RESERVE

log = logging.getLogger("gearflow.replay.table")

try:  # C helpers (setup.py builds them); numpy is the reference and the fallback
    from gearflow.replay import _hotpath
except ImportError:  # pragma: no cover - depends on the build
    _hotpath = None

EVICT_PROBE = 64  # records checked per probe when looking for overwritten items

__all__ = ["EVICT_PROBE", "TableIngest"]


class TableIngest:
    """Scan, ingest, evict, state and stats of a table (set up by :meth:`_init_ingest`; the
    table provides ``storage``, ``kind``, ``selector``, ``_device``, ``_P``, ``_R``, ``_S``, ``_S_trust``,
    ``_max_item_steps``, ``rate_limiter`` and ``insert_limit``, its
    :class:`~gearflow.replay.inserts.InsertLimit`)."""

    def _init_ingest(self, P: int, R: int) -> None:
        # per slot (P*R): the record as ingested, so later ring overwrites cannot change it
        # One 24-byte record per slot (start, seq, length), so a sampled item costs one
        # cache miss, not three, in tables of 10^7 items; the names below are column views.
        self._slot_rec = np.zeros((P * R, 3), dtype=np.int64)
        self._slot_start, self._slot_seq, self._slot_length = (self._slot_rec[:, i] for i in range(3))
        self._slot_seq[:] = -1
        self._slot_live = np.zeros(P * R, dtype=bool)
        # per partition
        self._ingested = np.zeros(P, dtype=np.int64)  # next seq to ingest
        self._live_lo = np.zeros(P, dtype=np.int64)  # oldest seq that may be live
        self._seen_reserve = np.full(P, -1, dtype=np.int64)
        self._seen_total = -1  # sum of all partitions' RESERVE, COMMIT, PUBLISHED at the last scan
        self._order = 0  # insertion sequence over all partitions (FIFO/LIFO order)
        self.samples = 0  # items sampled
        self.inserts = 0  # items ingested
        self.evictions = 0
        self.torn = 0  # items replaced because their steps were overwritten mid-gather
        # what one C scan call hands the selector (a partition that would not fit is done in parts)
        n_out = min(P * R, 1 << 16)
        self._new_slots, self._new_prios, self._gone = np.empty(n_out, np.int64), np.empty(n_out), np.empty(n_out, np.int64)
        self.bad_records = 0  # item records dropped at ingest: priority not finite and ≥ 0

    # ------------------------------------------------------------------ ingest
    def _counter_total(self) -> int:
        """Sum of every partition's RESERVE, COMMIT and PUBLISHED: they only grow, so an
        unchanged sum means no writer moved (one call on the sample path)."""
        if _hotpath is not None:
            return _hotpath.counter_total(self.storage.counters)
        return int(self.storage.counters[:, :3].sum())

    def scan(self) -> int:
        """Ingest newly published items and evict overwritten ones; returns items ingested.

        Where the C module is built, one C pass over every partition (``_hotpath.scan``) does
        what :meth:`_scan_reference` does, and the selector is told in two calls."""
        evictions = self.evictions
        ingested = self._scan_reference() if _hotpath is None else self._scan_native()
        if self.evictions != evictions and self.size < self.rate_limiter.min_size_to_sample:
            self.insert_limit.publish()  # stage 1: eviction took the table below its minimum size
        return ingested

    def _scan_native(self) -> int:
        """:meth:`scan` in one C pass (``_hotpath.scan``)."""
        P, sel = self._P, self.selector
        first_p, ingested = 0, 0
        head, tail = self._scan_args()
        while True:
            fused = sel.scan_state()  # the selector's arrays, updated in the same pass (prioritized)
            total, next_p, n_new, n_gone, n_replaced, n_bad, count, changed = _hotpath.scan(
                *head, self._seen_total, first_p, *tail, *(fused or ())
            )
            if fused:
                sel.scan_done(count, changed)
            if n_new:  # inserted before the evictions: an item can be both (a reader a lap behind)
                slots = self._new_slots[:n_new]
                if not fused:
                    sel.insert_ingested(slots, self._new_prios[:n_new], self._order)
                if self._device is not None:
                    rec = self._slot_rec[slots]
                    self._device.insert(slots.copy(), self._new_prios[:n_new].copy(), rec[:, 0], rec[:, 1], rec[:, 2])
                self._order += n_new
                self.inserts += n_new
                ingested += n_new
            if n_gone:
                gone = self._gone[:n_gone]
                if not fused:
                    sel.remove_known(gone)
                if self._device is not None:
                    self._device.remove(gone.copy())
            self.evictions += n_replaced + n_gone
            if n_bad:
                self.bad_records += n_bad
                log.warning("replay: dropped %d item record(s) whose priority is not finite and ≥ 0 "
                            "(a writer bypassed Writer's checks); %d so far", n_bad, self.bad_records)  # fmt: skip
            if next_p >= P:
                break
            first_p = next_p
        self._seen_total = total
        return ingested

    def _scan_args(self) -> tuple[tuple, tuple]:
        """The C scan's fixed arguments (views of the segment and of this table's arrays), built
        once (every array in them is only ever written in place)."""
        args = self.__dict__.get("_scan_args_cache")
        if args is None:
            st = self.storage
            head = (st.counters, st.item_start, st.item_length, st.item_priority, self._ingested, self._live_lo,
                    self._seen_reserve, self._S_trust, self._max_item_steps)  # fmt: skip
            tail = (self._slot_rec, self._slot_live, self._new_slots, self._new_prios, self._gone)
            args = self._scan_args_cache = (head, tail)
        return args

    def _scan_reference(self) -> int:
        """:meth:`scan` in numpy (the reference, and the path where the C module is not built)."""
        c = self.storage.counters
        total = self._counter_total()  # unchanged: nothing written since the last scan
        if total == self._seen_total:
            return 0
        self._seen_total = total
        published = c[:, PUBLISHED].copy()
        reserve = c[:, RESERVE].copy()
        changed = np.flatnonzero((published != self._ingested) | (reserve != self._seen_reserve))
        new = 0
        for p in changed.tolist():
            if published[p] > self._ingested[p]:
                new += self._ingest(p, int(published[p]))
            self._evict_overwritten(p, int(reserve[p]))
        self._seen_reserve[:] = reserve  # in place: the C scan's arguments view this array
        return new

    def _ingest(self, p: int, published: int) -> int:
        R, st = self._R, self.storage
        lo = max(int(self._ingested[p]), published - R)  # a lapped reader keeps the newest R
        seqs = np.arange(lo, published, dtype=np.int64)
        ring = seqs % R
        starts = st.item_start[p, ring].copy()
        # an item longer than the kind's window is cut to it (its first steps are kept)
        lengths = np.minimum(st.item_length[p, ring], self._max_item_steps)
        prios = st.item_priority[p, ring].copy()
        # a writer bumps REC_RESERVE before it rewrites record slots: records of items older
        # than REC_RESERVE - R (read after the copy) may have been rewritten while we copied
        ok = seqs >= max(int(st.counters[p, REC_RESERVE]), int(st.counters[p, PUBLISHED])) - R
        good = np.isfinite(prios) & (prios >= 0)  # a writer that bypassed its checks: dropped
        if not good.all():
            self.bad_records += int((ok & ~good).sum())
            log.warning("replay: dropped item record(s) of partition %d whose priority is not finite and ≥ 0", p)
        ok &= good
        if not ok.all():
            seqs, ring, starts, lengths, prios = (a[ok] for a in (seqs, ring, starts, lengths, prios))
        slots = p * R + ring
        replaced = slots[self._slot_live[slots]]
        self.evictions += replaced.size
        order = np.arange(self._order, self._order + seqs.size, dtype=np.int64)
        self._order += seqs.size
        self.selector.insert(slots, prios, order)
        if self._device is not None:
            self._device.insert(slots, prios, starts, seqs, lengths)
        self._slot_seq[slots], self._slot_start[slots], self._slot_length[slots] = seqs, starts, lengths
        self._slot_live[slots] = True
        self._ingested[p] = published
        self._live_lo[p] = max(int(self._live_lo[p]), published - R)
        self.inserts += seqs.size
        return int(seqs.size)

    def _evict_overwritten(self, p: int, reserve: int) -> None:
        """Evict the oldest items of ``p`` whose first step is older than ``reserve - S`` (less the
        steps a stack reaches back before it: ``_S_trust``)."""
        limit, R = reserve - self._S_trust, self._R
        lo, hi = int(self._live_lo[p]), int(self._ingested[p])
        while lo < hi:
            seqs = np.arange(lo, min(hi, lo + EVICT_PROBE), dtype=np.int64)
            slots = record_slot(p, seqs, R)
            gone = self._slot_start[slots] < limit  # starts ascend with seq in a partition
            k = int(np.searchsorted(~gone, True)) if not gone.all() else seqs.size
            self._remove(slots[:k][self._slot_live[slots[:k]]])
            lo += k
            if k < seqs.size:
                break
        self._live_lo[p] = lo

    def _remove(self, slots: np.ndarray) -> None:
        """Evict unique ``slots`` (live or not)."""
        slots = slots[self._slot_live[slots]]
        if slots.size:
            self.selector.remove_known(slots)
            self._slot_live[slots] = False
            if self._device is not None:
                self._device.remove(slots)
            self.evictions += slots.size

    # ------------------------------------------------------------------ sample
    @property
    def size(self) -> int:
        """Live items."""
        return len(self.selector)

    @property
    def deletes(self) -> int:
        """Items published, ingested and gone since: evicted, or dropped at ingest (Reverb's deletes)."""
        return int(self._ingested.sum()) - self.size

    # ------------------------------------------------------------------ state (checkpoints)
    ARRAY_STATE = ("slot_seq", "slot_start", "slot_length", "slot_live", "ingested", "live_lo", "seen_reserve")
    COUNTER_STATE = ("samples", "inserts", "evictions", "torn", "order")

    def state(self) -> dict[str, Any]:
        """The table's own state (copies): per-slot records and liveness, per-partition
        ingest/evict positions, counters. With the storage and the selector's
        ``state_dict`` it is everything a restored table needs."""
        arrays = {name: getattr(self, "_" + name).copy() for name in self.ARRAY_STATE}
        counters = {"samples": self.samples, "inserts": self.inserts, "evictions": self.evictions,
                    "torn": self.torn, "order": self._order}  # fmt: skip
        return {**arrays, **counters}

    def load_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state` (the storage and selector are restored separately)."""
        for name in self.ARRAY_STATE:
            getattr(self, "_" + name)[:] = state[name]
        self.samples, self.inserts = int(state["samples"]), int(state["inserts"])
        self.evictions, self.torn, self._order = int(state["evictions"]), int(state["torn"]), int(state["order"])
        self._seen_total = -1  # the next scan looks at every partition
        self.insert_limit.publish()
        if self._device is not None:
            self._device.load(self._slot_live, self._slot_start, self._slot_seq, self._slot_length)

    def stats(self) -> dict[str, float]:
        if self._closed:
            self._refuse_closed("no stats")
        c = self.storage.counters
        fill = self.partition_fill()
        return {
            "replay/size": self.size,
            "replay/inserts": self.inserts,
            "replay/samples": self.samples,
            "replay/evictions": self.evictions,
            "replay/torn_resampled": self.torn,
            "replay/steps": int(c[:, COMMIT].sum()),
            "replay/fill": float(fill.mean()),
            "replay/fill_min": float(fill.min()),
            "replay/bytes": self.storage.nbytes,
        }

    def partition_fill(self) -> np.ndarray:
        """Fraction of each partition's ring written so far."""
        return np.minimum(self.storage.counters[:, COMMIT], self._S) / self._S
