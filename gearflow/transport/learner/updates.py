"""Priority updates sent to shard services and not yet answered (a learner's
:class:`~gearflow.transport.learner.RemoteSampler`): Ape-X's learner does not wait for its
priority writes, so the round trip of one update overlaps the next learn step.

    pending = PendingUpdates()
    pending.add(i, tag, future)                       # after submitting replay.update_priorities
    applied = pending.collect(block=False, read=read)  # the replies that have arrived, in order

``read(i, tag, future)`` reads one reply (and raises its error) and returns how many of its keys
the shard applied. Replies are read in the order the updates were sent; with ``block`` every one
is waited for. At most :data:`LIMIT` stay unread: an update beyond it waits for the oldest (a shard
that falls behind slows the learner down instead of queueing without bound).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

__all__ = ["LIMIT", "PendingUpdates"]

LIMIT = 16  # updates (one per shard per batch) sent and not yet read back


class PendingUpdates:
    """The updates' ``(shard, tag, future)`` in the order they were sent; :attr:`applied`: how
    many keys the replies read so far said were applied."""

    def __init__(self, limit: int = LIMIT):
        self._q: collections.deque = collections.deque()
        self.limit, self.applied = int(limit), 0

    def __len__(self) -> int:
        return len(self._q)

    def add(self, i: int, tag: int, fut: Any) -> None:
        self._q.append((i, tag, fut))

    def collect(self, block: bool, read: Callable[[int, int, Any], int]) -> int:
        """Read the replies that have arrived (``block``: all of them, waiting), oldest first, and
        the oldest beyond :attr:`limit`; returns how many keys they applied."""
        n = 0
        q = self._q
        while q and (block or len(q) > self.limit or q[0][2].done()):
            i, tag, fut = q.popleft()
            n += read(i, tag, fut)
        self.applied += n
        return n

    def clear(self) -> None:
        self._q.clear()
