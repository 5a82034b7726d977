"""The GPU sampler's buffer sets: each one batch's draw, outputs and status word, and the
consumer streams that release them.

A :class:`BufferSets` owns ``num_sets`` preallocated :class:`DeviceBuffers` (CuPy arrays with
torch tensors over the same memory, made once per batch size) used in turn. A set holds
everything one batch in flight needs, so that batches drawn ahead never share a scratch array:

    draw       slots, probs, parts, starts, seqs, lengths, flags   [B] device (the fused draw's rows)
    outputs    the kind's layout (B, ...), keys int64, weights float32, probabilities float64 [B]
    desc       select.cu's gf_draw descriptor over those arrays (int64, device)
    status     int64[4] in mapped pinned host memory: impossible rows, torn rows, priorities applied,
               priorities refused (written by finish_batch, read by the host after ``event``)
    event      recorded after the batch's last kernel (a blocking-sync event: a waiting host sleeps)

A set is refilled only after the replay stream has waited (device-side events, never a host
wait) for every :meth:`BufferSets.release` the consumer recorded on its own stream since the
set was last handed out; a set handed out and never released is refilled only after the replay
stream waited for torch's current stream (the consumer that reads batches on the stream it
samples from, without releasing them). A learner that releases every batch (gearflow's does)
is therefore never waited for as a whole: only its reads of the set being refilled are.

Sets replaced on a batch-size change are *retired*, not dropped: their release events are still
waited for, and they are let go only after ``num_sets`` later samples have synchronized
(:meth:`BufferSets.after_sync`), so their CuPy memory never returns to the pool (and a later
allocation on this stream) while torch may still read it.

    sets = BufferSets(cupy, device_id, on_device, stream, kind, spec, consumer_stream)
    out = sets.next(256, 4)      # inside nothing: enters on_device itself; waits for out's releases
    ...                          # the sampler draws and gathers into out on stream, records out.event
    sets.after_sync()            # once a sample's event was waited for
    sets.release(out, side_stream)   # the consumer: every read of out is queued on side_stream
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearflow.native.cuda_backend import to_torch
from gearflow.native.hostmem import MappedArea
from gearflow.native.select import DRAW_FIELDS, STATUS_WORDS, descriptor

__all__ = ["BufferSets", "DeviceBuffers", "DeviceDraw", "RawStream", "torch_stream"]


@dataclass
class DeviceDraw:
    """One batch's draws and the records of the drawn items, device arrays of length B (CuPy),
    written by ``draw_items`` on the replay stream and never re-read from the mirrors: the gather,
    the seqlock check and the keys all use these, so each key names the item whose rows were
    gathered even if a later scan reuses the slot."""

    slots: Any  # int64 (B,) as drawn (-1: rounding found no slot; see flags)
    probs: Any  # float64 (B,)
    parts: Any  # int64 (B,) partition of the slot (-1 where impossible)
    starts: Any  # int64 (B,) absolute first step of the item
    seqs: Any  # int64 (B,) item sequence number in its partition
    lengths: Any  # int32 (B,) steps in the item
    flags: Any  # uint8 (B,) bit 0 impossible slot, bit 1 torn (finish_batch)


@dataclass
class DeviceBuffers:
    """One preallocated buffer set (module docstring): name → (CuPy array, torch tensor over the
    same memory) for the outputs, the draw's arrays, the descriptor, status word, event."""

    data: dict[str, tuple[Any, Any]]  # the kind's layout: (B, ...) or (B, T, ...), mask, length
    keys: tuple[Any, Any]  # int64 (B,)
    weights: tuple[Any, Any]  # float32 (B,)
    probabilities: tuple[Any, Any]  # float64 (B,)
    draw: DeviceDraw
    desc: Any  # select.cu gf_draw over draw, keys, weights, probabilities, status (int64, device)
    status_area: MappedArea  # status: int64[4] at its start
    event: Any  # CuPy event recorded after the batch's last kernel
    batch_size: int
    # consumer stream (raw cudaStream_t) -> the reused event recorded there by release(); and the
    # streams whose event was recorded since this set was handed out (waited for before the next fill)
    released: dict[int, Any] = field(default_factory=dict)
    recorded: set[int] = field(default_factory=set)
    handed_out: bool = False  # returned to a consumer since its last fill
    in_flight: bool = False  # queued on the stream, its event not waited for yet
    retired_for: int = 0  # samples synchronized since the set was replaced (batch-size change)

    @property
    def status(self) -> np.ndarray:
        """int64[4] (STATUS_WORDS), host memory the batch's finish_batch wrote: read after ``event``."""
        return self.status_area.host[: 8 * len(STATUS_WORDS)].view(np.int64)


def torch_stream(device_id: int) -> int | None:
    """Raw ``cudaStream_t`` of torch's current stream on ``device_id`` (None without CUDA torch)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.current_stream(device_id).cuda_stream)


class RawStream:
    """A stream CuPy does not own, by its raw ``cudaStream_t`` (0: the legacy default stream):
    what ``cupy.cuda.Event.record`` reads (``.ptr``). CuPy's ``ExternalStream`` is deprecated
    in CuPy 14 and ``Stream.from_external`` is not in 13."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __repr__(self) -> str:
        return f"consumer stream 0x{self.ptr:x}"


def _numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of a torch dtype of a column (``torch.uint8`` → ``uint8``: the names match
    for every dtype a :class:`~gearflow.replay.spec.TableSpec` column may have)."""
    return np.dtype(str(dtype).removeprefix("torch."))


class BufferSets:
    """The buffer sets of one :class:`~gearflow.native.device_replay.DeviceReplay`: allocated on
    ``device_id`` under ``on_device`` (``with on_device:`` enters the device and ``stream``),
    shaped by ``kind.layout(spec, B)``; ``consumer_stream()`` is the raw stream a release
    defaults to, and the one waited for before refilling a set that was handed out and never
    released (torch's current stream on the device, None without a CUDA consumer)."""

    def __init__(self, cupy: Any, device_id: int, on_device: Any, stream: Any, kind: Any, spec: Any,
                 consumer_stream: Callable[[], int | None]) -> None:  # fmt: skip
        self.cupy, self.device_id, self.on_device, self.stream = cupy, device_id, on_device, stream
        self.kind, self.spec, self.consumer_stream = kind, spec, consumer_stream
        self.sets: list[DeviceBuffers] = []
        self.retired: list[DeviceBuffers] = []  # replaced sets torch may still read (module docstring)
        self.key: tuple[int, int] = (-1, -1)  # (batch size, number of sets) of self.sets
        self._next = 0
        with cupy.cuda.Device(device_id):
            self._consumer_done = cupy.cuda.Event(disable_timing=True)  # reused: only the device waits on it
        self._consumer = RawStream(0)  # re-pointed per wait
        self._lock = threading.Lock()  # release() (the learner's thread) against a refill's wait (the sampler's)
        self.consumer_waits = 0  # refills that waited for torch's current stream (a consumer that never released)

    def stream_ptr(self, stream: Any) -> int | None:
        """Raw ``cudaStream_t`` of ``stream``: None → :attr:`consumer_stream`; a
        ``torch.cuda.Stream`` (``cuda_stream``), a CuPy stream (``ptr``) or an int."""
        if stream is None:
            return self.consumer_stream()
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)

    def release(self, out: DeviceBuffers, stream: Any = None) -> None:
        """The consumer has queued every read of the batch in ``out`` on ``stream`` (default:
        torch's current stream on the device): record that point, so the set is refilled only
        after the consumer's stream has passed it. One reused event per (set, stream); no wait."""
        ptr = self.stream_ptr(stream)
        if ptr is None:  # no CUDA consumer (CPU torch, the emulation without one)
            return
        with self._lock, self.cupy.cuda.Device(self.device_id):
            event = out.released.get(ptr)
            if event is None:
                event = out.released[ptr] = self.cupy.cuda.Event(disable_timing=True)
            event.record(RawStream(ptr))
            out.recorded.add(ptr)

    def wait_for_caller(self) -> bool:
        """Make the replay stream wait (device-side) for the work queued so far on torch's current
        stream; False without a CUDA consumer. Inside ``on_device``."""
        ptr = self.consumer_stream()
        if ptr is None:  # no CUDA consumer (CPU torch, the emulation): its code has already run
            return False
        self._consumer.ptr = ptr
        self._consumer_done.record(self._consumer)
        self.stream.wait_event(self._consumer_done)
        return True

    def _wait_for_release(self, out: DeviceBuffers) -> None:  # inside self.on_device
        """Order the stream after the consumers' recorded releases of ``out`` (then forget them)."""
        with self._lock:
            for ptr in sorted(out.recorded):
                self.stream.wait_event(out.released[ptr])
            out.recorded.clear()

    def _allocate(self, batch_size: int, num_sets: int) -> None:
        self.retired.extend(self.sets)  # kept until no consumer can still read them
        layout = self.kind.layout(self.spec, batch_size)
        cp, B = self.cupy, batch_size

        def pair(shape, dtype):
            a = cp.zeros(shape, dtype=dtype)
            return a, to_torch(a)

        def one() -> DeviceBuffers:
            draw = DeviceDraw(slots=cp.zeros(B, dtype=cp.int64), probs=cp.zeros(B, dtype=cp.float64),
                              parts=cp.zeros(B, dtype=cp.int64), starts=cp.zeros(B, dtype=cp.int64),
                              seqs=cp.zeros(B, dtype=cp.int64), lengths=cp.zeros(B, dtype=cp.int32),
                              flags=cp.zeros(B, dtype=cp.uint8))  # fmt: skip
            keys, weights, probs = pair(B, cp.int64), pair(B, cp.float32), pair(B, cp.float64)
            status = MappedArea(cp, 8 * len(STATUS_WORDS))
            fields = {**vars(draw), "keys": keys[0], "weights": weights[0], "probabilities": probs[0],
                      "status": status.device_ptr}  # fmt: skip
            return DeviceBuffers(
                data={n: pair(shape, _numpy_dtype(t)) for n, (shape, t) in layout.items()},
                keys=keys, weights=weights, probabilities=probs, draw=draw,
                desc=descriptor(cp, DRAW_FIELDS, fields), status_area=status,
                event=cp.cuda.Event(block=True, disable_timing=True), batch_size=B,
            )  # fmt: skip

        with self.on_device:
            self.sets = [one() for _ in range(num_sets)]
        self.key, self._next = (batch_size, num_sets), 0

    def next(self, batch_size: int, num_sets: int) -> DeviceBuffers:
        """The next of ``num_sets`` sets for batches of ``batch_size`` (allocated on a change, the
        old ones retired), after the stream waited for its releases (or, handed out and never
        released, for torch's current stream) and for the retired sets' releases."""
        if (batch_size, num_sets) != self.key:
            self._allocate(batch_size, num_sets)
        out = self.sets[self._next]
        self._next = (self._next + 1) % num_sets
        with self.on_device:
            with self._lock:
                unreleased = out.handed_out and not out.recorded
            if unreleased and self.wait_for_caller():
                self.consumer_waits += 1  # a consumer that reads on torch's stream without releasing
            self._wait_for_release(out)
            for old in self.retired:
                self._wait_for_release(old)
                old.retired_for += 1  # this sample waited for the consumer stream too
        out.handed_out = False
        return out

    def after_sync(self) -> None:
        """A sample synchronized (its stream had waited for the retired sets' consumers): retired
        sets that ``num_sets`` samples (a batch's life) have passed may go."""
        if self.retired:
            keep = max(1, self.key[1])
            gone = [old for old in self.retired if old.retired_for >= keep]
            self.retired = [old for old in self.retired if old.retired_for < keep]
            for old in gone:
                self._close(old)

    @staticmethod
    def _close(out: DeviceBuffers) -> None:
        out.status_area.close()

    def clear(self) -> None:
        """Drop every set (the sampler is closing; its stream has synchronized)."""
        for out in self.sets + self.retired:
            self._close(out)
        self.sets, self.retired, self.key = [], [], (-1, -1)
