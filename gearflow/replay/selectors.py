"""Item selectors: which slots of a replay table the next sample returns.

Roles
-----
A replay *table* owns ``capacity`` item slots, numbered ``0 .. capacity-1``, and
stores the items themselves. A *selector* owns only the per-slot state needed to
choose among them (liveness, priority, insertion order) and answers a single
question: which slots go into the next batch? The table reports every change
(``insert``, ``remove``, ``update``) and asks for batches with ``sample``.

Every method takes a whole batch as numpy arrays and does its work in a fixed
number of vectorised numpy calls: there is no Python loop over items. Arguments
are validated before any state changes, so a rejected call leaves the selector
exactly as it was.

Kinds (see :func:`make_selector`):

* ``uniform``: every live slot equally likely, with replacement.
* ``prioritized``: proportional prioritized replay over a wide-fanout sum tree.
* ``fifo`` / ``lifo``: the oldest / newest live items.
* ``max_heap`` / ``min_heap``: the highest / lowest priority live items.
* ``top_k``: uniform with replacement among the ``k`` highest priority items.

Example
-------
>>> import numpy as np
>>> sel = make_selector("prioritized", capacity=8, seed=0, alpha=1.0, beta=1.0)
>>> sel.insert(np.array([0, 1, 2]), np.array([1.0, 3.0, 0.0]), order=np.arange(3))
>>> len(sel)
3
>>> batch = sel.sample(4)
>>> sorted(set(batch.slots.tolist()))  # slot 2 has zero priority: never picked
[0, 1]
>>> {int(s): float(p) for s, p in zip(batch.slots, batch.probabilities)}
{0: 0.25, 1: 0.75}
>>> sel.update(np.array([2]), np.array([4.0]))  # now slot 2 holds half the mass
>>> sel.beta = 0.5  # learners anneal beta between calls
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

try:  # the C descent/update (setup.py builds it); the numpy code below is the reference
    from gearflow.replay import _hotpath
except ImportError:  # pragma: no cover - depends on the build
    _hotpath = None

_TORCH_DTYPES: tuple = ()  # (int64, float32, float64) once a tensor was seen: this module does not import torch

__all__ = [
    "SELECTORS",
    "selector_kwargs",
    "FifoSelector",
    "KeyIndex",
    "LifoSelector",
    "MaxHeapSelector",
    "MinHeapSelector",
    "PrioritizedSelector",
    "Selection",
    "Selector",
    "SumTree",
    "TopKSelector",
    "UniformSelector",
    "check_priorities",
    "make_selector",
]

StateDict = dict[str, Any]


@dataclass(frozen=True)
class KeyIndex:
    """How a table maps item keys to slots, for :meth:`Selector.update_by_key`: key
    ``seq * P + p`` lives in slot ``p * R + seq % R`` while ``slot_live[slot]`` and
    ``slot_rec[slot, 1] == seq`` (the table's own arrays, viewed, not copied)."""

    P: int
    R: int
    slot_rec: np.ndarray  # int64 [P * R, 3]: start, seq, length
    slot_live: np.ndarray  # bool [P * R]

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each int64 key, or -1 where the table no longer holds that item."""
        if _hotpath is None:  # the reference
            seq = keys // self.P
            slots = (keys % self.P) * self.R + seq % self.R
            ok = (keys >= 0) & self.slot_live[slots] & (self.slot_rec[slots, 1] == seq)
            return np.where(ok, slots, -1)
        out = np.empty(keys.size, np.int64)
        _hotpath.key_slots(keys, self.P, self.R, self.slot_rec, self.slot_live, out)
        return out


@dataclass
class Selection:
    """One sampled batch.

    ``probabilities[i]`` is the probability that draw ``i`` picks ``slots[i]``;
    ``weights`` are importance-sampling weights (all 1.0 unless prioritized).
    """

    slots: np.ndarray  # (B,) int64
    probabilities: np.ndarray  # (B,) float64
    weights: np.ndarray  # (B,) float32
    # probabilities[i] = mass_i / total at the draw (prioritized: the tree's total mass;
    # uniform: the live count with mass 1); None where probabilities are not proportional
    total: float | None = None


def _unique_sorted(values: np.ndarray) -> np.ndarray:
    """Drop repeats from an already sorted 1-D array in O(n) (no sort)."""
    if len(values) < 2:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


def _last_wins(slots: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """Sorted unique ``slots`` with, for each repeated slot, its last value in ``columns``."""
    # np.unique sorts stably when asked for indices, so the first hit in the
    # reversed array is the last occurrence in the original one.
    unique, first_reversed = np.unique(slots[::-1], return_index=True)
    last = len(slots) - 1 - first_reversed
    return (unique, *(column[last] for column in columns))


def _encode_rng(rng: np.random.Generator) -> np.ndarray:
    """Bit-generator state as a uint8 array of JSON (big integers survive as text)."""
    text = json.dumps(rng.bit_generator.state)
    return np.frombuffer(text.encode(), dtype=np.uint8).copy()


def _decode_rng(encoded: np.ndarray) -> dict[str, Any]:
    return json.loads(np.asarray(encoded, dtype=np.uint8).tobytes().decode())


def check_priorities(priorities: np.ndarray) -> None:
    """The one priority rule (writers, the table, selectors): finite and ≥ 0.
    Raises ValueError naming the first bad value and its index."""
    bad = ~np.isfinite(priorities) | (priorities < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"priority must be finite and ≥ 0, got {float(priorities[i])!r} at index {i} "
            f"({int(bad.sum())} bad of {priorities.size})"
        )


def _check_positive_int(name: str, value: int) -> int:
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _check_non_negative(name: str, value: float) -> float:
    value = float(value)
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


class Selector:
    """Base class: liveness bookkeeping, validation, sampling entry point and state.

    The live slots are kept densely packed in ``_live_slots[:len(self)]`` with
    ``_position`` mapping each slot to its index there (-1 when dead), so that
    insert/remove cost O(batch) and a uniform draw over live slots is one gather.
    Subclasses implement ``_sample`` and may override the storage hooks
    ``_set_priorities``, ``_set_order`` and ``_forget``.
    """

    name: str = ""
    # constructor keyword → the ``replay`` config field that gives it (the one place the
    # config's selector arguments are named); see :func:`selector_kwargs`
    config_args: dict[str, str] = {}
    importance_sampled = False  # True: samples carry IS weights with an exponent ``beta`` learners anneal

    def __init__(self, capacity: int, *, seed: int | None = None) -> None:
        self.capacity = _check_positive_int("capacity", capacity)
        self._rng = np.random.default_rng(seed)
        self._position = np.full(self.capacity, -1, dtype=np.int64)  # (capacity,)
        self._live_slots = np.zeros(self.capacity, dtype=np.int64)  # (capacity,)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, live={self._count})"

    @property
    def live_slots(self) -> np.ndarray:
        """The live slots, densely packed, in no particular order: int64 (len(self),), a view
        valid until the next insert or remove (the device sampler's all-zero uniform draw)."""
        return self._live_slots[: self._count]

    # -- public API ---------------------------------------------------------

    def insert(self, slots: np.ndarray, priorities: np.ndarray, order: np.ndarray) -> None:
        """Make ``slots`` live with raw ``priorities`` and insertion sequence numbers ``order``.

        A slot that is already live is replaced; a slot repeated in the call
        takes its last values.
        """
        slots = self._check_slots(slots)
        priorities = self._check_priorities(priorities, len(slots))
        order = np.asarray(order)
        if order.shape != slots.shape or (order.size and order.dtype.kind not in "iu"):
            raise ValueError(
                f"order must be integers of the same shape as slots {slots.shape}, "
                f"got shape {order.shape} and dtype {order.dtype}"
            )
        slots, priorities, order = _last_wins(slots, priorities, order.astype(np.int64))
        self._make_live(slots)
        self._set_priorities(slots, priorities)
        self._set_order(slots, order)

    def remove(self, slots: np.ndarray) -> None:
        """Make ``slots`` dead (evicted). Removing a dead slot is a no-op."""
        slots = np.unique(self._check_slots(slots))
        slots = slots[self._position[slots] >= 0]
        self._make_dead(slots)
        self._forget(slots)

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Set new raw priorities for live slots; for a repeated slot the last one wins."""
        slots = self._check_slots(slots)
        priorities = self._check_priorities(priorities, len(slots))
        dead = self._position[slots] < 0
        if dead.any():
            raise ValueError(f"cannot update slot {slots[dead][0]}: it is not live")
        slots, priorities = _last_wins(slots, priorities)
        self._set_priorities(slots, priorities)

    # -- the table's per-call paths ----------------------------------------
    # The table calls these with arguments it has already checked (slots in range and,
    # for insert_ingested/remove_known, unique): they skip the public methods' argument
    # checks and sorting. The defaults go through the public methods.

    def insert_ingested(self, slots: np.ndarray, priorities: np.ndarray, order0: int) -> None:
        """:meth:`insert` of unique in-range ``slots`` with orders ``order0, order0 + 1, ...``."""
        if _hotpath is None:
            self.insert(slots, priorities, np.arange(order0, order0 + len(slots), dtype=np.int64))
            return
        self._count = _hotpath.make_live(self._position, self._live_slots, self._count, slots)
        self._set_priorities(slots, priorities)
        if self._uses_order:
            self._set_order(slots, np.arange(order0, order0 + len(slots), dtype=np.int64))

    def remove_known(self, slots: np.ndarray) -> None:
        """:meth:`remove` of unique in-range ``slots``."""
        if _hotpath is None or not len(slots):
            self.remove(slots)
            return
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        self._count = _hotpath.make_dead(self._position, self._live_slots, self._count, slots)
        self._forget_known(slots)

    def _forget_known(self, slots: np.ndarray) -> None:
        """:meth:`_forget` of unique slots in any order."""
        self._forget(np.sort(slots))

    def update_by_key(self, keys: np.ndarray, priorities: np.ndarray, index: "KeyIndex") -> int:
        """New priorities for the items named by ``keys`` (``index``: the table's key → slot
        records); keys of items the table no longer holds are skipped. Returns how many
        applied. Priorities are float32 or float64 arrays."""
        return self.update_known(index.slots(keys), priorities)

    def update_by_key_tensors(self, keys: Any, priorities: Any, index: "KeyIndex") -> int | None:
        """The same from torch tensors without converting them, where a selector can (None here)."""
        return None

    def update_known(self, slots: np.ndarray, priorities: np.ndarray) -> int:
        """:meth:`update` where ``slots`` are live or -1 (skipped); returns how many applied."""
        priorities = np.asarray(priorities, dtype=np.float64)
        check_priorities(priorities)  # every one, skipped or not: bad input is an error
        keep = slots >= 0
        if not keep.all():
            slots, priorities = slots[keep], priorities[keep]
        self.update(slots, priorities)
        return int(slots.size)

    _uses_order = False  # ranked selectors keep insertion order

    def scan_state(self) -> tuple | None:
        """The arrays a table's C scan updates in place for this selector (the fused path:
        ingest and eviction tell the selector in the same pass), or None (the table calls
        :meth:`insert_ingested` / :meth:`remove_known`)."""
        return None

    def scan_done(self, count: int, leaves_changed: int) -> None:
        """After a fused scan: the live count it left, and how many leaves it changed."""

    def reweigh(self, masses: np.ndarray, group: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
        """Probabilities and importance weights of a batch whose rows came from several draws
        (a table's torn-row redraws), from each row's mass at its draw (``probability * total``)
        against the selector as it is now; None where a draw's weights need no change.
        ``group``: rows drawn by ``sample(groups=)``, weighted per consecutive ``group`` rows."""
        return None

    draws_groups = False  # sample(groups=) > 1: several independent batches in one draw

    def sample(self, batch_size: int, groups: int = 1) -> Selection:
        """Pick ``batch_size`` live slots; with ``groups`` > 1 (selectors that draw with
        replacement from a distribution: :attr:`draws_groups`), ``groups`` independent batches
        of ``batch_size`` in one call, one after the other in the Selection, each drawn and
        weighted as a call of its own would draw and weight it (a refill of several batches
        at the cost of one call)."""
        batch_size, groups = operator.index(batch_size), operator.index(groups)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        if self._count == 0:
            raise ValueError(f"cannot sample from {type(self).__name__}: it is empty")
        if groups == 1:
            return self._sample(batch_size)
        if not self.draws_groups:
            raise ValueError(f"{type(self).__name__} draws one batch a call (groups={groups})")
        return self._sample_groups(batch_size, groups)

    def _sample_groups(self, batch_size: int, groups: int) -> Selection:
        raise NotImplementedError

    def state_dict(self) -> StateDict:
        """Copy of everything that determines future samples, RNG state included.

        Per-slot arrays are listed in the order of ``state["slots"]`` (the live
        slots only), so their size follows ``len(self)``, not ``capacity``.
        Values are numpy arrays, ints and floats (the RNG state is JSON bytes).
        """
        return {
            "capacity": self.capacity,
            "slots": self._live_slots[: self._count].copy(),
            "rng_state": _encode_rng(self._rng),
        }

    def load_state_dict(self, state: StateDict) -> None:
        """Restore a ``state_dict`` taken from a selector of the same kind and capacity."""
        if int(state["capacity"]) != self.capacity:
            raise ValueError(
                f"state is for capacity {state['capacity']}, this selector has {self.capacity}"
            )
        slots = self._check_slots(state["slots"])
        if len(np.unique(slots)) != len(slots):
            raise ValueError("state['slots'] repeats a slot")
        rng_state = _decode_rng(state["rng_state"])
        self._rng.bit_generator.state = rng_state
        self._position[self._live_slots[: self._count]] = -1
        self._count = 0
        self._make_live(slots)

    # -- storage hooks ------------------------------------------------------

    def _sample(self, batch_size: int) -> Selection:
        raise NotImplementedError

    def _set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Store raw priorities for sorted, unique, live ``slots``."""

    def _set_order(self, slots: np.ndarray, order: np.ndarray) -> None:
        """Store insertion sequence numbers for sorted, unique, live ``slots``."""

    def _forget(self, slots: np.ndarray) -> None:
        """Drop state of sorted, unique ``slots`` that have just died."""

    # -- helpers ------------------------------------------------------------

    def _check_slots(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots)
        if slots.ndim != 1:
            raise ValueError(f"slots must be a 1-D array, got shape {slots.shape}")
        if slots.size == 0:
            return slots.astype(np.int64)
        if not np.issubdtype(slots.dtype, np.integer):
            raise ValueError(f"slots must be integers, got dtype {slots.dtype}")
        low, high = slots.min(), slots.max()
        if low < 0 or high >= self.capacity:
            bad = low if low < 0 else high
            raise ValueError(f"slot {bad} out of range [0, {self.capacity})")
        return slots.astype(np.int64, copy=False)

    @staticmethod
    def _check_priorities(priorities: np.ndarray, count: int) -> np.ndarray:
        priorities = np.asarray(priorities, dtype=np.float64)
        if priorities.shape != (count,):
            raise ValueError(
                f"priorities has shape {priorities.shape} but slots has shape ({count},)"
            )
        check_priorities(priorities)
        return priorities

    def _make_live(self, slots: np.ndarray) -> None:
        """Append the dead ones among unique ``slots`` to the packed live list."""
        new = slots[self._position[slots] < 0]
        end = self._count + len(new)
        self._live_slots[self._count : end] = new
        self._position[new] = np.arange(self._count, end)
        self._count = end

    def _make_dead(self, slots: np.ndarray) -> None:
        """Remove unique live ``slots`` from the packed list, refilling holes from its tail."""
        end = self._count - len(slots)
        holes = self._position[slots]
        self._position[slots] = -1
        holes = holes[holes < end]  # vacated positions that stay inside the live prefix
        tail = self._live_slots[end : self._count]
        movers = tail[self._position[tail] >= 0]  # survivors past the new end; len(holes) of them
        self._live_slots[holes] = movers
        self._position[movers] = holes
        self._count = end


class UniformSelector(Selector):
    """Every live slot equally likely, drawn with replacement: P(i) = 1 / N."""

    name = "uniform"

    def _sample(self, batch_size: int) -> Selection:
        picks = self._rng.integers(self._count, size=batch_size)  # (B,)
        return Selection(
            slots=self._live_slots[picks],
            probabilities=np.full(batch_size, 1.0 / self._count),
            weights=np.ones(batch_size, dtype=np.float32),
            total=float(self._count),
        )

    draws_groups = True

    def _sample_groups(self, batch_size: int, groups: int) -> Selection:
        return self._sample(batch_size * groups)  # independent draws: any split is a batch's

    def reweigh(self, masses, group: int = 0):
        return np.full(len(masses), 1.0 / self._count), np.ones(len(masses), dtype=np.float32)


class SumTree:
    """Sum tree with a wide fanout ``F``, stored level by level in flat float64 arrays.

    ``levels[0]`` is the root (one node) and ``levels[-1]`` the leaves. Node ``j``
    of level ``d`` has children ``j*F .. j*F+F-1`` on level ``d+1``, so every
    non-root level has a length that is a multiple of ``F`` and can be viewed as
    ``(n_parents, F)``. Padding leaves stay 0. Depth is ``ceil(log_F(size))``:
    6 levels below the root for 10^7 leaves at the default ``F = 16``, which
    measured fastest for batches of a few hundred (32 and 8 are close).

    :meth:`set` recomputes each touched parent as the sum of its children (exact).
    :meth:`set_priorities` (the learner's per-batch update and the table's ingest)
    changes each ancestor by its child's change, one add per level instead of
    re-summing ``F`` children; a node whose change cancels nearly all of it (e.g.
    its last positive leaf went to 0) is re-summed from its children instead, so
    a node over only zero leaves is exactly 0, and the whole tree is re-summed
    after every ``4 * size`` incremental leaf changes, so rounding stays bounded.
    """

    def __init__(self, size: int, fanout: int = 16) -> None:
        size = _check_positive_int("size", size)
        fanout = operator.index(fanout)
        if fanout < 2:
            raise ValueError(f"fanout must be >= 2, got {fanout}")
        self.size = size
        self.fanout = fanout
        child_level_sizes = []
        nodes = size
        while nodes > 1 or not child_level_sizes:
            parents = -(-nodes // fanout)
            child_level_sizes.append(parents * fanout)
            nodes = parents
        self.levels = [np.zeros(1)] + [np.zeros(n) for n in reversed(child_level_sizes)]
        self._ones = np.ones(fanout)  # (F,)
        self._incremental = 0  # leaf changes carried up by adding since the last exact re-sum
        self.native = _hotpath is not None  # False: the numpy reference path
        self._strictly_upper = np.triu(np.ones((fanout, fanout)), k=1)  # (F, F)

    @property
    def leaves(self) -> np.ndarray:
        """The leaf level (a view; padded past ``size`` with zeros)."""
        return self.levels[-1]

    @property
    def total(self) -> float:
        """Sum of all leaves (the root)."""
        return float(self.levels[0][0])

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Set leaves at sorted, unique ``indices`` and recompute their ancestors."""
        if self.native:
            idx = np.ascontiguousarray(indices, dtype=np.int64)
            vals = np.ascontiguousarray(np.broadcast_to(values, idx.shape), dtype=np.float64)
            _hotpath.set(self.levels, self.fanout, idx, vals)
            return
        fanout = self.fanout
        self.levels[-1][indices] = values
        for depth in range(len(self.levels) - 2, -1, -1):
            indices = _unique_sorted(indices // fanout)  # sorted stays sorted
            children = self.levels[depth + 1].reshape(-1, fanout)[indices]  # (n, F)
            self.levels[depth][indices] = children @ self._ones  # row sums; 4x np.sum's speed

    def set_priorities(self, slots: np.ndarray, priorities: np.ndarray, alpha: float, skip_negative: bool = False) -> int:
        """Leaves at ``slots`` (any order; a repeated slot keeps its last value) := ``p ** alpha``
        (0 for ``p == 0``). Every priority must be finite and ≥ 0 and every slot in range
        (``skip_negative``: slots < 0 are skipped), else ValueError and nothing changes.
        Returns the number of leaves set."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        if self.native:
            pr = priorities if isinstance(priorities, np.ndarray) and priorities.dtype in (np.float32, np.float64) else np.asarray(priorities, dtype=np.float64)
            n = _hotpath.set_priorities(self.levels, self.fanout, self.size, slots, np.ascontiguousarray(pr), float(alpha), skip_negative)
            self.note_incremental(n)
            return n
        pr = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if pr.shape != slots.shape:
            raise ValueError(f"{pr.size} priorities for {slots.size} slots")
        check_priorities(pr)
        if slots.size and (slots.max() >= self.size or (not skip_negative and slots.min() < 0)):
            bad_slot = slots.max() if slots.max() >= self.size else slots.min()
            raise ValueError(f"slot {bad_slot} out of range [0, {self.size})")
        keep = slots >= 0
        slots, pr = slots[keep], pr[keep]
        unique, first_reversed = np.unique(slots[::-1], return_index=True)  # last one wins
        pr = pr[len(slots) - 1 - first_reversed]
        self.set(unique, np.where(pr > 0, pr ** float(alpha) if alpha else 1.0, 0.0))
        return int(slots.size)

    def note_incremental(self, leaves: int) -> None:
        """``leaves`` leaf changes were carried up by adding; re-sum exactly every ``4 * size``."""
        self._incremental += leaves
        if self._incremental > 4 * self.size:
            self.rebuild()

    def rebuild(self) -> None:
        """Re-sum every parent from its children (exact)."""
        self._incremental = 0
        if self.native:
            _hotpath.rebuild(self.levels, self.fanout)
            return
        for depth in range(len(self.levels) - 2, -1, -1):
            sums = self.levels[depth + 1].reshape(-1, self.fanout).sum(axis=1)
            self.levels[depth][:] = 0.0
            self.levels[depth][: len(sums)] = sums

    def find(self, targets: np.ndarray) -> np.ndarray:
        """Leaf index holding each cumulative-mass target in ``[0, total]``, shape (B,).

        Descends one level per step with a (B, F) gather, a prefix sum and a
        compare. At each node it takes the *last child with nonzero mass whose
        exclusive prefix sum is <= the remaining target*: exactly the child
        whose mass interval contains the target, and, for a target at or past
        the mass actually under the node (``targets == total``, rounding), the
        node's last nonzero child. So zero-mass leaves are never returned while
        ``total > 0``, and the remaining target never goes negative.
        """
        if self.native:
            out = np.empty(len(targets), dtype=np.int64)
            _hotpath.find(self.levels, self.fanout, np.ascontiguousarray(targets, dtype=np.float64), out)
            return out
        fanout = self.fanout
        rows = np.arange(len(targets))
        node = np.zeros(len(targets), dtype=np.int64)  # (B,)
        rest = np.array(targets, dtype=np.float64)  # (B,) mass still to skip below `node`
        for level in self.levels[1:]:
            children = level.reshape(-1, fanout)[node]  # (B, F)
            # Exclusive prefix sums as one small matmul: about twice as fast as
            # np.cumsum on short rows; correctness does not depend on its rounding.
            before = children @ self._strictly_upper  # (B, F)
            eligible = (before <= rest[:, None]) & (children > 0)  # (B, F)
            choice = (fanout - 1) - eligible[:, ::-1].argmax(axis=1)  # (B,) last eligible
            rest -= before[rows, choice]
            node = node * fanout + choice
        return node


class PrioritizedSelector(Selector):
    """Proportional prioritized replay (Schaul et al. 2016; Ape-X).

    Each slot stores mass ``m_i = p_i ** alpha`` (0 for ``p_i == 0``, even when
    ``alpha == 0``) in a :class:`SumTree`, and

        P(i) = m_i / sum_j m_j
        w_i  = (N * P(i)) ** -beta / max_batch (N * P(k)) ** -beta

    where ``N`` is the number of live slots (zero-priority ones included). The
    batch is stratified: the total mass is cut into ``B`` equal segments and one
    uniform target is drawn in each; ``probabilities`` reports P(i), the chance
    of a draw at a uniformly random point of the mass, as the weights assume.
    Sampling costs ``O(B * F * log_F(capacity))``, an update
    ``O(B log B + B * F * log_F(capacity))``.

    ``beta`` may be reassigned at any time (learners anneal it); ``alpha``
    applies to priorities stored from then on.

    When every live slot has priority 0 the draw is uniform (P(i) = 1/N, weights 1), as
    Reverb's prioritized selector does, so a learner whose TD errors all reach 0 keeps
    training.
    """

    name = "prioritized"
    config_args = {"alpha": "alpha", "beta": "beta"}
    importance_sampled = True

    def __init__(
        self,
        capacity: int,
        *,
        seed: int | None = None,
        alpha: float = 0.6,
        beta: float = 0.4,
        fanout: int = 16,
    ) -> None:
        super().__init__(capacity, seed=seed)
        self.alpha = _check_non_negative("alpha", alpha)
        self.beta = beta
        self.tree = SumTree(self.capacity, fanout)

    @property
    def beta(self) -> float:
        """Importance-sampling exponent; assignable (validated) between samples."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = _check_non_negative("beta", value)

    def _set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        if self.tree.native:
            self.tree.set_priorities(slots, priorities, self.alpha)
            return
        masses = np.where(priorities > 0, priorities**self.alpha, 0.0)
        self.tree.set(slots, masses)

    def _forget_known(self, slots: np.ndarray) -> None:
        self.tree.set_priorities(slots, np.zeros(len(slots)), 0.0)

    def scan_state(self):
        tree = self.tree
        if not tree.native:
            return None
        return (self._position, self._live_slots, self._count, tree.levels, tree.fanout, self.alpha)

    def scan_done(self, count, leaves_changed):
        self._count = count
        self.tree.note_incremental(leaves_changed)

    def update_by_key(self, keys: np.ndarray, priorities: np.ndarray, index: "KeyIndex") -> int:
        tree = self.tree
        if not tree.native:
            return super().update_by_key(keys, priorities, index)
        # one C pass: priorities checked, keys mapped to the slots still holding them, leaves set
        n = _hotpath.update_by_key(tree.levels, tree.fanout, keys, index.P, index.R, index.slot_rec,
                                   index.slot_live, priorities, self.alpha)  # fmt: skip
        tree.note_incremental(n)
        return n

    def update_by_key_tensors(self, keys: Any, priorities: Any, index: "KeyIndex") -> int | None:
        """:meth:`update_by_key` straight from a learner's CPU tensors (contiguous int64 keys;
        float32 or float64 priorities, same length) by their addresses, or None when they are
        not such tensors (the caller converts them and calls :meth:`update_by_key`)."""
        global _TORCH_DTYPES
        if not _TORCH_DTYPES:
            import torch

            _TORCH_DTYPES = (torch.int64, torch.float32, torch.float64)
        i64, f32_, f64 = _TORCH_DTYPES
        tree = self.tree
        if not (tree.native and keys.is_cpu and priorities.is_cpu and keys.dtype is i64):
            return None
        f32 = priorities.dtype is f32_
        if not (f32 or priorities.dtype is f64) or not (keys.is_contiguous() and priorities.is_contiguous()):
            return None
        n = keys.numel()
        if priorities.numel() != n:
            raise ValueError(f"{n} keys but {priorities.numel()} priorities")
        applied = _hotpath.update_by_key_raw(tree.levels, tree.fanout, keys.data_ptr(), priorities.data_ptr(), n, f32,
                                             index.P, index.R, index.slot_rec, index.slot_live, self.alpha)  # fmt: skip
        tree.note_incremental(applied)
        return applied

    def update_known(self, slots: np.ndarray, priorities: np.ndarray) -> int:
        # one C pass: priorities checked, -1 slots skipped, leaves set, ancestors changed
        return self.tree.set_priorities(slots, priorities, self.alpha, skip_negative=True)

    def _forget(self, slots: np.ndarray) -> None:
        self.tree.set(slots, 0.0)

    draws_groups = True

    def _sample_groups(self, batch_size: int, groups: int) -> Selection:
        return self._sample(batch_size * groups, batch_size)

    def _sample(self, batch_size: int, group: int = 0) -> Selection:
        """``batch_size`` rows; ``group`` (a divisor of it): each run of ``group`` rows its own
        stratified batch with its own weight maximum (0: one batch)."""
        group = group or batch_size
        total = self.tree.total
        if total <= 0:
            # Reverb's AllZeroPrioritiesResultsInUniformSampling: a learner whose TD errors all
            # reached 0 keeps sampling (P = 1/N, weights 1) instead of crashing
            picks = self._rng.integers(self._count, size=batch_size)  # (B,)
            return Selection(
                slots=self._live_slots[picks],
                probabilities=np.full(batch_size, 1.0 / self._count),
                weights=np.ones(batch_size, dtype=np.float32),
            )  # total None: not proportional to the tree's masses
        uniforms = self._rng.random(batch_size)  # (B,)
        if self.tree.native:  # the same arithmetic in one C pass
            slots = np.empty(batch_size, dtype=np.int64)
            probabilities = np.empty(batch_size, dtype=np.float64)
            weights32 = np.empty(batch_size, dtype=np.float32)
            _hotpath.sample_proportional(
                self.tree.levels, self.tree.fanout, uniforms, self._count, self.beta,
                slots, probabilities, weights32, group,
            )  # fmt: skip
            return Selection(slots, probabilities, weights32, total)
        strata = np.arange(batch_size) % group + uniforms  # (B,): each group its own strata
        slots = self.tree.find(strata * (total / group))
        probabilities = self.tree.leaves[slots] / total  # (B,)
        weights = ((self._count * probabilities) ** -self.beta).reshape(-1, group)
        weights /= weights.max(axis=1, keepdims=True)
        return Selection(slots, probabilities, weights.reshape(-1).astype(np.float32), total)

    def reweigh(self, masses, group: int = 0):
        """P(i) = m_i / total and w_i = (N P(i)) ** -beta / max over the batch (each ``group``
        rows: over its group), with the total and N of now: one normalisation for every row,
        whichever draw it came from (None when every mass is 0 now: the rows keep their draws'
        uniform probabilities)."""
        if self.tree.total <= 0:
            return None
        probabilities = np.asarray(masses, dtype=np.float64) / self.tree.total
        weights = ((self._count * probabilities) ** -self.beta).reshape(-1, group or len(probabilities))
        weights /= weights.max(axis=1, keepdims=True)
        return probabilities, weights.reshape(-1).astype(np.float32)

    def state_dict(self) -> StateDict:
        state = super().state_dict()
        state.update(
            alpha=self.alpha,
            beta=self.beta,
            fanout=self.tree.fanout,
            tree=np.concatenate(self.tree.levels),  # bit-exact copy, all levels root first
        )
        return state

    def load_state_dict(self, state: StateDict) -> None:
        alpha = _check_non_negative("alpha", state["alpha"])
        beta = _check_non_negative("beta", state["beta"])
        tree = SumTree(self.capacity, state["fanout"])
        flat = np.array(state["tree"], dtype=np.float64)  # a copy: the levels will view it
        sizes = [len(level) for level in tree.levels]
        if flat.shape != (sum(sizes),):
            raise ValueError(f"state['tree'] has shape {flat.shape}, expected ({sum(sizes)},)")
        super().load_state_dict(state)
        tree.levels = np.split(flat, np.cumsum(sizes[:-1]))
        self.tree = tree
        self.alpha, self.beta = alpha, beta


class _RankedSelector(Selector):
    """Selectors that rank live slots by a key (smaller first), ties by older ``order``.

    ``sample(B)`` returns the ``B`` best live slots, best first, each with
    probability 1.0; with fewer than ``B`` live slots the ranking repeats
    cyclically. Ranking is O(N) in the number N of live slots (argpartition,
    then a sort of only the ``B`` chosen), so it suits small tables or rare calls.
    """

    _uses_order = True

    def __init__(self, capacity: int, *, seed: int | None = None) -> None:
        super().__init__(capacity, seed=seed)
        self._order = np.zeros(self.capacity, dtype=np.int64)  # (capacity,)

    def _keys(self, live: np.ndarray) -> np.ndarray:
        """Ranking key of each slot in ``live``; smaller ranks first."""
        raise NotImplementedError

    def _set_order(self, slots: np.ndarray, order: np.ndarray) -> None:
        self._order[slots] = order

    def _best(self, count: int) -> np.ndarray:
        """The ``count`` (<= N) best live slots, best first."""
        live = self._live_slots[: self._count]  # (N,)
        keys = self._keys(live)  # (N,)
        order = self._order[live]  # (N,)
        if count < len(live):
            cutoff = np.partition(keys, count - 1)[count - 1]
            ahead = np.flatnonzero(keys < cutoff)  # fewer than `count`
            tied = np.flatnonzero(keys == cutoff)
            needed = count - len(ahead)  # >= 1, since the cutoff itself is tied
            if needed < len(tied):
                tied = tied[np.argpartition(order[tied], needed - 1)[:needed]]
            chosen = np.concatenate((ahead, tied))  # (count,)
        else:
            chosen = np.arange(len(live))
        ranked = chosen[np.lexsort((order[chosen], keys[chosen]))]
        return live[ranked]

    def _sample(self, batch_size: int) -> Selection:
        ranked = self._best(min(batch_size, self._count))
        return Selection(
            slots=np.resize(ranked, batch_size),
            probabilities=np.ones(batch_size),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def state_dict(self) -> StateDict:
        state = super().state_dict()
        state["order"] = self._order[state["slots"]]
        return state

    def load_state_dict(self, state: StateDict) -> None:
        order = np.asarray(state["order"], dtype=np.int64)
        if order.shape != np.shape(state["slots"]):
            raise ValueError("state['order'] does not match state['slots']")
        super().load_state_dict(state)
        self._order[self._live_slots[: self._count]] = order


class FifoSelector(_RankedSelector):
    """The ``B`` oldest live items (smallest ``order``), oldest first."""

    name = "fifo"

    def _keys(self, live: np.ndarray) -> np.ndarray:
        return self._order[live]


class LifoSelector(_RankedSelector):
    """The ``B`` newest live items (largest ``order``), newest first."""

    name = "lifo"

    def _keys(self, live: np.ndarray) -> np.ndarray:
        return -self._order[live]


class _PriorityRankedSelector(_RankedSelector):
    """A ranked selector that keeps the raw priority of every slot."""

    def __init__(self, capacity: int, *, seed: int | None = None) -> None:
        super().__init__(capacity, seed=seed)
        self._priority = np.zeros(self.capacity)  # (capacity,) raw priorities

    def _set_priorities(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self._priority[slots] = priorities

    def _keys(self, live: np.ndarray) -> np.ndarray:
        return -self._priority[live]  # highest priority first

    def state_dict(self) -> StateDict:
        state = super().state_dict()
        state["priorities"] = self._priority[state["slots"]]
        return state

    def load_state_dict(self, state: StateDict) -> None:
        priorities = self._check_priorities(state["priorities"], len(state["slots"]))
        super().load_state_dict(state)
        self._priority[self._live_slots[: self._count]] = priorities


class MaxHeapSelector(_PriorityRankedSelector):
    """The ``B`` highest priority live items, highest first (ties: older first). O(N)."""

    name = "max_heap"


class MinHeapSelector(_PriorityRankedSelector):
    """The ``B`` lowest priority live items, lowest first (ties: older first). O(N)."""

    name = "min_heap"

    def _keys(self, live: np.ndarray) -> np.ndarray:
        return self._priority[live]


class TopKSelector(_PriorityRankedSelector):
    """Uniform with replacement among the ``k`` highest priority live items.

    P(i) = 1 / min(k, N) for each of the top ``min(k, N)`` items (ties at the
    cutoff: older first), 0 otherwise. ``k`` defaults to 1000, a small elite
    set next to typical capacities of 10^5..10^7. O(N) per sample.
    """

    name = "top_k"
    config_args = {"k": "top_k"}

    def __init__(self, capacity: int, *, seed: int | None = None, k: int = 1000) -> None:
        super().__init__(capacity, seed=seed)
        self.k = _check_positive_int("k", k)

    def _sample(self, batch_size: int) -> Selection:
        top = self._best(min(self.k, self._count))  # (K,)
        picks = self._rng.integers(len(top), size=batch_size)  # (B,)
        return Selection(
            slots=top[picks],
            probabilities=np.full(batch_size, 1.0 / len(top)),
            weights=np.ones(batch_size, dtype=np.float32),
        )

    def state_dict(self) -> StateDict:
        state = super().state_dict()
        state["k"] = self.k
        return state

    def load_state_dict(self, state: StateDict) -> None:
        k = _check_positive_int("k", state["k"])
        super().load_state_dict(state)
        self.k = k


SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls
    for cls in (
        UniformSelector,
        PrioritizedSelector,
        FifoSelector,
        LifoSelector,
        MaxHeapSelector,
        MinHeapSelector,
        TopKSelector,
    )
}


def make_selector(name: str, capacity: int, *, seed: int | None = None, **kwargs: Any) -> Selector:
    """Build the selector called ``name``; ``kwargs`` go to its constructor.

    Raises ValueError for an unknown name, listing the valid ones.
    """
    try:
        cls = SELECTORS[name]
    except KeyError:
        valid = ", ".join(sorted(SELECTORS))
        raise ValueError(f"unknown selector {name!r}; valid names: {valid}") from None
    if capacity is None or isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise ValueError(
            f"make_selector({name!r}, capacity): capacity must be the number of item slots (an int ≥ 1), "
            f"got {capacity!r}"
        )
    return cls(capacity, seed=seed, **kwargs)


def selector_kwargs(replay_cfg: Any) -> dict[str, Any]:
    """The constructor arguments of ``replay_cfg.selector`` taken from the ``replay`` config group
    (``prioritized``: ``alpha``, ``beta``; ``top_k``: ``k`` from ``top_k``; others: none)."""
    return {arg: replay_cfg[key] for arg, key in SELECTORS[replay_cfg.selector].config_args.items()}

