"""The shard's writer sessions: ``replay.open_writer``, ``replay.write``, ``replay.close_writer``.

A session is one remote writer's partitions (out of the shard's assignable ones), written by
a :class:`~gearflow.replay.Writer` of this process; it ends with its connection or
``replay.close_writer``, freeing the partitions. An actor-role connection opens sessions only
on the partitions of the places it joined (``writable``). The ops of a ``replay.write`` are
decoded by :func:`gearflow.transport.ops.decode_ops`, every op and range checked before the
first is applied. :class:`~gearflow.transport.server.shard.ShardService` registers these
handlers on its service.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from gearflow.replay.rate_limiter import NO_LIMIT
from gearflow.replay.storage import EPISODES, H_INSERT_LIMIT, PartitionOwned
from gearflow.replay.writer import Writer
from gearflow.transport.auth import AuthorizationError
from gearflow.transport.errors import SessionLost
from gearflow.transport.ops import (
    RPC,
    Append,
    CreateItems,
    EndEpisode,
    Episodes,
    Extend,
    Flush,
    decode_ops,
)
from gearflow.transport.service import ANY_ROLE, Connection, Defer, Service

log = logging.getLogger("gearflow.transport.server.shard")

__all__ = ["WriterSessions"]


class WriterSessions:
    """The remote writers of ``table``'s storage: which session owns which partition, and the
    handlers that open, write and close sessions. ``partitions``: those remote writers may be
    given (default all)."""

    def __init__(self, table, service: Service, partitions: Sequence[int] | None = None):
        self.storage, self.service = table.storage, service
        P = self.storage.num_partitions
        parts = list(range(P)) if partitions is None else [int(p) for p in partitions]
        if any(not 0 <= p < P for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"assignable partitions must be distinct and in [0, {P}), got {parts}")
        self.assignable = parts
        # writable(conn) -> the partitions an actor-role connection may write (the run's places it
        # joined: roles.remote_actors.Members); None: any assignable one
        self.writable: Callable[[Connection], set[int]] | None = None
        self._owner: dict[int, int] = {}  # partition -> session
        self._owners_lock = threading.Lock()
        self._sessions = itertools.count(1)
        self._names = [c.name for c in self.storage.spec]

    def writing(self) -> int:
        """How many partitions remote writers hold now."""
        with self._owners_lock:
            return len(self._owner)

    def register(self, s: Service) -> None:
        s.register(RPC.REPLAY_OPEN_WRITER, self.open, with_connection=True, roles=ANY_ROLE)
        s.register(RPC.REPLAY_CLOSE_WRITER, self.close, with_connection=True, roles=ANY_ROLE)
        # on the loop while no rate limit is set (nothing can wait), else in the pool
        s.register(RPC.REPLAY_WRITE, self.write, with_connection=True, inline=True, roles=ANY_ROLE)

    def open(self, meta: dict, bufs, conn: Connection):
        k = meta.get("num_streams")
        want = meta.get("partitions")
        timeout = self.service.limits.wait_s(meta.get("insert_timeout_s"), 60.0)
        session = next(self._sessions)
        allowed = self.writable(conn) if self.writable is not None and conn.role == "actor" else None
        if allowed is not None:
            if want is None:
                raise AuthorizationError("an actor credential opens writers on the partitions of its joined place "
                                      "(run.join first, then replay.open_writer with those partitions)")
            if not isinstance(want, list) or not set(want) <= allowed:
                raise AuthorizationError(f"partitions {want!r} are not those of a place this actor credential "
                                      f"({conn.actor_name}) joined: {sorted(allowed)}")  # fmt: skip
        with self._owners_lock:
            if want is not None:
                if not isinstance(want, list) or not all(type(p) is int for p in want) or (k is not None and len(want) != k):
                    raise ValueError(f"partitions must be a list of {k} ints, got {want!r}")
                bad = [p for p in want if p not in self.assignable]
                if bad:
                    raise ValueError(f"partitions {bad} are not assignable to remote writers here ({self.assignable})")
                taken = [p for p in want if p in self._owner]
                if taken:
                    raise PartitionOwned(f"partitions {taken} are written by another remote writer")
                parts = want
            else:
                if type(k) is not int or k < 1:
                    raise ValueError(f"num_streams must be an int ≥ 1, got {k!r}")
                free = [p for p in self.assignable if p not in self._owner]
                if len(free) < k:
                    raise ValueError(f"{k} streams asked for, {len(free)} of the shard's {len(self.assignable)} "
                                     f"assignable partitions are free")  # fmt: skip
                parts = free[:k]
            for p in parts:
                self._owner[p] = session
        try:
            w = Writer(self.storage, parts, insert_timeout_s=timeout)
        except BaseException:
            self.release(session, parts)
            raise
        w.abort = lambda: conn.closed or self.service.stopping
        conn.state.setdefault("writers", {})[session] = w
        conn.on_close(lambda: self.release(session, parts))
        log.info("shard: writer session %d from %s: partitions %s", session, conn.peer, parts)
        return {
            "session": session, "partitions": parts, "positions": w.positions.tolist(),
            "episode_starts": w.episode_starts().tolist(), "spec": self.storage.spec.to_dict(),
            "steps_per_stream": w.steps_per_stream, "items_per_stream": self.storage.items_per_partition,
        }, []  # fmt: skip

    def release(self, session: int, parts: list[int]) -> None:
        with self._owners_lock:
            for p in parts:
                if self._owner.get(p) == session:
                    del self._owner[p]

    def session(self, conn: Connection, meta: dict) -> Writer:
        w = conn.state.get("writers", {}).get(meta.get("session"))
        if w is None:
            raise SessionLost(f"no writer session {meta.get('session')!r} on this connection (reopen it)")
        return w

    def close(self, meta: dict, bufs, conn: Connection):
        w = conn.state.get("writers", {}).pop(meta.get("session"), None)
        if w is not None:
            self.release(meta["session"], w.partitions.tolist())
        return {}, []

    def write(self, meta: dict, bufs: list, conn: Connection, deferred: bool = False):
        if not deferred and int(self.storage.header[H_INSERT_LIMIT]) != NO_LIMIT:
            raise Defer  # a create_items may wait on the rate limiter: not on the loop
        w = self.session(conn, meta)
        if len(bufs) < 2:
            raise ValueError("replay.write: the buffers must be [ints, floats, columns...]")
        ints, floats, cols = bufs[0], bufs[1], bufs[2:]
        if ints.dtype != np.int64 or floats.dtype != np.float64 or ints.ndim != 1 or floats.ndim != 1:
            raise ValueError("replay.write: buffers 0 and 1 must be 1-D int64 and float64")
        if cols and len(cols) != len(self._names):
            raise ValueError(f"replay.write: {len(cols)} column buffers for {len(self._names)} columns")
        if cols and len({len(c) for c in cols}) != 1:
            raise ValueError(f"replay.write: the column buffers hold {sorted({len(c) for c in cols})} rows: one count for every column")
        # every op and every range it names checked before the first is applied: a malformed batch changes nothing
        ops = decode_ops(meta.get("ops"), ints.size, floats.size, len(cols[0]) if cols else None)
        row = 0

        def rows(n: int) -> dict:
            return {name: c[row:row + n] for name, c in zip(self._names, cols)}

        for op in ops:
            if type(op) is Append:
                w.append(rows(op.count), streams=ints[op.ints_at:op.ints_at + op.count])
                row += op.count
            elif type(op) is Extend:
                stream, n, t0 = op.stream, op.count, op.first_step
                if t0 is not None:  # the first step's index: a shipped log continues exactly where it stopped
                    if not 0 <= stream < w.num_streams or int(w.positions[stream]) != t0:
                        raise SessionLost(f"replay.write: steps from {t0} of stream {stream} do not continue the "
                                          f"shard's partition (at {int(w.positions[stream]) if 0 <= stream < w.num_streams else '?'})")
                w.extend(rows(n), stream=stream)
                row += n
            elif type(op) is CreateItems:
                m, o, s = op.count, op.ints_at, op.stream
                streams = ints[o + m:o + 2 * m] if s < 0 else s
                e0 = o + (2 * m if s < 0 else m)  # ends follow the streams, if any
                ends = ints[e0:e0 + m] if op.has_ends else None
                w.insert_timeout_s = self.service.limits.wait_s(op.timeout_s, 60.0)
                w.create_items(floats[op.floats_at:op.floats_at + m], ints[o:o + m], streams, ends, expired=op.expired)
            elif type(op) is EndEpisode:
                w.end_episode(None if op.count < 0 else ints[op.ints_at:op.ints_at + op.count])
            elif type(op) is Episodes:  # episodes ended (the counter only: a shipped log's items carry their own ends)
                if not 0 <= op.stream < w.num_streams:
                    raise ValueError(f"streams [{op.stream}] out of range [0, {w.num_streams})")
                self.storage.counters[int(w.partitions[op.stream]), EPISODES] += op.count
            elif type(op) is Flush:
                w.flush()
        return {}, []
