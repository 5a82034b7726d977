"""Batches into the learner loop: :class:`Prefetcher` (a background thread sampling ``depth``
batches ahead, through :class:`~gearflow.replay.protocols.SamplerLike`, and applying the learner's
priority write-backs before each draw: :mod:`gearflow.learner.access`) and
:class:`SerialBatches` (``run.serial=true``: one thread steps the actor and samples)."""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

from gearflow.learner.access import ReplayAccess
from gearflow.learner.progress import Progress
from gearflow.replay.host_batch import BufferRing
from gearflow.replay.protocols import SamplerLike

_BACKOFF = (1e-4, 5e-3)  # seconds between asks while the rate limiter holds a sample (doubling)
GROUP_SETS = 4  # buffer sets of a Prefetcher's refill draws: the one drawn into, the queue's
# (≤ depth // 2 batches: ≤ 2 sets) and the learner's batch's, and one to spare


def refill_size(depth: int) -> int:
    """Batches a refill of a ``depth``-deep :class:`BatchesAhead` draws (it refills at ``depth // 2``)."""
    return int(depth) - int(depth) // 2


class BatchesAhead:
    """The batches drawn ahead, ``depth`` at most, handed over in refills: the drawing thread is
    woken once at most ``depth // 2`` are left and then draws until ``depth`` are there, so the
    learner's thread and it meet (a wake-up, the GIL handed over) about once per ``depth / 2``
    batches rather than once per batch. ``get`` never blocks while a batch is there; ``put``
    never blocks."""

    def __init__(self, depth: int):
        self.depth, self.low = int(depth), int(depth) // 2
        self.batches_a_refill = refill_size(self.depth)  # depth - low
        self.items: collections.deque = collections.deque()
        self.refill = threading.Event()  # set: the drawing side should fill up
        self.refill.set()
        self._ready = threading.Condition()  # the learner waits on it when there is none

    def __len__(self) -> int:
        return len(self.items)

    def full(self) -> bool:
        return len(self.items) >= self.depth

    def put(self, batch: Any) -> None:
        self.items.append(batch)
        with self._ready:
            self._ready.notify()

    def wait_for_room(self, timeout: float) -> bool:
        """The drawing side, once full: sleep until a refill is due (or ``timeout``)."""
        self.refill.clear()
        if len(self.items) > self.low:  # a get after the clear sets it again: no refill missed
            return self.refill.wait(timeout)
        return True

    def get(self, timeout: float) -> Any:
        """The oldest batch; ``queue.Empty`` after ``timeout`` without one."""
        items = self.items
        try:
            batch = items.popleft()
        except IndexError:
            with self._ready:
                self.refill.set()
                if not self._ready.wait_for(lambda: items, timeout):
                    raise queue.Empty from None
                batch = items.popleft()  # one consumer: still there
        if len(items) <= self.low and not self.refill.is_set():
            self.refill.set()
        return batch


class Prefetcher:
    """Samples batches in a background thread, ``depth`` ahead of the learner, and applies the
    learner's priority write-backs before each draw (``lock`` a :class:`ReplayAccess`, the
    learner's ``lock``; a plain lock: none to apply).

    A refill's ``depth - depth // 2`` batches are one draw where the table allows it (:attr:`group`:
    a local host table whose selector draws with replacement; ``Table.sample_batches`` into
    :attr:`group_ring`, ``GROUP_SETS`` sets in turn): one lock, scan and gather, and the GIL handed
    across about once, for all of them.

    The lock is held only for the table's own critical sections: the write-backs and a draw,
    never across a rate-limiter wait (a local table is asked :meth:`~gearflow.replay.Table.can_sample`
    under the lock and waited for outside it) and never by the learn step, which only queues its
    priorities: sampling and learning overlap, and the learner's wait for a batch
    (:meth:`next_batch`, ``Progress.wait_s``) is every moment it waits."""

    def __init__(self, table: SamplerLike, lock: ReplayAccess | threading.Lock, batch_size: int, depth: int,
                 stop: threading.Event, progress: Progress | None = None):  # fmt: skip
        self.table, self.lock, self.batch_size, self.progress = table, lock, batch_size, progress
        self.access = lock if isinstance(lock, ReplayAccess) else None
        if self.access is not None:
            self.access.sampler_applies = True  # this thread applies the write-backs, before each draw
        self._can_sample = getattr(table, "can_sample", None)  # a local table: asked without waiting
        self.ring = getattr(self.access, "ring", None)  # a CUDA learner: batches ahead on its device
        self.ahead = BatchesAhead(depth)
        # a refill in one draw: a local table that draws several batches a call (Table.draws_groups:
        # a host table, a prioritized or uniform selector) gets a refill's batches in one call (one
        # lock, one scan, one gather: the Python and GIL hand-offs of one batch), into sets of its
        # own: GROUP_SETS of them, a batch valid until GROUP_SETS - 1 refills later
        grouped = self._can_sample is not None and getattr(table, "draws_groups", False)
        self.group = self.ahead.batches_a_refill if grouped else 1
        self.group_ring = BufferRing(GROUP_SETS, getattr(table, "pin_memory", False)) if self.group > 1 else None
        self.stop = stop
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self.thread.start()

    def _draw(self) -> list | None:
        """The write-backs applied, then a refill's batches (:attr:`group` of them where the
        rate limiter allows them all, else one); None while the rate limiter holds a batch."""
        B, K = self.batch_size, self.group
        if self.ring is not None:  # the buffer sets about to be reused: copied out of first (the
            # batches since a set's last use: the table's num_buffers - 1, a group ring's K a set)
            sets = getattr(self.table, "num_buffers", 1)
            self.ring.before_draw(sets if K == 1 else min(sets, (GROUP_SETS - 1) * K + 1))
        with self.lock:
            if self.access is not None:
                self.access.writeback.apply()
            if self._can_sample is None:  # a remote sampler waits in its own call
                try:
                    return [self.table.sample(B, timeout_s=0.2)]
                except TimeoutError:
                    return None
            self.table.scan()
            if K > 1 and self._can_sample(K * B):
                return self.table.sample_batches(B, K, ring=self.group_ring)
            if not self._can_sample(B):
                return None
            return [self.table.sample(B)]  # the table's own sets: a ring's size never changes

    def _run(self) -> None:
        try:
            delay = _BACKOFF[0]
            ahead, room = self.ahead, self.ahead.depth - self.group
            while not self.stop.is_set():
                if len(ahead) > room:  # until a refill is due (the learner took half of them)
                    ahead.wait_for_room(0.2)
                    continue
                batches = self._draw()
                if batches is None:  # the rate limiter: wait without the lock, then ask again
                    self.stop.wait(delay)
                    delay = min(2 * delay, _BACKOFF[1])
                    continue
                delay = _BACKOFF[0]
                for batch in batches:
                    if self.ring is not None:  # into a free device slot, on the ring's stream
                        batch = self.ring.put(batch, self.stop)
                    if batch is not None:
                        ahead.put(batch)
        except BaseException as exc:  # surfaced in the learner thread
            self.error = exc

    def get(self, timeout: float) -> Any:
        if self.error is not None:
            raise self.error
        return self.ahead.get(timeout)

    def next_batch(self):
        """The next batch, or None after waiting 0.5 s (the wait counts once learning began)."""
        t0 = time.perf_counter()
        try:
            batch = self.get(timeout=0.5)
        except queue.Empty:
            batch = None
        wait = getattr(batch, "wait", None)
        if wait is not None:  # a device batch: the learner's stream waits for its copy (the host does not)
            wait()
        if self.progress is not None and self.progress.updates:
            self.progress.wait_s += time.perf_counter() - t0
        return batch

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


class SerialBatches:
    """``run.serial=true``: a batch whenever the rate limiter allows one (the same check the table
    applies when it samples), else one actor step, a scan, and a batch if that allowed one.

    Sampling first keeps the one thread from deadlocking where one batch allows fewer inserts than
    one actor step writes (``batch_size / samples_per_insert`` < the items of one recv): stepping
    first would add more than a batch frees every turn until an insert blocks, with no sampler left
    to free it. Now the actor steps only once no batch can be sampled, the state the error buffer
    leaves room to insert from (``2 · error_buffer ≥ batch_size + items · samples_per_insert``).

    ``paced=False`` (``replay.samples_per_insert=0``: inserts never wait for samples) steps the
    actor every call, then samples: sampling first would learn forever on the first
    ``min_size_to_sample`` items, the actor never stepping again."""

    def __init__(self, actor, table, batch_size: int, progress: Progress, paced: bool = True):
        self.actor, self.table, self.batch_size, self.progress = actor, table, batch_size, progress
        self.paced = paced

    def next_batch(self):
        if not self.paced:
            self.actor.step()
        self.table.scan()
        if not self.table.can_sample(self.batch_size):
            if not self.paced:
                return None
            self.actor.step()
            self.table.scan()
            if not self.table.can_sample(self.batch_size):
                return None
        t0 = time.perf_counter()
        batch = self.table.sample(self.batch_size)
        self.progress.wait_s += time.perf_counter() - t0
        return batch

