"""What the CuPy kernel wrappers share: loading the ``.cu`` sources, reading
device arrays, launching, and handing results to torch.

Nothing here imports CuPy. The ``cupy`` module is passed in by the caller
(``gearflow.native.require_cupy(purpose)`` returns it), and so is the compiled
``RawModule`` when a caller or a test wants to supply its own; so the Python
logic around the kernels runs on a CPU-only machine with a stand-in module.

Device arrays are read through the CUDA Array Interface
(``__cuda_array_interface__``), which CuPy arrays, torch CUDA tensors and Numba
arrays all expose: a wrapper accepts any of them without a copy, and passes
raw pointers to the kernels. Results come back as CuPy arrays; :func:`to_torch`
turns one into a torch tensor over the same memory (DLPack)::

    cupy = require_cupy("GPU replay")
    module = load_module(cupy, "gather")          # compiled once per device (NVRTC)
    batch = cupy.empty((256, 4, 84, 84), cupy.uint8)
    ...                                             # a kernel fills it
    obs = to_torch(batch)                           # torch.uint8 (256, 4, 84, 84), same memory
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

MAX_GRID_X = 65535  # grid-stride kernels: more blocks than this only add scheduling work

_modules: dict[tuple[int, str, int], Any] = {}
_modules_lock = threading.Lock()


def kernel_source(name: str) -> str:
    """Text of ``kernels/<name>.cu``."""
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in KERNEL_DIR.glob("*.cu")))
        raise ValueError(f"no kernel source {name!r} in {KERNEL_DIR} (have: {known})")
    return path.read_text()


def load_module(cupy: Any, name: str, *, options: tuple[str, ...] = ()) -> Any:
    """``cupy.RawModule`` of ``kernels/<name>.cu``, compiled (NVRTC) once per process and device."""
    device = int(cupy.cuda.runtime.getDevice())
    key = (id(cupy), name, device)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            module = cupy.RawModule(code=kernel_source(name), options=tuple(options))
            _modules[key] = module
    return module


@dataclass(frozen=True)
class DeviceArray:
    """What a wrapper needs to know about a device array (from ``__cuda_array_interface__``)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    contiguous: bool  # C-contiguous
    obj: Any  # the array itself: kept referenced until the launch is queued

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def is_device_array(obj: Any) -> bool:
    """A CUDA torch tensor (asked directly: its interface raises for one that requires grad) or
    anything with ``__cuda_array_interface__`` (CuPy arrays, Numba's)."""
    if type(obj).__module__.startswith("torch") and hasattr(obj, "is_cuda"):
        return bool(obj.is_cuda)
    return hasattr(obj, "__cuda_array_interface__")


def device_array(obj: Any, name: str) -> DeviceArray:
    """Read ``obj``'s CUDA Array Interface; ValueError naming ``name`` when it has none."""
    try:
        iface = obj.__cuda_array_interface__
    except AttributeError:
        raise ValueError(
            f"{name} must be a device array (CuPy array or CUDA torch tensor), got {type(obj).__name__}"
        ) from None
    shape = tuple(int(s) for s in iface["shape"])
    dtype = np.dtype(iface["typestr"])
    strides = iface.get("strides")
    contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize)
    ptr = int(iface["data"][0])
    return DeviceArray(ptr, shape, dtype, contiguous, obj)


def dptr(obj: Any) -> int:
    """Device address of a device array's first element."""
    return int(obj.__cuda_array_interface__["data"][0])


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def check_device(
    obj: Any,
    name: str,
    *,
    dtype: Any = None,
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
) -> DeviceArray:
    """A C-contiguous device array of ``dtype`` and ``shape`` (``-1`` matches any size)."""
    arr = device_array(obj, name)
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {arr.dtype}")
    if ndim is not None and len(arr.shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if shape is not None and (
        len(arr.shape) != len(shape) or any(w not in (-1, s) for s, w in zip(arr.shape, shape))
    ):
        want = "(" + ", ".join("*" if w == -1 else str(w) for w in shape) + ")"
        raise ValueError(f"{name} must have shape {want}, got {arr.shape}")
    if not arr.contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return arr


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """An exact integer (bool rejected), at least ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004 - argument errors are ValueErrors here
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_float(name: str, value: Any, *, minimum: float | None = None) -> float:
    """A finite float, at least ``minimum``."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not np.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" and >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be finite{bound}, got {value}")
    return value


def pow2_at_least(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most ``cap`` (and at least 1)."""
    p = 1
    while p < n and p < cap:
        p <<= 1
    return p


def grid_for(items: int, per_block: int) -> tuple[int, int, int]:
    """1-D grid covering ``items`` at ``per_block`` per block, capped (kernels grid-stride)."""
    return (max(1, min(-(-items // per_block), MAX_GRID_X)), 1, 1)


def ptr_arg(ptr: int) -> np.uint64:
    """A pointer as a kernel argument (8 bytes)."""
    return np.uint64(ptr)


def stream_scope(stream: Any):
    """``with stream:`` when a stream is given, else the caller's current CuPy stream."""
    return stream if stream is not None else contextlib.nullcontext()


class Kernels:
    """The kernels of one ``kernels/<source>.cu``: the module compiled on first use (or the one
    injected), its functions looked up once, launches queued on the current CuPy stream."""

    def __init__(self, cupy: Any, source: str, module: Any = None) -> None:
        self.cupy, self.source = cupy, source
        self._module = module
        self._functions: dict[str, Any] = {}

    @property
    def module(self) -> Any:
        if self._module is None:
            self._module = load_module(self.cupy, self.source)
        return self._module

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple) -> None:
        """Queue kernel ``name`` (``with stream_scope(...)`` picks the stream)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self.module.get_function(name)
        fn(grid, block, args)


def to_torch(array: Any):
    """A torch tensor over the same device memory as ``array`` (DLPack: no copy).

    ``torch.from_dlpack`` hands torch's current stream to ``array.__dlpack__``,
    and the producer (CuPy) makes that stream wait for the work queued on its
    own current stream, so the tensor is safe to use on torch's stream without
    a host synchronization. The tensor keeps ``array``'s memory alive.
    """
    import torch

    return torch.from_dlpack(array)
