"""ShippingWriter: log shipping of a private shared-memory ring to a shard (the actor side of ``gearflow actor --connect``).

    writer = ShippingWriter("10.0.0.5:7000", num_streams=16, token=token)
    adder = TransitionAdder(writer, n=3, gamma=0.99)    # the C path: writer is a Writer
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gearflow.replay.layout import step_rows
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import COMMIT, EPISODES, H_INSERT_LIMIT, PUBLISHED, RESERVE, SHM_DIR, SharedStorage
from gearflow.replay.writer import Writer
from gearflow.transport.actor.writer import POLL_S, close_session
from gearflow.transport.client import RequestTimeout, as_client
from gearflow.transport.errors import InsertAborted, SessionLost
from gearflow.transport.ops import CreateItems, Episodes, Extend, Flush, RPC, WriteOp, encode_ops

__all__ = ["ShippingWriter"]

CHECK_S = 0.0005  # how often a publish also checks how full the private ring is
SLACK_ITEMS = 256  # items published at most between two calls of the shipping hook


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
        self._client, self._own_client = as_client(address, token, timeout_s, loop)
        self.timeout_s, self.max_in_flight, self.max_delay_s = float(timeout_s), int(max_in_flight), float(max_delay_s)
        self._last_ship = time.monotonic()
        meta, _ = self._client.call(RPC.REPLAY_OPEN_WRITER, {
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
        ops: list[WriteOp] = []
        ints, floats, chunks = [], [], {n: [] for n in self._names}
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
                    ops.append(Extend(i, b - a, a))
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
            ops.append(CreateItems(int(seqs.size), o, fo, i, True, self.insert_timeout_s))  # expired: left out (raise)
        for i in np.flatnonzero(episodes > self._shipped_episodes).tolist():
            ops.append(Episodes(i, int(episodes[i] - self._shipped_episodes[i])))
        if heartbeat:
            ops.append(Flush())
        self._last_ship = time.monotonic()
        if not ops:
            return
        bufs = [np.concatenate(ints) if ints else np.zeros(0, np.int64),
                np.concatenate(floats) if floats else np.zeros(0)]  # fmt: skip
        if nrows:
            bufs += [np.concatenate(chunks[n]) if len(chunks[n]) > 1 else chunks[n][0] for n in self._names]
        while len(self._inflight) >= self.max_in_flight:
            self._wait_oldest()
        fut = self._client.submit(RPC.REPLAY_WRITE, {"session": self._session, "ops": encode_ops(ops)}, bufs, timeout_s=self.timeout_s)
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
        while not concurrent.futures.wait([fut], timeout=POLL_S).done:
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
            close_session(self._client, self._own_client, self._session, self.timeout_s, self._drain)
        finally:
            name = self.storage.name
            self.storage.close()
            (SHM_DIR / name).unlink(missing_ok=True)

    def _drain(self) -> bool:
        """Ship everything and wait for the replies (the session is then ended)."""
        self.flush()
        return True
