"""Gathers of item windows and rows out of replay storage: CPU references and the CUDA kernels.

Storage layout (``gearflow/replay/storage.py``): column ``c`` is a C-contiguous
array ``[P * S, *c.shape]`` of ``c.dtype``; step ``t`` of partition ``p`` is row
``p * S + t % S``. A row is ``row_bytes = prod(c.shape) * c.dtype.itemsize``
bytes, not necessarily a multiple of 16. An item is (partition ``p``, absolute
first step ``start``, ``length``); its window of ``T`` steps reads rows
``p * S + (start + j) % S`` for ``j < length`` (wrapping around the ring) and
is padded with zeros, ``mask[b, j] = j < length``, for ``length <= j < T``.

Stacked-frame columns (``stack=K``): a row is one frame, and the segment's
``step_offset`` block (``uint8[P * S]``) holds each step's offset in its episode
(capped at 255); the stack of step ``t`` is the frames of steps
``t - min(K-1-f, offset[t])``, ``f < K``, oldest first (:func:`gather_stacks`).

Two implementations with the same signatures:

* module functions :func:`gather_windows`, :func:`gather_rows` — the numpy
  references. ``src_base`` is the column (any dtype, rows on axis 0), outputs
  are numpy arrays (or CPU torch tensors).
* :class:`CudaGather` — the kernels of ``kernels/gather.cu``. ``src_base`` is the
  *device pointer* of the column's row 0 in host memory registered and mapped
  with :func:`gearflow.native.hostmem.register_host` (zero-copy: the GPU reads
  the shared-memory segment itself), and ``num_rows=`` bounds it. Outputs are
  device arrays (CuPy arrays or CUDA torch tensors). CuPy results reach torch
  without a copy through DLPack: :func:`gearflow.native.cuda_backend.to_torch`
  (``torch.from_dlpack``).

Example (GPU)::

    cupy = require_cupy("zero-copy replay gather")
    reg = register_storage(cupy, storage)                 # whole segment, mapped
    gather = CudaGather(cupy)
    obs = cupy.empty((B, T, 4, 84, 84), cupy.uint8)      # [B, T, row_bytes] bytes
    mask = cupy.empty((B, T), cupy.bool_)
    gather.gather_windows(reg.device_pointer(storage.column_offsets["obs"]), 28224, S,
                          parts, starts, lengths, T, obs, mask, num_rows=P * S)
    cupy.cuda.get_current_stream().synchronize()          # the gather is done ...
    bad = torn_items(parts, starts, storage.counters[:, RESERVE], S)   # ... now read RESERVE
    batch = to_torch(obs)                                  # torch.uint8 [B, T, 4, 84, 84], no copy

Seqlock: the gather only reads; whether a writer overwrote an item's steps
during the copy is decided afterwards from the partitions' RESERVE counters,
read *after* the gather has finished (:func:`torn_items`, the rule of
``Table.overwritten``). Torn items are replaced by the caller, never returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gearflow.native.cuda_backend import (
    DeviceArray,
    Kernels,
    check_device,
    check_int,
    device_array,
    grid_for,
    is_device_array,
    pow2_at_least,
    ptr_arg,
    stream_scope,
)
from gearflow.replay.layout import (  # torn_items: re-exported (the seqlock rule)
    step_rows,
    torn_items,
)

THREADS = 256  # threads per block of every gather kernel (GF_GATHER_THREADS in gather.cu)
WIDTHS = (16, 8, 4, 1)  # bytes per load/store of the kernel variants _v16, _v8, _v4, _v1
VARIANTS = {"windows": (*(f"v{w}" for w in WIDTHS), "va"), "rows": (*(f"v{w}" for w in WIDTHS), "va"),
            "stacks": tuple(f"v{w}" for w in WIDTHS)}  # fmt: skip
KERNELS = tuple(f"gather_{kind}_{v}" for kind, variants in VARIANTS.items() for v in variants)
PIECE = 8192  # bytes per work item of the rows/windows kernels (a longer row is several items)
ANY_MIN = 64  # rows from this many bytes take the _va variant when they are not all 16-byte aligned
INT32_MAX = 2**31 - 1

__all__ = [
    "CudaGather",
    "GatherPlan",
    "gather_rows",
    "gather_stacks",
    "gather_windows",
    "plan_gather",
    "torn_items",
    "transition_rows",
]


# ---------------------------------------------------------------------------- launch geometry
@dataclass(frozen=True)
class GatherPlan:
    """How a gather is launched (see the header of ``kernels/gather.cu``)."""

    kernel: str  # e.g. "gather_windows_v16"
    width: int  # bytes per load: 16, 8, 4 or 1 (_va: 16, at any alignment)
    units: int  # loads per row: ceil(row_bytes / width)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]  # (threads per work item, items per block, 1); product == THREADS
    piece: int = 0  # bytes per work item (rows/windows; a row of more is several items); 0: a whole row
    pieces: int = 1  # work items per row


def plan_gather(kind: str, row_bytes: int, rows: int, src_ptr: int, dst_ptr: int, piece: int | None = None) -> GatherPlan:
    """Kernel variant and launch geometry for ``rows`` output rows of ``row_bytes``.

    The load width is the widest of 16/8/4/1 bytes that divides the source
    base pointer, the destination pointer and ``row_bytes``: then every source
    and destination row starts aligned to it. Rows/windows of at least
    :data:`ANY_MIN` bytes that are not all 16-byte aligned take the ``_va``
    variant (16-byte loads from each row's first aligned byte, head and tail
    bytewise). Rows/windows are copied in pieces of ``piece`` bytes (default
    :data:`PIECE`; a multiple of the width, 16 for ``_va``), each a work item:
    more independent loads in flight over the host link for a few long rows.
    Threads per item: the power of two covering its units, at most 256; the
    rest of the block's 256 threads take further items.

    >>> plan_gather("rows", 28224, 256, 0x7f0000001000, 0x7e0000000200)   # 256 Atari rows: 1024 work items
    GatherPlan(kernel='gather_rows_v16', width=16, units=1764, grid=(1024, 1, 1), block=(256, 1, 1), piece=8192, pieces=4)
    >>> plan_gather("rows", 28225, 256, 0x7f0000001000, 0x7e0000000200).kernel   # rows at every offset mod 16
    'gather_rows_va'
    >>> plan_gather("rows", 12, 256, 4096, 512).block   # 3 units per row: 4 threads, 64 rows per block
    (4, 64, 1)
    """
    if kind not in VARIANTS:
        raise ValueError(f"kind must be 'windows', 'rows' or 'stacks', got {kind!r}")
    row_bytes = check_int("row_bytes", row_bytes, minimum=1)
    rows = check_int("rows", rows, minimum=0)
    width = next(w for w in WIDTHS if src_ptr % w == 0 and dst_ptr % w == 0 and row_bytes % w == 0)
    if kind == "stacks":  # a frame per work item (the stack kernel writes each read into K slots)
        units = row_bytes // width
        tx = pow2_at_least(units, THREADS)
        return GatherPlan(f"gather_{kind}_v{width}", width, units, grid_for(rows, THREADS // tx), (tx, THREADS // tx, 1))
    variant = f"v{width}"
    if width < 16 and row_bytes >= ANY_MIN:
        variant, width = "va", 16
    piece = PIECE if piece is None else check_int("piece", piece, minimum=1)
    if piece % width:
        raise ValueError(f"piece must be a multiple of the load width {width}, got {piece}")
    pieces = -(-row_bytes // piece)
    units = -(-row_bytes // width)
    tx = pow2_at_least(-(-min(piece, row_bytes) // width), THREADS)
    ty = THREADS // tx
    return GatherPlan(f"gather_{kind}_{variant}", width, units, grid_for(rows * pieces, ty), (tx, ty, 1), piece, pieces)


def stack_rows(T: int, K: int) -> int:
    """Source frames the stack kernel reads per window, at most: ``T + K - 1`` (each once, written
    into every slot that holds it), not ``T * K`` (once per slot).

    >>> stack_rows(80, 4), 80 * 4     # R2D2's 80-step windows of 4-frame stacks
    (83, 320)
    """
    return int(T) + int(K) - 1


def stack_frames_read(offsets, parts, starts, lengths, S: int, K: int) -> int:
    """Frames the stack kernel reads for these windows (host numpy): the distinct steps their
    stacks hold (what the benchmark counts as bytes over the host link)."""
    off = np.asarray(offsets)
    total = 0
    back = np.arange(K - 1, -1, -1, dtype=np.int64)
    for p, start, n in zip(np.asarray(parts), np.asarray(starts), np.asarray(lengths)):
        steps = int(start) + np.arange(max(int(n), 0), dtype=np.int64)
        depth = off[step_rows(int(p), steps, S)].astype(np.int64)
        total += len(np.unique(steps[:, None] - np.minimum(back, depth[:, None])))
    return total


# ---------------------------------------------------------------------------- index helpers
def transition_rows(parts, starts, lengths, S: int):
    """Rows of a transition's first and last step: ``(p*S + start % S, p*S + (start+length-1) % S)``.

    Works on numpy and CuPy arrays alike (int64 in, int64 out).
    """
    S = check_int("S", S, minimum=1)
    return step_rows(parts, starts, S), step_rows(parts, starts + lengths - 1, S)


def _host_index(x: Any, name: str, dtype, length: int | None) -> np.ndarray:
    """A host index array as a contiguous 1-D numpy array of ``dtype`` (integers only)."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if length is not None and a.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {a.shape}")
    return np.ascontiguousarray(a, dtype=dtype)


def _check_range(name: str, a: np.ndarray, low: int, high: int | None) -> None:
    """Every value of ``a`` in ``[low, high)`` (``high`` None: unbounded)."""
    if not a.size:
        return
    lo, hi = int(a.min()), int(a.max())
    if lo < low or (high is not None and hi >= high):
        bad = lo if lo < low else hi
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} holds {bad}, outside {bound}")


def _check_window_indices(parts, starts, lengths, T: int, S: int, num_parts: int | None) -> None:
    """Values of host index arrays of a window gather (device arrays are guarded in the kernel)."""
    if isinstance(parts, np.ndarray):
        _check_range("parts", parts, 0, num_parts)
    if isinstance(starts, np.ndarray):
        _check_range("starts", starts, 0, None)
    if isinstance(lengths, np.ndarray):
        _check_range("lengths", lengths, 0, min(T, S) + 1)


def _check_sizes(row_bytes, S, T) -> tuple[int, int, int]:
    row_bytes = check_int("row_bytes", row_bytes, minimum=1)
    S = check_int("S", S, minimum=1)
    T = check_int("T", T, minimum=1)
    if T > INT32_MAX:
        raise ValueError(f"T must be < 2**31, got {T}")
    return row_bytes, S, T


# ---------------------------------------------------------------------------- CPU references
def _host_out(x: Any, name: str) -> np.ndarray:
    """A writable, C-contiguous host output array (numpy array or CPU torch tensor), no copy."""
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be in host memory for the CPU reference, got a {x.device} tensor")
        x = x.numpy()
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name} must be a numpy array or CPU torch tensor, got {type(x).__name__}")  # noqa: TRY004 - argument errors are ValueErrors here
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError(f"{name} must be a writable C-contiguous array")
    return x


def _host_rows(src: Any, row_bytes: int, num_rows: int | None) -> np.ndarray:
    """The column ``src`` as bytes ``[rows, row_bytes]`` (a view)."""
    if type(src).__module__.startswith("torch"):
        src = src.numpy()
    if not isinstance(src, np.ndarray) or src.ndim < 1:
        raise ValueError(f"src_base must be the column as a numpy array for the CPU reference, got {type(src).__name__}")
    if not src.flags.c_contiguous:
        raise ValueError("src_base must be C-contiguous")
    rows = src.shape[0]
    if rows * row_bytes != src.nbytes:
        raise ValueError(
            f"row_bytes is {row_bytes} but src_base rows are {src.nbytes // max(rows, 1)} bytes "
            f"(shape {src.shape}, dtype {src.dtype})"
        )
    if num_rows is not None and check_int("num_rows", num_rows, minimum=1) != rows:
        raise ValueError(f"num_rows is {num_rows} but src_base has {rows} rows")
    return src.reshape(rows, -1).view(np.uint8).reshape(rows, row_bytes)


def _out_bytes(dst: np.ndarray, name: str, lead: tuple[int, ...], row_bytes: int) -> np.ndarray:
    """``dst`` (leading dims ``lead``, rows of ``row_bytes``) as bytes ``[prod(lead), row_bytes]``."""
    if tuple(dst.shape[: len(lead)]) != lead or dst.nbytes != int(np.prod(lead)) * row_bytes:
        raise ValueError(
            f"{name} must be a ({', '.join(map(str, lead))}, ...) array of {row_bytes}-byte rows, "
            f"got shape {dst.shape} of {dst.dtype} ({dst.nbytes} bytes)"
        )
    return dst.reshape(-1).view(np.uint8).reshape(int(np.prod(lead)), row_bytes)


def gather_windows(src_base, row_bytes, S, parts, starts, lengths, T, dst, mask, *, num_rows=None) -> None:
    """CPU reference: ``dst[b, j] = column row parts[b]*S + (starts[b]+j) % S`` for ``j < lengths[b]``,
    zeros after; ``mask[b, j] = j < lengths[b]``.

    src_base  the column, ``[P * S, *shape]`` (any dtype; ``row_bytes`` bytes per row)
    parts     int64[B] in [0, P);  starts int64[B] >= 0;  lengths int32[B] in [0, min(T, S)]
    dst       ``[B, T, ...]`` C-contiguous, ``B * T * row_bytes`` bytes;  mask bool[B, T]

    >>> col = np.arange(8, dtype=np.int32).reshape(8, 1)          # P=2 partitions of S=4 rows
    >>> out, m = np.empty((1, 3, 1), np.int32), np.empty((1, 3), bool)
    >>> gather_windows(col, 4, 4, np.array([1]), np.array([6]), np.array([2], np.int32), 3, out, m)
    >>> out[0, :, 0].tolist(), m[0].tolist()                      # steps 6, 7 of partition 1 = rows 6, 7
    ([6, 7, 0], [True, True, False])
    """
    row_bytes, S, T = _check_sizes(row_bytes, S, T)
    src = _host_rows(src_base, row_bytes, num_rows)
    if src.shape[0] % S:
        raise ValueError(f"src_base has {src.shape[0]} rows, not a multiple of S={S}")
    parts = _host_index(parts, "parts", np.int64, None)
    B = parts.shape[0]
    starts = _host_index(starts, "starts", np.int64, B)
    lengths = _host_index(lengths, "lengths", np.int32, B)
    _check_window_indices(parts, starts, lengths, T, S, src.shape[0] // S)
    out = _out_bytes(_host_out(dst, "dst"), "dst", (B, T), row_bytes)
    mask = _host_out(mask, "mask")
    if mask.dtype != np.bool_ or mask.shape != (B, T):
        raise ValueError(f"mask must be bool ({B}, {T}), got {mask.dtype} {mask.shape}")
    steps = np.arange(T, dtype=np.int64)
    rows = step_rows(parts[:, None], starts[:, None] + steps, S)  # (B, T)
    np.less(steps, lengths[:, None], out=mask)  # (B, T)
    np.take(src, rows.reshape(-1), axis=0, out=out)  # (B*T, row_bytes)
    out[~mask.reshape(-1)] = 0


def gather_rows(src_base, row_bytes, rows, dst, *, num_rows=None) -> None:
    """CPU reference: ``dst[i] = column row rows[i]``.

    src_base  the column ``[R, *shape]`` (``row_bytes`` bytes per row)
    rows      int64[N] in [0, R);  dst ``[N, ...]`` C-contiguous, ``N * row_bytes`` bytes

    Transitions: ``gather_rows(col, rb, first, obs)`` and ``gather_rows(col, rb, last, next_obs)``
    with ``first, last = transition_rows(parts, starts, lengths, S)``.
    """
    row_bytes = check_int("row_bytes", row_bytes, minimum=1)
    src = _host_rows(src_base, row_bytes, num_rows)
    rows = _host_index(rows, "rows", np.int64, None)
    _check_range("rows", rows, 0, src.shape[0])
    out = _out_bytes(_host_out(dst, "dst"), "dst", (rows.shape[0],), row_bytes)
    np.take(src, rows, axis=0, out=out)


def gather_stacks(src_base, row_bytes, S, K, offsets, parts, starts, lengths, T, dst, *, num_rows=None) -> None:
    """CPU reference: ``dst[b, j, f] = frame f of the K-frame stack of step starts[b] + j`` for
    ``j < lengths[b]``, zeros after. The stack of step ``t`` of partition ``p`` is the rows of
    steps ``t - min(K-1-f, offsets[p*S + t % S])`` (oldest first): an episode's first frame
    repeats before its start.

    src_base  the column ``[P * S, *frame]`` (``row_bytes`` bytes per frame)
    offsets   uint8[P * S]: each step's offset in its episode (the segment's step_offset)
    parts     int64[B] in [0, P);  starts int64[B] >= 0;  lengths int32[B] in [0, min(T, S)]
    dst       ``[B, T, K, ...]`` C-contiguous, ``B * T * K * row_bytes`` bytes

    A transition's ``obs``: ``T = 1`` and lengths 1; its ``next_obs``: starts ``starts + lengths - 1``.

    >>> col = np.arange(8, dtype=np.int32).reshape(8, 1)          # P=1 partition of S=8 frames
    >>> off = np.array([0, 1, 2, 0, 1, 2, 3, 4], np.uint8)         # episodes start at steps 0 and 3
    >>> out = np.empty((2, 1, 3, 1), np.int32)
    >>> gather_stacks(col, 4, 8, 3, off, np.array([0, 0]), np.array([4, 6]), np.array([1, 1], np.int32), 1, out)
    >>> out[:, 0, :, 0].tolist()                                    # step 4: [3, 3, 4]; step 6: [4, 5, 6]
    [[3, 3, 4], [4, 5, 6]]
    """
    row_bytes, S, T = _check_sizes(row_bytes, S, T)
    K = check_int("K", K, minimum=1)
    src = _host_rows(src_base, row_bytes, num_rows)
    if src.shape[0] % S:
        raise ValueError(f"src_base has {src.shape[0]} rows, not a multiple of S={S}")
    off = np.asarray(offsets)
    if off.dtype != np.uint8 or off.shape != (src.shape[0],):
        raise ValueError(f"offsets must be uint8[{src.shape[0]}] (one per row), got {off.dtype} {off.shape}")
    parts = _host_index(parts, "parts", np.int64, None)
    B = parts.shape[0]
    starts = _host_index(starts, "starts", np.int64, B)
    lengths = _host_index(lengths, "lengths", np.int32, B)
    _check_window_indices(parts, starts, lengths, T, S, src.shape[0] // S)
    out = _out_bytes(_host_out(dst, "dst"), "dst", (B, T, K), row_bytes)
    j = np.arange(T, dtype=np.int64)
    steps = starts[:, None] + j  # (B, T)
    depth = off[step_rows(parts[:, None], steps, S)].astype(np.int64)  # (B, T) each step's offset
    back = np.arange(K - 1, -1, -1, dtype=np.int64)  # (K,)
    frames = steps[..., None] - np.minimum(back, depth[..., None])  # (B, T, K)
    rows = step_rows(parts[:, None, None], frames, S)
    np.take(src, rows.reshape(-1), axis=0, out=out)  # (B*T*K, row_bytes)
    out.reshape(B, T, K, row_bytes)[~(j < lengths[:, None])] = 0


# ---------------------------------------------------------------------------- CUDA
def _check_pointer(name: str, ptr: Any) -> int:
    if is_device_array(ptr):
        raise ValueError(
            f"{name} must be a device pointer (int) into registered host memory, "
            f"e.g. HostRegistration.device_pointer(offset); got an array"
        )
    return check_int(name, ptr, minimum=1)


class CudaGather:
    """The gather kernels of ``kernels/gather.cu``, launched through an injected CuPy.

    ``cupy`` is the CuPy module (``require_cupy(...)``); ``module`` a compiled
    ``RawModule`` of ``gather.cu`` (default: compiled on first use with NVRTC).
    Methods have the signatures of the CPU references plus:

    * ``src_base`` is a device pointer (int) to row 0 of the column in mapped
      host memory, and ``num_rows=`` (the column's rows, ``P * S``) is required:
      the kernel refuses indices outside it.
    * index arrays may be host arrays (validated on the host, then uploaded on
      the stream) or device arrays of exactly the documented dtype (not
      validated: the kernel turns an item it cannot address into padding and
      a bad row into zeros, it never reads outside the column).
    * ``stream=``: a CuPy stream to queue on; default the current CuPy stream.
      Nothing synchronizes: the outputs are ready when that stream gets there.
    """

    def __init__(self, cupy: Any, module: Any = None) -> None:
        self.cupy = cupy
        self._kernels = Kernels(cupy, "gather", module)

    @property
    def module(self) -> Any:
        """The compiled ``RawModule`` (compiled on first use unless one was injected)."""
        return self._kernels.module

    def _index(self, x: Any, name: str, dtype, length: int | None) -> DeviceArray | np.ndarray:
        """A device index array (checked, not copied) or a host one (checked; uploaded later)."""
        if is_device_array(x):
            shape = None if length is None else (length,)
            return check_device(x, name, dtype=dtype, shape=shape, ndim=1)
        return _host_index(x, name, dtype, length)

    def _upload(self, x: DeviceArray | np.ndarray, name: str) -> DeviceArray:
        return x if isinstance(x, DeviceArray) else device_array(self.cupy.asarray(x), name)

    def gather_windows(
        self, src_base, row_bytes, S, parts, starts, lengths, T, dst, mask, *, num_rows=None, stream=None, piece=None
    ) -> GatherPlan | None:
        """Queue the window gather (see :func:`gather_windows`); returns the launch plan (None if B == 0).
        ``piece``: bytes per work item (:func:`plan_gather`)."""
        row_bytes, S, T = _check_sizes(row_bytes, S, T)
        src = _check_pointer("src_base", src_base)
        if num_rows is None:
            raise ValueError("num_rows is required: src_base is a bare pointer, the kernel bounds it by num_rows")
        num_rows = check_int("num_rows", num_rows, minimum=1)
        if num_rows % S:
            raise ValueError(f"num_rows={num_rows} is not a multiple of S={S}")
        parts = self._index(parts, "parts", np.int64, None)
        B = parts.shape[0]
        starts = self._index(starts, "starts", np.int64, B)
        lengths = self._index(lengths, "lengths", np.int32, B)
        _check_window_indices(parts, starts, lengths, T, S, num_rows // S)
        out = device_array(dst, "dst")
        if out.shape[:2] != (B, T) or out.nbytes != B * T * row_bytes:
            raise ValueError(
                f"dst must be a ({B}, {T}, ...) device array of {row_bytes}-byte rows, "
                f"got shape {out.shape} of {out.dtype} ({out.nbytes} bytes)"
            )
        if not out.contiguous:
            raise ValueError("dst must be C-contiguous")
        m = check_device(mask, "mask", dtype=np.bool_, shape=(B, T))
        if B == 0:
            return None
        plan = plan_gather("windows", row_bytes, B * T, src, out.ptr, piece)
        with stream_scope(stream):
            parts, starts, lengths = (
                self._upload(a, n) for a, n in ((parts, "parts"), (starts, "starts"), (lengths, "lengths"))
            )
            args = (
                ptr_arg(src), np.int64(row_bytes), np.int64(S), np.int64(num_rows // S),
                ptr_arg(parts.ptr), ptr_arg(starts.ptr), ptr_arg(lengths.ptr),
                np.int64(B), np.int32(T), ptr_arg(out.ptr), ptr_arg(m.ptr), np.int64(plan.piece),
            )  # fmt: skip
            self._kernels.launch(plan.kernel, plan.grid, plan.block, args)
        return plan

    def gather_rows(self, src_base, row_bytes, rows, dst, *, num_rows=None, stream=None, piece=None) -> GatherPlan | None:
        """Queue the row gather (see :func:`gather_rows`); returns the launch plan (None if N == 0).
        ``piece``: bytes per work item (:func:`plan_gather`)."""
        row_bytes = check_int("row_bytes", row_bytes, minimum=1)
        src = _check_pointer("src_base", src_base)
        if num_rows is None:
            raise ValueError("num_rows is required: src_base is a bare pointer, the kernel bounds it by num_rows")
        num_rows = check_int("num_rows", num_rows, minimum=1)
        rows = self._index(rows, "rows", np.int64, None)
        if isinstance(rows, np.ndarray):
            _check_range("rows", rows, 0, num_rows)
        N = rows.shape[0]
        out = device_array(dst, "dst")
        if out.shape[:1] != (N,) or out.nbytes != N * row_bytes:
            raise ValueError(
                f"dst must be a ({N}, ...) device array of {row_bytes}-byte rows, "
                f"got shape {out.shape} of {out.dtype} ({out.nbytes} bytes)"
            )
        if not out.contiguous:
            raise ValueError("dst must be C-contiguous")
        if N == 0:
            return None
        plan = plan_gather("rows", row_bytes, N, src, out.ptr, piece)
        with stream_scope(stream):
            rows = self._upload(rows, "rows")
            args = (
                ptr_arg(src), np.int64(row_bytes), np.int64(num_rows),
                ptr_arg(rows.ptr), np.int64(N), ptr_arg(out.ptr), np.int64(plan.piece),
            )  # fmt: skip
            self._kernels.launch(plan.kernel, plan.grid, plan.block, args)
        return plan

    def gather_stacks(
        self, src_base, row_bytes, S, K, offsets, parts, starts, lengths, T, dst, *, num_rows=None, stream=None
    ) -> GatherPlan | None:
        """Queue the stack gather (see :func:`gather_stacks`); ``offsets`` is the device pointer
        (int) of the segment's ``step_offset`` block. Returns the launch plan (None if B == 0)."""
        row_bytes, S, T = _check_sizes(row_bytes, S, T)
        K = check_int("K", K, minimum=1)
        src = _check_pointer("src_base", src_base)
        off = _check_pointer("offsets", offsets)
        if num_rows is None:
            raise ValueError("num_rows is required: src_base is a bare pointer, the kernel bounds it by num_rows")
        num_rows = check_int("num_rows", num_rows, minimum=1)
        if num_rows % S:
            raise ValueError(f"num_rows={num_rows} is not a multiple of S={S}")
        parts = self._index(parts, "parts", np.int64, None)
        B = parts.shape[0]
        starts = self._index(starts, "starts", np.int64, B)
        lengths = self._index(lengths, "lengths", np.int32, B)
        _check_window_indices(parts, starts, lengths, T, S, num_rows // S)
        out = device_array(dst, "dst")
        if out.shape[:3] != (B, T, K) or out.nbytes != B * T * K * row_bytes:
            raise ValueError(
                f"dst must be a ({B}, {T}, {K}, ...) device array of {row_bytes}-byte frames, "
                f"got shape {out.shape} of {out.dtype} ({out.nbytes} bytes)"
            )
        if not out.contiguous:
            raise ValueError("dst must be C-contiguous")
        if B == 0:
            return None
        plan = plan_gather("stacks", row_bytes, B * stack_rows(T, K), src, out.ptr)  # a frame read once per window
        with stream_scope(stream):
            parts, starts, lengths = (
                self._upload(a, n) for a, n in ((parts, "parts"), (starts, "starts"), (lengths, "lengths"))
            )
            args = (
                ptr_arg(src), np.int64(row_bytes), np.int64(S), np.int64(num_rows // S), ptr_arg(off),
                np.int64(K), ptr_arg(parts.ptr), ptr_arg(starts.ptr), ptr_arg(lengths.ptr),
                np.int64(B), np.int32(T), ptr_arg(out.ptr),
            )  # fmt: skip
            self._kernels.launch(plan.kernel, plan.grid, plan.block, args)
        return plan
