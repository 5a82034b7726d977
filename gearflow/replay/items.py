"""The item interface: what an item's record (partition, start, length) turns into in a batch.

An item references consecutive steps of one partition; it never copies them. Its *kind*
(an :class:`ItemKind` subclass) decides which rows a sample gathers and the batch layout.
The kinds themselves live in :mod:`gearflow.kinds`, one module each with its adder and actor
(``gearflow/kinds/transition.py``, ``sequence.py``, ``episode.py``), named in one registry
(:mod:`gearflow.kinds.registry`); the replay core only calls the methods below.

Stacked-frame columns (``TableSpec`` ``stack=k``): a row holds one frame; the kinds
gather each step's stack from rows t-k+1..t of the item's own episode (the
episode's first frame repeated before its start), one index computation
(:func:`stack_rows`) and one ``index_select`` per output buffer, so the batch is
``[B, k, *frame]`` / ``[B, T, k, *frame]`` exactly as with whole stacks stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gearflow.replay.layout import step_rows
from gearflow.replay.spec import TableSpec

TORCH_DTYPES = {
    np.dtype(k): v
    for k, v in {
        "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
        "uint16": torch.uint16, "int32": torch.int32, "uint32": torch.uint32,
        "int64": torch.int64, "uint64": torch.uint64, "float16": torch.float16,
        "float32": torch.float32, "float64": torch.float64,
    }.items()
}  # fmt: skip

# torch only has "shell" support for uint16/32/64 (no index_select on 1-D, masked_fill,
# index_copy): gather those columns through a signed view of the same width, bit for bit.
_SIGNED_VIEW = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def gatherable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a same-width signed view of it where torch cannot index the dtype itself."""
    signed = _SIGNED_VIEW.get(t.dtype)
    return t if signed is None else t.view(signed)


_BACK: dict[int, np.ndarray] = {}


def stack_rows(parts: np.ndarray, steps: np.ndarray, depth: np.ndarray, k: int, S: int) -> np.ndarray:
    """Rows of the ``k``-frame stacks of absolute ``steps`` (int64, any shape, ``parts``
    broadcast against it): frame ``j`` of step t's stack is step ``t - min(k-1-j, depth)``,
    ``depth`` = t's offset in its episode (broadcast), so frames before the episode's start
    repeat its first frame. Returns int64 ``(*steps.shape, k)``, oldest frame first::

        stack_rows(np.array([0]), np.array([[5, 9]]), np.array([[1, 5]]), 4, 100)
        # [[[4, 4, 4, 5], [6, 7, 8, 9]]]: step 5 is its episode's step 1
    """
    back = _BACK.get(k)
    if back is None:
        back = _BACK[k] = np.arange(k - 1, -1, -1, dtype=np.int64)  # (k,) frames back, oldest first
    frames = steps[..., None] - np.minimum(back, depth[..., None])  # (..., k) absolute steps
    return step_rows(np.asarray(parts)[..., None], frames, S)


@dataclass(frozen=True)
class FrameStacks:
    """What a kind needs to gather stacked-frame columns: the storage's per-step offsets in
    their episodes (``uint8[P * S]``, capped at 255) and ``{column: k}``."""

    offsets: np.ndarray
    columns: dict

    @classmethod
    def of(cls, storage) -> "FrameStacks | None":
        """The stacks of a :class:`~gearflow.replay.storage.SharedStorage` (None without any)."""
        stacked = storage.spec.stacked
        return cls(storage.step_offset, stacked) if stacked else None

    def rows(self, parts: np.ndarray, first_rows: np.ndarray, steps: np.ndarray, rel: np.ndarray, S: int) -> dict:
        """``{column: int64 (*rel.shape, k)}``: stack rows of ``steps`` (each item's first step
        + ``rel``), the items' first steps at ``first_rows`` (shaped to broadcast with ``rel``)."""
        depth = self.offsets[first_rows].astype(np.int64) + rel  # each step's offset in its episode
        by_k: dict[int, np.ndarray] = {}
        out = {}
        for name, k in self.columns.items():
            if k not in by_k:
                by_k[k] = stack_rows(parts, steps, depth, k, S)
            out[name] = by_k[k]
        return out


def flat_index(rows: np.ndarray) -> torch.Tensor:
    """``rows`` (any shape) as one flat int64 tensor for ``index_select`` (a view where it can)."""
    return torch.from_numpy(np.ascontiguousarray(rows).reshape(-1))


class ItemKind:
    """Base: the batch layout and the gather of a kind (a frozen dataclass in its kind module).

    Besides the methods below, a kind may offer ``gather_on_device(cols, draw, data)``: the
    GPU gather of a batch (``replay.device=cuda``), called by
    :class:`~gearflow.native.device_replay.DeviceReplay` with a
    :class:`~gearflow.native.device_replay.DeviceColumns`; a kind without one (``None``) is
    refused there, with the reason, instead of being gathered as another kind.
    """

    name = "item"
    gather_on_device = None  # the device gather hook (see above), or None: CPU tables only

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ItemKind":
        """The kind :meth:`to_dict` wrote (without its ``kind`` entry)."""
        return cls(**d)

    def records_per_partition(self, steps_per_partition: int) -> int:
        """Item records a partition of ``steps_per_partition`` steps keeps, sized so that the
        step ring, not the record ring, decides eviction in the common case."""
        raise NotImplementedError(f"item kind {self.name!r} does not say how many records a partition keeps")

    def max_steps(self, steps_per_partition: int) -> int:
        """The most steps of one item this kind gathers (a longer item is cut at ingest, its first
        steps kept): a window's length; the ring's for kinds without a window."""
        return int(steps_per_partition)

    def layout(self, spec: TableSpec, batch_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def rows(self, parts: np.ndarray, starts: np.ndarray, lengths: np.ndarray, S: int) -> dict[str, np.ndarray]:
        """Storage rows to gather, keyed by which buffer group they fill."""
        raise NotImplementedError

    def gather(self, tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor], rows: dict[str, np.ndarray], lengths: np.ndarray) -> None:
        """Fill ``out`` from the storage ``tensors`` (only the columns ``tensors`` holds: a
        column left out is left to :meth:`wire_rows`)."""
        raise NotImplementedError

    def wire_rows(self, columns, rows: dict[str, np.ndarray], lengths: np.ndarray) -> dict[str, tuple[str, np.ndarray, np.ndarray | None]] | None:
        """Where each row of the outputs of storage ``columns`` comes from, for a reader that
        copies the storage's rows itself (the shard service writes them to the socket without
        a gather): ``{output: (column, flat storage rows (N,), zero (N,) bool or None)}``, the
        N rows of the output flattened over its leading item dimensions; a ``zero`` row is
        sent as zeros (padding). Stacked-frame columns are never listed (they are gathered as
        usual). None: this kind has no such map (every column is gathered)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError


def records_per_partition(kind: ItemKind, steps_per_partition: int) -> int:
    """Item records a partition's record ring holds for ``kind`` (:meth:`ItemKind.records_per_partition`),
    sized so that the step ring, not the record ring, decides eviction in the common case."""
    return int(kind.records_per_partition(int(steps_per_partition)))
