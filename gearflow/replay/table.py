"""The replay table: the learner side, embedded in the learner's process.

The table scans the partitions' published counters, ingests new item records
into its selector, evicts items whose steps the ring overwrote (FIFO eviction
falls out of the ring), samples, and takes priority updates by item key.

    storage = SharedStorage.create(spec, num_partitions=8, steps_per_partition=10_000)
    table = Table(storage, Transition(next_columns=("obs",)),
                  make_selector("prioritized", storage.num_partitions * storage.items_per_partition),
                  RateLimiter(min_size_to_sample=1000))
    # ... actor processes write with Writer(SharedStorage.attach(storage.name), partitions)
    batch = table.sample(256)          # batch.data["obs"]: (256, *obs_shape), batch.weights: (256,)
    table.update_priorities(batch.keys, new_priorities)
    table.close()                      # unlinks the segment

Keys: item ``seq`` of partition ``p`` has key ``seq * P + p`` and lives in slot
``p * R + seq % R``; a key whose slot has moved on (evicted, overwritten) is
ignored by :meth:`update_priorities`.

Torn reads: after a gather the table re-reads each partition's RESERVE
counter; an item whose first step is older than ``RESERVE - S`` may have been
overwritten during the copy, so it is evicted and replaced by a fresh draw
(a seqlock). A torn batch is never returned.

Batches are written into ``num_buffers`` preallocated buffer sets used in
turn (pinned where CUDA exists): a batch stays valid until ``num_buffers - 1``
further samples have been drawn. Nothing is allocated per sample.

CPU gathers run on as many torch threads as measure fastest (1, or all of torch's:
see :class:`GatherThreads`; ``Table(num_threads=N)`` fixes the count).

``Table(..., device="cuda")`` draws and gathers on the GPU instead
(:mod:`gearflow.native.device_replay`: a device priority vector mirrored from
this table's ingest, zero-copy gather out of the registered segment, the same
seqlock check); the batch is then CUDA tensors. The default ``"cpu"`` path is
unchanged by it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from gearflow.replay.ingest import TableIngest
from gearflow.replay.layout import item_key, slot_partition
from gearflow.replay.items import FrameStacks, ItemKind, gatherable
from gearflow.replay.rate_limiter import MAX_BACKOFF_S, RateLimiter, RateLimiterTimeout
from gearflow.replay.selectors import KeyIndex, Selector, check_priorities
from gearflow.replay.storage import (
    CLOSED_LIMIT,
    H_CLOSED,
    H_INSERT_LIMIT,
    H_SAMPLES,
    PUBLISHED,
    RESERVE,
    SHM_DIR,
    SharedStorage,
    TableClosed,
)

log = logging.getLogger(__name__)

try:  # C helpers (setup.py builds them); numpy is the reference and the fallback
    from gearflow.replay import _hotpath
except ImportError:  # pragma: no cover - depends on the build
    _hotpath = None

_NONE = np.zeros(0, dtype=np.int64)


def _device_replay(device: Any, storage: SharedStorage, kind: ItemKind, selector: Selector) -> Any:
    """None for ``"cpu"``; a ``DeviceReplay`` for ``"cuda"`` (CuPy's current device) or ``"cuda:N"``
    (GPU N: its arrays, stream and kernels; CuPy imported only then), or the one passed in
    (built by the caller, e.g. with its own CuPy handle)."""
    if isinstance(device, str):
        if device == "cpu":
            return None
        from gearflow.native import device_replay

        index = device_replay.cuda_device_index(device)  # ValueError for anything but cuda / cuda:N
        return device_replay.DeviceReplay(storage, kind, selector, device=index)
    if getattr(device, "storage", None) is not storage or getattr(device, "selector", None) is not selector:
        raise ValueError("device must be 'cpu', 'cuda', 'cuda:N' or a DeviceReplay over this table's storage and selector")
    return device


_INT64, _FLOATS = (np.dtype(np.int64),), (np.dtype(np.float64), np.dtype(np.float32))


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


def _host_array(x: Any, dtypes: tuple) -> np.ndarray:
    """``x`` (a tensor on any device, an array, a list) as a 1-D C-contiguous numpy array of
    one of ``dtypes`` (converted to the first when it is none of them)."""
    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16
            x = x.float()
        x = x.numpy() if x.is_cpu and not x.requires_grad else x.detach().cpu().numpy()
    if type(x) is np.ndarray and x.ndim == 1 and x.dtype in dtypes and x.flags.c_contiguous:
        return x  # the learner's case: nothing to convert
    if not (isinstance(x, np.ndarray) and x.dtype in dtypes):
        x = np.asarray(x, dtype=dtypes[0])
    return np.ascontiguousarray(x.reshape(-1))


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


class BufferRing:
    """``num`` output buffer sets of one batch size, used in turn: a batch drawn into the ring
    stays valid for ``num - 1`` more draws into the same ring. A table has its own; the shard
    service gives each sampling connection one (:meth:`Table.draw` ``ring=``), so the replies
    a client has not read yet hold only that client's buffers."""

    def __init__(self, num: int, pin_memory: bool = False):
        self.num, self.pin_memory = int(num), pin_memory
        self.batch, self.sets, self.next = -1, [], 0

    def take(self, layout: dict, batch_size: int) -> dict[str, torch.Tensor]:
        if batch_size != self.batch:
            self.sets = [{name: torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
                          for name, (shape, dtype) in layout.items()} for _ in range(self.num)]  # fmt: skip
            self.batch, self.next = batch_size, 0
        buf = self.sets[self.next]
        self.next = (self.next + 1) % self.num
        return buf

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sets for t in s.values())


class Table(TableIngest):
    """Samples items out of a :class:`SharedStorage` written by :class:`Writer` s (its ingest
    half, :class:`~gearflow.replay.ingest.TableIngest`: scan, evict, state, stats)."""

    def __init__(
        self,
        storage: SharedStorage,
        kind: ItemKind,
        selector: Selector,
        rate_limiter: RateLimiter | None = None,
        *,
        num_buffers: int = 3,
        sample_timeout_s: float = 60.0,
        pin_memory: bool | None = None,
        device: Any = "cpu",
        num_threads: int | None = None,
    ):
        P, R = storage.num_partitions, storage.items_per_partition
        self.storage, self.kind, self.selector = storage, kind, selector
        self.rate_limiter = rate_limiter or RateLimiter()
        self.sample_timeout_s = sample_timeout_s
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be ≥ 1, got {num_buffers}")
        self._num_buffers = num_buffers
        self.gather_threads = GatherThreads(num_threads)  # CPU gathers: measured, or num_threads
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._P, self._R, self._S = P, R, storage.steps_per_partition
        # an item is intact while its first step is ≥ RESERVE - _S_trust: S less the steps its
        # stacks reach back (stacked-frame columns), so eviction and the re-check cover them
        self._S_trust = storage.trusted_steps
        self._stacks = FrameStacks.of(storage)  # None without stacked-frame columns
        kind.layout(storage.spec, 1)  # validates the kind against the spec
        # "cuda": selection and gather on the GPU (gearflow.native.device_replay), set up before the
        # table touches the storage, so a missing CuPy leaves the caller's storage as it was
        self._device = _device_replay(device, storage, kind, selector)
        self._max_item_steps = kind.max_steps(storage.steps_per_partition)
        self._init_ingest(P, R)
        self._key_index = KeyIndex(P, R, self._slot_rec, self._slot_live)  # update_priorities
        self._buffers: list[dict[str, torch.Tensor]] = []
        self._buffer_batch = -1
        self._next_buffer = 0
        self._closed = False
        self._active = 0  # samples / waits in progress (close() lets them leave first)
        storage.header[H_SAMPLES] = 0
        self._publish_insert_limit()


    def set_rate_limiter(self, limiter: RateLimiter) -> None:
        """Replace the rate limiter (a resumed run's config) and publish its insert limit."""
        self.rate_limiter = limiter
        self._publish_insert_limit()

    def _publish_insert_limit(self) -> None:
        lim = self.rate_limiter
        deletes = 0
        if self.size < lim.min_size_to_sample:
            # Reverb's stage 1: inserts go on while the table is below its minimum size. Items
            # published but not held (evicted, or dropped at ingest) are the deletes, so a
            # writer may publish until held + not yet scanned + new = min_size_to_sample.
            deletes = int(self._ingested.sum()) - self.size
        self.storage.header[H_INSERT_LIMIT] = lim.insert_limit(self.samples, deletes)
        self.storage.header[H_SAMPLES] = self.samples

    @property
    def num_buffers(self) -> int:
        """Output buffer sets used in turn: a batch stays valid for ``num_buffers - 1`` more samples."""
        return self._num_buffers

    @num_buffers.setter
    def num_buffers(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"num_buffers must be ≥ 1, got {n}")
        self._num_buffers, self._buffer_batch, self._buffers, self._next_buffer = n, -1, [], 0

    def _buffers_for(self, batch_size: int) -> dict[str, torch.Tensor]:
        if batch_size != self._buffer_batch:
            layout = self.kind.layout(self.storage.spec, batch_size)
            self._buffers = [
                {
                    name: torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
                    for name, (shape, dtype) in layout.items()
                }
                for _ in range(self.num_buffers)
            ]
            self._buffer_batch = batch_size
        buf = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % self.num_buffers
        return buf

    def _refuse_closed(self, what: str) -> None:
        raise TableClosed(f"replay table {self.storage.name} is closed: {what}")

    def scan(self) -> int:
        if self._closed:
            self._refuse_closed("cannot scan")
        return super().scan()

    def can_sample(self, batch_size: int) -> bool:
        """Whether the rate limiter allows sampling ``batch_size`` items now (no scan, no wait)."""
        if self._closed:
            self._refuse_closed(f"cannot sample {batch_size}")
        lim = self.rate_limiter
        if lim.samples_per_insert == 0 and self.size >= lim.min_size_to_sample:
            return True  # the usual case, without reading the insert counters
        return lim.can_sample(self.size, int(self.storage.counters[:, PUBLISHED].sum()), self.samples, batch_size)

    def wait_until_ready(self, batch_size: int, timeout_s: float | None = None) -> None:
        """Block (scanning) until the rate limiter allows sampling ``batch_size`` items;
        :class:`TableClosed` when the table is (or gets) closed meanwhile."""
        if self.can_sample(batch_size):
            return
        self._active += 1
        try:
            self._wait_until_ready(batch_size, timeout_s)
        finally:
            self._active -= 1

    def _wait_until_ready(self, batch_size: int, timeout_s: float | None) -> None:
        lim = self.rate_limiter
        total = lambda: int(self.storage.counters[:, PUBLISHED].sum())  # noqa: E731
        timeout_s = self.sample_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        delay = 1e-4
        while True:
            if self._closed:  # close() in another thread: it waits for this call to leave
                self._refuse_closed(f"closed while a sample of {batch_size} waited for the rate limiter")
            self.scan()
            if lim.can_sample(self.size, total(), self.samples, batch_size):
                return
            if time.monotonic() > deadline:
                raise RateLimiterTimeout(
                    f"sample of {batch_size} blocked for {timeout_s:.1f} s: "
                    + lim.why_blocked(self.size, total(), self.samples, batch_size)
                )
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)

    def sample(self, batch_size: int, timeout_s: float | None = None) -> Sample:
        """Draw a batch with the selector; blocks while the rate limiter says so.
        :class:`TableClosed` once the table is closed (a blocked sample is woken with it)."""
        return self.draw(batch_size, timeout_s)[0]

    def draw(self, batch_size: int, timeout_s: float | None = None, tensors: dict | None = None,
             ring: BufferRing | None = None):
        """:meth:`sample`, returning ``(sample, slots, records)`` (records as :meth:`records`
        gives them; slots and records None on a device table); ``tensors`` (default every
        column's): the storage columns gathered into the batch, the others left for the
        caller to read by :meth:`rows_of` (and to check afterwards with :meth:`overwritten`).
        The shard service's sample replies use it. ``ring``: the buffer sets to draw into
        (default the table's own)."""
        if self._closed:
            self._refuse_closed(f"cannot sample {batch_size}")
        self._active += 1
        try:
            return self._draw_open(batch_size, timeout_s, tensors, ring)
        finally:
            self._active -= 1

    def _draw_open(self, batch_size: int, timeout_s: float | None, tensors: dict | None, ring: BufferRing | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        self.scan()
        self.wait_until_ready(batch_size, timeout_s)
        if self._device is not None:
            if tensors is not None:
                raise ValueError("a device table gathers every column on the GPU")
            return self._sample_on_device(batch_size, timeout_s), None, None
        sel = self.selector.sample(batch_size)
        slots, probs, weights = sel.slots, sel.probabilities, sel.weights
        out = self._buffers_for(batch_size) if ring is None else ring.take(self.kind.layout(self.storage.spec, batch_size), batch_size)
        rec = self._records(slots)  # (3, B): start, seq, length
        self._gather(slots, rec, out, tensors=tensors)
        bad = self._torn(slots, rec)
        deadline, masses = None, None
        while bad.size:
            # steps overwritten while we copied: evict those items, draw replacements
            deadline = self.evict_torn(slots[bad], deadline, timeout_s, "they could be gathered")
            if masses is None and sel.total is not None:
                masses = probs * sel.total  # each row's mass at its draw
            fresh = self.selector.sample(bad.size)
            slots, probs, weights = slots.copy(), probs.copy(), weights.copy()
            slots[bad], probs[bad], weights[bad] = fresh.slots, fresh.probabilities, fresh.weights
            if masses is not None and fresh.total is not None:
                masses[bad] = fresh.probabilities * fresh.total
                # one normalisation for the whole batch, against the table as it is now
                probs, weights = self.selector.reweigh(masses) or (probs, weights)
            # only the redrawn rows get records: the scan above may have ingested new items
            # into slots that other rows still hold, and those rows keep the records (and so
            # the keys) of the items they gathered
            rec[:, bad] = self._records(fresh.slots)
            self._gather(slots, rec, out, only=bad, tensors=tensors)
            bad = bad[self._torn(slots[bad], rec[:, bad])]
        self.note_sampled(batch_size)
        keys = self.keys_of(slots, rec)
        sample = Sample(
            data=out,
            keys=torch.from_numpy(keys),
            weights=torch.from_numpy(np.asarray(weights, dtype=np.float32)),
            probabilities=torch.from_numpy(np.asarray(probs, dtype=np.float64)),
        )
        return sample, slots, rec

    def rows_of(self, slots: np.ndarray, rec: np.ndarray) -> tuple[dict, np.ndarray]:
        """The item kind's storage rows of the items at ``slots`` (records ``rec`` as
        :meth:`draw` returns them) and their lengths."""
        stack = {} if self._stacks is None else {"stacks": self._stacks}
        return self.kind.rows(slots // self._R, rec[0], rec[2], self._S, **stack), rec[2]

    def overwritten(self, slots: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """Positions of the items (drawn at ``slots`` with records ``rec``) whose steps writers
        may have overwritten since the draw: the seqlock rule of the gather, without its
        shortcut (a scan since the draw must not hide them), for a reader that copied the rows
        after the draw."""
        reserve = self.storage.counters[:, RESERVE]
        starts = rec[0]
        if starts.min() >= reserve.max() - self._S_trust:  # nothing can be torn (the usual case)
            return _NONE
        return np.flatnonzero(starts < reserve[slots // self._R] - self._S_trust)

    def evict_torn(self, slots: np.ndarray, deadline: float | None, timeout_s: float | None, gatherer: str) -> float:
        """Items at ``slots`` were overwritten while they were gathered: evict them (and, by a
        scan, everything else overwritten since the draw) and wait until replacements can be
        drawn. A sampler descheduled for a whole lap of a small ring can lose many rounds in a
        row, so this gives up only after the sample timeout (``deadline``, set on the first
        round and returned), not after a number of rounds."""
        if deadline is None:
            deadline = time.monotonic() + (self.sample_timeout_s if timeout_s is None else timeout_s)
        elif time.monotonic() > deadline:
            raise RateLimiterTimeout(
                f"replay: writers kept overwriting the drawn items faster than {gatherer} "
                f"({self.torn} redrawn so far); the ring ({self._S} steps per partition) is too "
                f"small for the write rate"
            )
        self.torn += slots.size
        self._remove(np.unique(slots))
        self.scan()
        self.wait_until_ready(slots.size, timeout_s)
        return deadline

    # ------------------------------------------------ the draw's pieces, for samplers of this table
    # (the RDMA shard's select, which draws here and lets the learner read the rows itself)
    def records(self, slots: np.ndarray) -> np.ndarray:
        """The records of the items at ``slots``: int64 (3, B), rows start, seq, length."""
        return self._records(slots)

    def keys_of(self, slots: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """The keys of the items at ``slots`` with records ``rec``: int64 (B,)."""
        return item_key(rec[1], slot_partition(slots, self._R), self._P)

    def partitions_of(self, slots: np.ndarray) -> np.ndarray:
        """The partition of each slot: int64 (B,)."""
        return slot_partition(slots, self._R)

    def slots_of(self, keys: np.ndarray) -> np.ndarray:
        """The slot still holding each key, -1 where the item is gone: int64 (B,)."""
        return self._key_index.slots(keys)

    def note_sampled(self, n: int) -> None:
        """Count ``n`` samples drawn (by :meth:`draw`, or by a sampler that drew from
        :attr:`selector` itself) and republish the writers' insert limit."""
        self.samples += n
        self._publish_insert_limit()

    def _records(self, slots: np.ndarray) -> np.ndarray:
        """``_slot_rec[slots].T`` (3, B): rows start, seq, length; gathered in C with
        prefetching where built (in big tables every record is a cache miss)."""
        if _hotpath is None:
            return self._slot_rec[slots].T
        rec = np.empty((3, slots.size), dtype=np.int64)
        _hotpath.take_rows(self._slot_rec, 3, slots, rec)
        return rec

    def _gather(self, slots: np.ndarray, rec: np.ndarray, out: dict[str, torch.Tensor], only: np.ndarray | None = None,
                tensors: dict | None = None) -> None:  # fmt: skip
        tensors = self.storage.tensors if tensors is None else tensors
        parts = slots // self._R
        starts, lengths = rec[0], rec[2]
        stack = {} if self._stacks is None else {"stacks": self._stacks}
        if only is None:
            rows = self.kind.rows(parts, starts, lengths, self._S, **stack)
            B = slots.size
            n = self.gather_threads.pick(B)
            before = torch.get_num_threads()
            if n != before:
                torch.set_num_threads(n)
            t0 = time.perf_counter()
            try:
                self.kind.gather(tensors, out, rows, lengths)
            finally:
                if n != before:
                    torch.set_num_threads(before)
            self.gather_threads.record(B, n, time.perf_counter() - t0)
            return
        # replacements: gather the few redrawn items, then place them (rare path)
        sub = {k: torch.empty((only.size, *v.shape[1:]), dtype=v.dtype) for k, v in out.items()}
        p, s, n = parts[only], starts[only], lengths[only]
        self.kind.gather(tensors, sub, self.kind.rows(p, s, n, self._S, **stack), n)
        idx = torch.from_numpy(only)
        for k, v in out.items():
            gatherable(v).index_copy_(0, idx, gatherable(sub[k]))

    def _torn(self, slots: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """Positions whose first step (or, with stacked frames, the oldest step its stacks reach
        back to) may have been overwritten (seqlock check)."""
        if self._counter_total() == self._seen_total:  # read after the copy
            return _NONE  # no writer has moved since this sample's scan evicted the overwritten
        return self.overwritten(slots, rec)

    def _sample_on_device(self, batch_size: int, timeout_s: float | None) -> Sample:
        """:meth:`sample` with selection and gather on the GPU (``device="cuda"``): the same
        seqlock rule and torn-item replacement, a batch of CUDA tensors. Each row keeps the
        record it was drawn with (only redrawn rows get new ones), so its key names the item
        whose rows were gathered; a slot outside the table (< 0 or ≥ capacity) is redrawn."""
        dev = self._device
        draw = dev.draw(batch_size, self.size)  # the device first waits for the consumer's queued work
        out = dev.buffers(batch_size, self.num_buffers)
        dev.gather(draw, out)  # the one host sync: the counters below postdate the copy
        deadline = None
        while True:
            redo = dev.invalid(draw)  # impossible slots: redrawn, never returned (no device read if none)
            if self._counter_total() != self._seen_total:  # a writer moved since this sample's scan
                torn = dev.torn(draw, self.storage.counters[:, RESERVE])
                if torn.size:
                    deadline = self.evict_torn(dev.slots_at(draw, torn), deadline, timeout_s,
                                                "the GPU could gather them")  # fmt: skip
                    redo = np.union1d(redo, torn)
            if not redo.size:
                break
            draw = dev.redraw(draw, redo, self.size)  # new records for those rows only
            dev.gather(draw, out)  # the whole batch again (rare path): every item is re-checked
        self.samples += batch_size
        self._publish_insert_limit()
        data, keys, weights, probs = dev.batch(out)
        return Sample(data=data, keys=keys, weights=weights, probabilities=probs, on_release=partial(dev.release, out))

    @property
    def device(self) -> str:
        """Where selection and the batch gather run: ``"cpu"`` or ``"cuda"``."""
        return "cpu" if self._device is None else "cuda"

    # ------------------------------------------------------------------ priorities
    def update_priorities(self, keys, priorities) -> int:
        """New priorities by key; keys of evicted items are ignored. Returns how many applied.

        A priority that is not finite and ≥ 0 raises ValueError and nothing changes."""
        if self._closed:
            self._refuse_closed("cannot update priorities")
        if self._device is None and type(keys) is torch.Tensor and type(priorities) is torch.Tensor:
            applied = self.selector.update_by_key_tensors(keys, priorities, self._key_index)
            if applied is not None:  # a learner's CPU tensors, read where they are
                return applied
        keys = _host_array(keys, _INT64)
        prios = _host_array(priorities, _FLOATS)
        if keys.shape != prios.shape:
            raise ValueError(f"{keys.size} keys but {prios.size} priorities")
        if self._device is None:  # one C pass where built: checked, mapped, applied
            return self.selector.update_by_key(keys, prios, self._key_index)
        check_priorities(prios)
        slots = self._key_index.slots(keys)
        held = slots >= 0
        if not held.all():
            slots, prios = slots[held], prios[held]
        self.selector.update(slots, prios)
        self._device.update(slots, prios)  # the device path: its priority vector mirrors the selector's
        return int(slots.size)

    # ------------------------------------------------------------------ close
    def close(self, wait_s: float = 5.0) -> None:
        """Free the buffers; the owner unlinks the shared-memory segment. Idempotent.

        Afterwards every call raises :class:`TableClosed`; a sample blocked in another thread
        is woken with it (close waits up to ``wait_s`` for such calls to leave before the
        segment is unmapped), and writers of the segment (other processes too) get it at
        their next publish: the header says the table is closed."""
        if self._closed:
            return
        self._closed = True
        if self.storage.owner:
            self.storage.header[H_CLOSED] = 1
            self.storage.header[H_INSERT_LIMIT] = CLOSED_LIMIT  # every writer's limit check now fails
        deadline = time.monotonic() + wait_s
        while self._active > 0 and time.monotonic() < deadline:
            time.sleep(MAX_BACKOFF_S)  # a blocked sample re-checks at least this often
        self._buffers = []
        if self._device is not None:
            self._device.close()  # unregisters the segment: before it is unmapped
        owner = self.storage.owner
        name = self.storage.name
        self.storage.close()
        if owner:
            (SHM_DIR / name).unlink(missing_ok=True)

    def __enter__(self) -> "Table":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
