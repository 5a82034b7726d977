"""Global pacing: one rate limiter over several shard nodes (the learner applies it).

A learner over several shards draws each batch as one table would (the split follows the
shards' priority totals, :mod:`gearflow.transport.learner.sampler`). A rate limiter per
shard cannot hold under that split: a shard's samples follow its share of the priority mass,
its inserts follow its actors, so a shard whose total is small (it started late, or restarted
with an empty table) is sampled little and its own samples-per-insert limit holds its
writers — it stays small, and its actors die of ``RateLimiterTimeout``. So the ratio is kept
where the samples are known, over the union:

* **samples**: a batch of ``B`` may be drawn iff the configured :class:`RateLimiter` allows it
  with the nodes' counters summed (``size``, ``inserts``, ``samples`` of every node, plus the
  rounds this learner has requested and not yet seen answered);
* **inserts**: the union may hold ``G = limiter.insert_limit(ΣS, Σdeletes)`` inserts in all;
  the room left, ``H = G - ΣI``, is handed out as each node's own insert limit
  ``L_i = I_i + h_i`` with ``Σ h_i ≤ H`` (so the union never passes ``G``): half of it in
  proportion to the nodes' weights (their partitions: no node, even a stalled one that never
  uses its share, holds the others at 0), half by water-filling on inserts per weight (the
  node furthest behind gets it first: a late or restarted node catches up). While the union
  holds fewer than ``min_size_to_sample`` items, every node may insert the whole room (stage 1:
  a node not acting yet must not keep the union below its minimum size). A node's share at
  the limit is about ``error_buffer / samples_per_insert / N`` items; it must take one of its
  writers' inserts (a chunk: an actor's batch of items), as the whole buffer must for one table.

A node whose counters go backwards was restarted (a fresh table): what it had inserted and
sampled stays in the union's counters (``base``), so the union's ratio does not jump, and
its inserts since the restart count toward its catching up from where it was.

    pacing = GlobalPacing(RateLimiter(1000, 8.0, 4000.0), weights=[4, 4])
    pacing.note(0, inserts=5000, samples=40000, deletes=0, size=5000)
    pacing.note(1, inserts=0, samples=0, deletes=0, size=0)    # restarted: empty
    pacing.can_sample(256)        # False: 5000·8 - 40000 - 256 < 1000·8 - 4000 (the union waits for inserts)
    pacing.insert_limits()        # array([5375, 1125]): room 1500, 375 each by weight, 750 more to node 1
"""

from __future__ import annotations

import numpy as np

from gearflow.replay.rate_limiter import NO_LIMIT, RateLimiter

__all__ = ["GlobalPacing"]


class GlobalPacing:
    """The global rate limiter over ``len(weights)`` nodes (see the module docstring). Pure
    arithmetic: the caller feeds each node's counters (:meth:`note`), asks whether a draw may go
    (:meth:`can_sample`) and sends each node its :meth:`insert_limits`."""

    def __init__(self, limiter: RateLimiter, weights):
        self.limiter = limiter
        self.weights = np.asarray(weights, dtype=np.float64)
        if self.weights.ndim != 1 or not self.weights.size or (self.weights <= 0).any():
            raise ValueError(f"weights must be one positive number per node, got {weights!r}")
        n = self.weights.size
        self.inserts = np.zeros(n, dtype=np.int64)  # per node, since its table started
        self.samples = np.zeros(n, dtype=np.int64)
        self.deletes = np.zeros(n, dtype=np.int64)  # items inserted and gone (evicted, dropped)
        self.size = np.zeros(n, dtype=np.int64)
        self.base_inserts = np.zeros(n, dtype=np.int64)  # earlier tables of a restarted node
        self.base_samples = np.zeros(n, dtype=np.int64)
        self.restarts = 0

    def note(self, i: int, *, inserts: int, samples: int, deletes: int, size: int) -> None:
        """Node ``i``'s counters as one of its replies reports them (newer than those kept)."""
        if inserts < self.inserts[i] or samples < self.samples[i]:  # a fresh table: the node restarted
            self.base_inserts[i] += self.inserts[i]
            self.base_samples[i] += self.samples[i]
            self.restarts += 1
        self.inserts[i], self.samples[i], self.deletes[i], self.size[i] = inserts, samples, deletes, size

    # ------------------------------------------------------------- the union's counters
    def total_inserts(self) -> int:
        return int(self.inserts.sum() + self.base_inserts.sum())

    def total_samples(self) -> int:
        return int(self.samples.sum() + self.base_samples.sum())

    def _deletes(self) -> int:
        return int(self.deletes.sum() + self.base_inserts.sum())  # a lost table's items are gone

    def can_sample(self, n: int, in_flight: int = 0) -> bool:
        """Whether the union may be sampled ``n`` more items, ``in_flight`` already requested
        and not yet counted by the nodes."""
        return self.limiter.can_sample(int(self.size.sum()), self.total_inserts(), self.total_samples() + in_flight, n)

    def why_blocked(self, n: int, in_flight: int = 0) -> str:
        return "over every shard node: " + self.limiter.why_blocked(
            int(self.size.sum()), self.total_inserts(), self.total_samples() + in_flight, n)

    def insert_limits(self, live=None) -> np.ndarray:
        """Each node's insert limit (int64, in the node's own count since its table started):
        the union's room ``H`` split half by weight, half by water-filling (module docstring).
        ``live``: the nodes that share the room (default all; a node down keeps its count as
        its limit, and its counters in the union's)."""
        lim = self.limiter
        if lim.samples_per_insert == 0:
            return np.full(self.weights.size, NO_LIMIT, dtype=np.int64)
        filling = int(self.size.sum()) < lim.min_size_to_sample
        room = lim.insert_limit(self.total_samples(), self._deletes() if filling else 0) - self.total_inserts()
        if room <= 0:
            return self.inserts.copy()
        if filling:  # stage 1: any node may fill the union to its minimum size (one not acting yet holds no one)
            return self.inserts + max(room, lim.min_size_to_sample - int(self.size.sum()))  # (a down node's: unsent)
        up = np.ones(self.weights.size, dtype=bool) if live is None else np.isin(np.arange(self.weights.size), live)
        out = self.inserts.copy()
        if not up.any():
            return out
        w = self.weights[up]
        share = 0.5 * room * w / w.sum()  # by weight
        share += _water_fill((self.inserts + self.base_inserts)[up] / w, w, 0.5 * room)
        out[up] += np.floor(share).astype(np.int64)
        return out


def _water_fill(level: np.ndarray, w: np.ndarray, amount: float) -> np.ndarray:
    """``x ≥ 0`` with ``Σx = amount`` raising the lowest ``level`` first: ``x_i = w_i·max(0, λ - level_i)``."""
    order = np.argsort(level, kind="stable")
    lv, ww = level[order], w[order]
    x = np.zeros_like(level)
    cum_w, cum_wl = 0.0, 0.0
    for k in range(lv.size):
        cum_w += ww[k]
        cum_wl += ww[k] * lv[k]
        lam = (amount + cum_wl) / cum_w  # the level if nodes 0..k are raised together
        if k + 1 == lv.size or lam <= lv[k + 1]:
            x[order[: k + 1]] = ww[: k + 1] * (lam - lv[: k + 1])
            return np.maximum(x, 0.0)
    return x
