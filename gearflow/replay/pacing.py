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
* **inserts**: the union may hold ``G = limiter.insert_limit(ΣS, Σdeletes)`` inserts in all.
  Each node's limit is ``L_i = I_i + c_i``: its inserts plus its *credit*, room of the union
  handed to it and not used yet, with ``Σ c_i ≤ G - ΣI`` (the union never passes ``G``). Each
  call hands out the room no credit holds, half in proportion to the nodes' weights (their
  partitions), half by water-filling on inserts per weight (the node furthest behind gets it
  first: a late or restarted node catches up). A credit stays until it is used — a node's
  share of one call's room may be an item, its writers insert a chunk (33 items), so shares
  that did not add up held the node ahead still for as long as the other caught up — and is
  capped at the node's share of the error buffer, ``2·e/spi · w_i/Σw`` (the excess to the
  others): a stalled node holds at most that, and the union's room at the sampling limit,
  ``≈ 2·e/spi``, is the others'. While the union holds fewer than ``min_size_to_sample``
  items every node may insert the whole room (stage 1: a node not acting yet must not keep
  the union below its minimum size). A node's cap must take one of its writers' chunks, as the
  whole buffer must for one table.

A node whose counters go backwards was restarted (a fresh table): what it had inserted and
sampled stays in the union's counters (``base``), so the union's ratio does not jump, and
its inserts since the restart count toward its catching up from where it was.

    pacing = GlobalPacing(RateLimiter(1000, 8.0, 4000.0), weights=[4, 4])
    pacing.note(0, inserts=5000, samples=40000, deletes=0, size=5000)
    pacing.note(1, inserts=0, samples=0, deletes=0, size=0)    # restarted: empty
    pacing.can_sample(256)        # False: 5000·8 - 40000 - 256 < 1000·8 - 4000 (the union waits for inserts)
    pacing.insert_limits()        # array([5500, 500]): of the room 1500, each its cap 2·4000/8/2 = 500
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from gearflow.replay.rate_limiter import MAX_BACKOFF_S, NO_LIMIT, RateLimiter, RateLimiterTimeout

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
        self.credit = np.zeros(n)  # room handed to each node and not used yet (insert_limits)
        self._limits = np.zeros(n, dtype=np.int64)  # the limits last handed out
        self.restarts = 0

    def note(self, i: int, *, inserts: int, samples: int, deletes: int, size: int) -> None:
        """Node ``i``'s counters as one of its replies reports them (newer than those kept)."""
        if inserts < self.inserts[i] or samples < self.samples[i]:  # a fresh table: the node restarted
            self.base_inserts[i] += self.inserts[i]
            self.base_samples[i] += self.samples[i]
            self._limits[i] = 0  # its credit went with its table
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

    def wait_to_sample(self, n: int, in_flight: Callable[[], int], refresh: Callable[[], None], lock,
                       timeout_s: float) -> None:  # fmt: skip
        """Block until the union may be sampled ``n`` more items: ``refresh()`` reads every node's
        counters afresh (a sampler's ``replay.total`` round, which also sends each its insert
        limit) before each check, made under ``lock`` with ``in_flight()`` items requested and not
        yet counted; :class:`RateLimiterTimeout` after ``timeout_s``."""
        deadline, delay = time.monotonic() + timeout_s, MAX_BACKOFF_S
        while True:
            refresh()
            with lock:
                if self.can_sample(n, in_flight()):
                    return
                why = self.why_blocked(n, in_flight())
            if time.monotonic() > deadline:
                raise RateLimiterTimeout(f"sample of {n} blocked for {timeout_s:.1f} s {why}")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def paces(self, live=None) -> list[dict[str, int]]:
        """Each node's :meth:`insert_limits` as the ``pace`` its next request carries."""
        return [{"pace": int(x)} for x in self.insert_limits(live).tolist()]

    def insert_limits(self, live=None) -> np.ndarray:
        """Each node's insert limit (int64, in the node's own count since its table started):
        what it has inserted plus its credit — room of the union handed to it and not used yet.
        Each call hands out the room no credit holds (``G - ΣI - Σcredit``) half by weight, half
        by water-filling (module docstring); a credit stays until it is used, so a node whose
        inserts come in chunks larger than one call's share gathers one, and is capped at the
        node's share of the error buffer (``2·e/spi·w_i/Σw``, the rest to the others), so a
        stalled node holds no more than that. ``live``: the nodes that share the room (default
        all; a node down gets no credit, keeps its counters in the union's)."""
        lim, n = self.limiter, self.weights.size
        if lim.samples_per_insert == 0:
            return np.full(n, NO_LIMIT, dtype=np.int64)
        filling = int(self.size.sum()) < lim.min_size_to_sample
        room = lim.insert_limit(self.total_samples(), self._deletes() if filling else 0) - self.total_inserts()
        up = np.ones(n, dtype=bool) if live is None else np.isin(np.arange(n), live)
        if room <= 0 or not up.any():
            self.credit[:] = 0.0
            return self.inserts.copy()
        if filling:  # stage 1: any node may fill the union to its minimum size (one not acting yet holds no one)
            self.credit[:] = 0.0
            return self.inserts + max(room, lim.min_size_to_sample - int(self.size.sum()))  # (a down node's: unsent)
        c = np.where(up, np.maximum(self._limits - self.inserts, 0), 0).astype(np.float64)  # credit left unused
        if c.sum() > room:  # the union's room shrank under the credits (a restart, another learner's draws)
            c *= room / c.sum()
        free = room - c.sum()
        w = np.where(up, self.weights, 0.0)
        cap = 2.0 * lim.error_buffer / lim.samples_per_insert * w / w.sum()
        give = np.zeros(n)
        give[up] = 0.5 * free * w[up] / w[up].sum()  # by weight
        give[up] += _water_fill((self.inserts + self.base_inserts + c)[up] / w[up], w[up], 0.5 * free)  # the one behind first
        c += give
        for _ in range(n):  # a credit over its cap: the excess to the nodes under theirs, by weight
            excess = np.maximum(c - cap, 0.0)
            c -= excess
            under = up & (c < cap)
            if excess.sum() < 1.0 or not under.any():
                break
            c[under] += excess.sum() * w[under] / w[under].sum()
        self.credit = c
        self._limits = self.inserts + np.floor(c).astype(np.int64)
        return self._limits.copy()


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
