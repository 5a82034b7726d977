"""The shard service: one machine's replay table (and parameter store) served over TCP.

    table = Table(storage, Transition(next_columns=("obs",)), make_selector("prioritized", P * R))
    shard = ShardService(table, params=store, host="0.0.0.0", port=7000, token=token)
    shard.start()                                  # the bound port
    ...                                            # remote actors write, learners sample
    shard.stop()                                   # the table and store stay the caller's

Message types (:class:`~gearflow.transport.service.Service` handlers):

* ``replay.info`` — the spec, geometry, item kind and selector.
* ``replay.open_writer`` — a session for one remote writer: ``num_streams`` partitions out
  of the shard's assignable ones (or the ``partitions`` it asks for, when free), written by
  a :class:`~gearflow.replay.Writer` of this process; replies with their positions. The
  session ends with its connection (or ``replay.close_writer``), freeing the partitions.
* ``replay.write`` — a batch of writer calls, applied in order by the session's Writer:
  ``append`` / ``extend`` / ``create_items`` / ``end_episode`` / ``flush`` with the local
  writer's semantics and errors. A ``create_items`` the rate limiter holds holds the
  reply, and the client has at most ``max_in_flight`` requests unanswered: back-pressure
  is bounded in-flight data, never a queue. A held insert gives up when its connection
  closes or the service stops (:class:`~gearflow.replay.writer.InsertAborted`).
* ``replay.sample`` — the shard's own draw: keys, probabilities, IS weights, the data, and
  the shard's priority total and item count at the draw (under the table lock, after the
  scan the draw made): what a several-shard sampler needs to draw like one table (see
  :mod:`gearflow.transport.learner.sampler`). Wide columns (rows of ≥ ``wire_min_row_bytes``, 1024:
  frames, observations) are not gathered: their rows go to the socket straight out of the
  segment (:mod:`gearflow.transport.server.wire`), and the reply's last buffer ``torn`` (``"torn":
  true`` in its meta), written after the rest has left the process, marks the items writers
  overwrote meanwhile, for the sampler to redraw. The other columns go out of the table's
  own buffers (no copy); sample ``j`` waits until the reply of sample ``j - num_buffers`` has
  left the socket, since it reuses that buffer set.
* ``replay.total`` — the total and count only (after a scan): a several-shard round's shard
  that was given no draw still reports them, so its share of the next split is current.
* Pacing (a learner over several shards keeps one rate limiter over all of them,
  :mod:`gearflow.replay.pacing`): ``replay.info`` names the rate limiter; every reply above
  and ``replay.update_priorities`` / ``replay.stats`` carry the table's ``inserts``,
  ``samples``, ``deletes`` and ``size``; a ``pace`` in ``replay.sample`` / ``replay.total`` is
  the writers' insert limit (:meth:`Table.pace`: the table then samples whenever it holds an
  item), and a ``replay.sample`` without one puts the table back on its own limiter.
* ``replay.update_priorities`` (replies with the total and count it left), ``replay.stats``,
  ``replay.checkpoint`` (into the shard's ``checkpoint_dir``, by a plain name). ``replay.info``
  names the selector (and its ``alpha``): several shards sample as one table only with one.
* ``params.get`` — the latest weights if newer than ``min_version``, else only
  ``{"version": null}``: one round trip when nothing is new.

A ``replay.write`` request's ops are decoded by :func:`gearflow.transport.ops.decode_ops` (the
layout is written there, once, with the encoder the writers use), every op and range checked
before the first is applied: a malformed batch is refused whole, with a ``ValueError`` naming
the op and the field, and nothing the table holds changes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from gearflow.replay.rate_limiter import NO_LIMIT, RateLimiterTimeout
from gearflow.replay.table import BufferRing
from gearflow.transport.ops import RPC
from gearflow.transport.server.sessions import WriterSessions
from gearflow.transport.server.wire import WireRows
from gearflow.transport.service import ANY_ROLE, Connection, Defer, Service, ServiceLimits

log = logging.getLogger(__name__)

__all__ = ["ShardService", "priority_total"]


def _pace_of(meta: dict) -> int | None:
    """A request's ``pace`` (the insert limit a learner pacing several shards sets here), checked."""
    pace = meta.get("pace")
    if pace is not None and (type(pace) is not int or not 0 <= pace <= NO_LIMIT):
        raise ValueError(f"pace must be an int in [0, 2^63), got {pace!r}")
    return pace

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class _Lane:
    """One sampler's buffer sets and the samples drawn into them whose replies have not left
    the socket: sample ``j`` of a lane reuses the buffer set of sample ``j - num_buffers`` of
    the same lane, so a client that does not read its replies holds only its own lane."""

    def __init__(self, ring: BufferRing | None):
        self.ring, self.samples, self.unsent = ring, 0, set()


def priority_total(table) -> tuple[float, int]:
    """(total sampling mass, live items) of ``table``'s selector: the sum tree's total for a
    prioritized selector, the item count for the others (uniform mass 1 per item)."""
    count = int(table.size)
    tree = getattr(table.selector, "tree", None)
    return (float(tree.total) if tree is not None else float(count)), count


class ShardService:
    """Serves ``table`` (and ``params``, a :class:`~gearflow.params.ParameterStore`) over a
    :class:`Service` (see the module docstring). ``partitions``: those remote writers may be
    given (default all: a learner process that also has local actors passes the others).
    ``learners=False``: no ``replay.sample`` / ``update_priorities`` / ``checkpoint`` (only
    remote actors: the process's own learner samples the table directly). With ``learners``
    the table must be sampled only through this object (:meth:`sample` locally, under
    :attr:`lock`): it counts samples to know when a buffer set is free."""

    def __init__(self, table, *, params=None, partitions: Sequence[int] | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 limits: ServiceLimits | None = None, loop: str = "auto",
                 checkpoint_dir: str | None = None, service: Service | None = None,
                 learners: bool = True, wire_min_row_bytes: int | None = 1024):  # fmt: skip
        self.table, self.params = table, params
        self.service = service or Service(host, port, token, limits=limits, loop=loop, name="shard")
        # wide columns out of the segment, integrity on or off: a row a writer changes while it is sent
        # is marked torn, and the frame's MAC leaves it out (gearflow.transport.integrity: torn rows)
        self.wire = WireRows(table, wire_min_row_bytes if learners else None)
        self.sessions = WriterSessions(table, self.service, partitions)  # replay.open_writer / write / close_writer
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.lock = threading.Condition()  # the table: sample, priorities, stats, checkpoints
        self._local = _Lane(None)  # sample(): the table's own buffer sets (each connection has its own lane)
        s = self.service
        # actors (ANY_ROLE): write their sessions' partitions, read stats and weights; the rest is the learners'
        s.register(RPC.REPLAY_INFO, self._info, inline=True)
        self.sessions.register(s)
        s.register(RPC.REPLAY_STATS, self._stats, inline=True, roles=ANY_ROLE)
        if learners:  # on the loop when the table is free and can answer at once (no thread hop), else in the pool
            s.register(RPC.REPLAY_SAMPLE, self._sample, inline=True, with_connection=True)
            s.register(RPC.REPLAY_UPDATE_PRIORITIES, self._update_priorities, inline=True)
            s.register(RPC.REPLAY_TOTAL, self._total, inline=True)
            s.register(RPC.REPLAY_CHECKPOINT, self._checkpoint)
        s.register(RPC.PARAMS_GET, self._params_get, roles=ANY_ROLE)

    @property
    def assignable(self) -> list[int]:
        return self.sessions.assignable

    @property
    def writable(self) -> Callable[[Connection], set[int]] | None:
        """``writable(conn)`` → the partitions an actor-role connection may write (the run's
        places it joined: ``roles.remote_actors.Members``); None: any assignable one."""
        return self.sessions.writable

    @writable.setter
    def writable(self, fn: Callable[[Connection], set[int]] | None) -> None:
        self.sessions.writable = fn

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> int:
        return self.service.start()

    def stop(self) -> None:
        self.service.stop()

    @property
    def port(self) -> int:
        return self.service.port

    def __enter__(self) -> ShardService:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------- info
    def _info(self, meta, bufs):
        st, t = self.table.storage, self.table
        return {
            "spec": st.spec.to_dict(), "num_partitions": st.num_partitions,
            "steps_per_partition": st.steps_per_partition, "items_per_partition": st.items_per_partition,
            "kind": t.kind.to_dict(), "selector": t.selector.name, "alpha": getattr(t.selector, "alpha", None),
            "importance_sampled": bool(t.selector.importance_sampled), "assignable": self.assignable,
            "params": self.params is not None, "rate_limiter": asdict(t.rate_limiter),
        }, []  # fmt: skip

    # ----------------------------------------------------------------- learners
    def _locked(self, deferred: bool) -> None:
        """Take the table lock: on the loop (not ``deferred``) only if it is free now."""
        if deferred:
            self.lock.acquire()
        elif not self.lock.acquire(blocking=False):
            raise Defer

    def sample(self, batch_size: int, timeout_s: float | None = None, beta: float | None = None,
               deferred: bool = True):  # fmt: skip
        """Draw a batch under the table lock; returns ``(sample, total, count, release)``: call
        ``release()`` once the batch's buffers may be reused (the table's ``num_buffers`` rule).
        ``deferred=False`` (on the service's loop): raise :class:`Defer` rather than wait."""
        timeout_s = self.table.sample_timeout_s if timeout_s is None else float(timeout_s)
        batch, _, _, (total, count, _), release = self._draw(batch_size, timeout_s, beta, deferred, None, self._local)
        return batch, total, count, release

    def _draw(self, batch_size: int, timeout_s: float, beta: float | None, deferred: bool, tensors,
              lane: _Lane, aborted=lambda: False, pace: int | None | bool = False):  # fmt: skip
        """:meth:`sample` into ``lane``'s buffers, gathering only ``tensors`` (None: every column),
        with the draw's slots and records: ``(sample, slots, records, total, count, release)``.
        The wait (for the rate limiter, or for the lane's buffer set to leave the socket) is
        spent without the table lock, and ends at ``timeout_s``, when the service stops or
        when ``aborted()`` (the request's connection closed). ``pace``: the insert limit a learner
        pacing several shards sets (``None``: the table's own limiter again; ``False``: as it is)."""
        t = self.table
        deadline = time.monotonic() + timeout_s
        delay = 1e-4
        while True:
            self._locked(deferred)
            try:
                j = lane.samples
                if pace is not False:
                    t.pace(pace)
                t.scan()
                busy = (j - t.num_buffers) in lane.unsent  # its buffer set is still being sent
                last = time.monotonic() >= deadline
                if not busy and (t.can_sample(batch_size) or (deferred and last)):
                    if beta is not None and t.selector.importance_sampled:
                        t.selector.beta = float(beta)
                    try:  # on the loop: never wait (a redraw after torn items that must wait goes to the pool)
                        batch, slots, rec = t.draw(batch_size, max(0.0, deadline - time.monotonic()) if deferred else 0.0,
                                                   tensors, lane.ring)  # fmt: skip
                    except RateLimiterTimeout:
                        if deferred:
                            raise
                        raise Defer from None
                    total, count = priority_total(t)
                    counters = t.pace_counters()
                    lane.samples = j + 1
                    lane.unsent.add(j)
                    break
                if not deferred:
                    raise Defer
                if last or self.service.stopping or aborted():
                    why = "its connection closed" if aborted() else "the service is stopping" if self.service.stopping else \
                        f"the batch {t.num_buffers} samples ago is still being sent after {timeout_s:.1f} s"  # fmt: skip
                    raise RateLimiterTimeout(f"sample of {batch_size}: {why}")
                # wait without the table: a release() or the next poll wakes it
                self.lock.wait(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(delay * 2, 0.01)
            finally:
                self.lock.release()

        def release():
            with self.lock:
                lane.unsent.discard(j)
                self.lock.notify_all()

        return batch, slots, rec, (total, count, counters), release

    def _reply_bytes(self, batch_size: int) -> int:
        """Bytes of a ``replay.sample`` reply of ``batch_size`` items (keys, probabilities,
        weights, every output, the torn marks)."""
        per = getattr(self, "_item_bytes", None)
        if per is None:
            layout = self.table.kind.layout(self.table.storage.spec, 1)
            per = 8 + 8 + 4 + 1 + sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
                                      for shape, dt in layout.values())  # fmt: skip
            self._item_bytes = per
        return per * batch_size

    def _sample(self, meta: dict, bufs, conn: Connection, deferred: bool = False):
        limits = self.service.limits
        b = meta.get("batch_size")
        if type(b) is not int or b < 1:
            raise ValueError(f"batch_size must be an int ≥ 1, got {b!r}")
        if b > limits.max_batch:
            raise ValueError(f"batch_size {b} exceeds this service's transport.limits.max_batch={limits.max_batch}")
        if self._reply_bytes(b) > limits.max_reply_bytes:
            raise ValueError(f"a sample of {b} items is a reply of {self._reply_bytes(b)} bytes, over this service's "
                             f"transport.limits.max_reply_bytes={limits.max_reply_bytes}")  # fmt: skip
        timeout = limits.wait_s(meta.get("timeout_s"), self.table.sample_timeout_s)
        pace = _pace_of(meta)
        beta = meta.get("beta")
        lane = conn.state.get("lane")
        if lane is None:  # this connection's own buffer sets (dropped with it)
            lane = conn.state["lane"] = _Lane(BufferRing(self.table.num_buffers))
        # a request without "pace" is from a learner that does not pace (one shard): the table's own limiter
        batch, slots, rec, (total, count, counters), release = self._draw(
            b, timeout, beta if isinstance(beta, (int, float)) and not isinstance(beta, bool) else None,
            deferred, self.wire.gathered, lane, lambda: conn.closed, pace)  # fmt: skip
        row_key = conn.row_key if meta.get("row_digests") is True else None  # the learner takes row digests
        meta = {"total": total, "count": count, "beta": getattr(self.table.selector, "beta", None), **counters}
        return self.wire.reply(batch, slots, rec, meta, release, row_key)

    def _total(self, meta: dict, bufs, deferred: bool = False):
        """The table's priority total, live count and counters now (after a scan), as a draw would
        see them; a ``pace`` sets the writers' insert limit first."""
        pace = _pace_of(meta)
        self._locked(deferred)
        try:
            if pace is not None:
                self.table.pace(pace)
            self.table.scan()
            total, count = priority_total(self.table)
            counters = self.table.pace_counters()
        finally:
            self.lock.release()
        return {"total": total, "count": count, **counters}, []

    def _update_priorities(self, meta: dict, bufs, deferred: bool = False):
        if len(bufs) != 2:
            raise ValueError("replay.update_priorities takes two buffers: keys (int64), priorities")
        self._locked(deferred)
        try:
            applied = self.table.update_priorities(bufs[0], bufs[1])
            total, count = priority_total(self.table)
            counters = self.table.pace_counters()
        finally:
            self.lock.release()
        return {"applied": int(applied), "total": total, "count": count, **counters}, []

    def _stats(self, meta: dict, bufs, deferred: bool = False):
        self._locked(deferred)
        try:
            stats = self.table.stats()
            total, count = priority_total(self.table)
            counters = self.table.pace_counters()
        finally:
            self.lock.release()
        stats.update(self.service.stats())
        stats["replay/remote_partitions"] = self.sessions.writing()
        if self.wire:
            stats["replay/torn_resampled"] = stats.get("replay/torn_resampled", 0) + self.wire.torn
        return {"stats": {k: float(v) for k, v in stats.items()}, "total": total, "count": count, **counters}, []

    def _checkpoint(self, meta: dict, bufs):
        from gearflow.replay.table_checkpoint import save_checkpoint

        name = meta.get("name")
        if self.checkpoint_dir is None:
            raise ValueError("this shard has no checkpoint_dir: remote checkpoints are off")
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):  # fullmatch: no trailing newline
            raise ValueError(f"a checkpoint name is 1-128 characters of [A-Za-z0-9_.-], got {str(name)[:40]!r}")
        with self.lock:
            path = save_checkpoint(self.table, self.checkpoint_dir / name)
        return {"path": str(path)}, []

    # ----------------------------------------------------------------- parameters
    def _params_get(self, meta: dict, bufs):
        if self.params is None:
            raise ValueError("this shard serves no parameters")
        have = meta.get("min_version", 0)
        if type(have) is not int:
            raise ValueError(f"min_version must be an int, got {have!r}")
        if self.params.latest_version() <= have:
            return {"version": None}, []
        version, state = self.params.read()
        names = list(state)
        return {"version": version, "names": names}, [state[n] for n in names]

