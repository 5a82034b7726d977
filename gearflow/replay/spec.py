"""Table spec: the named, typed columns of one step.

    spec = TableSpec.parse({"obs": "uint8[4,84,84]", "action": "int64", "reward": "float32",
                            "done": "bool"})
    spec["obs"].nbytes       # 28224 bytes per step
    spec.check_batch({"obs": obs, ...}, n=64)   # ValueError naming the column on a mismatch

Storage is columnar (one array per column, one row per step), so the spec is
also the storage layout: column ``c`` is an array ``[rows, *c.row_shape]`` of
``c.dtype``.

Stacked frames: ``"obs": "uint8[4,84,84] stack=4"`` is a column whose items are
``uint8[4,84,84]`` (what the learner gets, exactly as before) but whose rows hold
one ``uint8[84,84]`` frame per step (``row_shape``, 7 KiB instead of 28 KiB).
Writers write only the newest frame of each step; a sample gathers the stack of
step t from rows t-3..t of the item's own episode, the episode's first frame
repeated before its start (what EnvPool's / AtariPreprocessing's stack shows).

    spec = TableSpec.parse({"obs": "uint8[4,84,84] stack=4", "action": "int64"})
    spec["obs"].shape, spec["obs"].row_shape, spec["obs"].nbytes   # (4, 84, 84) (84, 84) 7056
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from gearflow.errors import ConfigError

# dims: "[]" (a scalar) or comma-separated integers, e.g. "[4,84,84]" (a trailing comma is fine);
# "[4,,84]" or "[4 84]" are errors, not silently different shapes
_TYPE_RE = re.compile(
    r"^\s*([a-z0-9_]+)\s*(?:\[\s*((?:[0-9]+\s*,\s*)*(?:[0-9]+\s*,?)?)\s*\])?\s*(?:stack\s*=\s*([0-9]+))?\s*$"
)
MAX_STACK = 256  # a step's offset in its episode is stored as min(offset, MAX_STACK - 1) in one byte
SUPPORTED_DTYPES = frozenset(
    np.dtype(t)
    for t in (
        "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
        "float16", "float32", "float64",
    )
)  # fmt: skip


@dataclass(frozen=True)
class Column:
    """One column: ``name``, per-item ``shape`` and ``dtype``; ``stack`` > 1: a stacked-frame
    column (``shape[0] == stack``) whose rows hold one frame ``row_shape = shape[1:]`` per step."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    stack: int = 1

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of what one step stores (and a writer writes): one frame of a stacked column."""
        return self.shape[1:] if self.stack > 1 else self.shape

    @property
    def nbytes(self) -> int:
        """Bytes per step stored (one frame of a stacked column)."""
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def item_nbytes(self) -> int:
        """Bytes of the column in one step of a batch (the whole stack of a stacked column)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def describe(self) -> str:
        desc = f"{self.dtype.name}[{','.join(map(str, self.shape))}]"
        return f"{desc} stack={self.stack}" if self.stack > 1 else desc

    def shape_hint(self) -> str:
        """What a write of this column should look like, for error messages."""
        if self.stack <= 1:
            return ""
        return (f" (column {self.name!r} is stacked, stack={self.stack}: write only the newest frame "
                f"{list(self.row_shape)} of each step, e.g. obs[:, -1])")  # fmt: skip


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _typed(value: Any, column: "Column") -> np.ndarray:
    """Arrays and tensors as they are (their dtype is checked later); Python values and
    lists converted to the column's dtype when that loses nothing of their kind
    (1 → 1.0 is fine, 1.7 → int is not, 300 → uint8 is not)."""
    if isinstance(value, np.ndarray) or type(value).__module__.startswith("torch"):
        return _as_array(value)
    try:
        natural = np.asarray(value)
    except ValueError as exc:  # ragged lists
        raise ValueError(f"column {column.name!r}: cannot make an array of {value!r}: {exc}") from None
    both_int = natural.dtype.kind in "iu" and column.dtype.kind in "iu"  # range checked below
    flag = column.dtype == np.bool_ and natural.dtype.kind in "iu" and bool(np.isin(natural, (0, 1)).all())
    lossless = both_int or flag or np.can_cast(natural.dtype, column.dtype, "same_kind")
    if natural.dtype == object or not lossless:
        raise ValueError(
            f"column {column.name!r}: expected dtype {column.dtype.name}, got {natural.dtype.name} value(s)"
        )
    try:
        return np.asarray(value, dtype=column.dtype)
    except OverflowError:
        raise ValueError(f"column {column.name!r}: value out of range for {column.dtype.name}") from None


class TableSpec:
    """An ordered set of columns, validated on creation."""

    def __init__(self, columns: Iterable[Column]):
        cols = tuple(columns)
        if not cols:
            raise ValueError("a table spec needs at least one column")
        seen: set[str] = set()
        for c in cols:
            if not c.name.isidentifier():
                raise ValueError(f"column name {c.name!r} is not an identifier")
            if c.name in seen:
                raise ValueError(f"column {c.name!r} appears twice")
            if c.dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"column {c.name!r}: unsupported dtype {c.dtype}")
            if any((not isinstance(d, int)) or d < 1 for d in c.shape):
                raise ValueError(f"column {c.name!r}: shape {c.shape} must be positive ints")
            if isinstance(c.stack, bool) or not isinstance(c.stack, int) or not 1 <= c.stack <= MAX_STACK:
                raise ValueError(f"column {c.name!r}: stack must be an int in [1, {MAX_STACK}], got {c.stack!r}")
            if c.stack > 1 and (len(c.shape) < 2 or c.shape[0] != c.stack):
                raise ValueError(
                    f"column {c.name!r}: stack={c.stack} needs a shape [{c.stack}, ...] (the stacked "
                    f"frames first, then one frame's shape), got {list(c.shape)}"
                )
            seen.add(c.name)
        self.columns = cols
        self._by_name = {c.name: c for c in cols}

    # ------------------------------------------------------------------ building
    @classmethod
    def parse(cls, columns: Mapping[str, Any]) -> "TableSpec":
        """From ``{"obs": "uint8[4,84,84]", "action": "int64"}`` or ``{name: (shape, dtype)}``
        (``(shape, dtype, stack)`` or ``"uint8[4,84,84] stack=4"`` for a stacked-frame column)."""
        out = []
        for name, desc in columns.items():
            stack = 1
            if isinstance(desc, str):
                m = _TYPE_RE.match(desc)
                if not m:
                    raise ValueError(
                        f"column {name!r}: cannot parse type {desc!r} (e.g. 'uint8[4,84,84]' or "
                        "'uint8[4,84,84] stack=4')"
                    )
                dtype_name, dims, stack_s = m.groups()
                shape = tuple(int(d) for d in dims.split(",") if d.strip()) if dims else ()
                stack = int(stack_s) if stack_s is not None else 1
            else:
                if len(desc) == 3:
                    shape, dtype_name, stack = desc
                else:
                    shape, dtype_name = desc
                shape = tuple(int(d) for d in shape)
            try:
                dtype = np.dtype(dtype_name)
            except TypeError as exc:
                raise ValueError(f"column {name!r}: unknown dtype {dtype_name!r}") from exc
            out.append(Column(str(name), shape, dtype, stack))
        return cls(out)

    def to_dict(self) -> dict[str, str]:
        return {c.name: c.describe() for c in self.columns}

    # ------------------------------------------------------------------ access
    def __getitem__(self, name: str) -> Column:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TableSpec) and self.columns == other.columns

    def __repr__(self) -> str:
        return f"TableSpec({self.to_dict()})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def step_nbytes(self) -> int:
        """Bytes stored per step (one frame of each stacked column)."""
        return sum(c.nbytes for c in self.columns)

    @property
    def stored_step_nbytes(self) -> int:
        """Bytes a step takes in the segment: its rows, plus with stacked frames its offset byte."""
        return self.step_nbytes + (1 if self.stacked else 0)

    def with_frames(self, name: str) -> "TableSpec":
        """This spec with column ``name`` (stacked frames ``[k, *frame]``, k ≥ 2) stored as one
        frame per step (``stack=k``): the batches are the same, the rows a k-th of the size."""
        c = self[name]
        if len(c.shape) < 2 or c.shape[0] < 2:
            raise ValueError(
                f"column {name!r} is {c.describe()}: storing one frame per step needs stacked frames "
                "[k, ...] with k ≥ 2 (e.g. uint8[4,84,84])"
            )
        return TableSpec(Column(x.name, x.shape, x.dtype, x.shape[0]) if x.name == name else x for x in self.columns)

    @property
    def stacked(self) -> dict[str, int]:
        """``{column: stack}`` of the stacked-frame columns (empty for a plain spec)."""
        return {c.name: c.stack for c in self.columns if c.stack > 1}

    @property
    def stack_reach(self) -> int:
        """Steps before an item's first step that its stacks may read (``max stack - 1``)."""
        return max((c.stack for c in self.columns), default=1) - 1

    # ------------------------------------------------------------------ validation
    def check_batch(self, steps: Mapping[str, Any], n: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        """Validate ``n`` steps given as ``{column: array [n, *shape]}``.

        Arrays must have the column's exact dtype; Python numbers and lists are
        converted. Returns the arrays and ``n``. Raises ``ValueError`` naming the
        column with the expected and actual shape or dtype; nothing is written
        by callers until every column has passed.
        """
        if n is not None and len(steps) == len(self.columns):
            # fast path (the hot insert path): exact numpy arrays, nothing to convert
            for c in self.columns:
                a = steps.get(c.name)
                if type(a) is not np.ndarray or a.dtype != c.dtype or a.shape != (n, *c.row_shape):
                    break
            else:
                return steps, n  # read only by the callers
        missing = [c for c in self.names if c not in steps]
        extra = [k for k in steps if k not in self._by_name]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing column(s) {missing}")
            if extra:
                parts.append(f"unknown column(s) {extra}")
            raise ValueError(f"step does not match the table spec: {'; '.join(parts)}; spec is {self.to_dict()}")
        out: dict[str, np.ndarray] = {}
        for c in self.columns:
            value = steps[c.name]
            arr = _typed(value, c)
            if arr.dtype != c.dtype:
                raise ValueError(
                    f"column {c.name!r}: expected dtype {c.dtype.name}, got {arr.dtype.name}"
                )
            if n is None:
                n = arr.shape[0] if arr.ndim > len(c.row_shape) else -1
            if n < 0 or arr.shape != (n, *c.row_shape):
                expected = f"[{n if n is not None and n >= 0 else 'n'}, {', '.join(map(str, c.row_shape))}]"
                raise ValueError(
                    f"column {c.name!r}: expected shape {expected.replace(', ]', ']')}, "
                    f"got {list(arr.shape)}{c.shape_hint()}"
                )
            out[c.name] = arr
        assert n is not None
        return out, n

    def check_row(self, step: Mapping[str, Any]) -> list[Any]:
        """Validate one unbatched step; returns its values in column order, each ready to
        be stored in a row (``column_array[row] = value``). The same rules and errors as
        :meth:`check_step`, with no per-column array building for values that already
        have the column's exact dtype and shape (numpy arrays and scalars)."""
        cols = self.columns
        if len(step) == len(cols):
            row = []
            try:
                for c in cols:
                    v = step[c.name]
                    if (type(v) is np.ndarray or isinstance(v, np.generic)) and v.dtype == c.dtype and v.shape == c.row_shape:
                        row.append(v)
                    else:
                        break
                else:
                    return row
            except KeyError:
                pass
        checked = self.check_step(step)
        return [checked[c.name][0] for c in cols]

    def check_step(self, step: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Validate one unbatched step; returns arrays shaped ``[1, *shape]``."""
        batched = {}
        for k, v in step.items():
            c = self._by_name.get(k)
            arr = _typed(v, c) if c is not None else _as_array(v)
            if c is not None and arr.shape != c.row_shape:
                raise ValueError(
                    f"column {k!r}: expected shape {list(c.row_shape)}, got {list(arr.shape)}{c.shape_hint()}"
                )
            batched[k] = arr[None]
        return self.check_batch(batched, n=1)[0]


def replay_spec(columns: Mapping[str, Any], frame_stack: bool = False) -> TableSpec:
    """A run's table spec: the agent's ``replay_columns``; with ``replay.frame_stack`` its ``obs``
    column stored as one frame per step (:meth:`TableSpec.with_frames`). ConfigError when the
    obs is not stacked frames."""
    spec = TableSpec.parse(columns)
    if not frame_stack:
        return spec
    if "obs" not in spec:
        raise ConfigError(f"replay.frame_stack=true: the agent's replay columns {list(spec.names)} have no 'obs'")
    try:
        return spec.with_frames("obs")
    except ValueError as exc:
        raise ConfigError(f"replay.frame_stack=true: {exc}") from None
