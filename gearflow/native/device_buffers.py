"""The GPU sampler's output buffer sets and the consumer streams that release them.

A :class:`BufferSets` owns ``num_buffers`` preallocated :class:`DeviceBuffers` (CuPy arrays with
torch tensors over the same memory, made once per batch size) used in turn, and decides when a
set may be refilled: only after the replay stream has waited (device-side events, never a host
wait) for every :meth:`BufferSets.release` the consumer recorded on its own stream since the
set's last fill. :class:`~gearflow.native.device_replay.DeviceReplay` hands out the sets
(``buffers``/``release``) and, before each fill, makes its stream wait for torch's current
stream (the consumer that reads batches on the stream it samples from).

Sets replaced on a batch-size change are *retired*, not dropped: their release events are still
waited for, and they are let go only after ``num_buffers`` later samples have synchronized
(:meth:`BufferSets.after_sync`), so their CuPy memory never returns to the pool (and a later
allocation on this stream) while torch may still read it.

    sets = BufferSets(cupy, device_id, on_device, stream, kind, spec, consumer_stream)
    out = sets.next(256, 3)      # inside nothing: enters on_device itself; waits for out's releases
    ...                          # the sampler fills out on stream, synchronizes, then:
    sets.after_sync()
    sets.release(out, side_stream)   # the consumer: every read of out is queued on side_stream
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearflow.native.cuda_backend import to_torch

__all__ = ["BufferSets", "DeviceBuffers", "RawStream", "torch_stream"]


@dataclass
class DeviceBuffers:
    """One preallocated output set: name → (CuPy array, torch tensor over the same memory)."""

    data: dict[str, tuple[Any, Any]]  # the kind's layout: (B, ...) or (B, T, ...), mask, length
    keys: tuple[Any, Any]  # int64 (B,)
    weights: tuple[Any, Any]  # float32 (B,)
    probabilities: tuple[Any, Any]  # float64 (B,)
    # consumer stream (raw cudaStream_t) -> the reused event recorded there by release(); and the
    # streams whose event was recorded since this set's last fill (waited for before the next)
    released: dict[int, Any] = field(default_factory=dict)
    recorded: set[int] = field(default_factory=set)
    retired_for: int = 0  # samples synchronized since the set was replaced (batch-size change)


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
    """The output sets of one :class:`~gearflow.native.device_replay.DeviceReplay`: allocated on
    ``device_id`` under ``on_device`` (``with on_device:`` enters the device and ``stream``),
    shaped by ``kind.layout(spec, B)``; ``consumer_stream()`` is the raw stream a release
    defaults to (torch's current stream on the device, None without a CUDA consumer)."""

    def __init__(self, cupy: Any, device_id: int, on_device: Any, stream: Any, kind: Any, spec: Any,
                 consumer_stream: Callable[[], int | None]) -> None:  # fmt: skip
        self.cupy, self.device_id, self.on_device, self.stream = cupy, device_id, on_device, stream
        self.kind, self.spec, self.consumer_stream = kind, spec, consumer_stream
        self.sets: list[DeviceBuffers] = []
        self.retired: list[DeviceBuffers] = []  # replaced sets torch may still read (module docstring)
        self.key: tuple[int, int] = (-1, -1)  # (batch size, num_buffers) of self.sets
        self._next = 0

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
        with self.cupy.cuda.Device(self.device_id):
            event = out.released.get(ptr)
            if event is None:
                event = out.released[ptr] = self.cupy.cuda.Event(disable_timing=True)
            event.record(RawStream(ptr))
            out.recorded.add(ptr)

    def _wait_for_release(self, out: DeviceBuffers) -> None:  # inside self.on_device
        """Order the stream after the consumers' recorded releases of ``out`` (then forget them)."""
        for ptr in sorted(out.recorded):
            self.stream.wait_event(out.released[ptr])
        out.recorded.clear()

    def _allocate(self, batch_size: int, num_buffers: int) -> None:
        self.retired.extend(self.sets)  # kept until no consumer can still read them
        layout = self.kind.layout(self.spec, batch_size)
        cp = self.cupy

        def pair(shape, dtype):
            a = cp.zeros(shape, dtype=dtype)
            return a, to_torch(a)

        with self.on_device:
            self.sets = [
                DeviceBuffers(
                    data={n: pair(shape, _numpy_dtype(t)) for n, (shape, t) in layout.items()},
                    keys=pair(batch_size, cp.int64),
                    weights=pair(batch_size, cp.float32),
                    probabilities=pair(batch_size, cp.float64),
                )
                for _ in range(num_buffers)
            ]
        self.key, self._next = (batch_size, num_buffers), 0

    def next(self, batch_size: int, num_buffers: int) -> DeviceBuffers:
        """The next of ``num_buffers`` sets for batches of ``batch_size`` (allocated on a change,
        the old ones retired), after the stream waited for its releases and the retired sets'."""
        if (batch_size, num_buffers) != self.key:
            self._allocate(batch_size, num_buffers)
        out = self.sets[self._next]
        self._next = (self._next + 1) % num_buffers
        with self.on_device:
            self._wait_for_release(out)
            for old in self.retired:
                self._wait_for_release(old)
                old.retired_for += 1  # this sample waited for the consumer stream too (the draw)
        return out

    def after_sync(self) -> None:
        """A sample synchronized (its stream had waited for the retired sets' consumers): retired
        sets that ``num_buffers`` samples (a batch's life) have passed may go."""
        if self.retired:
            keep = max(1, self.key[1])
            self.retired = [old for old in self.retired if old.retired_for < keep]

    def clear(self) -> None:
        """Drop every set (the sampler is closing; its stream has synchronized)."""
        self.sets, self.retired, self.key = [], [], (-1, -1)
