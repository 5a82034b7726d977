"""A priority write-back's inputs, for :class:`~gearflow.native.device_replay.DeviceReplay`:
device or host arrays, checked where they are (:meth:`WriteBackInputs.prepare`,
:meth:`~WriteBackInputs.pointer`), device ones waited for on the device
(:meth:`~WriteBackInputs.wait_for_caller`: the replay stream waits for the caller's stream, the
host never), and kept allocated until the replay stream has read them
(:meth:`~WriteBackInputs.keep_alive`: torch tensors through ``record_stream``, other arrays
until an event after them has passed). No host sync anywhere."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from gearflow.native.cuda_backend import check_device, dptr, is_device_array
from gearflow.native.device_buffers import RawStream

__all__ = ["WriteBackInputs"]


class WriteBackInputs:
    """The write-back inputs of one replay on GPU ``device_id`` whose work runs on ``stream`` (a
    CuPy stream); ``consumer_stream()``: the caller's raw ``cudaStream_t`` (None: nothing to wait for)."""

    def __init__(self, cupy: Any, device_id: int, stream: Any, consumer_stream: Callable[[], int | None]):
        self.cupy, self.device_id, self.stream, self._consumer_stream = cupy, device_id, stream, consumer_stream
        self._caller_done = cupy.cuda.Event(disable_timing=True)  # a write-back's inputs are ready
        self._caller = RawStream(0)
        self._keep: deque = deque()  # (event, inputs) of write-backs whose inputs the stream may still read
        self._free_events: list = []  # their events, reused
        self._ext_stream = None  # torch's view of the stream (record_stream of write-back inputs)

    def prepare(self, keys: Any, priorities: Any) -> tuple[int, bool, Callable[[], tuple[int, int, tuple]]]:
        """A write-back's keys (int64) and priorities (float32 or float64), checked where they are:
        ``(entries, priorities are float32, stage)``; ``stage()``, called on the replay's device
        in the replay's order, makes them readable by the stream and returns (keys pointer,
        priorities pointer, what to :meth:`keep_alive`). Device arrays (CUDA torch tensors, CuPy
        arrays) are read where they are once the stream waited for the caller's stream (no host
        sync); host arrays are uploaded (from pageable memory: a wait for the stream, the host
        path, not the learner's). ValueError: other lengths, dtypes, devices, or a mix."""
        if is_device_array(keys) or is_device_array(priorities):
            k_ptr, K, _, k_keep = self.pointer(keys, "keys", (np.int64,))
            p_ptr, n, p_dtype, p_keep = self.pointer(priorities, "priorities", (np.float32, np.float64))

            def stage() -> tuple[int, int, tuple]:
                self.wait_for_caller()
                return k_ptr, p_ptr, (k_keep, p_keep)
        else:
            k_host = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
            p_host = np.asarray(priorities).reshape(-1)
            if p_host.dtype not in (np.float32, np.float64):
                p_host = p_host.astype(np.float64)
            K, n, p_dtype = k_host.size, p_host.size, p_host.dtype

            def stage() -> tuple[int, int, tuple]:
                k_dev, p_dev = self.cupy.asarray(k_host), self.cupy.asarray(np.ascontiguousarray(p_host))
                return dptr(k_dev), dptr(p_dev), (k_dev, p_dev)
        if K != n:
            raise ValueError(f"{K} keys but {n} priorities")
        return K, p_dtype == np.float32, stage

    def pointer(self, x: Any, name: str, dtypes: tuple) -> tuple[int, int, np.dtype, Any]:
        """(device pointer, length, dtype, what to keep alive) of a 1-D contiguous device array on this device."""
        if type(x).__module__.startswith("torch"):
            if not x.is_cuda:
                raise ValueError(f"{name} and the other argument must both be CUDA tensors or both host arrays")
            if x.device.index != self.device_id:
                raise ValueError(f"{name} is on {x.device}, the replay on cuda:{self.device_id}")
            x = x.detach().reshape(-1)  # a view where it can be; otherwise a copy queued on torch's stream
            if x.dtype.is_floating_point and x.element_size() < 4:  # bf16 / fp16 priorities
                x = x.float()
            x = x.contiguous()
            dtype = np.dtype(str(x.dtype).removeprefix("torch."))
            ptr, n = x.data_ptr(), x.numel()
        else:
            if not is_device_array(x):
                raise ValueError(f"{name} and the other argument must both be device arrays or both host arrays")
            a = check_device(x, name, ndim=1)
            ptr, n, dtype = a.ptr, a.shape[0], a.dtype
        if dtype not in [np.dtype(d) for d in dtypes]:
            raise ValueError(f"{name} must be {' or '.join(str(np.dtype(d)) for d in dtypes)}, got {dtype}")
        return ptr, n, dtype, x

    def wait_for_caller(self) -> None:  # on the replay's device
        """The replay stream waits (device-side) for the work queued so far on the caller's
        stream: a write-back's device inputs are written there."""
        ptr = self._consumer_stream()
        if ptr is not None:
            self._caller.ptr = ptr
            self._caller_done.record(self._caller)
            self.stream.wait_event(self._caller_done)

    def keep_alive(self, *inputs: Any) -> None:  # on the replay's device
        """Write-back inputs stay allocated until the replay stream has read them: torch tensors
        through ``record_stream`` on torch's view of the stream (no host wait); other arrays are
        held until an event after them has passed (checked at the next write-backs)."""
        rest = []
        for x in inputs:
            if type(x).__module__.startswith("torch") and x.is_cuda:
                x.record_stream(self._torch_stream())
            else:
                rest.append(x)
        while self._keep and self._keep[0][0].done:
            self._free_events.append(self._keep.popleft()[0])
        if rest:
            event = self._free_events.pop() if self._free_events else self.cupy.cuda.Event(disable_timing=True)
            event.record(self.stream)
            self._keep.append((event, rest))

    def clear(self) -> None:
        """Drop what is held (the stream has been synchronized: nothing reads it any more)."""
        self._keep.clear()

    def _torch_stream(self) -> Any:
        if self._ext_stream is None:
            import torch

            self._ext_stream = torch.cuda.ExternalStream(self.stream.ptr, device=self.device_id)
        return self._ext_stream
