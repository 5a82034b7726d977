"""Batches ahead on the learner's device: :class:`DeviceBatches`, a ring of K static device buffer
sets that the prefetch thread fills on a side stream while the learner's step runs
(``learner.device_batches``; a CUDA learner sampling a host table).

A batch goes: the table's gather into one of its pinned buffer sets (prefetch thread) → a
``non_blocking`` copy into a free slot of the ring on the ring's own stream, after that slot's
``consumed`` event (the stream waits, not the thread) → an event ``ready`` → the learner's stream
waits for ``ready`` (:meth:`StagedSample.wait`) → the step reads the slot → ``release`` records
``consumed`` on the learner's stream and hands the slot back. A pinned buffer set is drawn into
again only after the copy out of it finished (:meth:`DeviceBatches.before_draw`, the prefetch
thread waits on the copy's event before the table reuses it)::

    ring = DeviceBatches("cuda", slots=3)
    batch = ring.put(table.sample(256), stop)   # prefetch thread: queued copy, returns at once
    batch.wait()                                # learner thread: its stream waits for the copy
    agent.learn(batch); batch.release()         # the slot is refilled after this step's reads

Shapes: each slot holds the sample's columns as they are, ``(B, ...)`` or ``(B, T, ...)`` plus
``mask`` ``(B, T)``, and the IS weights ``(B,)``, on the device; keys and probabilities stay on the
host (the write-back to a host table needs the keys there). Slots are made on the first batch
and anew when the batch's shapes change.

On a CPU device the same ring copies synchronously and has no events (a CPU op is done when it
returns): the rotation logic runs there, which is how it is tested without a GPU.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from gearflow.replay.host_batch import Sample

__all__ = ["DeviceBatches", "StagedSample"]


@dataclass
class StagedSample(Sample):
    """A sample in a :class:`DeviceBatches` slot; ``ready``: the copy's event (None on a CPU)."""

    ready: Any = None

    def wait(self) -> None:
        """Make the caller's current stream wait until the batch is on the device (no host wait)."""
        if self.ready is not None:
            self.ready.wait(torch.cuda.current_stream(self.weights.device))


class DeviceBatches:
    """``slots`` static device buffer sets filled on a side stream (see the module docstring)."""

    def __init__(self, device: torch.device | str, slots: int = 3):
        if slots < 2:
            raise ValueError(f"a ring of device batches needs ≥ 2 slots (one read, one filled), got {slots}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.slots: list[dict[str, torch.Tensor] | None] = [None] * slots
        self._shapes: list[tuple | None] = [None] * slots
        self._free: queue.Queue = queue.Queue()
        for i in range(slots):
            self._free.put(i)
        self._consumed: list[Any] = [None] * slots  # the learner's event after the step that read slot i
        self._copies: collections.deque = collections.deque()  # events of copies out of the table's buffer sets
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.filled = 0  # batches put

    def before_draw(self, num_buffers: int) -> None:
        """Before the table draws into its next buffer set (prefetch thread): wait for the copies out
        of the sets it will reuse (it has ``num_buffers`` in turn)."""
        while len(self._copies) >= max(1, num_buffers - 1):
            self._copies.popleft().synchronize()

    def put(self, sample: Sample, stop: threading.Event | None = None) -> StagedSample | None:
        """``sample`` copied into a free slot (waiting for one while the learner holds them all);
        None if ``stop`` is set meanwhile. Prefetch thread."""
        while True:
            try:
                i = self._free.get(timeout=0.2)
                break
            except queue.Empty:
                if stop is not None and stop.is_set():
                    return None
        slot = self._slot(i, sample)
        ready = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if self._consumed[i] is not None:
                    self.stream.wait_event(self._consumed[i])  # the step that read the slot is done
                for k, v in sample.data.items():
                    slot[k].copy_(v, non_blocking=True)
                slot["__weights"].copy_(sample.weights, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self._copies.append(ready)
        else:
            for k, v in sample.data.items():
                slot[k].copy_(v)
            slot["__weights"].copy_(sample.weights)
        self.filled += 1
        data = {k: v for k, v in slot.items() if k != "__weights"}
        return StagedSample(data=data, keys=sample.keys, weights=slot["__weights"],
                            probabilities=sample.probabilities, on_release=partial(self._release, i), ready=ready)  # fmt: skip

    def _slot(self, i: int, sample: Sample) -> dict[str, torch.Tensor]:
        shapes = (tuple((k, tuple(v.shape), v.dtype) for k, v in sample.data.items()), tuple(sample.weights.shape))
        if self._shapes[i] != shapes:  # first use, or another batch size
            slot = {k: torch.empty(v.shape, dtype=v.dtype, device=self.device) for k, v in sample.data.items()}
            slot["__weights"] = torch.empty(sample.weights.shape, dtype=sample.weights.dtype, device=self.device)
            self.slots[i], self._shapes[i] = slot, shapes
        return self.slots[i]

    def _release(self, i: int, stream: Any = None) -> None:
        """The learner queued every read of slot ``i`` on ``stream`` (default its current one)."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            self._consumed[i] = event
        self._free.put(i)
