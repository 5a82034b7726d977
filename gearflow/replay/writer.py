"""Writers: the actor side of the table, in Reverb's words.

A :class:`Writer` owns a set of partitions (one per environment stream) and
writes to them with one vectorised call per batch of streams, which is what an
EnvPool actor needs (``recv`` returns a batch of envs, each its own stream).
:class:`TrajectoryWriter` is the one-stream form with Reverb's method names.

    writer = TrajectoryWriter(storage, partition=0)
    for t in range(4):
        writer.append({"obs": obs[t], "action": a[t], "reward": r[t], "done": d[t]})
    writer.create_item(priority=1.5, num_steps=4)   # an item over the last 4 steps
    writer.end_episode()

Write protocol per partition (a seqlock; one writer, no lock): bump RESERVE to
the end of the steps about to be written, copy the rows, bump COMMIT. Item
records follow the same rule on their own ring: bump REC_RESERVE to the end of
the items about to be written, write the records, bump PUBLISHED. Readers only
trust rows of steps ``>= RESERVE - S`` and records of items
``>= REC_RESERVE - R``, both counters read *after* their copy.
"""

from __future__ import annotations

import math
import operator
import time
from typing import Any, Callable, Mapping

import numpy as np

from gearflow.replay.checks import (
    ORDER_MESSAGE,
    check_items,
    check_stream_order,
    crossing_message,
    drop_expired,
    expired_message,
    stream_order,
)
from gearflow.replay.inserts import InsertAborted, wait_for_insert  # noqa: F401 - InsertAborted: re-exported
from gearflow.replay.rate_limiter import NO_LIMIT
from gearflow.replay.spec import MAX_STACK

try:  # C item records for one stream (setup.py builds it); the numpy code below is the reference
    from gearflow.replay import _hotpath
except ImportError:  # pragma: no cover - depends on the build
    _hotpath = None
_put_rows = getattr(_hotpath, "put_rows", None)  # large rows of append; None: the slice-copy loop
from gearflow.replay.layout import step_rows
from gearflow.replay.storage import (
    COMMIT,
    EPISODES,
    H_INSERT_LIMIT,
    HEARTBEAT_NS,
    PUBLISHED,
    REC_RESERVE,
    RESERVE,
    SharedStorage,
    claim_partitions,
    release_partitions,
)

LARGE_ROW_BYTES = 2048  # rows this big are copied one slice at a time by append
OFFSET_MAX = MAX_STACK - 1  # a step's offset in its episode is stored capped (uint8)






class StreamPositions:
    """Where each stream of a writer stands, from ``_pos`` (next step), ``_episode_start``,
    ``_S`` (ring steps) and ``_all`` (every stream's index): the bookkeeping a local
    :class:`Writer` and a remote writer's mirror of its shard session share."""

    _pos: np.ndarray
    _episode_start: np.ndarray
    _all: np.ndarray
    _S: int

    @property
    def num_streams(self) -> int:
        return self._all.size

    @property
    def steps_per_stream(self) -> int:
        """Steps a stream holds before its oldest are overwritten (the partition's ring)."""
        return self._S

    @property
    def positions(self) -> np.ndarray:
        """Absolute index of the next step of each stream."""
        return self._pos.copy()

    def episode_starts(self, streams=None) -> np.ndarray:
        """Absolute index of the first step of each stream's current episode."""
        return self._episode_start[self._streams(streams)].copy()

    def episode_lengths(self, streams=None) -> np.ndarray:
        s = self._streams(streams)
        return self._pos[s] - self._episode_start[s]

    def _streams(self, streams) -> np.ndarray:
        if streams is None:
            return self._all
        s = np.asarray(streams, dtype=np.int64).reshape(-1)
        if s.size and (s.min() < 0 or s.max() >= self.num_streams):
            raise ValueError(f"streams {s.tolist()} out of range [0, {self.num_streams})")
        return s


class Writer(StreamPositions):
    """Writes steps and items into ``partitions`` (stream ``i`` → ``partitions[i]``).

    Steps of stream ``i`` are numbered by an absolute, per-partition counter that
    continues across episodes (and across a restarted writer).
    """

    def __init__(self, storage: SharedStorage, partitions, *, insert_timeout_s: float = 60.0, prefault: bool = True):
        parts = np.asarray(partitions, dtype=np.int64).reshape(-1)
        if parts.size == 0:
            raise ValueError("a writer needs at least one partition")
        if np.unique(parts).size != parts.size:
            raise ValueError(f"partitions must be distinct, got {parts.tolist()}")
        if parts.min() < 0 or parts.max() >= storage.num_partitions:
            raise ValueError(
                f"partitions {parts.tolist()} out of range [0, {storage.num_partitions})"
            )
        self.storage = storage
        self.partitions = parts
        self.insert_timeout_s = insert_timeout_s
        self._S = storage.steps_per_partition
        self._R = storage.items_per_partition
        self._trust = storage.trusted_steps  # an item's first step must be >= next step - this
        # expired items dropped by create_items(expired="drop") and the C adder (int64[1]: the C
        # adder counts into it in place)
        self._expired = np.zeros(1, dtype=np.int64)
        claim_partitions(storage, parts)  # refused while another live writer has one of them
        c = storage.counters
        # A writer that died mid-write left RESERVE ahead of COMMIT: those rows may be
        # torn, so a new writer continues after them (RESERVE never moves back).
        self._pos = np.maximum(c[parts, RESERVE], c[parts, COMMIT])  # next step per stream
        c[parts, COMMIT] = self._pos
        c[parts, RESERVE] = self._pos
        self.abort: Callable[[], bool] | None = None  # polled while an insert waits on the rate limiter
        # an insert held past insert_timeout_s calls hold(seconds held): True waits on, else RateLimiterTimeout
        self.hold: Callable[[float], bool] | None = None
        self._closed = False  # close(): partitions handed over, writes refused
        if prefault:
            storage.prefault(parts)  # no page faults in the env loop's first lap
        self._episode_start = self._pos.copy()
        self._last_item_start = self._pos.copy()
        self._all = np.arange(parts.size)
        self._offsets = storage.step_offset  # uint8[P * S] with stacked-frame columns, else None
        self._frames = frozenset(storage.spec.stacked)  # stacked-frame columns
        self._ramp = np.zeros(0, np.uint8)
        self._record_rows: dict[int, tuple] = {}  # stream -> its partition's record rows (C item path)

    def native_arrays(self) -> dict[str, Any]:
        """The arrays a native (C) adder writes in place, under this writer's protocols: the
        table's ``columns`` (by name, ``[P * S, *shape]``), ``partitions``, ``counters``
        (``[P, 8]``), the item records ``rec_start`` / ``rec_len`` / ``rec_prio`` (``[P, R]``),
        ``header``, ``offsets`` (stacked frames, else ``None``) and this writer's per-stream
        state ``pos`` / ``episode_start`` / ``last_start`` (int64 ``[streams]``), ``trusted``
        (int64 ``[1]``: an item's first step must be ``>= pos - trusted``) and ``expired`` (int64
        ``[1]``: items dropped for starting before that, counted in place). A C path
        that keeps these as the numpy methods do (seqlocks, record ring, episode starts)
        leaves the writer exactly as :meth:`append` / :meth:`create_items` /
        :meth:`end_episode` would; ``_hotpath.nstep_*`` is the one user."""
        st = self.storage
        return {
            "columns": dict(st.columns), "partitions": self.partitions, "counters": st.counters,
            "rec_start": st.item_start, "rec_len": st.item_length, "rec_prio": st.item_priority,
            "header": st.header, "offsets": self._offsets, "pos": self._pos,
            "episode_start": self._episode_start, "last_start": self._last_item_start,
            "trusted": np.array([self._trust], dtype=np.int64), "expired": self._expired,
        }  # fmt: skip

    @property
    def expired_items(self) -> int:
        """Items dropped because the ring had already overwritten their first steps
        (``create_items(expired="drop")``; the C n-step adder drops them the same way)."""
        return int(self._expired[0])

    def wait_for_insert(self, m: int) -> None:
        """Block until the rate limiter takes ``m`` more items (``insert_timeout_s``, then
        :class:`RateLimiterTimeout`; :class:`InsertAborted` once ``abort()`` says stop)."""
        self._wait_for_insert(m)

    def _offset_ramp(self, n: int) -> np.ndarray:
        """``min(i, OFFSET_MAX)`` for ``i < n`` as uint8 (grown on demand, kept)."""
        if self._ramp.size < n:
            self._ramp = np.minimum(np.arange(max(n, 2 * OFFSET_MAX)), OFFSET_MAX).astype(np.uint8)
        return self._ramp

    @property
    def spec(self):
        """The :class:`~gearflow.replay.spec.TableSpec` of the rows this writer takes."""
        return self.storage.spec

    # ------------------------------------------------------------------ steps
    def append(self, steps: Mapping[str, Any], streams=None) -> np.ndarray:
        """One step for each of ``streams`` (default: all), columns shaped ``[k, *shape]``.

        Returns the absolute step index given to each stream's step.
        """
        if self._closed:
            self._refuse_closed()
        s = self._streams(streams)
        if np.unique(s).size != s.size:
            raise ValueError("append writes one step per stream: streams must be distinct")
        arrays, _ = self.storage.spec.check_batch(steps, n=s.size)
        parts, pos = self.partitions[s], self._pos[s]
        rows = step_rows(parts, pos, self._S)
        c = self.storage.counters
        c[parts, RESERVE] = pos + 1
        row_list = None
        for name, arr in arrays.items():
            col = self.storage.columns[name]
            if arr[0].nbytes < LARGE_ROW_BYTES or name in self._frames:
                # one fancy assignment for small rows and for frames (a stacked column's 84×84
                # rows: 6.7 µs for 16 streams against 11 µs one slice at a time, measured here)
                col[rows] = arr
            elif _put_rows is not None and arr.flags.c_contiguous:
                _put_rows(col, rows, arr)  # one memcpy per row in C (fancy assignment: ~0.5 GB/s)
            else:  # the reference: numpy's fancy assignment is slow for big rows; slice copies are memcpys
                row_list = rows.tolist() if row_list is None else row_list
                for r, a in zip(row_list, arr):
                    col[r] = a
        if self._offsets is not None:  # stacked frames: where each step's stack stops reaching back
            self._offsets[rows] = np.minimum(pos - self._episode_start[s], OFFSET_MAX)
        c[parts, COMMIT] = pos + 1
        self._pos[s] = pos + 1
        return pos

    def extend(self, steps: Mapping[str, Any], stream: int = 0) -> int:
        """``n`` consecutive steps of one stream, columns shaped ``[n, *shape]`` (slice copies).

        Returns the absolute index of the first of them.
        """
        if self._closed:
            self._refuse_closed()
        first_col = steps.get(self.storage.spec.columns[0].name)
        arrays, n = self.storage.spec.check_batch(steps, n=len(first_col) if hasattr(first_col, "__len__") else None)
        if n > self._S:
            raise ValueError(f"extend of {n} steps exceeds the partition's {self._S} steps")
        if not 0 <= stream < self.num_streams:
            raise ValueError(f"streams [{stream}] out of range [0, {self.num_streams})")
        s = int(stream)
        p, pos = int(self.partitions[s]), int(self._pos[s])
        c, columns = self.storage.counters, self.storage.columns
        r0 = pos % self._S
        first = min(n, self._S - r0)  # rows before the ring wraps
        lo = p * self._S + r0  # step_rows of the first step, as scalars (slice copies follow)
        c[p, RESERVE] = pos + n
        if first == n:
            for name, arr in arrays.items():
                columns[name][lo : lo + n] = arr
        else:
            base = p * self._S
            for name, arr in arrays.items():
                columns[name][lo : lo + first] = arr[:first]
                columns[name][base : base + n - first] = arr[first:]
        if self._offsets is not None:  # stacked frames: each step's offset in its episode
            o = pos - int(self._episode_start[s])
            if o >= OFFSET_MAX:  # deep in an episode: every offset is the cap
                self._offsets[lo : lo + first] = OFFSET_MAX
                self._offsets[p * self._S : p * self._S + n - first] = OFFSET_MAX
            else:
                off = self._offset_ramp(o + n)[o : o + n]  # min(o + i, cap), precomputed
                self._offsets[lo : lo + first] = off[:first]
                self._offsets[p * self._S : p * self._S + n - first] = off[first:]
        c[p, COMMIT] = pos + n
        self._pos[s] = pos + n
        return pos

    # ------------------------------------------------------------------ items
    def create_items(self, priorities, num_steps, streams=None, ends=None, *, expired: str = "raise") -> None:
        """Publish items: item ``j`` covers steps ``[ends[j] - num_steps[j], ends[j])`` of
        ``streams[j]`` (``ends`` defaults to each stream's next step, i.e. the last
        ``num_steps`` steps). ``streams`` may be one int for many items of one stream.
        Items never cross an episode boundary, and a stream's items are published in
        order of their first step.

        An item whose first step the ring already overwrote (older than the stream's next
        step less ``S``, less a stack's reach with stacked frames) is refused with a
        ValueError and nothing is published (Reverb's expired cell refs); ``expired="drop"``
        skips such items instead and counts them (:attr:`expired_items`): an adder whose
        queued items a tiny ring overtook between two flushes.

        Blocks while the table's rate limiter forbids the insert, up to
        ``insert_timeout_s``, then raises :class:`RateLimiterTimeout`.
        """
        if type(priorities) is np.ndarray and priorities.dtype == np.float64 and priorities.ndim == 1:
            prio = priorities
        else:
            prio = np.asarray(priorities, dtype=np.float64).reshape(-1)
        m = prio.size
        if self._closed:
            self._refuse_closed()
        if expired != "raise":
            if expired != "drop":
                raise ValueError(f'expired must be "raise" or "drop", got {expired!r}')
            if m:  # items starting before the ring's trusted steps: dropped and counted
                one = streams is not None and np.ndim(streams) == 0
                s = np.full(m, int(streams)) if one else self._streams(streams)
                prio, num_steps, streams, ends, dropped = drop_expired(prio, num_steps, s, ends, self._pos, self._trust,
                                                                       streams)  # fmt: skip
                self._expired[0] += dropped
                m = prio.size
        if m == 0:
            return
        if isinstance(streams, (int, np.integer)) or (streams is not None and np.ndim(streams) == 0):
            return self._create_stream_items(prio, num_steps, int(streams), ends)
        if streams is None and m != self.num_streams:
            raise ValueError(f"{m} priorities for {self.num_streams} streams (pass streams=)")
        s = self._streams(streams)
        if s.size != m:
            raise ValueError(f"{m} priorities for {s.size} streams")
        lengths = np.broadcast_to(np.asarray(num_steps, dtype=np.int64), (m,))
        end = self._pos[s] if ends is None else np.broadcast_to(np.asarray(ends, dtype=np.int64), (m,))
        start = check_items(prio, lengths, end, s, self._pos[s], self._episode_start[s], self._S, self._trust)
        c, st = self.storage.counters, self.storage
        # grouped by stream, starts ascending within one; rank: among this call's items of its stream
        order, _, _, rank, last = stream_order(s, start, self._last_item_start, self._R)
        s, start, lengths, prio = s[order], start[order], lengths[order], prio[order]
        parts = self.partitions[s]
        self._wait_for_insert(m)
        seq = c[parts, PUBLISHED] + rank
        slot = seq % self._R
        ends = seq[last] + 1
        # announce the record slots before rewriting them (the record ring's seqlock)
        c[parts[last], REC_RESERVE] = np.maximum(c[parts[last], REC_RESERVE], ends)
        st.item_start[parts, slot] = start
        st.item_length[parts, slot] = lengths
        st.item_priority[parts, slot] = prio
        c[parts[last], PUBLISHED] = ends  # publish after the records are written
        self._last_item_start[s[last]] = start[last]

    def _create_stream_items(self, prio: np.ndarray, num_steps, stream: int, ends) -> None:
        """``create_items`` for many items of one stream (the ``extend`` path): one C call
        where built (the same checks and messages), else a few numpy calls."""
        if not 0 <= stream < self.num_streams:
            raise ValueError(f"streams [{stream}] out of range [0, {self.num_streams})")
        if _hotpath is not None:
            m, pos = prio.size, int(self._pos[stream])
            if ends is None:
                end = np.full(m, pos, dtype=np.int64)
            elif type(ends) is np.ndarray and ends.dtype == np.int64 and ends.ndim == 1 and ends.flags.c_contiguous:
                end = ends
            else:
                end = np.ascontiguousarray(ends, dtype=np.int64).reshape(-1)
            if isinstance(num_steps, (int, np.integer)):
                n = int(num_steps)
            else:
                n = np.ascontiguousarray(np.broadcast_to(np.asarray(num_steps, dtype=np.int64), (m,)))
            self._wait_for_insert(m)
            rows = self._record_rows.get(stream)
            if rows is None:  # the partition's record rows and counter line, viewed once
                p, st = int(self.partitions[stream]), self.storage
                rows = self._record_rows[stream] = (st.item_start[p], st.item_length[p], st.item_priority[p], st.counters[p])
            self._last_item_start[stream] = _hotpath.stream_items(
                *rows, end, n, prio, self._S, pos, int(self._episode_start[stream]),
                int(self._last_item_start[stream]), stream, PUBLISHED, REC_RESERVE, self._trust,
            )  # fmt: skip
            return
        m, R = prio.size, self._R
        pos, ep0 = int(self._pos[stream]), int(self._episode_start[stream])
        lengths = np.broadcast_to(np.asarray(num_steps, dtype=np.int64), (m,))
        end = np.full(m, pos, dtype=np.int64) if ends is None else np.asarray(ends, dtype=np.int64).reshape(-1)
        if end.size != m:
            raise ValueError(f"{m} priorities but {end.size} ends")
        start = check_items(prio, lengths, end, np.full(m, stream), pos, ep0, self._S, self._trust)
        check_stream_order(start, int(self._last_item_start[stream]), R)
        p, c, st = int(self.partitions[stream]), self.storage.counters, self.storage
        self._wait_for_insert(m)
        seq0 = int(c[p, PUBLISHED])
        c[p, REC_RESERVE] = max(int(c[p, REC_RESERVE]), seq0 + m)  # before the record slots change
        r0 = seq0 % R
        slot = slice(r0, r0 + m) if r0 + m <= R else np.arange(seq0, seq0 + m) % R
        st.item_start[p, slot] = start
        st.item_length[p, slot] = lengths
        st.item_priority[p, slot] = prio
        c[p, PUBLISHED] = seq0 + m  # publish after the records are written
        self._last_item_start[stream] = start[-1]

    def _wait_for_insert(self, m: int) -> None:
        """Before publishing ``m`` items (a hook: the shipping writer ships here)."""
        wait_for_insert(self.storage, m, self.insert_timeout_s, self.abort, self.hold, self.partitions)

    def end_episode(self, streams=None) -> None:
        """Close the current episode of ``streams``: later items cannot reach back into it."""
        if streams is not None and np.ndim(streams) == 0:  # one stream: plain int indexing
            s = int(streams)
            if not 0 <= s < self.num_streams:
                raise ValueError(f"streams [{s}] out of range [0, {self.num_streams})")
            self._episode_start[s] = self._pos[s]
            self.storage.counters[int(self.partitions[s]), EPISODES] += 1
            return
        s = np.unique(self._streams(streams))  # a stream listed twice ends one episode
        self._episode_start[s] = self._pos[s]
        self.storage.counters[self.partitions[s], EPISODES] += 1

    def flush(self) -> None:
        """Make the writer's state visible: steps and items are published as they are
        written, so this only stamps the partitions' heartbeat (used by supervisors)."""
        self.storage.counters[self.partitions, HEARTBEAT_NS] = time.monotonic_ns()

    def close(self) -> None:
        """Hand the partitions over: they stop being this process's, so a writer in another
        process may continue them (after their last step) while this one lives, e.g. offline
        data prefilled here, then an actor. Everything written stays published; this writer
        refuses further writes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        release_partitions(self.storage, self.partitions)

    def _refuse_closed(self) -> None:
        raise ValueError(f"this writer was closed: partitions {self.partitions.tolist()} were handed over")

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrajectoryWriter:
    """One stream, Reverb's names: ``append`` / ``extend`` / ``create_item`` / ``end_episode`` / ``flush``.

    ``append`` and ``create_item`` are the per-step loop of a one-env actor: they write the
    row and the item record with scalar stores (no batch arrays), under the same checks,
    write protocol and rate limiter as :class:`Writer`, which holds the stream's state."""

    def __init__(self, storage: SharedStorage, partition: int, *, insert_timeout_s: float = 60.0):
        self._w = Writer(storage, [partition], insert_timeout_s=insert_timeout_s)
        self.partition = p = int(partition)
        self._counters = storage.counters[p]  # this partition's counter line
        self._columns = [storage.columns[c.name] for c in storage.spec]
        self._records = (storage.item_start[p], storage.item_length[p], storage.item_priority[p])
        self._S, self._R = storage.steps_per_partition, storage.items_per_partition

    @property
    def episode_length(self) -> int:
        return int(self._w._pos[0] - self._w._episode_start[0])

    @property
    def position(self) -> int:
        return int(self._w._pos[0])

    def append(self, step: Mapping[str, Any]) -> int:
        """One unbatched step; returns its absolute index."""
        values = self._w.storage.spec.check_row(step)  # every column checked before a byte is stored
        w, c = self._w, self._counters
        if w._closed:
            w._refuse_closed()
        pos = int(w._pos[0])
        row = step_rows(self.partition, pos, self._S)  # one step, as scalars (the per-step path)
        c[RESERVE] = pos + 1
        for col, v in zip(self._columns, values):
            col[row] = v
        if w._offsets is not None:  # stacked frames: the step's offset in its episode
            w._offsets[row] = min(pos - int(w._episode_start[0]), OFFSET_MAX)
        c[COMMIT] = pos + 1
        w._pos[0] = pos + 1
        return pos

    def extend(self, steps: Mapping[str, Any]) -> int:
        return self._w.extend(steps)

    def create_item(self, priority: float, num_steps: int) -> None:
        """An item over the last ``num_steps`` steps of the current episode."""
        w, c = self._w, self._counters
        if w._closed:
            w._refuse_closed()
        try:
            prio, n = float(priority), operator.index(num_steps)
        except TypeError:
            raise ValueError(f"create_item(priority, num_steps): a number and an int, got {priority!r}, {num_steps!r}") from None
        if not (prio >= 0.0 and prio != math.inf):
            raise ValueError(f"priority must be finite and ≥ 0, got {prio!r} at index 0 (1 bad of 1)")
        if not 1 <= n <= self._S:
            raise ValueError(f"num_steps must be in [1, {self._S}], got {n}")
        pos, ep0 = int(w._pos[0]), int(w._episode_start[0])
        start = pos - n
        if start < ep0:
            raise ValueError(crossing_message(n, 0, pos - ep0))
        if start < pos - w._trust:  # only with stacked frames: n > S - their reach
            raise ValueError(expired_message(start, 0, pos, w._trust))
        if start < w._last_item_start[0]:
            raise ValueError(ORDER_MESSAGE)
        if int(w.storage.header[H_INSERT_LIMIT]) != NO_LIMIT:
            w._wait_for_insert(1)
        seq = int(c[PUBLISHED])
        if c[REC_RESERVE] < seq + 1:
            c[REC_RESERVE] = seq + 1  # announce the record slot before rewriting it
        starts, lengths, prios = self._records
        r = seq % self._R
        starts[r], lengths[r], prios[r] = start, n, prio
        c[PUBLISHED] = seq + 1  # publish after the record is written
        w._last_item_start[0] = start

    def end_episode(self) -> None:
        self._w.end_episode()

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        """:meth:`Writer.close`: the partition is handed over (another process may continue it)."""
        self._w.close()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
