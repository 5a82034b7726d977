"""The typed boundary of the native back ends (EnvPool's ``protocol.py``, Reverb's ``pybind.pyi``).

What crosses it, so that the Python side is written and tested against these
declarations on a CPU-only machine:

* :class:`CupyLike` — the slice of the CuPy module gearflow calls (``cuda.runtime``,
  ``RawModule``, ``asarray``...). It is injected (``DeviceReplay(cupy=...)``,
  ``CudaGather(cupy=...)``): tests hand in an emulation, production code
  :func:`~gearflow.native.require_cupy`'s module.
* :class:`DeviceSampler` — what :class:`~gearflow.replay.Table` calls on the device
  sampler it is handed (``Table(device=DeviceReplay(...))``; ``device="cuda"`` builds
  one): it holds the priority vector (the table's selector keeps only the live slots), follows
  every insert and removal, takes write-backs by key, and draws and gathers batches.
* :data:`DEVICE_SELECTORS` — the selectors the device path samples with (the one place
  that says so: config validation and ``resolve_replay_device`` read it).

Nothing here imports CuPy, pyverbs or torch.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from gearflow.replay.layout import PROPORTIONAL_SELECTORS

__all__ = ["DEVICE_SELECTORS", "CupyLike", "DeviceSampler"]

DEVICE_SELECTORS = PROPORTIONAL_SELECTORS  # replay.device=cuda samples with these (layout owns the set)


@runtime_checkable
class CupyLike(Protocol):
    """The CuPy module as gearflow uses it (arrays are ``cupy.ndarray``; streams are CUDA streams)."""

    cuda: Any  # .runtime (getDeviceCount, getDevice, hostRegister, memcpy), .Device, .Stream, .ExternalStream
    ndarray: type

    def RawModule(self, *, code: str, options: tuple = (), name_expressions: tuple = ()) -> Any: ...

    def asarray(self, a: Any, dtype: Any = None) -> Any: ...

    def zeros(self, shape: Any, dtype: Any = float) -> Any: ...

    def empty(self, shape: Any, dtype: Any = float) -> Any: ...


@runtime_checkable
class DeviceSampler(Protocol):
    """A table's device side (slots: the selector's; records: start, seq, length; the priorities)."""

    storage: Any  # the SharedStorage it gathers from (mapped into the device's address space)
    selector: Any  # the table's DeviceSelector (live slots, alpha, beta), handed over by the table
    device_id: int

    def insert(self, slots: np.ndarray, priorities: np.ndarray, starts: np.ndarray, seqs: np.ndarray,
               lengths: np.ndarray) -> None: ...  # fmt: skip

    def remove(self, slots: np.ndarray) -> None: ...

    def load(self, live: np.ndarray, starts: np.ndarray, seqs: np.ndarray, lengths: np.ndarray) -> None: ...

    def update_keys(self, keys: Any, priorities: Any) -> int: ...  # device or host arrays; no host sync for device ones

    def masses(self) -> np.ndarray: ...  # the priority vector (p ** alpha) read back: checkpoints

    def load_masses(self, masses: np.ndarray) -> None: ...

    def next_batch(self, batch_size: int, num_live: int, num_buffers: int) -> Any: ...  # a DeviceBuffers, waited for

    def bad_rows(self, out: Any) -> tuple[np.ndarray, np.ndarray]: ...  # (impossible, torn) positions

    def drawn_at(self, out: Any, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...  # slots, seqs

    def redraw(self, out: Any, positions: np.ndarray, num_live: int) -> None: ...

    def batch(self, out: Any) -> tuple: ...  # (data, keys, weights, probabilities) as torch tensors

    def release(self, out: Any, stream: Any = None) -> None: ...

    def close(self) -> None: ...
