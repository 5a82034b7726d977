"""A table's CPU batch path, in three small roles that a table and the RDMA sampler share:

* :class:`BatchBuffers` — ``num_buffers`` preallocated buffer sets of an item kind's batch
  layout (pinned where asked), used in turn (a :class:`BufferRing`): a batch stays valid until
  ``num_buffers - 1`` further batches have been drawn; nothing is allocated per batch.
* :class:`GatherThreads` — how many torch threads a gather runs on, chosen by measuring, and
  the timed gather itself (:meth:`GatherThreads.gather`).
* :class:`HostGather` — the rows of drawn items (the kind's row rule over their records) and
  their gather out of a :class:`~gearflow.replay.storage.SharedStorage` into a buffer set,
  whole or only the redrawn rows of a batch.

    buffers = BatchBuffers(kind, storage.spec, num_buffers=3)
    host = HostGather(storage, GatherThreads())
    out = buffers.next(256)                  # {name: (256, ...) tensor}, reused 3 batches on
    host.gather(kind, slots, rec, out)       # rec: (3, 256) start, seq, length per drawn slot
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gearflow.replay.items import FrameStacks, ItemKind, gatherable
from gearflow.replay.layout import slot_partition

__all__ = ["BatchBuffers", "BufferRing", "GatherThreads", "HostGather", "Sample", "split_sample"]


@dataclass
class Sample:
    """One batch. ``data`` views a reusable buffer (see the module docstring)."""

    data: dict[str, torch.Tensor]  # (B, ...) or (B, T, ...) + mask (B, T)
    keys: torch.Tensor  # int64 (B,)
    weights: torch.Tensor  # float32 (B,) importance weights, max 1
    probabilities: torch.Tensor  # float64 (B,)
    on_release: Any = field(default=None, repr=False, compare=False)  # the device path's (stream) -> None

    def release(self, stream: Any = None) -> None:
        """Every read of this batch is queued on ``stream`` (default: torch's current stream):
        on the GPU path its buffer set is refilled only after that stream passes this point
        (gearflow/native/device_replay.py); nothing on the CPU path."""
        if self.on_release is not None:
            self.on_release(stream)


def split_sample(whole: Sample, ring: "BufferRing", batch_size: int, count: int) -> list[Sample]:
    """A draw of ``count`` batches (``whole``, gathered into a set of ``ring``) as ``count``
    Samples of ``batch_size``: the set's views made once (:meth:`BufferRing.parts`), the keys,
    weights and probabilities sliced."""
    if count == 1:
        return [whole]
    data, n = ring.parts(whole.data, batch_size), batch_size
    keys, weights, probs = whole.keys, whole.weights, whole.probabilities
    return [Sample(data=data[j], keys=keys[i : i + n], weights=weights[i : i + n], probabilities=probs[i : i + n])
            for j, i in enumerate(range(0, count * n, n))]  # fmt: skip


class BufferRing:
    """``num`` output buffer sets of one batch size, used in turn: a batch drawn into the ring
    stays valid for ``num - 1`` more draws into the same ring. A table has its own (in its
    :class:`BatchBuffers`); the shard service gives each sampling connection one
    (:meth:`Table.draw` ``ring=``), so the replies a client has not read yet hold only that
    client's buffers."""

    def __init__(self, num: int, pin_memory: bool = False):
        self.num, self.pin_memory = int(num), pin_memory
        self.batch, self.sets, self.next = -1, [], 0
        self._parts: dict[tuple[int, int], tuple[dict, list]] = {}  # (id(set), part size) -> (set, its views)

    def take(self, layout: dict | None, batch_size: int) -> dict[str, torch.Tensor]:
        """The next set for a batch of ``batch_size`` (``layout``: name → (shape, dtype), read
        only when the batch size changes and the sets are made anew)."""
        if batch_size != self.batch:
            self.sets = [{name: torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
                          for name, (shape, dtype) in layout.items()} for _ in range(self.num)]  # fmt: skip
            self.batch, self.next, self._parts = batch_size, 0, {}
        buf = self.sets[self.next]
        self.next = (self.next + 1) % self.num
        return buf

    def parts(self, buf: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
        """``buf`` (one of this ring's sets) as consecutive batches of ``size`` rows: views made
        once per set (a view costs ~1 µs of Python; a refill of 8 batches of 6 columns, 48)."""
        key = (id(buf), size)
        hit = self._parts.get(key)
        if hit is None or hit[0] is not buf:  # (an id is only unique among live objects)
            split = {k: v.split(size) for k, v in buf.items()}
            hit = self._parts[key] = (buf, [{k: v[i] for k, v in split.items()} for i in range(self.batch // size)])
        return hit[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sets for t in s.values())


class BatchBuffers:
    """The buffer sets of a kind's batches: a :class:`BufferRing` of ``num_buffers`` sets of
    ``kind.layout(spec, B)``, made on the first batch of size ``B`` (again when it changes) and
    handed out in turn by :meth:`next`."""

    def __init__(self, kind: ItemKind, spec: Any, num_buffers: int = 3, *, pin_memory: bool = False):
        self.kind, self.spec, self.pin_memory = kind, spec, pin_memory
        self.num_buffers = num_buffers

    @property
    def num_buffers(self) -> int:
        """Sets used in turn: a batch stays valid for ``num_buffers - 1`` more batches."""
        return self.ring.num

    @num_buffers.setter
    def num_buffers(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"num_buffers must be ≥ 1, got {n}")
        self.ring = BufferRing(n, self.pin_memory)

    def clear(self) -> None:
        """Drop every set (the next batch allocates afresh)."""
        self.ring = BufferRing(self.ring.num, self.pin_memory)

    def next(self, batch_size: int, ring: BufferRing | None = None) -> dict[str, torch.Tensor]:
        """The next set for a batch of ``batch_size`` items, from ``ring`` (default: these)."""
        ring = self.ring if ring is None else ring
        layout = self.kind.layout(self.spec, batch_size) if batch_size != ring.batch else None
        return ring.take(layout, batch_size)


class GatherThreads:
    """How many torch threads the table's CPU gather uses, chosen by measuring.

    torch's gather splits a batch over its intra-op threads; when another process holds
    the other cores (actors next to the learner), the split waits on a descheduled thread
    and a 2-thread gather can take 30 × as long as a 1-thread one (measured here: 6.6 ms
    against 0.23 ms for 256 Atari frames). So the table times its gathers with 1 thread
    and with all of torch's, keeps a moving average of the count in use per batch size,
    uses torch's count unless one thread is clearly cheaper (``MARGIN``), and re-tries the
    other now and then (``RETRY`` gathers in a row, every 32 samples while the two are within
    1.2 ×, every 128 within 2 ×, every 256 beyond; the re-try's median replaces that count's
    figure), so it follows the machine's load both ways.
    Each count's first gather is a warm-up (cold buffers) and is not counted; each is
    measured ``WARMUP`` times, in turn, before the choice starts.
    ``fixed`` (``Table(num_threads=N)``) turns the choice off.
    """

    WARMUP = 4  # gathers per count, taken in turn, before choosing (the first one not counted)
    RETRY = 3  # gathers in a row when the other count is re-tried (its figure: their median)
    MARGIN = 1.3  # one thread replaces torch's count only when this much cheaper

    def __init__(self, fixed: int | None = None, most: int | None = None):
        if fixed is not None and (isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1):
            raise ValueError(f"num_threads must be an int ≥ 1 or None (chosen by measuring), got {fixed!r}")
        self.fixed = fixed
        self.candidates = sorted({1, max(1, most or torch.get_num_threads())})
        # per batch size: [cost of each count, gathers timed of each, best index, period, calls,
        # the re-try's gathers so far];
        # plain lists and ints, read and written every sample
        self._state: dict[int, list] = {}

    def _of(self, batch_size: int) -> list:
        st = self._state.get(batch_size)
        if st is None:
            k = len(self.candidates)
            st = self._state[batch_size] = [[0.0] * k, [0] * k, -1, 32, 0, []]
        return st

    def pick(self, batch_size: int) -> int:
        if self.fixed is not None or len(self.candidates) == 1:
            return self.fixed or self.candidates[0]
        st = self._of(batch_size)
        best = st[2]
        if best < 0:  # measure each in turn first
            seen = st[1]
            return self.candidates[seen.index(min(seen))]
        st[4] += 1
        if st[4] % st[3] < self.RETRY:
            return self.candidates[1 - best]  # a re-try of the other count (RETRY gathers in a row)
        return self.candidates[best]

    def record(self, batch_size: int, threads: int, seconds: float) -> None:
        if self.fixed is not None or len(self.candidates) == 1:
            return
        st = self._of(batch_size)
        costs, seen = st[0], st[1]
        i = self.candidates.index(threads)
        seen[i] += 1
        if seen[i] <= 2:  # the first gather (cold buffers) is replaced by the second
            costs[i] = seconds
        elif seen[i] <= self.WARMUP:  # the warm-up: a plain mean
            costs[i] += (seconds - costs[i]) / (seen[i] - 1)
        elif i != st[2]:  # a re-try of the other count: the middle of its RETRY gathers
            burst = st[5]
            burst.append(seconds)
            if len(burst) >= self.RETRY:
                costs[i] = sorted(burst)[len(burst) // 2]
                burst.clear()
        else:
            costs[i] = 0.8 * costs[i] + 0.2 * seconds
        if min(seen) >= self.WARMUP:
            # torch's own count (all threads) unless one thread is clearly cheaper: a split gather
            # stalled by a busy core costs many times more, a noisy measurement only a little
            d = len(costs) - 1
            best = 0 if costs[0] * self.MARGIN < costs[d] else d
            if best != st[2]:
                st[5].clear()
            st[2] = best
            worse = costs[1 - best] / max(costs[best], 1e-12)
            st[3] = 32 if worse < 1.2 else 128 if worse < 2 else 256  # a much worse count is re-tried rarely

    def chosen(self, batch_size: int) -> int | None:
        """The count in use for ``batch_size`` (None while still measuring)."""
        if self.fixed is not None or len(self.candidates) == 1:
            return self.fixed or self.candidates[0]
        best = self._of(batch_size)[2]
        return None if best < 0 else self.candidates[best]

    def gather(self, kind: ItemKind, tensors: dict, out: dict, rows: Any, lengths: np.ndarray) -> None:
        """``kind.gather(tensors, out, rows, lengths)`` on the thread count :meth:`pick` gives for
        the batch, timed and :meth:`record` ed (torch's count restored after)."""
        B = lengths.shape[0]
        n = self.pick(B)
        before = torch.get_num_threads()
        if n != before:
            torch.set_num_threads(n)
        t0 = time.perf_counter()
        try:
            kind.gather(tensors, out, rows, lengths)
        finally:
            if n != before:
                torch.set_num_threads(before)
        self.record(B, n, time.perf_counter() - t0)


class HostGather:
    """The gather of drawn items out of ``storage`` into a buffer set: rows by the item kind's row
    rule from each item's record (start, length) and its slot's partition, frame stacks
    included; on the thread count ``threads`` chooses. The kind is passed per call (the
    table's ``kind``)."""

    def __init__(self, storage: Any, threads: GatherThreads):
        self.storage, self.threads = storage, threads
        self._R, self._S = storage.items_per_partition, storage.steps_per_partition
        stacks = FrameStacks.of(storage)  # None without stacked-frame columns
        self._stack = {} if stacks is None else {"stacks": stacks}

    def rows_of(self, kind: ItemKind, slots: np.ndarray, rec: np.ndarray) -> tuple[Any, np.ndarray]:
        """``kind``'s storage rows of the items at ``slots`` (records ``rec``: int64 (3, B),
        start, seq, length) and their lengths."""
        return kind.rows(slot_partition(slots, self._R), rec[0], rec[2], self._S, **self._stack), rec[2]

    def gather(self, kind: ItemKind, slots: np.ndarray, rec: np.ndarray, out: dict[str, torch.Tensor],
               only: np.ndarray | None = None, tensors: dict | None = None) -> None:  # fmt: skip
        """The items at ``slots`` (records ``rec``) into ``out``: every row, or with ``only``
        (positions in the batch) just those rows, gathered apart and placed (the rare redraw
        path). ``tensors`` (default every storage column): the columns gathered."""
        tensors = self.storage.tensors if tensors is None else tensors
        if only is None:
            rows, lengths = self.rows_of(kind, slots, rec)
            self.threads.gather(kind, tensors, out, rows, lengths)
            return
        # replacements: gather the few redrawn items, then place them
        sub = {k: torch.empty((only.size, *v.shape[1:]), dtype=v.dtype) for k, v in out.items()}
        rows, lengths = self.rows_of(kind, slots[only], rec[:, only])
        kind.gather(tensors, sub, rows, lengths)
        idx = torch.from_numpy(only)
        for k, v in out.items():
            gatherable(v).index_copy_(0, idx, gatherable(sub[k]))
