"""Remote writer, sampler and parameter source: the seams of replay over a shard service.

    writer = RemoteWriter("10.0.0.5:7000", num_streams=16, token=token)   # WriterLike
    adder = TransitionAdder(writer, n=3, gamma=0.99)                         # unchanged
    sampler = RemoteSampler(["10.0.0.5:7000", "10.0.0.6:7000"], token=token)  # SamplerLike
    batch = sampler.sample(256); sampler.update_priorities(batch.keys, prios)
    params = RemoteParams("10.0.0.5:7000", token=token)                      # ParameterSource

**RemoteWriter.** Every check a local :class:`~gearflow.replay.Writer` makes is made here,
at the same call and with the same message (spec, streams, sizes, priorities, episode
boundaries, item order), against a mirror of the session's positions; the writes are
then staged (one copy into reused per-column buffers) and sent as one ``replay.write``
by the first ``create_items`` at least ``max_delay_s`` after the previous send (or by
``flush``, or once ``batch_bytes`` are staged), without waiting for the reply: at most ``max_in_flight`` batches are unanswered, and the next send waits for the
oldest reply (the rate limiter holds it on the shard: bounded in-flight data is the
back-pressure). So what can only fail on the shard — the rate limiter's timeout, a lost
connection — is raised at the writer's next call (or ``flush``, which waits for every
reply), with its own type (:class:`~gearflow.replay.RateLimiterTimeout`,
:class:`~gearflow.transport.client.ServiceUnavailable`, ...). ``create_items`` with
``insert_timeout_s <= 0`` (an adder's non-blocking flush at shutdown) waits for its own
reply, so its ``RateLimiterTimeout`` comes from that call as locally. Every wait has a
timeout and polls ``abort``. After a lost connection the next call re-opens the session
(same partitions, positions from the shard: as a restarted local writer continues) and
raises :class:`SessionLost` once, since the steps staged meanwhile are gone. A batch that
fails part-way on the shard (its rate limiter's timeout, an op the shard refused) leaves
the shard's session short of what this mirror assumed: the writer waits for the batches
still in flight, re-opens the session on the same partitions (positions from the shard)
and raises that error once, with its own type and a note saying so; later calls continue
from the shard's positions. Either way an adder over the writer holds n-step items of lost
steps and should be rebuilt (an actor process rejoins).

**RemoteSampler: exact global sampling.** Keys of shard ``i`` carry ``i`` in bits 56..62
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
its own priority updates, because ``update_priorities`` waits for the shards' replies and a
shard handles one connection's requests in order: a round requested after an update is
drawn after it and split by the totals it left (replies are tagged, so a prefetched round
answered later never overwrites an update's newer totals). A round requested ahead
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
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gearflow.kinds.registry import kind_from_dict
from gearflow.replay.layout import (
    PROPORTIONAL_SELECTORS,
    key_shard,
    local_key,
    shard_key,
    step_rows,
)
from gearflow.replay.protocols import SelectorInfo
from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.selectors import check_priorities
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import (
    COMMIT,
    EPISODES,
    H_INSERT_LIMIT,
    PUBLISHED,
    RESERVE,
    SHM_DIR,
    SharedStorage,
)
from gearflow.replay.table import Sample
from gearflow.replay.writer import InsertAborted, StreamPositions, Writer
from gearflow.transport.client import Client, RequestTimeout, ServiceUnavailable
from gearflow.transport.shard import SHARD_SHIFT, SessionLost

__all__ = ["LEARNER_PREFETCH", "SHARD_SHIFT", "RemoteParams", "RemoteSampler", "RemoteWriter", "SessionLost", "ShippingWriter"]

_POLL_S = 0.05  # how often a wait polls ``abort``
CHECK_S = 0.0005  # ShippingWriter: how often a publish also checks how full the private ring is
SLACK_ITEMS = 256  # ShippingWriter: items published at most between two calls of its hook
LEARNER_PREFETCH = 2  # rounds a learner's RemoteSampler requests ahead: the shard draws and gathers one while
# the one before is on the wire (gearflow bench transport sample, 2 cores: ~0.77 of a raw socket vs ~0.63 at 1)


def _client(address_or_client: Any, token: str | None, timeout_s: float, loop: str) -> tuple[Client, bool]:
    if isinstance(address_or_client, Client):
        return address_or_client, False
    return Client(address_or_client, token, timeout_s=timeout_s, loop=loop), True


class _Stage:
    """One batch of writer calls being built: ops, ints, floats and the rows of every column,
    in buffers reused from batch to batch (grown by doubling)."""

    def __init__(self, spec: TableSpec):
        self.cols = {c.name: np.empty((64, *c.row_shape), dtype=c.dtype) for c in spec}
        self.ints = np.empty(256, dtype=np.int64)
        self.floats = np.empty(64, dtype=np.float64)
        self.ops: list = []
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
        self._client, self._own_client = _client(address, token, timeout_s, loop)
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
        meta, _ = self._client.call("replay.open_writer", {
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
        st.ops.append(["a", int(s.size), st.add_ints(s)])
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
        st.ops.append(["x", int(stream), int(n)])
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
        start = self._check_items(prio, lengths, end, s)
        if one:
            if m > self._R:
                raise ValueError(f"more than {self._R} items for one stream in one call")
            if start[0] < self._last_item_start[stream] or (m > 1 and np.diff(start).min() < 0):
                raise ValueError("items of a stream must be created in order of their first step")
            self._last_item_start[stream] = start[-1]
        else:
            order = np.lexsort((start, s))
            so, sto = s[order], start[order]
            first = np.r_[True, so[1:] != so[:-1]]
            if (sto[first] < self._last_item_start[so[first]]).any():
                raise ValueError("items of a stream must be created in order of their first step")
            group = np.flatnonzero(first)
            rank = np.arange(m) - np.repeat(group, np.diff(np.r_[group, m]))
            if rank.max() >= self._R:
                raise ValueError(f"more than {self._R} items for one stream in one call")
            last = np.r_[group[1:] - 1, m - 1]
            self._last_item_start[so[last]] = sto[last]
        st = self._stage
        o = st.add_ints(lengths, *(() if one else (s,)), *(() if ends is None else (end,)))
        fo = st.add_floats(prio)
        st.ops.append(["i", m, o, fo, stream if one else -1, int(ends is not None), self.insert_timeout_s,
                       int(expired == "drop")])
        if not (self.insert_timeout_s > 0):  # a non-blocking insert: its error belongs to this call
            self._send()
            self._wait_all()
        elif st.nbytes >= self.batch_bytes or time.monotonic() - self._last_send >= self.max_delay_s:
            self._send()

    def _check_items(self, prio, lengths, end, streams) -> np.ndarray:
        """:meth:`Writer._check_items`' checks, with its messages."""
        check_priorities(prio)
        bad = (lengths < 1) | (lengths > self._S)
        if bad.any():
            raise ValueError(f"num_steps must be in [1, {self._S}], got {lengths[bad][0]}")
        if (end > self._pos[streams]).any():
            raise ValueError("an item ends after the last appended step")
        start = end - lengths
        ep0 = self._episode_start[streams]
        crosses = start < ep0
        if crosses.any():
            j = int(np.argmax(crosses))
            raise ValueError(
                f"item of {lengths[j]} steps crosses an episode boundary: stream {streams[j]} has "
                f"{int(end[j] - ep0[j])} steps in its current episode"
            )
        return start

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
        st.ops.append(["e", int(s.size), st.add_ints(s)])

    def flush(self) -> None:
        """Send what is staged with a heartbeat and wait for every reply: errors of earlier
        batches are raised here."""
        self._check_session()
        self._stage.ops.append(["f"])
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
        meta = {"session": self._session, "ops": st.ops}
        free = self._free

        def on_sent(stage=st):
            stage.clear()
            free.put(stage)

        self._last_send = time.monotonic()
        fut = self._client.submit("replay.write", meta, st.buffers(), timeout_s=self.timeout_s, on_sent=on_sent)
        fut.add_done_callback(self._done)
        self._inflight.append(fut)
        self._stage = nxt

    def _take_stage(self) -> _Stage:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._free.get(timeout=_POLL_S)
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
        while not concurrent.futures.wait([fut], timeout=_POLL_S).done:  # its error: recorded by _done
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
                self._client.call("replay.close_writer", {"session": self._session}, timeout_s=self.timeout_s)
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
        try:
            if self._client.connected and self._client.generation == self._gen:
                self._send()
                self._wait_all()
                self._client.call("replay.close_writer", {"session": self._session}, timeout_s=self.timeout_s)
        except (ServiceUnavailable, RequestTimeout, RateLimiterTimeout, InsertAborted):
            pass
        finally:
            if self._own_client:
                self._client.close()


# ---------------------------------------------------------------------- sampler

PROPORTIONAL = PROPORTIONAL_SELECTORS  # selectors whose draw several shards reproduce exactly


_Weights = SelectorInfo  # its old name (tests/test_peer_semantics.py builds one)


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

    def __init__(self, shards: Sequence[Any], token: str | None = None, *, prefetch: int = 1,
                 timeout_s: float = 60.0, num_buffers: int = 3, seed: int | None = None, loop: str = "auto"):  # fmt: skip
        if isinstance(shards, (str, Client)) or (isinstance(shards, tuple) and len(shards) == 2 and isinstance(shards[1], int)):
            shards = [shards]
        if not shards or len(shards) > 127:
            raise ValueError(f"a sampler reads 1 to 127 shards, got {len(shards)}")
        pairs = [_client(s, token, timeout_s, loop) for s in shards]
        self._clients = [c for c, _ in pairs]
        self._own = [own for _, own in pairs]
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
        self.split_drift = 0.0  # last round: max |split share - the shard's share at its draw|
        self._ahead: collections.deque = collections.deque()  # (batch_size, round) requested ahead
        self.torn = 0  # items the shards marked torn in their replies, redrawn here
        self._buffers: list[dict[str, torch.Tensor]] = []
        self._buffer_batch, self._next = -1, 0
        infos = [c.call("replay.info", timeout_s=timeout_s)[0] for c in self._clients]
        self.spec = TableSpec.parse(infos[0]["spec"])
        self.kind = kind_from_dict(infos[0]["kind"])
        first = infos[0]
        for i, info in enumerate(infos[1:], 1):
            if info["spec"] != first["spec"] or info["kind"] != first["kind"]:
                raise ValueError(f"shard {i} ({self._clients[i].address_text}) holds another spec or item kind than shard 0")
            if info["selector"] != first["selector"] or info.get("alpha") != first.get("alpha"):
                raise ValueError(f"shard {i} ({self._clients[i].address_text}) selects with {info['selector']} "
                                 f"(alpha {info.get('alpha')}), shard 0 with {first['selector']} (alpha "
                                 f"{first.get('alpha')}): several shards sample as one table only with one selector")  # fmt: skip
        if n > 1 and first["selector"] not in PROPORTIONAL:
            raise ValueError(f"the shards' {first['selector']!r} selector ranks the items of one table: there is no "
                             f"global order over {n} shards, so their draws cannot be one table's; use "
                             f"{' or '.join(PROPORTIONAL)}, or sample one shard")  # fmt: skip
        self.selector = SelectorInfo(first["selector"], first.get("importance_sampled", True))
        if n > 1:
            self._refresh_totals()

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    # ----------------------------------------------------------------- shard totals
    def _submit(self, i: int, op: str, meta: dict | None = None, bufs: Sequence[Any] = (), timeout_s: float | None = None):
        """Send a request to shard ``i``; returns ``(tag, future)``: the tags of one shard's requests
        rise in the order the shard handles them (one connection: in order)."""
        with self._tags:  # stats() may come from another thread than sample() (the learner's metrics)
            fut = self._clients[i].submit(op, meta, bufs, timeout_s=self.timeout_s if timeout_s is None else timeout_s)
            self._sent[i] += 1
            return int(self._sent[i]), fut

    def _note(self, i: int, tag: int, meta: dict) -> None:
        """Keep the total and count a reply reports if it is newer than those kept: a prefetched
        round answered after a priority update reports the shard as it was before the update."""
        with self._tags:
            if tag > self._known[i]:
                self._known[i], self._totals[i], self._counts[i] = tag, float(meta["total"]), int(meta["count"])

    def _refresh_totals(self) -> None:
        """Every shard's total and count now (``replay.total``: the shard scans, draws nothing)."""
        futs = [(i, *self._submit(i, "replay.total")) for i in range(len(self._clients))]
        for i, tag, f in futs:
            self._note(i, tag, self._clients[i].result(f, "replay.total", self.timeout_s)[0])
        self._stale = False

    # ----------------------------------------------------------------- draws
    def _request(self, batch_size: int, timeout_s: float) -> tuple:
        """One round: the split ``q`` (each shard's share of every draw) and each shard's request;
        ``b_i ~ Multinomial(B, q)`` with ``q = T / ΣT`` over the newest totals; a shard given no
        draw still reports its total (``replay.total``)."""
        n = len(self._clients)
        if self._stale and n > 1:
            self._refresh_totals()
        if n == 1:
            q, split = np.ones(1), [batch_size]
        else:
            with self._tags:
                t = np.maximum(self._totals, 0.0)  # a copy
            s = float(t.sum())
            q = t / s if s > 0 else np.full(n, 1.0 / n)  # nothing known yet: even, and said so by q
            split = self._rng.multinomial(batch_size, q).tolist()
        meta = {"timeout_s": timeout_s}
        if self.selector.beta is not None:
            meta["beta"] = float(self.selector.beta)
        parts = [(i, int(b), *(self._submit(i, "replay.sample", {**meta, "batch_size": int(b)}, timeout_s=timeout_s + self.timeout_s)
                               if b else self._submit(i, "replay.total")))
                 for i, b in enumerate(split)]  # fmt: skip
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
            q, parts = self._ahead.popleft()[1] if self._ahead else self._request(batch_size, timeout_s)
            replies, drawn = [], np.empty(len(parts))
            for i, b, tag, fut in parts:
                meta, bufs = self._clients[i].result(fut, "replay.sample" if b else "replay.total", timeout_s + self.timeout_s)
                self._note(i, tag, meta)
                drawn[i] = max(float(meta["total"]), 0.0)  # the shard's total at its draw
                if b:
                    replies.append((i, b, meta, bufs))
            replies = [self._mend(r, timeout_s) for r in replies]
            s = drawn.sum()
            self.split_drift = float(np.abs(q - drawn / s).max()) if s > 0 and len(parts) > 1 else 0.0
            # the rounds ahead are requested after this round's replies: split by the totals they
            # carry (a change the shards saw reaches the split one round later, not two)
            while len(self._ahead) < self.prefetch:
                self._ahead.append((batch_size, self._request(batch_size, timeout_s)))
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
        return self._combine(batch_size, q, parts, replies)

    def _mend(self, reply: tuple, timeout_s: float) -> tuple:
        """A reply sent out of the shard's segment ends with ``torn``: items a writer overwrote
        while the reply was written. Each is replaced by a fresh draw from the same shard (until
        none is torn), and the batch reweighed against the shard's newest total, as a local
        table replaces torn items."""
        i, b, meta, bufs = reply
        if not meta.get("torn"):
            return reply
        *bufs, torn = bufs
        bad = self._torn_of(i, torn, b)
        if not bad.size:
            return i, b, meta, bufs
        masses = bufs[1] * max(float(meta["total"]), 0.0)  # each item's mass at its draw
        m = {"timeout_s": timeout_s}
        if self.selector.beta is not None:
            m["beta"] = float(self.selector.beta)
        deadline = time.monotonic() + timeout_s
        while bad.size:
            if time.monotonic() > deadline:  # as a local table gives up
                raise RateLimiterTimeout(f"replay: writers kept overwriting the drawn items of shard {i} faster than "
                                         f"they could be sent ({self.torn} redrawn so far); its rings are too small "
                                         f"for the write rate")  # fmt: skip
            self.torn += int(bad.size)
            tag, fut = self._submit(i, "replay.sample", {**m, "batch_size": int(bad.size)}, timeout_s=timeout_s + self.timeout_s)
            meta, fresh = self._clients[i].result(fut, "replay.sample", timeout_s + self.timeout_s)
            self._note(i, tag, meta)
            again = self._torn_of(i, fresh.pop(), bad.size) if meta.get("torn") else bad[:0]
            for a, f in zip(bufs, fresh):
                a[bad] = f
            masses[bad] = fresh[1] * max(float(meta["total"]), 0.0)
            bad = bad[again]
        total = max(float(meta["total"]), 0.0)
        if total > 0:
            np.divide(masses, total, out=bufs[1])  # one normalisation, against the shard now
            w = self._is_weights(float(meta["count"]), bufs[1], meta)
            if w is not None:
                bufs[2][:] = w
        return i, b, meta, bufs

    def _is_weights(self, count: float, probs: np.ndarray, meta: dict) -> np.ndarray | None:
        """IS weights ``(N·P)^-β / max`` over the batch (a local table's rule); None without
        importance sampling (uniform: the shards' weights, ones, stand). β: the learner's, else
        the shard's (``meta``)."""
        beta = self.selector.beta if self.selector.beta is not None else meta.get("beta")
        if beta is None or not self.selector.importance_sampled:
            return None
        w = (count * probs) ** -float(beta)
        return w / w.max()

    def _torn_of(self, i: int, torn: np.ndarray, b: int) -> np.ndarray:
        """Positions a reply's ``torn`` buffer marks (checked: uint8, one per item)."""
        if torn.dtype != np.uint8 or torn.shape != (b,):
            raise ValueError(f"shard {i} ({self._clients[i].address_text}) sent a torn buffer of {torn.dtype}"
                             f"{list(torn.shape)} for {b} items")  # fmt: skip
        return np.flatnonzero(torn)

    def _out(self, batch_size: int, meta: dict, bufs: list) -> dict[str, torch.Tensor]:
        if batch_size != self._buffer_batch:
            names = ["keys", "probabilities", "weights", *meta["names"]]
            self._buffers = [{n: torch.empty((batch_size, *a.shape[1:]), dtype=torch.from_numpy(a[:0]).dtype)
                              for n, a in zip(names, bufs)} for _ in range(self.num_buffers)]  # fmt: skip
            self._buffer_batch = batch_size
        out = self._buffers[self._next]
        self._next = (self._next + 1) % self.num_buffers
        return out

    def _combine(self, batch_size: int, q: np.ndarray, parts: list, replies: list) -> Sample:
        """The shards' rows in one batch: keys tagged with their shard, ``P = q_i · m/T_i`` (the
        shard reports ``m/T_i`` at its draw), IS weights ``(N·P)^-β / max`` over the batch with
        ``N`` the shards' live items at the draws (a local table's normalisation)."""
        out = self._out(batch_size, replies[0][2], replies[0][3])
        names = ["keys", "probabilities", "weights", *replies[0][2]["names"]]
        row = 0
        probs = np.empty(batch_size)
        for i, b, meta, bufs in replies:
            for n, a in zip(names, bufs):
                out[n][row:row + b] = torch.from_numpy(a)
            keys = out["keys"][row:row + b]
            if int(key_shard(keys.max())):
                raise ValueError(f"shard {i} returned a key ≥ 2^{SHARD_SHIFT}: cannot tag it with the shard")
            shard_key(keys, i)
            np.multiply(bufs[1], q[i], out=probs[row:row + b])
            row += b
        w = self._is_weights(float(self._counts.sum()), probs, replies[0][2])
        if w is not None:
            out["weights"].copy_(torch.from_numpy(w))
        out["probabilities"].copy_(torch.from_numpy(probs))
        return Sample(data={n: out[n] for n in names[3:]}, keys=out["keys"], weights=out["weights"],
                      probabilities=out["probabilities"])  # fmt: skip

    # ----------------------------------------------------------------- priorities, stats
    def update_priorities(self, keys, priorities) -> int:
        """New priorities by key, each key sent to the shard in its bits 56..62; returns how
        many were applied (keys of evicted items are ignored, as locally). Waits for every
        shard's reply: a round requested after this returns is drawn after the update, and
        split by the totals it left."""
        keys = np.ascontiguousarray(torch.as_tensor(keys).cpu().numpy(), dtype=np.int64).reshape(-1)
        if isinstance(priorities, torch.Tensor):
            p = priorities.detach()
            p = (p.float() if p.dtype in (torch.bfloat16, torch.float16) else p).cpu().numpy()
        else:
            p = np.asarray(priorities)
        # float32 and float64 go as they are (the shard's table converts as a local one does)
        prios = np.ascontiguousarray(p.reshape(-1), dtype=p.dtype if p.dtype in (np.float32, np.float64) else np.float64)
        if keys.shape != prios.shape:
            raise ValueError(f"{keys.size} keys but {prios.size} priorities")
        check_priorities(prios)
        shard = key_shard(keys)
        if (shard < 0).any() or (shard >= len(self._clients)).any():
            raise ValueError(f"keys name shards outside [0, {len(self._clients)})")
        futs = []
        for i in np.unique(shard).tolist():
            sel = shard == i
            local = local_key(keys[sel])
            futs.append((i, *self._submit(i, "replay.update_priorities", {}, [local, prios[sel]])))
        applied = 0
        for i, tag, f in futs:
            meta, _ = self._clients[i].result(f, "replay.update_priorities", self.timeout_s)
            self._note(i, tag, meta)
            applied += int(meta["applied"])
        return applied

    SUMMED = ("replay/size", "replay/inserts", "replay/samples", "replay/evictions", "replay/torn_resampled",
              "replay/steps", "replay/bytes", "replay/remote_partitions")  # fmt: skip

    def stats(self) -> dict[str, float]:
        """Every shard's stats summed (counts) or averaged (fill), ``replay/shards``, and
        ``replay/split_drift``: how far the last batch's split was from the shards' totals at
        their draws (max over shards of |share - T_i/ΣT|; 0: drawn exactly as one table)."""
        futs = [(i, *self._submit(i, "replay.stats")) for i in range(len(self._clients))]
        per = []
        for i, tag, f in futs:
            meta, _ = self._clients[i].result(f, "replay.stats", self.timeout_s)
            self._note(i, tag, meta)
            per.append(meta["stats"])
        out: dict[str, float] = {"replay/shards": float(len(per)), "replay/split_drift": self.split_drift}
        for k in per[0]:
            vals = [s.get(k, 0.0) for s in per]
            out[k] = float(sum(vals)) if (k in self.SUMMED or k.startswith("transport/")) else (
                float(min(vals)) if k.endswith("_min") else float(np.mean(vals)))
        return out

    def checkpoint(self, name: str) -> list[str]:
        """Each shard writes its table to ``<its checkpoint_dir>/<name>`` (``replay.checkpoint``);
        returns the paths, shard by shard."""
        futs = [c.submit("replay.checkpoint", {"name": name}, timeout_s=self.timeout_s) for c in self._clients]
        return [c.result(f, "replay.checkpoint", self.timeout_s)[0]["path"] for c, f in zip(self._clients, futs)]

    def close(self) -> None:
        if hasattr(self, "_ahead"):
            self._ahead.clear()
        for c, own in zip(self._clients, self._own):
            if own:
                c.close()


# ---------------------------------------------------------------------- parameters


class RemoteParams:
    """A :class:`~gearflow.params.protocol.ParameterSource` over a shard's ``params.get``: one
    round trip when nothing is newer, the weights only when the version changed."""

    def __init__(self, address: Any, token: str | None = None, *, timeout_s: float = 30.0, loop: str = "auto"):
        self._client, self._own = _client(address, token, timeout_s, loop)
        self.timeout_s = float(timeout_s)
        self.fetches = 0  # replies that carried weights

    def load_into(self, module: Any, min_version: int = 0) -> int | None:
        meta, bufs = self._client.call("params.get", {"min_version": int(min_version)}, timeout_s=self.timeout_s)
        if meta.get("version") is None:
            return None
        state = module.state_dict() if isinstance(module, torch.nn.Module) else dict(module)
        names = meta["names"]
        if missing := [k for k in names if k not in state]:
            raise ValueError(f"parameter {missing[0]!r} is not in the module (the store has it)")
        if extra := [k for k in state if k not in names]:
            raise ValueError(f"parameter {extra[0]!r} is missing from the published weights")
        for k, a in zip(names, bufs):  # every shape checked before anything is copied
            if tuple(state[k].shape) != a.shape:
                raise ValueError(f"parameter {k!r} is {list(a.shape)} in the store, {list(state[k].shape)} here")
        with torch.no_grad():
            for k, a in zip(names, bufs):
                state[k].copy_(torch.from_numpy(a))
        self.fetches += 1
        return int(meta["version"])

    def close(self) -> None:
        if self._own:
            self._client.close()


# ---------------------------------------------------------------------- shipping writer


class ShippingWriter(Writer):
    """A local :class:`~gearflow.replay.Writer` over a private shared-memory ring whose committed
    steps and published items are shipped to a shard (log shipping).

    The actor writes at shared-memory speed — the C n-step adder too (it needs a ``Writer``) —
    and each time the adder publishes items (where a local writer would check the rate
    limiter) the steps committed and items published since the last shipment go to the shard
    in one ``replay.write`` (when due, below): ``extend`` ops that must continue each partition exactly where it
    stopped, ``create_items`` with the items' own ends, episode counts. The private ring has
    the shard's geometry and starts at the shard's positions, so step ``t`` here is step ``t``
    there; items reach the shard one adder flush late. At most ``max_in_flight`` shipments are
    unanswered: the shard's rate limiter holds the replies, and the next shipment waits (polling
    ``abort``) — back-pressure as bounded in-flight data. Errors of the shard (its rate
    limiter's timeout, a lost connection) are raised at the next shipment or :meth:`flush`.
    A shipment goes at the first publish ``max_delay_s`` (10 ms) after the last one, or once a
    quarter of a stream's ring is unshipped, or at :meth:`flush`; so unshipped steps stay
    under the ring's size (a stream's steps between two publishes are one adder flush).
    Stacked-frame specs are refused (use :class:`RemoteWriter`).

        writer = ShippingWriter("10.0.0.5:7000", num_streams=16, token=token)
        adder = TransitionAdder(writer, n=3, gamma=0.99)    # the C path: writer is a Writer
    """

    def __init__(self, address: Any, num_streams: int, token: str | None = None, *,
                 partitions: Sequence[int] | None = None, insert_timeout_s: float = 60.0,
                 timeout_s: float = 30.0, max_in_flight: int = 4, max_delay_s: float = 0.01, loop: str = "auto"):  # fmt: skip
        self._client, self._own_client = _client(address, token, timeout_s, loop)
        self.timeout_s, self.max_in_flight, self.max_delay_s = float(timeout_s), int(max_in_flight), float(max_delay_s)
        self._last_ship = time.monotonic()
        meta, _ = self._client.call("replay.open_writer", {
            "num_streams": int(num_streams), "partitions": None if partitions is None else [int(p) for p in partitions],
            "insert_timeout_s": float(insert_timeout_s),
        }, timeout_s=self.timeout_s)  # fmt: skip
        self._session, self._gen = meta["session"], self._client.generation
        self.remote_partitions = np.asarray(meta["partitions"], dtype=np.int64)
        spec = TableSpec.parse(meta["spec"])
        if spec.stacked:
            if self._own_client:
                self._client.close()
            raise ValueError("ShippingWriter does not ship stacked-frame columns; use RemoteWriter")
        S, R, E = int(meta["steps_per_stream"]), int(meta["items_per_stream"]), int(num_streams)
        local = SharedStorage.create(spec, E, S, R)
        pos = np.asarray(meta["positions"], dtype=np.int64)
        try:
            local.counters[:, RESERVE] = local.counters[:, COMMIT] = pos  # step t here is step t there
            local.header[H_INSERT_LIMIT] = 0  # every publish asks _wait_for_insert first: the shipping hook
            super().__init__(local, np.arange(E), insert_timeout_s=insert_timeout_s)
        except BaseException:
            local.close()
            local.unlink()
            if self._own_client:
                self._client.close()
            raise
        self._shipped = pos.copy()  # per stream: steps shipped
        self._shipped_items = np.zeros(E, dtype=np.int64)  # local item records shipped
        self._shipped_episodes = np.zeros(E, dtype=np.int64)
        self._inflight: collections.deque = collections.deque()
        self._error: BaseException | None = None
        self._names = [c.name for c in spec]
        self._checked, self._published_at_check, self._slack = 0.0, 0, 0  # the hook's bookkeeping

    # ----------------------------------------------------------------- the hook
    def _wait_for_insert(self, m: int) -> None:
        """Called before a publish that reaches the local insert limit (kept at most SLACK_ITEMS
        above the items published): ship what is committed and published so far when due, then
        let these ``m`` items through.
        Due: ``max_delay_s`` since the last shipment, or a quarter of a stream's step ring or
        record ring unshipped."""
        # A publish comes here when the limit this hook set is reached (the C adder's flush
        # included), so the common case is a clock read and one sum: the ring-fill reductions run
        # every CHECK_S, or as soon as a shipment is due.
        now = time.monotonic()
        c = self.storage.counters
        published = int(c[:, PUBLISHED].sum())
        if now - self._last_ship >= self.max_delay_s or now - self._checked >= CHECK_S or 8 * m >= self._R:
            # until the next check, publishes may skip this hook for as many items as arrive in
            # CHECK_S at the present rate (at most SLACK_ITEMS): a fast C adder then calls it for a
            # fraction of its flushes, a slow actor for every one
            rate = (published - self._published_at_check) / max(now - self._checked, 1e-6)
            self._slack = int(min(SLACK_ITEMS, rate * CHECK_S, self._R // 16))
            self._checked, self._published_at_check = now, published
            if (now - self._last_ship >= self.max_delay_s
                    or (c[:, COMMIT] - self._shipped).max() * 4 >= self._S
                    or (c[:, PUBLISHED] - self._shipped_items).max() * 4 + 4 * m >= self._R):  # fmt: skip
                self.ship()
            else:
                self._raise_pending()
        elif self._error is not None:
            self._raise_pending()
        # these m, and up to the slack more without asking (the C path publishes below the limit)
        self.storage.header[H_INSERT_LIMIT] = published + m + self._slack

    def ship(self, heartbeat: bool = False) -> None:
        """Send the steps committed, items published and episodes ended since the last shipment
        (one request, not waited for), after raising any earlier shipment's error; ``heartbeat``:
        also stamp the shard partitions' heartbeat (what a supervisor there watches)."""
        self._raise_pending()
        st, c, S, R = self.storage, self.storage.counters, self._S, self._R
        commit, published, episodes = c[:, COMMIT].copy(), c[:, PUBLISHED].copy(), c[:, EPISODES].copy()
        ops, ints, floats, chunks = [], [], [], {n: [] for n in self._names}
        nrows = 0
        for i in np.flatnonzero(commit > self._shipped).tolist():
            t0, t1 = int(self._shipped[i]), int(commit[i])
            if t1 - t0 > S:
                raise RuntimeError(f"stream {i}: {t1 - t0} unshipped steps overran the {S}-step ring")
            for a, b in ((t0, min(t1, (t0 // S + 1) * S)), ((t0 // S + 1) * S, t1)):  # split at the ring's wrap
                if b > a:
                    lo = step_rows(i, a, S)
                    for n in self._names:
                        chunks[n].append(st.columns[n][lo:lo + b - a])
                    ops.append(["x", i, b - a, a])
                    nrows += b - a
        for i in np.flatnonzero(published > self._shipped_items).tolist():
            seqs = np.arange(int(self._shipped_items[i]), int(published[i]))
            if seqs.size > R:
                raise RuntimeError(f"stream {i}: {seqs.size} unshipped items overran the {R}-record ring")
            slot = seqs % R
            starts, lengths = st.item_start[i, slot], st.item_length[i, slot].astype(np.int64)
            o, fo = sum(len(x) for x in ints), sum(len(x) for x in floats)
            ints += [lengths, starts + lengths]  # num_steps, then ends
            floats.append(st.item_priority[i, slot])
            ops.append(["i", int(seqs.size), o, fo, i, 1, self.insert_timeout_s])
        for i in np.flatnonzero(episodes > self._shipped_episodes).tolist():
            ops.append(["E", i, int(episodes[i] - self._shipped_episodes[i])])
        if heartbeat:
            ops.append(["f"])
        self._last_ship = time.monotonic()
        if not ops:
            return
        bufs = [np.concatenate(ints) if ints else np.zeros(0, np.int64),
                np.concatenate(floats) if floats else np.zeros(0)]  # fmt: skip
        if nrows:
            bufs += [np.concatenate(chunks[n]) if len(chunks[n]) > 1 else chunks[n][0] for n in self._names]
        while len(self._inflight) >= self.max_in_flight:
            self._wait_oldest()
        fut = self._client.submit("replay.write", {"session": self._session, "ops": ops}, bufs, timeout_s=self.timeout_s)
        fut.add_done_callback(self._done)
        self._inflight.append(fut)
        self._shipped, self._shipped_items, self._shipped_episodes = commit, published, episodes

    def _done(self, fut: concurrent.futures.Future) -> None:
        exc = fut.exception()
        if exc is not None and self._error is None:
            self._error = exc

    def _raise_pending(self) -> None:
        if self._client.generation != self._gen:  # the connection was re-made: the shard's session is gone
            raise SessionLost(f"the connection to {self._client.address_text} was lost: this writer's session "
                              f"ended (make a new writer)")  # fmt: skip
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _wait_oldest(self) -> None:
        fut = self._inflight[0]
        deadline = time.monotonic() + self.timeout_s + max(0.0, self.insert_timeout_s)
        while not concurrent.futures.wait([fut], timeout=_POLL_S).done:
            if self.abort is not None and self.abort():
                raise InsertAborted("shipment abandoned while the shard's rate limiter held it: the writer was asked to stop")
            if time.monotonic() > deadline:
                raise RequestTimeout(f"replay.write: no reply from {self._client.address_text}")
        self._inflight.popleft()
        self._raise_pending()

    def flush(self) -> None:
        """Heartbeat, ship everything, wait for every reply (raising the shard's errors)."""
        super().flush()
        self.ship(heartbeat=True)
        while self._inflight:
            self._wait_oldest()

    def close(self) -> None:
        """Ship and wait (errors of a gone shard are dropped), end the session, drop the private ring."""
        try:
            self.flush()
            self._client.call("replay.close_writer", {"session": self._session}, timeout_s=self.timeout_s)
        except (ServiceUnavailable, RequestTimeout, RateLimiterTimeout, InsertAborted):
            pass
        finally:
            if self._own_client:
                self._client.close()
            name = self.storage.name
            self.storage.close()
            (SHM_DIR / name).unlink(missing_ok=True)
