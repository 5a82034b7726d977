"""Replay's layout rules, each written once: where a step's row is, where an item's record
lives, what its key is, which bits of a key name its shard, and how many batch buffer sets a
prefetching consumer needs. A leaf (numpy only, nothing of gearflow), so the table, the
writers, the CUDA/RDMA back ends (:mod:`gearflow.native`) and the transport all import it.

    P partitions (one per env stream), S steps and R item records per partition

    row  of step t of partition p  = p * S + t % S          (the storage's column rings)
    step row j of partition p holds = c - 1 - (c - 1 - j) % S  (c: its COMMIT; < 0: none yet)
    slot of item seq of partition p = p * R + seq % R        (the record ring, the selector's slot)
    key  of item seq of partition p = seq * P + p            (unique while the table lives)
    partition of a slot             = slot // R;  of a key: key % P, its seq: key // P
    an item copied while RESERVE[p] was r is intact while start >= r - S   (the seqlock rule)
    a learner over several shards tags shard i's keys with i << SHARD_SHIFT (bits 56..62)

The C hot paths (``replay/_hotpath.c``) and the CUDA kernels (``native/kernels``) apply the
same rules; their references in Python call these.

>>> int(item_key(5, 2, 4)), int(step_rows(2, 19, 8)), int(record_slot(2, 5, 4))
(22, 19, 9)
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PROPORTIONAL_SELECTORS",
    "SHARD_SHIFT",
    "buffer_sets",
    "item_key",
    "key_partition",
    "key_shard",
    "local_key",
    "record_slot",
    "row_steps",
    "shard_key",
    "slot_partition",
    "step_rows",
    "torn_items",
]

SHARD_SHIFT = 56  # a several-shard sampler puts the shard's index in a key's bits 56..62
# selectors whose draw is proportional to a per-item mass (uniform: mass 1): the ones several
# shards reproduce exactly (transport), and the ones the GPU samples with (replay.device=cuda)
PROPORTIONAL_SELECTORS = ("prioritized", "uniform")


def step_rows(partitions, steps, S: int):
    """The row rule: absolute step ``t`` of partition ``p`` lives in row ``p * S + t % S``
    (ints or int64 arrays, broadcast)."""
    return partitions * S + steps % S


def row_steps(rows, commit, S: int):
    """The row rule read back: the step storage ``rows`` hold once their partitions have committed
    ``commit`` steps (``commit`` per partition, int64): the latest ``t < c`` with
    ``step_rows(p, t, S) == row`` (negative where none was written yet)."""
    c = commit[rows // S]
    return c - 1 - (c - 1 - rows % S) % S


def record_slot(partitions, seqs, R: int):
    """The slot rule: item ``seq`` of partition ``p`` has its record in slot ``p * R + seq % R``."""
    return partitions * R + seqs % R


def slot_partition(slots, R: int):
    """The partition of each slot: ``slot // R``."""
    return slots // R


def item_key(seqs, partitions, P: int):
    """The key rule: item ``seq`` of partition ``p`` has key ``seq * P + p``."""
    return seqs * P + partitions


def torn_items(parts, starts, reserve, S: int):
    """The seqlock rule: bool[B], True where an item's first step ``starts`` (int64 (B,), in
    partition ``parts``) may have been overwritten while it was copied, ``reserve`` being the
    partitions' RESERVE counters (int64[P]) read *after* the copy (for a CUDA gather: after its
    stream synchronized): ``start < RESERVE[p] - S``, ``S`` the steps a reader may trust (the
    ring less the steps a frame stack reaches back). The table's ``overwritten``, the GPU
    path and the RDMA sampler apply it. Works on numpy and CuPy arrays alike.

    >>> torn_items(np.array([0, 1]), np.array([5, 5]), np.array([20, 22]), 16)  # 5 < 22 - 16
    array([False,  True])
    """
    if isinstance(S, (bool, np.bool_)) or not isinstance(S, (int, np.integer)):
        raise ValueError(f"S must be an integer, got {S!r}")
    if S < 1:
        raise ValueError(f"S must be >= 1, got {int(S)}")
    for name, a in (("parts", parts), ("starts", starts), ("reserve", reserve)):
        if getattr(a, "ndim", None) != 1:
            raise ValueError(f"{name} must be a 1-D array, got {type(a).__name__} of shape {getattr(a, 'shape', None)}")
        if a.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    if starts.shape != parts.shape:
        raise ValueError(f"starts has shape {starts.shape} but parts has shape {parts.shape}")
    return starts < reserve[parts] - int(S)


def key_partition(keys, P: int):
    """The partition a key names: ``key % P``."""
    return keys % P


def shard_key(keys: np.ndarray, shard: int) -> np.ndarray:
    """``keys`` (int64, each < 2**SHARD_SHIFT) tagged with ``shard`` in bits 56..62, in place."""
    keys |= shard << SHARD_SHIFT
    return keys


def key_shard(keys: np.ndarray) -> np.ndarray:
    """The shard index of tagged keys."""
    return keys >> SHARD_SHIFT


def local_key(keys: np.ndarray) -> np.ndarray:
    """Tagged keys without their shard bits: the shard's own keys."""
    return keys & ((1 << SHARD_SHIFT) - 1)


def buffer_sets(prefetch: int) -> int:
    """Batch buffer sets a table (or shard) keeps for a consumer that prefetches ``prefetch``
    batches: one being read by the learner, ``prefetch`` queued, one being filled."""
    return int(prefetch) + 2


class RedrawRounds:
    """How many of a batch's torn rows to redraw in the next round. A sampler slowed by load
    whose redraw of every torn row takes longer than the writers need to lap the ring loses
    them all again, round after round, until its sample times out: after a round that lost
    every row it tried, the next tries half as many (each round short enough to win), and
    after one that lost none, twice as many."""

    def __init__(self, n: int):
        self.size = max(1, int(n))

    def take(self, bad: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows to redraw now, and the rest (left for later rounds)."""
        return bad[: self.size], bad[self.size :]

    def lost(self, tried: int, again: int) -> None:
        """A round redrew ``tried`` rows, of which ``again`` were torn again."""
        if again >= tried:
            self.size = max(1, self.size // 2)
        elif again == 0:
            self.size *= 2
