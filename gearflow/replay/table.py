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
(:mod:`gearflow.native.device_replay`: the priority vector lives on the device, fed
by this table's ingest and by write-backs of CUDA tensors; batches drawn ahead, a
zero-copy gather out of the registered segment, the same seqlock rule checked on the
device); the batch is then CUDA tensors and the table's selector a
:class:`~gearflow.replay.device_table.DeviceSelector` (live slots only). The default
``"cpu"`` path is unchanged by it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from gearflow.replay.device_table import DeviceSelector, sample_on_device, update_on_device
from gearflow.replay.host_batch import (  # re-exported
    BatchBuffers,
    BufferRing,
    GatherThreads,
    HostGather,
    Sample,
    split_sample,
)
from gearflow.replay.ingest import TableIngest
from gearflow.replay.inserts import InsertLimit
from gearflow.replay.items import ItemKind
from gearflow.replay.layout import RedrawRounds, item_key, slot_partition, torn_items
from gearflow.replay.rate_limiter import MAX_BACKOFF_S, RateLimiter, RateLimiterTimeout
from gearflow.replay.selectors import KeyIndex, Selector
from gearflow.replay.storage import (
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


def _take_records(slot_rec: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``slot_rec[slots].T`` (3, B): rows start, seq, length; gathered in C with prefetching
    where built (in big tables every record is a cache miss)."""
    if _hotpath is None:
        return slot_rec[slots].T
    rec = np.empty((3, slots.size), dtype=np.int64)
    _hotpath.take_rows(slot_rec, 3, slots, rec)
    return rec


_INT64, _FLOATS = (np.dtype(np.int64),), (np.dtype(np.float64), np.dtype(np.float32))


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
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        # the CPU path's batch buffer sets and gather (gearflow/replay/host_batch.py)
        self.batches = BatchBuffers(kind, storage.spec, num_buffers, pin_memory=self.pin_memory)
        self.gather_threads = GatherThreads(num_threads)  # CPU gathers: measured, or num_threads
        self._P, self._R, self._S = P, R, storage.steps_per_partition
        # an item is intact while its first step is ≥ RESERVE - _S_trust: S less the steps its
        # stacks reach back (stacked-frame columns), so eviction and the re-check cover them
        self._S_trust = storage.trusted_steps
        kind.layout(storage.spec, 1)  # validates the kind against the spec
        self.host_gather = HostGather(storage, self.gather_threads)
        # "cuda": selection and gather on the GPU (gearflow.native.device_replay), set up before the
        # table touches the storage, so a missing CuPy leaves the caller's storage as it was
        self._device = _device_replay(device, storage, kind, selector)
        if self._device is not None:  # priorities on the device only; liveness stays here
            self.selector = selector = self._device.selector = DeviceSelector(selector, self._device)
        self._max_item_steps = kind.max_steps(storage.steps_per_partition)
        self._init_ingest(P, R)
        self._key_index = KeyIndex(P, R, self._slot_rec, self._slot_live)  # update_priorities
        self._closed = False
        self._active = 0  # samples / waits in progress (close() lets them leave first)
        self.insert_limit = InsertLimit(self)  # the writers' limit in the header (pace(): set from outside)
        self.insert_limit.publish()

    def set_rate_limiter(self, limiter: RateLimiter) -> None:
        """Replace the rate limiter (a resumed run's config) and publish its insert limit."""
        self.rate_limiter = limiter
        self.insert_limit.publish()

    def pace(self, insert_limit: int | None) -> None:
        """Writers may insert up to ``insert_limit`` items in all and samples go while the table holds an
        item: a learner's :class:`~gearflow.replay.pacing.GlobalPacing` keeps the rate over several
        tables (:class:`InsertLimit`). ``None``: back to this table's own :attr:`rate_limiter`."""
        if not self._closed:
            self.insert_limit.pace(insert_limit)

    @property
    def paced(self) -> bool:
        return self.insert_limit.paced is not None

    def pace_counters(self) -> dict[str, int]:
        """What a global pacer needs of this table (:meth:`InsertLimit.counters`)."""
        return self.insert_limit.counters()

    @property
    def num_buffers(self) -> int:
        """Output buffer sets used in turn: a batch stays valid for ``num_buffers - 1`` more samples."""
        return self.batches.num_buffers

    @num_buffers.setter
    def num_buffers(self, n: int) -> None:
        self.batches.num_buffers = n

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
        if self.insert_limit.paced is not None:
            return self.size >= 1  # the sampler keeps the rate over every table it samples
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
            _wait_until_ready(self, batch_size, timeout_s)
        finally:
            self._active -= 1

    def sample(self, batch_size: int, timeout_s: float | None = None) -> Sample:
        """Draw a batch with the selector; blocks while the rate limiter says so.
        :class:`TableClosed` once the table is closed (a blocked sample is woken with it)."""
        return self.draw(batch_size, timeout_s)[0]

    @property
    def draws_groups(self) -> bool:
        """Whether :meth:`sample_batches` draws several batches in one call here: a host table
        whose selector :attr:`~gearflow.replay.selectors.Selector.draws_groups`."""
        return self._device is None and self.selector.draws_groups

    def sample_batches(self, batch_size: int, count: int, timeout_s: float | None = None,
                       ring: BufferRing | None = None) -> list[Sample]:  # fmt: skip
        """``count`` batches of ``batch_size`` in one draw (where :attr:`draws_groups`): each drawn and weighted as its
        own :meth:`sample` would be, gathered into one buffer set of ``ring`` (default the
        table's; a ring is remade when its batch size changes: give each size its own) and
        returned as views of it (:func:`split_sample`). The rate limiter is asked for all
        ``count × batch_size`` items. One call's Python and GIL hand-offs for ``count``
        batches (Reverb's ``flexible_batch_size``)."""
        whole = self.draw(batch_size, timeout_s, None, ring, count)[0]
        return split_sample(whole, self.batches.ring if ring is None else ring, batch_size, count)

    def draw(self, batch_size: int, timeout_s: float | None = None, tensors: dict | None = None,
             ring: BufferRing | None = None, groups: int = 1):  # fmt: skip
        """:meth:`sample`, returning ``(sample, slots, records)`` (records as :meth:`records`
        gives them; slots and records None on a device table); ``tensors`` (default every
        column's): the storage columns gathered into the batch, the others left for the
        caller to read by :meth:`rows_of` (and to check afterwards with :meth:`overwritten`).
        The shard service's sample replies use it. ``ring``: the buffer sets to draw into
        (default the table's own); ``groups``: that many batches in one (:meth:`sample_batches`)."""
        if self._closed:
            self._refuse_closed(f"cannot sample {batch_size}")
        self._active += 1
        try:
            return self._draw_open(batch_size, timeout_s, tensors, ring, groups)
        finally:
            self._active -= 1

    def _draw_open(self, batch_size: int, timeout_s: float | None, tensors: dict | None, ring: BufferRing | None = None,
                   groups: int = 1):  # fmt: skip
        """A draw of ``groups`` batches of ``batch_size`` (one Sample of them all, in order)."""
        if batch_size < 1 or groups < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}" if groups >= 1 else f"count must be ≥ 1, got {groups}")
        if groups > 1 and not self.draws_groups:
            where = "a device table" if self._device is not None else f"a {self.selector.name} selector"
            raise ValueError(f"{groups} batches in one draw: {where} draws one batch a call")
        group, batch_size = batch_size, batch_size * groups
        self.scan()
        self.wait_until_ready(batch_size, timeout_s)
        if self._device is not None:
            if tensors is not None:
                raise ValueError("a device table gathers every column on the GPU")
            return sample_on_device(self, self._device, batch_size, timeout_s), None, None
        sel = self.selector.sample(group, groups)
        slots, probs, weights = sel.slots, sel.probabilities, sel.weights
        out = self.batches.next(batch_size, ring)  # the table's own sets, or the caller's ring
        rec = _take_records(self._slot_rec, slots)  # (3, B): start, seq, length
        self._gather(slots, rec, out, tensors=tensors)
        bad = self._torn(slots, rec)
        if bad.size:  # steps overwritten while we copied
            slots, probs, weights = _redraw_torn(self, sel, bad, rec, out, timeout_s, tensors, group)
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
        return self.host_gather.rows_of(self.kind, slots, rec)

    def overwritten(self, slots: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """Positions of the items (drawn at ``slots`` with records ``rec``) whose steps writers
        may have overwritten since the draw: the seqlock rule of the gather, without its
        shortcut (a scan since the draw must not hide them), for a reader that copied the rows
        after the draw."""
        reserve = self.storage.counters[:, RESERVE]
        starts = rec[0]
        if starts.min() >= reserve.max() - self._S_trust:  # nothing can be torn (the usual case)
            return _NONE
        return np.flatnonzero(torn_items(slot_partition(slots, self._R), starts, reserve, self._S_trust))

    def evict_torn(self, slots: np.ndarray, deadline: float | None, timeout_s: float | None, gatherer: str,
                   rows: int | None = None) -> float:  # fmt: skip
        """Items at ``slots`` were overwritten while they were gathered: evict them (and, by a
        scan, everything else overwritten since the draw) and wait until replacements can be
        drawn. A sampler descheduled for a whole lap of a small ring can lose many rounds in a
        row, so this gives up only after the sample timeout (``deadline``, set on the first
        round and returned), not after a number of rounds. ``rows``: the torn rows to count
        (default one per slot; a device batch drawn ahead evicts only the items still held)."""
        if deadline is None:
            deadline = time.monotonic() + (self.sample_timeout_s if timeout_s is None else timeout_s)
        elif time.monotonic() > deadline:
            raise RateLimiterTimeout(
                f"replay: writers kept overwriting the drawn items faster than {gatherer} "
                f"({self.torn} redrawn so far); the ring ({self._S} steps per partition) is too "
                f"small for the write rate"
            )
        self.torn += slots.size if rows is None else rows
        self._remove(np.unique(slots))
        self.scan()
        self.wait_until_ready(slots.size, timeout_s)
        return deadline

    # ------------------------------------------------ the draw's pieces, for samplers of this table
    # (the RDMA shard's select, which draws here and lets the learner read the rows itself)
    def records(self, slots: np.ndarray) -> np.ndarray:
        """The records of the items at ``slots``: int64 (3, B), rows start, seq, length."""
        return _take_records(self._slot_rec, slots)

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
        self.insert_limit.publish()

    def _gather(self, slots: np.ndarray, rec: np.ndarray, out: dict[str, torch.Tensor], only: np.ndarray | None = None,
                tensors: dict | None = None) -> None:  # fmt: skip
        self.host_gather.gather(self.kind, slots, rec, out, only, tensors)

    def _torn(self, slots: np.ndarray, rec: np.ndarray) -> np.ndarray:
        """Positions whose first step (or, with stacked frames, the oldest step its stacks reach
        back to) may have been overwritten (seqlock check)."""
        if not self.writers_moved():  # read after the copy
            return _NONE  # no writer has moved since this sample's scan evicted the overwritten
        return self.overwritten(slots, rec)

    def writers_moved(self) -> bool:
        """Whether any writer's counter moved since the last scan (read now: after a copy, False
        means nothing copied since that scan can be torn)."""
        return self._counter_total() != self._seen_total

    @property
    def device(self) -> str:
        """Where selection and the batch gather run: ``"cpu"`` or ``"cuda"``."""
        return "cpu" if self._device is None else "cuda"

    # ------------------------------------------------------------------ priorities
    def update_priorities(self, keys, priorities) -> int:
        """New priorities by key; keys of evicted items are ignored. Returns how many applied.

        A priority that is not finite and ≥ 0 raises ValueError and nothing changes. A device
        table takes the learner's CUDA tensors as they are and applies them on the GPU without a
        host sync (:func:`~gearflow.replay.device_table.update_on_device`: it returns how many
        were handed in, and a bad priority is skipped and raised by the next sample)."""
        if self._closed:
            self._refuse_closed("cannot update priorities")
        if self._device is not None:  # CUDA tensors applied where they are (no host sync)
            return update_on_device(self, self._device, keys, priorities)
        if type(keys) is torch.Tensor and type(priorities) is torch.Tensor:
            applied = self.selector.update_by_key_tensors(keys, priorities, self._key_index)
            if applied is not None:  # a learner's CPU tensors, read where they are
                return applied
        keys = _host_array(keys, _INT64)
        prios = _host_array(priorities, _FLOATS)
        if keys.shape != prios.shape:
            raise ValueError(f"{keys.size} keys but {prios.size} priorities")
        return self.selector.update_by_key(keys, prios, self._key_index)  # one C pass where built

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
        self.insert_limit.close()  # every writer's limit check now fails
        deadline = time.monotonic() + wait_s
        while self._active > 0 and time.monotonic() < deadline:
            time.sleep(MAX_BACKOFF_S)  # a blocked sample re-checks at least this often
        self.batches.clear()
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


def _redraw_torn(table: Table, sel, bad: np.ndarray, rec: np.ndarray, out: dict, timeout_s: float | None,
                 tensors: dict | None, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The rows ``bad`` of a draw (``sel``, records ``rec``, gathered into ``out``) were overwritten
    while they were copied: evict those items, draw replacements and gather them, in rounds until
    none is torn (:meth:`Table.evict_torn` gives up after the sample timeout). Returns the slots,
    probabilities and weights of the batch as it then is (``rec`` and ``out`` changed in place)."""
    slots, probs, weights = sel.slots, sel.probabilities, sel.weights
    deadline, masses, newly, rounds = None, None, bad, RedrawRounds(bad.size)
    while bad.size:
        # steps overwritten while we copied: evict those items, draw replacements (as many
        # rows a round as ``rounds`` says: a slowed sampler must win some rounds)
        if newly.size:
            deadline = table.evict_torn(slots[newly], deadline, timeout_s, "they could be gathered")
        if masses is None and sel.total is not None:
            masses = probs * sel.total  # each row's mass at its draw
        part, rest = rounds.take(bad)
        fresh = table.selector.sample(part.size)
        slots, probs, weights = slots.copy(), probs.copy(), weights.copy()
        slots[part], probs[part], weights[part] = fresh.slots, fresh.probabilities, fresh.weights
        if masses is not None and fresh.total is not None:
            masses[part] = fresh.probabilities * fresh.total
            # one normalisation for each batch of ``group`` rows, against the table as it is now
            probs, weights = table.selector.reweigh(masses, group) or (probs, weights)
        # only the redrawn rows get records: the scan above may have ingested new items
        # into slots that other rows still hold, and those rows keep the records (and so
        # the keys) of the items they gathered
        rec[:, part] = table.records(fresh.slots)
        table._gather(slots, rec, out, only=part, tensors=tensors)
        newly = part[table._torn(slots[part], rec[:, part])]
        rounds.lost(part.size, newly.size)
        bad = np.concatenate([newly, rest])
    return slots, probs, weights


def _wait_until_ready(table: Table, batch_size: int, timeout_s: float | None) -> None:
    """:meth:`Table.wait_until_ready`'s wait: scan, ask the rate limiter, back off (doubling, at most
    ``MAX_BACKOFF_S``) until it allows the sample, the table closes or ``timeout_s`` passes."""
    lim = table.rate_limiter
    timeout_s = table.sample_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    delay = 1e-4
    while True:
        if table._closed:  # close() in another thread: it waits for this call to leave
            table._refuse_closed(f"closed while a sample of {batch_size} waited for the rate limiter")
        table.scan()
        if table.can_sample(batch_size):
            return
        if time.monotonic() > deadline:
            total = int(table.storage.counters[:, PUBLISHED].sum())
            raise RateLimiterTimeout(f"sample of {batch_size} blocked for {timeout_s:.1f} s: "
                                     + lim.why_blocked(table.size, total, table.samples, batch_size))  # fmt: skip
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)
