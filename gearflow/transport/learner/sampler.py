"""RemoteSampler: a learner's :class:`~gearflow.replay.protocols.SamplerLike` over shard services (the learner side).

    sampler = RemoteSampler(["10.0.0.5:7000", "10.0.0.6:7000"], token=token)  # SamplerLike
    batch = sampler.sample(256); sampler.update_priorities(batch.keys, prios)


**Exact global sampling.** Keys of shard ``i`` carry ``i`` in bits 56..62
(``key | i << 56``; shard 0's keys are the shard's own), so ``update_priorities`` routes
each key to its shard with no map. A batch of ``B`` over several shards is one *round*:

1. the split ``q_i = T_i / ΣT`` over the newest priority totals the sampler knows (the
   sum-tree mass; the item count for a uniform selector), ``b ~ Multinomial(B, q)``;
2. shard ``i`` draws ``b_i`` items with its own stratified proportional draw (``m_k / T_i``
   each); a shard given no draw answers ``replay.total``; every shard reports its total and
   count at that moment with its reply;
3. each row's probability is ``P = q_i · m_k / T_i`` — the probability of the draw that was
   made — and the IS weights are the local table's normalisation over it,
   ``w = (N·P)^-β / max over the batch`` with ``N`` the shards' live items (float32).

*Exact* means: when the split's totals equal the totals at the shards' draws, ``P = m_k / ΣT``
and every row is drawn with one table's probability, probabilities equal to 1e-12 and
weights to the last float32 bit (tests/test_global_sampling.py). That holds whenever nothing
but this sampler changed the shards since the replies its totals come from — these include
its own priority updates: a shard handles one connection's requests in order, and a round is
split only once the replies of every update sent before it are in, so a round requested after
an update is drawn after it and split by the totals it left (replies are tagged, so a
prefetched round answered later never overwrites an update's newer totals).
``update_priorities`` itself does not wait for those replies (Ape-X's learner does not: the
round trip overlaps the next learn step; :mod:`~gearflow.transport.learner.updates`); the wait,
if any is left, falls on the next round's request, in the prefetching thread. A round requested ahead
(``prefetch``) is drawn before the updates of the batches returned meanwhile, as a local
table sampled that many batches ahead (``prefetch=0``: every draw sees every update). What
the sampler cannot know — writers' inserts and evictions, another learner's updates, since
the reply its totals come from — makes the split off by that change: the probabilities are
still those of the draw made (the IS correction stays right for it), ``split_drift``
(``stats()["replay/split_drift"]``) says by how much (max over shards of
``|q_i - T_i/ΣT|`` at the draws; 0.0: exact), and every round requested after a reply that
reported the change is split by it (rounds ahead are requested once the current round's
replies are in, so a change reaches the split ``prefetch + 1`` batches later at most).
Uniform shards draw uniformly over the union (``P = 1/N``, weights 1). Ranked selectors
(fifo, lifo, max/min heap, top_k) order the items of one table; no global order exists across
shards, so a sampler over several refuses them (one shard: its own draw, passed through).
``prefetch`` rounds are requested ahead, from every shard in parallel.

**One rate limiter over several shards** (:class:`~gearflow.replay.pacing.GlobalPacing`): a
shard's own samples-per-insert limit cannot hold when its share of the draws follows its
priority total, so over several shards the sampler keeps the shards' (common) rate limiter
over their union: a round is requested once the union's counters — reported with every reply
— allow it (a round ahead that is not allowed yet is requested when it is due), and every
request carries the shard's insert limit (``pace``), its share of the union's room. The split
is untouched: the draws stay one table's. A shard marked down keeps its counters in the union's
and gets no share of the room (the live ones share it) until it is back.

**A dead node.** With ``health`` (a :class:`~gearflow.transport.learner.health.NodeHealth`, as
:class:`~gearflow.transport.learner.shards.RemoteShards` passes), a shard whose call times out or
whose connection is refused is marked down: the round fails (the prefetcher asks again), and
every later round is split over the live shards only (``q_i = T_i / ΣT`` over them: exact over
what is left), their items counted in ``N``; a down shard's priority updates are dropped (its
items are out of reach), ``stats`` and ``checkpoint`` skip it. Re-admitted (it answers a probe),
it is back in the next round's split, by its newest total.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gearflow.kinds.registry import kind_from_dict
from gearflow.replay.pacing import GlobalPacing
from gearflow.replay.rate_limiter import RateLimiter
from gearflow.replay.layout import key_shard, local_key
from gearflow.replay.protocols import SelectorInfo
from gearflow.replay.spec import TableSpec
from gearflow.replay.table import Sample
from gearflow.transport.learner.assembly import (BatchAssembly, check_shards_agree, priority_arrays, split_round,
                                                 summed_stats)  # fmt: skip
from gearflow.transport.learner.updates import PendingUpdates
from gearflow.transport.client import Client, RequestTimeout, ServiceUnavailable, as_client
from gearflow.transport.errors import RateLimiterTimeout  # noqa: F401  (the shard's errors are raised here as themselves)
from gearflow.transport.ops import RPC

__all__ = ["LEARNER_PREFETCH", "RemoteSampler"]

GONE = (ServiceUnavailable, RequestTimeout)  # a node that does not answer (not a shard's own error)

LEARNER_PREFETCH = 2  # rounds a learner's RemoteSampler requests ahead: the shard draws and gathers one while
# the one before is on the wire (gearflow bench transport sample, 2 cores: ~0.77 of a raw socket vs ~0.63 at 1)


def _shard_list(shards) -> list:
    """The shards a sampler reads: one address or client alone, or a list of 1 to 127 of them."""
    if isinstance(shards, (str, Client)) or (isinstance(shards, tuple) and len(shards) == 2 and isinstance(shards[1], int)):
        shards = [shards]
    if not shards or len(shards) > 127:
        raise ValueError(f"a sampler reads 1 to 127 shards, got {len(shards)}")
    return list(shards)


class RemoteSampler:
    """A :class:`~gearflow.replay.protocols.SamplerLike` over one or several shard services
    (see the module docstring for the sampling rule). ``seed`` seeds the split of a batch over
    shards; ``prefetch`` rounds are requested ahead (each drawn before the priority updates of
    the batches returned meanwhile land, as a local table sampled that many batches ahead).
    Several shards must hold the same spec, item kind and a ``uniform`` or ``prioritized``
    selector with the same ``alpha`` (ranked selectors — fifo, lifo, heaps, top_k — order
    items within one table: no global order exists across shards; sample one shard).
    ``sample`` / ``update_priorities`` / ``checkpoint``: one thread at a time (the learner's
    lock); ``stats`` may come from another thread.

        sampler = RemoteSampler(["10.0.0.5:7000", "10.0.0.6:7000"], token=token, seed=0)
        sampler.selector.beta = 0.4
        batch = sampler.sample(256)           # keys carry their shard in bits 56..62
        sampler.update_priorities(batch.keys, new_priorities)
    """

    _pacing: GlobalPacing | None = None  # several shards: the rate limit kept over all of them (_setup)

    def __init__(self, shards: Sequence[Any], token: str | None = None, *, prefetch: int = 1,
                 timeout_s: float = 60.0, num_buffers: int = 3, seed: int | None = None, loop: str = "auto",
                 health=None):  # fmt: skip
        pairs = [as_client(s, token, timeout_s, loop) for s in _shard_list(shards)]
        self._clients = [c for c, _ in pairs]
        self._own = [own for _, own in pairs]
        self.health = health  # NodeHealth: down shards are left out (None: every shard, always)
        try:
            self._setup(timeout_s, prefetch, num_buffers, seed)
        except BaseException:
            self.close()
            raise

    def _setup(self, timeout_s: float, prefetch: int, num_buffers: int, seed: int | None) -> None:
        self.timeout_s, self.prefetch, self.num_buffers = float(timeout_s), int(prefetch), int(num_buffers)
        self._rng = np.random.default_rng(seed)
        n = len(self._clients)
        self._totals = np.ones(n)  # priority totals (sum-tree mass or item counts), newest known
        self._counts = np.zeros(n, dtype=np.int64)
        self._sent = np.zeros(n, dtype=np.int64)  # requests sent to each shard (their tags)
        self._known = np.zeros(n, dtype=np.int64)  # tag of the reply the totals above come from
        self._tags = threading.Lock()
        self._stale = False  # a round failed: read the totals afresh before the next split
        self._pacing = None
        self.split_drift = 0.0  # last round: max |split share - the shard's share at its draw|
        self._ahead: collections.deque = collections.deque()  # (batch_size, round) requested ahead
        self.torn = 0  # items the shards marked torn in their replies, redrawn here
        self._updates = PendingUpdates()  # priority updates sent, their replies not read yet
        infos = [c.call(RPC.REPLAY_INFO, timeout_s=timeout_s)[0] for c in self._clients]
        self.spec = TableSpec.parse(infos[0]["spec"])
        self.kind = kind_from_dict(infos[0]["kind"])
        check_shards_agree(infos, [c.address_text for c in self._clients])
        first = infos[0]
        self.selector = SelectorInfo(first["selector"], first.get("importance_sampled", True))
        self._assembly = BatchAssembly(self.selector, self.num_buffers)
        if n > 1 and all("rate_limiter" in info for info in infos):
            self._pacing = GlobalPacing(RateLimiter(**first["rate_limiter"]), [info["num_partitions"] for info in infos])
        if n > 1:
            self._refresh_totals()
        if self.health is not None:
            self.health.on_change(self.node_changed)

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    # ----------------------------------------------------------------- down shards
    def _live(self) -> list[int]:
        return list(range(len(self._clients))) if self.health is None else self.health.live()

    def _gone(self, i: int, exc: BaseException) -> None:
        """Shard ``i`` did not answer: marked down (with a health), else the error stands."""
        if self.health is not None:
            self.health.mark_down(i, exc)

    def _down_or_raise(self, i: int, exc: BaseException) -> None:
        """A priority update shard ``i`` did not take: marked down (with a health), else ``exc`` raised."""
        if self.health is None:
            raise exc
        self.health.mark_down(i, exc)

    def node_changed(self, i: int, up: bool) -> None:
        """NodeHealth's call: a shard marked down has its connection dropped (its unanswered calls
        fail now, not after their timeouts); one back makes the next split read every total."""
        if not up:
            self._clients[i].drop()
        self._stale = True

    # ----------------------------------------------------------------- shard totals
    def _submit(self, i: int, op: str, meta: dict | None = None, bufs: Sequence[Any] = (), timeout_s: float | None = None):
        """Send a request to shard ``i``; returns ``(tag, future)``: the tags of one shard's requests
        rise in the order the shard handles them (one connection: in order)."""
        if self.health is not None:  # a node marked down: fail now, not after reconnecting to a silent host
            self.health.check_up(i)
        client = self._clients[i]
        if op == RPC.REPLAY_SAMPLE and client.row_digests:  # its MAC over the wide rows' digests (kept by the shard)
            meta = {**meta, "row_digests": True}
        with self._tags:  # stats() may come from another thread than sample() (the learner's metrics)
            fut = client.submit(op, meta, bufs, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
            self._sent[i] += 1
            return int(self._sent[i]), fut

    def _note(self, i: int, tag: int, meta: dict) -> None:
        """Keep the total and count a reply reports if it is newer than those kept: a prefetched
        round answered after a priority update reports the shard as it was before the update."""
        with self._tags:
            if tag > self._known[i]:
                self._known[i], self._totals[i], self._counts[i] = tag, float(meta["total"]), int(meta["count"])
                if self._pacing is not None and "inserts" in meta:
                    self._pacing.note(i, inserts=int(meta["inserts"]), samples=int(meta["samples"]),
                                      deletes=int(meta["deletes"]), size=int(meta["size"]))  # fmt: skip

    def _paces(self) -> list[dict]:
        """Each shard's ``pace`` (its writers' insert limit, from the global pacing) for its next request."""
        if self._pacing is None:
            return [{} for _ in self._clients]
        live = self._live()
        with self._tags:
            return self._pacing.paces(live)

    def _refresh_totals(self) -> None:
        """Every shard's total and count now (``replay.total``: the shard scans, draws nothing)."""
        paces = self._paces()
        futs = []
        try:
            for i in self._live():
                futs.append((i, *self._submit(i, RPC.REPLAY_TOTAL, paces[i])))
            for i, tag, f in futs:
                self._note(i, tag, self._clients[i].result(f, RPC.REPLAY_TOTAL, self.timeout_s)[0])
        except GONE as exc:
            self._gone(i, exc)
            raise
        self._stale = False

    # ----------------------------------------------------------------- draws
    def _in_flight(self) -> int:
        """Items of the rounds requested ahead (drawn, or about to be, not yet counted here)."""
        return sum(b for b, r in self._ahead if r is not None)

    def _pace_wait(self, batch_size: int, timeout_s: float, wait: bool) -> bool:
        """Whether the global pacing lets ``batch_size`` more items be drawn; ``wait``: block until
        it does (reading every shard's counters afresh, which also sends each its insert limit),
        up to ``timeout_s``, then :class:`RateLimiterTimeout`."""
        pacing = self._pacing
        if pacing is None:
            return True
        with self._tags:
            ok = pacing.can_sample(batch_size, self._in_flight())
        if ok or not wait:
            return ok
        pacing.wait_to_sample(batch_size, self._in_flight, self._refresh_totals, self._tags, timeout_s)
        return True

    def _request(self, batch_size: int, timeout_s: float, wait: bool = True) -> tuple | None:
        """One round: the split ``q`` (each shard's share of every draw) and each shard's request;
        ``b_i ~ Multinomial(B, q)`` with ``q = T / ΣT`` over the newest totals; a shard given no
        draw still reports its total (``replay.total``). Several shards: once the global pacing
        lets it go (``wait=False``: None when it does not now), each request carrying its shard's
        insert limit (``pace``)."""
        n = len(self._clients)
        # every update sent before this round: its reply (and the totals it left) before the split
        self._updates.collect(block=n > 1, read=self._read_update)
        if self._stale and n > 1:
            self._refresh_totals()
        if not self._pace_wait(batch_size, timeout_s, wait):
            return None
        live = self._live()  # after those waits: a node marked down meanwhile is not asked
        if not live:
            raise ServiceUnavailable(f"every shard node is down ({', '.join(c.address_text for c in self._clients)})")
        if n == 1:
            q, split = np.ones(1), [batch_size]
        else:
            with self._tags:
                t = np.maximum(self._totals, 0.0)  # a copy
            q, split = split_round(t, live, batch_size, self._rng)
        meta = {"timeout_s": timeout_s, **self.selector.request_fields()}
        paces = self._paces()
        parts = []
        for i in live:
            b = int(split[i])
            try:
                parts.append((i, b, *(self._submit(i, RPC.REPLAY_SAMPLE, {**meta, **paces[i], "batch_size": b},
                                                   timeout_s=timeout_s + self.timeout_s)
                                      if b else self._submit(i, RPC.REPLAY_TOTAL, paces[i]))))  # fmt: skip
            except GONE as exc:
                self._gone(i, exc)
                raise
        return q, parts

    def sample(self, batch_size: int, timeout_s: float | None = None) -> Sample:
        """A batch of ``batch_size`` items over every shard; blocks while the shards' rate
        limiters say so (up to ``timeout_s``, then :class:`RateLimiterTimeout`)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        timeout_s = self.timeout_s if timeout_s is None else float(timeout_s)
        while self._ahead and self._ahead[0][0] != batch_size:
            self._ahead.popleft()  # drawn for another batch size: dropped
        try:
            ahead = self._ahead.popleft()[1] if self._ahead else None  # None: not requested yet (paced)
            q, parts = ahead if ahead is not None else self._request(batch_size, timeout_s)
            replies, drawn = [], np.zeros(len(self._clients))
            for i, b, tag, fut in parts:
                try:
                    meta, bufs = self._clients[i].result(fut, RPC.REPLAY_SAMPLE if b else RPC.REPLAY_TOTAL, timeout_s + self.timeout_s)
                except GONE as exc:
                    self._gone(i, exc)
                    raise
                self._note(i, tag, meta)
                drawn[i] = max(float(meta["total"]), 0.0)  # the shard's total at its draw
                if b:
                    replies.append((i, b, meta, bufs))
            replies = [self._mend(r, timeout_s) for r in replies]
            s = drawn.sum()
            self.split_drift = float(np.abs(q - drawn / s).max()) if s > 0 and len(parts) > 1 else 0.0
            # the rounds ahead are requested after this round's replies: split by the totals they
            # carry (a change the shards saw reaches the split one round later, not two)
            while len(self._ahead) < self.prefetch:  # None: the pacing holds it for now, requested when due
                self._ahead.append((batch_size, self._request(batch_size, timeout_s, wait=False)))
        except BaseException:
            self._ahead.clear()  # later rounds may hold the same error; draw afresh next time
            self._stale = True
            raise
        if len(self._clients) == 1:  # one table: its own draw
            _, _, meta, bufs = replies[0]
            keys, probs, weights, *data = bufs
            return Sample(data={n: torch.from_numpy(a) for n, a in zip(meta["names"], data)},
                          keys=torch.from_numpy(keys), weights=torch.from_numpy(weights),
                          probabilities=torch.from_numpy(probs))  # fmt: skip
        return self._assembly.combine(batch_size, q, replies, float(self._counts[self._live()].sum()))

    def _mend(self, reply: tuple, timeout_s: float) -> tuple:
        """A reply whose ``torn`` marks are set, mended by fresh draws from its shard
        (:meth:`BatchAssembly.mend`); ``self.torn`` counts the items redrawn."""
        i = reply[0]
        m = {"timeout_s": timeout_s, **self.selector.request_fields(), **self._paces()[i]}  # no pace unpaces the shard

        def redraw(n: int) -> tuple[dict, list]:
            self.torn += n
            tag, fut = self._submit(i, RPC.REPLAY_SAMPLE, {**m, "batch_size": n}, timeout_s=timeout_s + self.timeout_s)
            meta, fresh = self._clients[i].result(fut, RPC.REPLAY_SAMPLE, timeout_s + self.timeout_s)
            self._note(i, tag, meta)
            return meta, fresh

        return self._assembly.mend(reply, self._clients[i].address_text, redraw, timeout_s, lambda: self.torn)

    # ----------------------------------------------------------------- priorities, stats
    def update_priorities(self, keys, priorities, wait: bool = False) -> int:
        """New priorities by key, each key sent to the shard in its bits 56..62 (keys of evicted
        items are ignored there, as locally). Returns once the requests are sent, with how many
        keys went to live shards; the replies are read later, before the next round is split.
        ``wait``: read every reply now and return
        how many keys were applied. Either way a round requested after this returns is drawn
        after the update and split by the totals it left."""
        keys, prios = priority_arrays(keys, priorities)
        shard = key_shard(keys)
        if (shard < 0).any() or (shard >= len(self._clients)).any():
            raise ValueError(f"keys name shards outside [0, {len(self._clients)})")
        sent = 0
        live = self._live()
        for i in np.unique(shard).tolist():
            if i not in live:
                continue  # a down shard's items are out of reach: their updates are dropped
            sel = shard == i
            local = local_key(keys[sel])
            try:
                self._updates.add(i, *self._submit(i, RPC.REPLAY_UPDATE_PRIORITIES, {}, [local, prios[sel]]))
            except GONE as exc:
                self._down_or_raise(i, exc)
                continue
            sent += local.size
        applied = self._updates.collect(block=wait, read=self._read_update)
        return applied if wait else sent

    def _read_update(self, i: int, tag: int, fut) -> int:
        """One priority update's reply: its totals noted; a shard that does not answer is marked
        down (with a health: 0 applied), else its error is raised."""
        try:
            meta, _ = self._clients[i].result(fut, RPC.REPLAY_UPDATE_PRIORITIES, self.timeout_s)
        except GONE as exc:
            self._down_or_raise(i, exc)
            return 0
        self._note(i, tag, meta)
        return int(meta["applied"])

    def stats(self) -> dict[str, float]:
        """Every shard's stats summed (counts) or averaged (fill), ``replay/shards``, and
        ``replay/split_drift``: how far the last batch's split was from the shards' totals at
        their draws (max over shards of |share - T_i/ΣT|; 0: drawn exactly as one table)."""
        futs, per = [], []
        try:
            for i in self._live():
                futs.append((i, *self._submit(i, RPC.REPLAY_STATS)))
            for i, tag, f in futs:
                meta, _ = self._clients[i].result(f, RPC.REPLAY_STATS, self.timeout_s)
                self._note(i, tag, meta)
                per.append(meta["stats"])
        except GONE as exc:
            self._gone(i, exc)
            raise
        if not per:
            raise ServiceUnavailable("replay.stats: every shard node is down")
        out: dict[str, float] = {"replay/shards": float(len(per)), "replay/split_drift": self.split_drift}
        if self.health is not None:
            out["replay/shards_down"] = float(len(self._clients) - len(per))
        return {**out, **summed_stats(per)}

    def checkpoint(self, name: str) -> list[str]:
        """Each shard writes its table to ``<its checkpoint_dir>/<name>`` (``replay.checkpoint``);
        returns the paths, shard by shard (after every priority update sent before it)."""
        self._updates.collect(block=True, read=self._read_update)
        live = [self._clients[i] for i in self._live()]  # a down shard's table is out of reach
        futs = [c.submit(RPC.REPLAY_CHECKPOINT, {"name": name}, timeout_s=self.timeout_s) for c in live]
        return [c.result(f, RPC.REPLAY_CHECKPOINT, self.timeout_s)[0]["path"] for c, f in zip(live, futs)]

    def close(self) -> None:
        if hasattr(self, "_ahead"):
            self._ahead.clear()
            self._updates.clear()
        for c, own in zip(self._clients, self._own):
            if own:
                c.close()
