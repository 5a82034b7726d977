"""RemoteWriter: a :class:`~gearflow.replay.protocols.WriterLike` over a shard's ``replay.write`` (the actor side).

    writer = RemoteWriter("10.0.0.5:7000", num_streams=16, token=token)   # WriterLike
    adder = TransitionAdder(writer, n=3, gamma=0.99)                         # unchanged

Every check a local :class:`~gearflow.replay.Writer` makes is made here, at the same call and
with the same message (spec, streams, sizes, priorities, episode boundaries, item order: the
item checks are :mod:`gearflow.replay.checks`, the ones the local writer calls), against a
mirror of the session's positions; the writes are then staged (one copy into reused
per-column buffers, the calls as typed :mod:`~gearflow.transport.ops`) and sent as one
``replay.write`` by the first ``create_items`` at least ``max_delay_s`` after the previous send
(or by ``flush``, or once ``batch_bytes`` are staged), without waiting for the reply: at most
``max_in_flight`` batches are unanswered, and the next send waits for the oldest reply (the
rate limiter holds it on the shard: bounded in-flight data is the back-pressure). So what can
only fail on the shard — the rate limiter's timeout, a lost connection — is raised at the
writer's next call (or ``flush``, which waits for every reply), with its own type
(:class:`~gearflow.replay.RateLimiterTimeout`,
:class:`~gearflow.transport.client.ServiceUnavailable`, ...). ``create_items`` with
``insert_timeout_s <= 0`` (an adder's non-blocking flush at shutdown) waits for its own
reply, so its ``RateLimiterTimeout`` comes from that call as locally. Every wait has a
timeout and polls ``abort``. After a lost connection the next call re-opens the session
(same partitions, positions from the shard: as a restarted local writer continues) and
raises :class:`~gearflow.transport.errors.SessionLost` once, since the steps staged meanwhile are
gone. A batch that fails part-way on the shard (its rate limiter's timeout, an op the shard
refused) leaves the shard's session short of what this mirror assumed: the writer waits for the
batches still in flight, re-opens the session on the same partitions (positions from the shard)
and raises that error once, with its own type and a note saying so; later calls continue
from the shard's positions. Either way an adder over the writer holds n-step items of lost
steps and should be rebuilt (an actor process rejoins).
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gearflow.replay.checks import check_items, check_stream_order, stream_order
from gearflow.replay.spec import TableSpec
from gearflow.replay.writer import StreamPositions
from gearflow.transport.client import RequestTimeout, ServiceUnavailable, as_client
from gearflow.transport.errors import InsertAborted, RateLimiterTimeout, SessionLost
from gearflow.transport.ops import Append, CreateItems, EndEpisode, Extend, Flush, RPC, WriteOp, encode_ops

__all__ = ["POLL_S", "RemoteWriter", "close_session"]

POLL_S = 0.05  # how often a wait polls ``abort``
# what a writer's close drops: the shard is gone, its rate limiter or service said stop
GONE = (ServiceUnavailable, RequestTimeout, RateLimiterTimeout, InsertAborted)


def close_session(client: Any, own_client: bool, session: Any, timeout_s: float, drain: Callable[[], bool]) -> None:
    """A remote writer's close: ``drain()`` sends what is left and says whether the session is
    still there to end (``replay.close_writer``); errors of a gone shard (:data:`GONE`) are
    dropped; the client is closed if the writer made it (``own_client``)."""
    try:
        if drain():
            client.call(RPC.REPLAY_CLOSE_WRITER, {"session": session}, timeout_s=timeout_s)
    except GONE:
        pass
    finally:
        if own_client:
            client.close()


class _Stage:
    """One batch of writer calls being built: ops, ints, floats and the rows of every column,
    in buffers reused from batch to batch (grown by doubling)."""

    def __init__(self, spec: TableSpec):
        self.cols = {c.name: np.empty((64, *c.row_shape), dtype=c.dtype) for c in spec}
        self.ints = np.empty(256, dtype=np.int64)
        self.floats = np.empty(64, dtype=np.float64)
        self.ops: list[WriteOp] = []
        self.rows = self.ni = self.nf = 0
        self.nbytes = 0
        self.row_bytes = sum(c.nbytes for c in spec)

    def clear(self) -> None:
        self.ops, self.rows, self.ni, self.nf, self.nbytes = [], 0, 0, 0, 0

    def add_rows(self, arrays: Mapping[str, np.ndarray], n: int) -> None:
        if self.rows + n > len(next(iter(self.cols.values()))):
            cap = max(2 * (self.rows + n), 64)
            for name, a in self.cols.items():
                b = np.empty((cap, *a.shape[1:]), dtype=a.dtype)
                b[: self.rows] = a[: self.rows]
                self.cols[name] = b
        for name, a in arrays.items():
            self.cols[name][self.rows:self.rows + n] = a
        self.rows += n
        self.nbytes += n * self.row_bytes

    def add_ints(self, *arrays) -> int:
        o = self.ni
        n = sum(np.size(a) for a in arrays)
        if o + n > self.ints.size:
            self.ints = np.concatenate([self.ints[:o], np.empty(max(o + n, 2 * self.ints.size), np.int64)])
        for a in arrays:
            k = np.size(a)
            self.ints[self.ni:self.ni + k] = a
            self.ni += k
        return o

    def add_floats(self, a: np.ndarray) -> int:
        o = self.nf
        if o + a.size > self.floats.size:
            self.floats = np.concatenate([self.floats[:o], np.empty(max(o + a.size, 2 * self.floats.size))])
        self.floats[o:o + a.size] = a
        self.nf += a.size
        return o

    def buffers(self) -> list[np.ndarray]:
        cols = [a[: self.rows] for a in self.cols.values()] if self.rows else []
        return [self.ints[: self.ni], self.floats[: self.nf], *cols]


class RemoteWriter(StreamPositions):
    """A :class:`~gearflow.replay.protocols.WriterLike` over a shard's ``replay.write`` (see the
    module docstring). ``partitions``: ask for these (a restarted actor gets its own back);
    default: any free ones."""

    def __init__(self, address: Any, num_streams: int, token: str | None = None, *,
                 partitions: Sequence[int] | None = None, insert_timeout_s: float = 60.0,
                 timeout_s: float = 30.0, max_in_flight: int = 4, batch_bytes: int = 1 << 20,
                 max_delay_s: float = 0.01, loop: str = "auto"):  # fmt: skip
        self._client, self._own_client = as_client(address, token, timeout_s, loop)
        self.insert_timeout_s = float(insert_timeout_s)
        self.timeout_s = float(timeout_s)
        self.abort: Callable[[], bool] | None = None
        self.max_in_flight, self.batch_bytes, self.max_delay_s = int(max_in_flight), int(batch_bytes), float(max_delay_s)
        self._last_send = time.monotonic()
        self._num_streams = int(num_streams)
        self._want = None if partitions is None else [int(p) for p in partitions]
        self._inflight: collections.deque = collections.deque()  # futures, oldest first
        self._error: BaseException | None = None
        self._session = None
        self._reported = False  # a lost connection was already raised to the caller
        self._open()
        self._free: queue.Queue = queue.Queue()
        for _ in range(self.max_in_flight + 1):
            self._free.put(_Stage(self._spec))
        self._stage: _Stage = self._free.get()
        self._all = np.arange(self._num_streams)

    # ----------------------------------------------------------------- session
    def _open(self) -> None:
        meta, _ = self._client.call(RPC.REPLAY_OPEN_WRITER, {
            "num_streams": self._num_streams, "partitions": self._want, "insert_timeout_s": self.insert_timeout_s,
        }, timeout_s=self.timeout_s)  # fmt: skip
        self._session, self._gen = meta["session"], self._client.generation
        self.partitions = np.asarray(meta["partitions"], dtype=np.int64)
        self._want = meta["partitions"]  # a re-opened session asks for the same partitions
        self._spec = TableSpec.parse(meta["spec"])
        self._S, self._R = int(meta["steps_per_stream"]), int(meta["items_per_stream"])
        self._pos = np.asarray(meta["positions"], dtype=np.int64)
        self._episode_start = np.asarray(meta["episode_starts"], dtype=np.int64)
        self._last_item_start = self._pos.copy()  # a new shard Writer's (Writer.__init__)

    def _check_session(self) -> None:
        """Raise a deferred error; re-open the session after a lost connection (raising SessionLost once)."""
        err, self._error = self._error, None
        if err is not None:
            self._raise_batch_error(err)
        if self._client.connected and self._client.generation == self._gen:
            return
        lost = self._stage.rows
        self._stage.clear()
        self._inflight.clear()
        try:
            self._client.connect(self.timeout_s)
        except ServiceUnavailable:
            self._reported = True
            raise
        self._open()
        if self._reported and not lost:  # the caller already saw the outage: continue quietly
            self._reported = False
            return
        self._reported = False
        raise SessionLost(f"the connection to {self._client.address_text} was re-made: writer session re-opened on "
                          f"partitions {self._want} ({lost} staged steps lost); streams continue from the shard's positions")

    # ----------------------------------------------------------------- WriterLike
    @property
    def spec(self) -> TableSpec:
        return self._spec

    def append(self, steps: Mapping[str, Any], streams=None) -> np.ndarray:
        self._check_session()
        s = self._streams(streams)
        if np.unique(s).size != s.size:
            raise ValueError("append writes one step per stream: streams must be distinct")
        arrays, _ = self._spec.check_batch(steps, n=s.size)
        st = self._stage
        st.add_rows(arrays, s.size)
        st.ops.append(Append(int(s.size), st.add_ints(s)))
        pos = self._pos[s]
        self._pos[s] = pos + 1
        self._maybe_send()
        return pos

    def extend(self, steps: Mapping[str, Any], stream: int = 0) -> int:
        self._check_session()
        first_col = steps.get(self._spec.columns[0].name)
        arrays, n = self._spec.check_batch(steps, n=len(first_col) if hasattr(first_col, "__len__") else None)
        if n > self._S:
            raise ValueError(f"extend of {n} steps exceeds the partition's {self._S} steps")
        if not 0 <= stream < self._num_streams:
            raise ValueError(f"streams [{stream}] out of range [0, {self._num_streams})")
        st = self._stage
        st.add_rows(arrays, n)
        st.ops.append(Extend(int(stream), int(n)))
        pos = int(self._pos[stream])
        self._pos[stream] = pos + n
        self._maybe_send()
        return pos

    def create_items(self, priorities, num_steps, streams=None, ends=None, *, expired: str = "raise") -> None:
        """As :meth:`Writer.create_items` (same checks and messages, here); the items are
        published on the shard when this batch arrives (the rate limiter's wait happens there).
        Items over steps the shard's ring already overwrote are refused there (``expired="raise"``)
        or dropped and counted there (``"drop"``, what the n-step adder asks for)."""
        self._check_session()
        if expired not in ("raise", "drop"):
            raise ValueError(f'expired must be "raise" or "drop", got {expired!r}')
        prio = np.asarray(priorities, dtype=np.float64).reshape(-1)
        m = prio.size
        if m == 0:
            return
        one = isinstance(streams, (int, np.integer)) or (streams is not None and np.ndim(streams) == 0)
        if one:
            stream = int(streams)
            if not 0 <= stream < self._num_streams:
                raise ValueError(f"streams [{stream}] out of range [0, {self._num_streams})")
            s = np.full(m, stream, dtype=np.int64)
            end = np.full(m, self._pos[stream]) if ends is None else np.asarray(ends, dtype=np.int64).reshape(-1)
            if end.size != m:
                raise ValueError(f"{m} priorities but {end.size} ends")
        else:
            if streams is None and m != self._num_streams:
                raise ValueError(f"{m} priorities for {self._num_streams} streams (pass streams=)")
            s = self._streams(streams)
            if s.size != m:
                raise ValueError(f"{m} priorities for {s.size} streams")
            end = self._pos[s] if ends is None else np.broadcast_to(np.asarray(ends, dtype=np.int64), (m,))
        lengths = np.broadcast_to(np.asarray(num_steps, dtype=np.int64), (m,))
        # the local Writer's checks (the expired rule is the shard's: it knows its ring)
        start = check_items(prio, lengths, end, s, self._pos[s], self._episode_start[s], self._S)
        if one:
            check_stream_order(start, int(self._last_item_start[stream]), self._R)
            self._last_item_start[stream] = start[-1]
        else:
            order, _, _, _, last = stream_order(s, start, self._last_item_start, self._R)
            self._last_item_start[s[order][last]] = start[order][last]
        st = self._stage
        o = st.add_ints(lengths, *(() if one else (s,)), *(() if ends is None else (end,)))
        fo = st.add_floats(prio)
        st.ops.append(CreateItems(m, o, fo, stream if one else -1, ends is not None, self.insert_timeout_s,
                                  expired == "drop"))
        if not (self.insert_timeout_s > 0):  # a non-blocking insert: its error belongs to this call
            self._send()
            self._wait_all()
        elif st.nbytes >= self.batch_bytes or time.monotonic() - self._last_send >= self.max_delay_s:
            self._send()

    def end_episode(self, streams=None) -> None:
        self._check_session()
        if streams is not None and np.ndim(streams) == 0:
            s = int(streams)
            if not 0 <= s < self._num_streams:
                raise ValueError(f"streams [{s}] out of range [0, {self._num_streams})")
            s = np.asarray([s])
        else:
            s = np.unique(self._streams(streams))
        self._episode_start[s] = self._pos[s]
        st = self._stage
        st.ops.append(EndEpisode(int(s.size), st.add_ints(s)))

    def flush(self) -> None:
        """Send what is staged with a heartbeat and wait for every reply: errors of earlier
        batches are raised here."""
        self._check_session()
        self._stage.ops.append(Flush())
        self._send()
        self._wait_all()

    # ----------------------------------------------------------------- sending
    def _maybe_send(self) -> None:
        if self._stage.nbytes >= self.batch_bytes:
            self._send()

    def _send(self) -> None:
        st = self._stage
        if not st.ops:
            return
        while len(self._inflight) >= self.max_in_flight:
            self._wait_oldest()
        nxt = self._take_stage()
        meta = {"session": self._session, "ops": encode_ops(st.ops)}
        free = self._free

        def on_sent(stage=st):
            stage.clear()
            free.put(stage)

        self._last_send = time.monotonic()
        fut = self._client.submit(RPC.REPLAY_WRITE, meta, st.buffers(), timeout_s=self.timeout_s, on_sent=on_sent)
        fut.add_done_callback(self._done)
        self._inflight.append(fut)
        self._stage = nxt

    def _take_stage(self) -> _Stage:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._free.get(timeout=POLL_S)
            except queue.Empty:
                self._poll_abort("sending")
                if time.monotonic() > deadline:
                    raise RequestTimeout(f"replay.write: buffers not sent to {self._client.address_text} in {self.timeout_s:.1f} s")

    def _done(self, fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        if exc is not None and self._error is None:
            self._error = exc

    def _reply_timeout(self) -> float:
        return self.timeout_s + max(0.0, self.insert_timeout_s)

    def _poll_abort(self, what: str) -> None:
        if self.abort is not None and self.abort():
            raise InsertAborted(f"remote write abandoned while {what}: the writer was asked to stop")

    def _wait_oldest(self) -> None:
        fut = self._inflight[0]
        deadline = time.monotonic() + self._reply_timeout()
        while not concurrent.futures.wait([fut], timeout=POLL_S).done:  # its error: recorded by _done
            self._poll_abort("its batch waited on the shard's rate limiter")
            if time.monotonic() > deadline:
                raise RequestTimeout(f"replay.write: no reply from {self._client.address_text} in "
                                     f"{self._reply_timeout():.1f} s")  # fmt: skip
        self._inflight.popleft()
        err, self._error = self._error, None
        if err is not None:
            self._raise_batch_error(err)

    def _raise_batch_error(self, err: BaseException) -> None:
        """Raise the error of a batch the shard did not apply whole, once, with the writer usable again.

        A lost connection: what was staged and in flight is gone; the next call re-opens the
        session. Any other error (the rate limiter's timeout, a refused op) stopped the shard's
        session part-way through a batch, so this mirror of its positions no longer matches the
        shard: wait for the batches still in flight (their errors are this one's consequences),
        drop what is staged, close the session and open it again on the same partitions (positions,
        episode starts from the shard: as a restarted local writer continues), then raise ``err``
        with a note saying so. The caller's adder (its pending n-step items) must be rebuilt, as
        after :class:`SessionLost`."""
        lost = self._stage.rows
        self._stage.clear()
        if isinstance(err, ServiceUnavailable):  # every batch in flight is gone with it
            self._inflight.clear()
            self._reported = True
            raise err
        concurrent.futures.wait(list(self._inflight), timeout=self._reply_timeout())
        self._inflight.clear()
        self._error = None
        try:
            if self._client.connected and self._client.generation == self._gen:
                self._client.call(RPC.REPLAY_CLOSE_WRITER, {"session": self._session}, timeout_s=self.timeout_s)
                self._open()
        except (ServiceUnavailable, RequestTimeout) as exc:  # the next call re-opens it (or raises the outage)
            err.add_note(f"re-syncing the writer session failed too: {type(exc).__name__}: {exc}")
            raise err from None
        err.add_note(f"a batch failed on the shard {self._client.address_text}: the writer session on partitions "
                     f"{self._want} was re-opened ({lost} staged steps and the batches sent after it dropped); "
                     f"streams continue from the shard's positions (rebuild the adder)")  # fmt: skip
        raise err

    def _wait_all(self) -> None:
        while self._inflight:
            self._wait_oldest()

    def close(self) -> None:
        """Send what is staged (waiting up to the timeout), end the session, close the connection."""
        close_session(self._client, self._own_client, self._session, self.timeout_s, self._drain)

    def _drain(self) -> bool:
        """Send what is staged and wait for the replies, if the session is still this connection's."""
        if not (self._client.connected and self._client.generation == self._gen):
            return False
        self._send()
        self._wait_all()
        return True
