"""The insert limit in a segment's header: the table publishes it, a writer's insert waits until
it takes the insert.

The table publishes in its segment's header how many items writers may have published in all
(``H_INSERT_LIMIT``, written by the :class:`InsertLimit` a :class:`~gearflow.replay.table.Table`
holds: its rate limiter's limit, or the one a learner pacing several tables sets with
``Table.pace``; ``NO_LIMIT`` without a ratio); a writer about to publish ``m`` items compares it
with the partitions' PUBLISHED total and, while it is reached, sleeps with a capped backoff,
re-reading the header: until the limit moves, the table is closed (:class:`TableClosed`), the
writer's ``abort()`` says stop (:class:`InsertAborted`) or ``timeout_s`` passes
(:class:`RateLimiterTimeout`). With ``hold``, a wait past ``timeout_s`` calls
``hold(seconds_held)`` instead; while it returns True the insert waits on (Reverb's blocking
insert: an actor whose learner is away pauses, it is not killed).

Writers take room in the order they began to wait. A waiting writer stamps its partitions'
``WAIT_SINCE_NS`` (and their ``HEARTBEAT_NS`` at each re-check); a writer with room still waits
while another live writer (heartbeat under :data:`STALE_WAITER_NS` old) has waited longer. Without
this, a writer that needs a large room (16 envs ending their episodes at once flush 16 × n items)
never found it: writers of small pieces took each bit of room as the learner's samples made it,
and one actor of a HalfCheetah run wrote nothing for 660 s.

    wait_for_insert(storage, m, timeout_s=60.0, abort=stop_event.is_set)   # then publish m items
    table.insert_limit.publish()    # the table's side: after a sample, a scan, a new limiter
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from gearflow.errors import GearflowError
from gearflow.replay.rate_limiter import MAX_BACKOFF_S, NO_LIMIT, RateLimiterTimeout
from gearflow.replay.storage import (
    CLOSED_LIMIT,
    H_CLOSED,
    H_INSERT_LIMIT,
    H_SAMPLES,
    HEARTBEAT_NS,
    PUBLISHED,
    WAIT_SINCE_NS,
    SharedStorage,
    TableClosed,
)

if TYPE_CHECKING:
    from gearflow.replay.table import Table

__all__ = ["STALE_WAITER_NS", "InsertAborted", "InsertLimit", "wait_for_insert"]

STALE_WAITER_NS = 2_000_000_000  # a waiter that has not re-checked for this long is not waited for (dead)


class InsertAborted(GearflowError):
    """A blocked insert gave up because ``Writer.abort()`` said the writer should stop."""


def wait_for_insert(storage: SharedStorage, m: int, timeout_s: float, abort: Callable[[], bool] | None,
                    hold: Callable[[float], bool] | None = None, partitions: np.ndarray | None = None) -> None:
    """Return once the table's insert limit takes ``m`` more items (at once in the usual case:
    no limit, or room and nobody waiting before); see the module docstring for how it gives up.
    ``partitions``: the writer's own (it stamps them while it waits; None: a writer that waits
    behind the others but is not waited for)."""
    header, counters = storage.header, storage.counters
    limit = int(header[H_INSERT_LIMIT])
    if limit == NO_LIMIT:
        return
    mine = _NO_PARTITIONS if partitions is None else np.asarray(partitions, dtype=np.int64)
    start_ns = time.monotonic_ns()
    if counters[:, PUBLISHED].sum() + m <= limit and not _waited_longer(counters, mine, start_ns, start_ns):
        return
    start = time.monotonic()
    deadline = start + timeout_s
    delay = 1e-4
    counters[mine, WAIT_SINCE_NS] = start_ns
    counters[mine, HEARTBEAT_NS] = start_ns
    try:
        while (counters[:, PUBLISHED].sum() + m > header[H_INSERT_LIMIT]
               or _waited_longer(counters, mine, start_ns, time.monotonic_ns())):  # fmt: skip
            if header[H_CLOSED]:  # Table.close() set the limit below any count: it never opens again
                raise TableClosed(f"insert of {m} item(s) refused: the replay table {storage.name} was closed")
            if abort is not None and abort():
                raise InsertAborted(f"insert of {m} item(s) abandoned while the rate limiter held it: the writer was asked to stop")
            if time.monotonic() > deadline:
                if hold is not None and hold(time.monotonic() - start):
                    deadline = time.monotonic() + timeout_s  # asked again after another timeout_s
                    continue
                raise RateLimiterTimeout(
                    f"insert of {m} item(s) blocked for {timeout_s:.1f} s by the rate "
                    f"limiter: {int(counters[:, PUBLISHED].sum())} inserted, "
                    f"{int(header[H_SAMPLES])} sampled, limit {int(header[H_INSERT_LIMIT])} "
                    f"(is the learner sampling?)"
                )
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
            counters[mine, HEARTBEAT_NS] = time.monotonic_ns()  # still waiting: the others wait behind it
            counters[mine, WAIT_SINCE_NS] = start_ns  # (again, if another writer took it for stale)
    finally:
        counters[mine, WAIT_SINCE_NS] = 0


_NO_PARTITIONS = np.zeros(0, dtype=np.int64)


def _waited_longer(counters: np.ndarray, mine: np.ndarray, since_ns: int, now_ns: int) -> bool:
    """Whether a live writer of other partitions than ``mine`` has waited since before ``since_ns``."""
    waits = counters[:, WAIT_SINCE_NS]
    if not waits.any():  # the usual case: nobody waits
        return False
    live = now_ns - counters[:, HEARTBEAT_NS] < STALE_WAITER_NS
    stale = (waits > 0) & ~live
    stale[mine] = False
    if stale.any():  # a writer that died waiting: its stamp is cleared (one still waiting stamps again)
        counters[np.flatnonzero(stale), WAIT_SINCE_NS] = 0
    before = (waits > 0) & (waits < since_ns)  # (``waits`` is a view: the stale stamps are 0 now)
    before[mine] = False
    return bool(before.any())


class InsertLimit:
    """The table's side: what ``table`` publishes in its segment's header for its writers
    (``H_INSERT_LIMIT``, and ``H_SAMPLES`` for their timeout message) — its rate limiter's insert
    limit, or one set from outside (:meth:`pace`: a learner's
    :class:`~gearflow.replay.pacing.GlobalPacing` keeps the rate over several tables and sends
    each its limit) — and the counters such a pacer reads (:meth:`counters`). It reads the
    table's ``storage``, ``rate_limiter``, ``samples``, ``size`` and ``deletes``.

        limit = InsertLimit(table)      # Table.__init__: table.insert_limit
        limit.publish()                 # after a sample, a scan below the minimum size, a restore
        limit.pace(5500)                # writers may publish 5,500 items in all; pace(None): the limiter's
    """

    def __init__(self, table: Table):
        self.table = table
        self.paced: int | None = None  # an insert limit set from outside (pace()), else the limiter's

    def publish(self) -> None:
        """Write the writers' insert limit and the table's samples into the header."""
        t = self.table
        header = t.storage.header
        if self.paced is not None:
            header[H_INSERT_LIMIT] = self.paced
        else:
            lim = t.rate_limiter
            # Reverb's stage 1: inserts go on while the table is below its minimum size. Items
            # published but not held (evicted, or dropped at ingest) are the deletes, so a
            # writer may publish until held + not yet scanned + new = min_size_to_sample.
            deletes = t.deletes if t.size < lim.min_size_to_sample else 0
            header[H_INSERT_LIMIT] = lim.insert_limit(t.samples, deletes)
        header[H_SAMPLES] = t.samples

    def pace(self, insert_limit: int | None) -> None:
        """Let the writers insert up to ``insert_limit`` items in all (``None``: back to the
        table's rate limiter), published at once when it changed."""
        limit = None if insert_limit is None else int(insert_limit)
        if limit != self.paced:
            self.paced = limit
            self.publish()

    def counters(self) -> dict[str, int]:
        """What a global pacer needs of the table: items published (``inserts``), sampled, gone
        (published, then evicted or dropped: ``deletes``) and held (``size``)."""
        t = self.table
        inserts = int(t.storage.counters[:, PUBLISHED].sum())
        return {"inserts": inserts, "samples": int(t.samples), "deletes": t.deletes, "size": int(t.size)}

    def close(self) -> None:
        """The table closed: every writer's limit check fails from now on, and writers see it closed
        (only the segment's owner writes them)."""
        storage = self.table.storage
        if storage.owner:
            storage.header[H_CLOSED] = 1
            storage.header[H_INSERT_LIMIT] = CLOSED_LIMIT
