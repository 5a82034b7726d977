"""The learner's side of its replay: one lock for the table's own critical sections, and the
priority write-backs the learn step queues without waiting (:class:`ReplayAccess`,
:class:`PriorityWriteBack`).

The learn step never takes the lock and never waits for the device: it queues ``(keys,
priorities)`` and goes on. Whoever samples applies the queue before its next draw, under the lock
(the :class:`~gearflow.learner.batches.Prefetcher`'s thread; without one, the learner itself
right after the step); a checkpoint applies it before it reads the table. Where the priorities
are::

    CPU tensors (a CPU learner)          queued as they are
    CUDA, a host table (replay.device=cpu, shard nodes)
                                         copied with non_blocking into a pinned buffer, an event
                                         recorded after the copy; the sampling side waits for the
                                         event, then applies them (the learner's thread never does)
    CUDA, a device table (replay.device=cuda)
                                         queued as the device tensors they are, with an event; the
                                         sampling thread's stream waits for the event (on the device),
                                         the table takes them as they are (issue 46: its stream waits
                                         for that stream; no host wait anywhere)

::

    access = ReplayAccess(table)              # Learner.lock
    access.writeback.put(batch.keys, prios)   # the learn step: returns at once
    with access:                              # the sampling side, before its next draw
        access.writeback.apply()
        batch = table.sample(256)
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

__all__ = ["PriorityWriteBack", "ReplayAccess"]


class PriorityWriteBack:
    """Priority updates queued by the learner's thread and applied by the sampling side; see the
    module docstring. ``put`` never blocks; ``apply`` (under the :class:`ReplayAccess` lock) applies
    every queued update in order, waiting for a device copy's event where there is one: on the
    host for a host table (it reads the pinned copy), on the device for a device table (its
    stream waits for this thread's current stream, which waits for the learner's event)."""

    def __init__(self, table: Any):
        self.table = table
        self.device_table = str(getattr(table, "device", "cpu")) != "cpu"  # takes device tensors as they are
        self.pending: collections.deque = collections.deque()  # (keys, priorities, event | None, pinned | None)
        self._pinned: collections.deque = collections.deque()  # free pinned float32 buffers (CUDA learner)
        self.applied = 0  # updates applied (batches)

    def put(self, keys, priorities) -> None:
        """Queue the priorities of ``keys`` (the learner's thread; returns at once)."""
        event = pinned = None
        if isinstance(priorities, torch.Tensor):
            if priorities.requires_grad:
                priorities = priorities.detach()
            if priorities.device.type == "cuda":
                if not self.device_table:  # to a host table: a copy the learner does not wait for
                    pinned = self._take_pinned(priorities.shape)
                    pinned.copy_(priorities, non_blocking=True)
                    priorities = pinned
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(priorities.device))  # the learner's stream: after the step and the copy
            elif priorities.dtype != torch.float32 and priorities.dtype != torch.float64:
                priorities = priorities.float()
        self.pending.append((keys, priorities, event, pinned))

    def apply(self) -> int:
        """Apply every queued update, oldest first (the sampling side, under the lock); returns
        how many batches' priorities were applied."""
        n = 0
        pending = self.pending
        while pending:
            keys, priorities, event, pinned = pending.popleft()
            if event is not None and pinned is None:  # device priorities to a device table: no host wait;
                # this thread's stream waits for the learner's event, the table's stream for this one
                torch.cuda.current_stream(priorities.device).wait_event(event)
            elif event is not None:
                event.synchronize()  # the pinned copy read by a host table: the sampling side waits, never the learner
            try:
                self.table.update_priorities(keys, priorities)
            finally:
                if pinned is not None:
                    self._pinned.append(pinned)
            n += 1
        self.applied += n
        return n

    def _take_pinned(self, shape) -> torch.Tensor:
        shape = tuple(shape)
        for _ in range(len(self._pinned)):
            buf = self._pinned.popleft()
            if tuple(buf.shape) == shape:
                return buf
            # another batch size: dropped (made anew below)
        return torch.empty(shape, dtype=torch.float32, pin_memory=True)


class ReplayAccess:
    """The lock of the table's critical sections (a draw, the write-backs, a checkpoint's read),
    the learn step's queued priority write-backs (:attr:`writeback`) and, for a CUDA learner over
    a host table, the ring of batches ahead on its device (:attr:`ring`, ``device_batches`` slots:
    :class:`~gearflow.learner.staging.DeviceBatches`). Used as a lock (``with access:``); the
    learner holds it as ``Learner.lock`` and hands it to the ``Prefetcher``, which fills the ring.

    ``sampler_applies``: a sampling thread applies the write-backs before its draws (set by the
    ``Prefetcher`` that takes this access); while False the learner applies them after each step."""

    def __init__(self, table: Any, device: torch.device | str | None = None, device_batches: int = 0):
        self._lock = threading.Lock()
        self.writeback = PriorityWriteBack(table)
        self.sampler_applies = False
        self.ring = None
        if device is not None and torch.device(device).type == "cuda" and device_batches and \
                not self.writeback.device_table:  # fmt: skip
            from gearflow.learner.staging import DeviceBatches

            self.ring = DeviceBatches(device, int(device_batches))

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()
