"""Item kinds: what an item's record (partition, start, length) turns into in a batch.

An item references consecutive steps of one partition; it never copies them.
The kind decides which rows a sample gathers and the batch layout:

* :class:`Transition` — n-step transition: every column at the first step,
  and ``next_<c>`` for the ``next_columns`` at the last step (the bootstrap
  step ``t + n``, or the final step of an episode that ended sooner). The
  frame at ``t + n`` is stored once, as its own step. Batch: ``[B, *shape]``.
* :class:`Sequence` — fixed-length window (R2D2: length 80, period 40, burn-in
  40). Batch: ``[B, T, *shape]`` plus ``mask`` ``[B, T]`` (False on padding, which
  is zero-filled), ``length`` ``[B]``.
* :class:`Episode` — a whole episode up to ``max_length`` steps, padded like a
  sequence.

Stacked-frame columns (``TableSpec`` ``stack=k``): a row holds one frame; the kinds
gather each step's stack from rows t-k+1..t of the item's own episode (the
episode's first frame repeated before its start), one index computation
(:func:`stack_rows`) and one ``index_select`` per output buffer, so the batch is
``[B, k, *frame]`` / ``[B, T, k, *frame]`` exactly as with whole stacks stored.

The writer side schedules sequence windows with :meth:`Sequence.due_on_append`
and :meth:`Sequence.due_at_end`: windows start every ``period`` steps of an
episode, never cross its boundary, and the short tail windows of an episode
are created at its end (padded by the gather, masked in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gearflow.replay.layout import step_rows
from gearflow.replay.spec import TableSpec

try:  # C row indices for sequence windows (setup.py builds it); numpy below is the reference
    from gearflow.replay import _hotpath
except ImportError:  # pragma: no cover - depends on the build
    _hotpath = None

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


def _flat_index(rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(rows).reshape(-1))


class ItemKind:
    """Base: the batch layout and the gather of a kind."""

    name = "item"

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


@dataclass(frozen=True)
class Transition(ItemKind):
    """n-step transitions; ``next_columns`` are also gathered at the item's last step."""

    next_columns: tuple[str, ...] = ("obs",)
    name = "transition"

    def layout(self, spec, batch_size):
        shapes = {c.name: ((batch_size, *c.shape), TORCH_DTYPES[c.dtype]) for c in spec}
        for name in self.next_columns:
            if name not in spec:
                raise ValueError(f"next column {name!r} is not in the table spec {spec.names}")
            shapes["next_" + name] = shapes[name]
        return shapes

    def rows(self, parts, starts, lengths, S, stacks=None):
        rows = {"first": step_rows(parts, starts, S), "last": step_rows(parts, starts + lengths - 1, S)}
        if stacks is not None:  # (2, B, k): the first step's stack, the last step's stack
            rel = np.stack([np.zeros_like(lengths), lengths - 1])  # (2, B) steps after the first
            rows["stacks"] = stacks.rows(parts, rows["first"][None, :], starts + rel, rel, S)
        return rows

    def gather(self, tensors, out, rows, lengths):
        first = torch.from_numpy(rows["first"])
        last = torch.from_numpy(rows["last"])
        stacks = rows.get("stacks") or {}
        for name, src in tensors.items():
            src, dst = gatherable(src), gatherable(out[name])
            if name in stacks:  # (B, k, *frame) as (B*k, *frame)
                torch.index_select(src, 0, _flat_index(stacks[name][0]), out=dst.view(-1, *src.shape[1:]))
            else:
                torch.index_select(src, 0, first, out=dst)  # (B, *shape)
        for name in self.next_columns:
            if name not in tensors:
                continue  # left to wire_rows
            src, dst = gatherable(tensors[name]), gatherable(out["next_" + name])
            if name in stacks:
                torch.index_select(src, 0, _flat_index(stacks[name][1]), out=dst.view(-1, *src.shape[1:]))
            else:
                torch.index_select(src, 0, last, out=dst)

    def wire_rows(self, columns, rows, lengths):
        stacked = rows.get("stacks") or {}
        out = {}
        for col in columns:
            if col in stacked:
                continue
            out[col] = (col, rows["first"], None)
            if col in self.next_columns:
                out["next_" + col] = (col, rows["last"], None)
        return out

    def to_dict(self):
        return {"kind": self.name, "next_columns": list(self.next_columns)}


@dataclass(frozen=True)
class Sequence(ItemKind):
    """Fixed-length windows of ``length`` steps, one starting every ``period`` steps."""

    length: int = 80
    period: int = 40
    burn_in: int = 0
    name = "sequence"

    def __post_init__(self):
        if self.length < 1 or self.period < 1:
            raise ValueError(f"sequence length and period must be ≥ 1, got {self.length}, {self.period}")
        if not 0 <= self.burn_in < self.length:
            raise ValueError(f"burn_in must be in [0, length), got {self.burn_in}")

    @property
    def max_length(self) -> int:
        return self.length

    def layout(self, spec, batch_size):
        T = self.max_length
        shapes = {c.name: ((batch_size, T, *c.shape), TORCH_DTYPES[c.dtype]) for c in spec}
        shapes["mask"] = ((batch_size, T), torch.bool)
        shapes["length"] = ((batch_size,), torch.int64)
        return shapes

    def rows(self, parts, starts, lengths, S, stacks=None):
        rows = self._window_rows(parts, starts, lengths, S)
        if stacks is not None:  # (B, T, k): each step's stack (padding repeats the last step's)
            rel = np.minimum(self._arange(self.max_length), (lengths - 1)[:, None])  # (B, T)
            p = np.asarray(parts)[:, None]
            rows["stacks"] = stacks.rows(p, rows["window"][:, :1], starts[:, None] + rel, rel, S)
        return rows

    def _window_rows(self, parts, starts, lengths, S):
        T = self.max_length
        if _hotpath is not None:
            rows = np.empty((len(parts), T), dtype=np.int64)
            _hotpath.window_rows(
                np.ascontiguousarray(parts, dtype=np.int64), np.ascontiguousarray(starts, dtype=np.int64),
                np.ascontiguousarray(lengths, dtype=np.int64), S, T, rows,
            )  # fmt: skip
            return {"window": rows}
        first = starts % S  # (B,)
        if (lengths == T).all() and (first <= S - T).all():  # common case: full windows, no ring wrap
            return {"window": (parts * S + first)[:, None] + self._arange(T)}  # step_rows without a wrap
        offs = np.minimum(self._arange(T), (lengths - 1)[:, None])  # (B, T): padding repeats the last step
        return {"window": step_rows(parts[:, None], starts[:, None] + offs, S)}

    def wire_rows(self, columns, rows, lengths):
        stacked = rows.get("stacks") or {}
        window = rows["window"]  # (B, T): padding repeats the last step's row
        B, T = window.shape
        zero = None
        if lengths.min() < T:
            zero = (self._arange(T)[None, :] >= lengths[:, None]).reshape(-1)
        flat = window.reshape(-1)
        return {col: (col, flat, zero) for col in columns if col not in stacked}

    def _arange(self, T: int) -> np.ndarray:
        cached = self.__dict__.get("_arange_cache")
        if cached is None or cached.size != T:
            cached = np.arange(T)
            object.__setattr__(self, "_arange_cache", cached)  # frozen dataclass: a private cache
        return cached

    def gather(self, tensors, out, rows, lengths):
        idx = torch.from_numpy(rows["window"].reshape(-1))  # (B*T,)
        B, T = rows["window"].shape
        padded = bool(lengths.min() < T)
        if padded:
            lens = torch.from_numpy(lengths.astype(np.int64))
            torch.lt(torch.arange(T), lens[:, None], out=out["mask"])  # (B, T)
            out["length"].copy_(lens)
        else:  # full windows: no per-element work
            out["mask"].fill_(True)
            out["length"].fill_(T)
        stacks = rows.get("stacks") or {}
        for name, src, flat, dst in self._plan(tensors, out, B, T):
            # (B*T, *shape) view of dst; a stacked column: (B*T*k, *frame), each step's stack rows
            torch.index_select(src, 0, _flat_index(stacks[name]) if name in stacks else idx, out=flat)
            if padded:
                dst.masked_fill_(~out["mask"].view(B, T, *([1] * (dst.dim() - 2))), 0)

    def _plan(self, tensors, out, B, T):
        """Per output buffer, once: (gatherable source, flat destination view, destination)."""
        plans = self.__dict__.get("_plans")
        if plans is None:
            plans = {}
            object.__setattr__(self, "_plans", plans)  # frozen dataclass: a private cache
        key = (id(tensors), id(out))
        plan = plans.get(key)
        if plan is None or plan[0] is not tensors or plan[1] is not out:
            steps = []
            for name, src in tensors.items():
                src, dst = gatherable(src), gatherable(out[name])
                steps.append((name, src, dst.view(-1, *src.shape[1:]), dst))
            plan = plans[key] = (tensors, out, steps)
        return plan[2]

    # writer-side schedule ------------------------------------------------
    def due_on_append(self, episode_length: int) -> list[int]:
        """Windows (as ``num_steps`` over the last steps) complete after this append."""
        L = episode_length
        return [self.length] if L >= self.length and (L - self.length) % self.period == 0 else []

    def due_at_end(self, episode_length: int) -> list[int]:
        """Tail windows created when the episode ends: each starts at a multiple of
        ``period``, runs to the episode's end and is shorter than ``length``. A tail
        window made only of burn-in is skipped, except the first window of an episode
        shorter than ``length`` (it has no earlier context to lose)."""
        L = episode_length
        out = []
        for start in range(0, L, self.period):
            n = L - start
            if n >= self.length:
                continue  # a full window, created on append
            if n > self.burn_in or start == 0:
                out.append(n)
        return out

    def to_dict(self):
        return {"kind": self.name, "length": self.length, "period": self.period, "burn_in": self.burn_in}


@dataclass(frozen=True)
class Episode(Sequence):
    """Whole episodes (items of up to ``max_episode_length`` steps), padded like sequences."""

    max_episode_length: int = 1000
    length: int = 0
    period: int = 1
    name = "episode"

    def __post_init__(self):
        if self.max_episode_length < 1:
            raise ValueError(f"max_episode_length must be ≥ 1, got {self.max_episode_length}")

    @property
    def max_length(self) -> int:
        return self.max_episode_length

    def due_on_append(self, episode_length):
        """An episode longer than ``max_episode_length`` is cut into chunks of that length."""
        T = self.max_episode_length
        return [T] if episode_length > 0 and episode_length % T == 0 else []

    def due_at_end(self, episode_length):
        rest = episode_length % self.max_episode_length
        return [rest] if rest else []

    def to_dict(self):
        return {"kind": self.name, "max_episode_length": self.max_episode_length}


def kind_from_dict(d: dict[str, Any]) -> ItemKind:
    d = dict(d)
    kind = d.pop("kind")
    if kind == "transition":
        return Transition(next_columns=tuple(d.get("next_columns", ("obs",))))
    if kind == "sequence":
        return Sequence(**d)
    if kind == "episode":
        return Episode(**d)
    raise ValueError(f"unknown item kind {kind!r}; expected transition, sequence or episode")


def records_per_partition(kind: ItemKind, steps_per_partition: int) -> int:
    """Item records a partition's record ring holds, sized so that the step ring, not the
    record ring, decides eviction in the common case.

    Transitions: one item per step. Episodes: at most one per step. Sequences: an
    episode of L steps creates ceil(L / period) windows, at most 2 per ``period`` steps
    when L ≥ period; episodes shorter than half a period can still lap the record ring
    first (their oldest windows are then evicted early, never served stale)."""
    S = int(steps_per_partition)
    if isinstance(kind, Episode) or not isinstance(kind, Sequence):
        return S + (0 if kind.name == "transition" else 2)
    return 2 * (S // max(1, kind.period)) + 2
