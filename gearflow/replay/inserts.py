"""The writers' side of the rate limiter: an insert waits until the table's published insert
limit takes it.

The table publishes in its segment's header how many items writers may have published in all
(``H_INSERT_LIMIT``, :meth:`Table.note_sampled` / ``set_rate_limiter``; ``NO_LIMIT`` without a
ratio); a writer about to publish ``m`` items compares it with the partitions' PUBLISHED total
and, while it is reached, sleeps with a capped backoff, re-reading the header: until the limit
moves, the table is closed (:class:`TableClosed`), the writer's ``abort()`` says stop
(:class:`InsertAborted`) or ``timeout_s`` passes (:class:`RateLimiterTimeout`). With ``hold``,
a wait past ``timeout_s`` calls ``hold(seconds_held)`` instead; while it returns True the insert
waits on (Reverb's blocking insert: an actor whose learner is away pauses, it is not killed).

    wait_for_insert(storage, m, timeout_s=60.0, abort=stop_event.is_set)   # then publish m items
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gearflow.errors import GearflowError
from gearflow.replay.rate_limiter import MAX_BACKOFF_S, NO_LIMIT, RateLimiterTimeout
from gearflow.replay.storage import (
    H_CLOSED,
    H_INSERT_LIMIT,
    H_SAMPLES,
    PUBLISHED,
    SharedStorage,
    TableClosed,
)

__all__ = ["InsertAborted", "wait_for_insert"]


class InsertAborted(GearflowError):
    """A blocked insert gave up because ``Writer.abort()`` said the writer should stop."""


def wait_for_insert(storage: SharedStorage, m: int, timeout_s: float, abort: Callable[[], bool] | None,
                    hold: Callable[[float], bool] | None = None) -> None:
    """Return once the table's insert limit takes ``m`` more items (at once in the usual case:
    no limit, or room); see the module docstring for how it gives up."""
    header, counters = storage.header, storage.counters
    limit = int(header[H_INSERT_LIMIT])
    if limit == NO_LIMIT or counters[:, PUBLISHED].sum() + m <= limit:
        return
    start = time.monotonic()
    deadline = start + timeout_s
    delay = 1e-4
    while counters[:, PUBLISHED].sum() + m > header[H_INSERT_LIMIT]:
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
