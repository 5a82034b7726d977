"""The item checks of ``create_items``, written once: every writer makes them with these messages.

A local :class:`~gearflow.replay.writer.Writer` (its numpy paths and the scalar
``TrajectoryWriter.create_item``), and a remote writer against its mirror of the shard's
positions (:class:`~gearflow.transport.actor.RemoteWriter`; the shard's own ``Writer`` makes them
again when the batch arrives) call these; the C path (``replay/_hotpath.c``: ``stream_items``
and the n-step adder's flush) makes the same checks with the same messages in C.

    start = check_items(prio, lengths, ends, streams, pos, ep0, S, trust)  # first steps, or ValueError
    check_stream_order(start, last_start, R)                              # the items of one stream
    order, first, group_start, rank, last = stream_order(streams, start, last_item_start, R)
"""

from __future__ import annotations

import numpy as np

from gearflow.replay.selectors import check_priorities

__all__ = [
    "ORDER_MESSAGE",
    "check_items",
    "check_stream_order",
    "crossing_message",
    "drop_expired",
    "expired_message",
    "stream_order",
]

ORDER_MESSAGE = "items of a stream must be created in order of their first step"


def expired_message(start: int, stream: int, pos: int, trust: int) -> str:
    """The error of an item over steps the ring already overwrote (the C path says the same)."""
    return (f"item starting at step {start} of stream {stream} refers to steps the ring already "
            f"overwrote: the stream holds steps >= {pos - trust} ({trust} steps behind its next step {pos})")


def crossing_message(length: int, stream: int, in_episode: int) -> str:
    """The error of an item that reaches back over its stream's episode start."""
    return f"item of {length} steps crosses an episode boundary: stream {stream} has {in_episode} steps in its current episode"


def check_items(prio, lengths, end, streams, pos, ep0, S: int, trust: int | None = None) -> np.ndarray:
    """The checks of a batch of items: priorities finite and ≥ 0, lengths in ``[1, S]``, no end
    past its stream's next step ``pos``, no item reaching back over its stream's episode start
    ``ep0`` and, with ``trust`` (the steps a ring holds behind its next step), none starting on
    steps the ring already overwrote. ``pos`` / ``ep0``: per item (arrays) or one stream's
    (ints). Returns the items' first steps."""
    check_priorities(prio)
    bad = (lengths < 1) | (lengths > S)
    if bad.any():
        raise ValueError(f"num_steps must be in [1, {S}], got {lengths[bad][0]}")
    if (end > pos).any():
        raise ValueError("an item ends after the last appended step")
    start = end - lengths
    crosses = start < ep0
    if crosses.any():
        j = int(np.argmax(crosses))
        e0 = ep0[j] if np.ndim(ep0) else ep0
        raise ValueError(crossing_message(int(lengths[j]), int(streams[j]), int(end[j] - e0)))
    if trust is not None:
        expired = start < pos - trust
        if expired.any():  # Reverb's CreateItemRejectsExpiredCellRefs: the table would evict it unseen
            j = int(np.argmax(expired))
            raise ValueError(expired_message(int(start[j]), int(streams[j]), int(pos[j] if np.ndim(pos) else pos), trust))
    return start


def check_stream_order(start: np.ndarray, last_start: int, R: int) -> None:
    """The items of one stream in one call: at most ``R`` (its record ring), first steps
    ascending from the stream's last item's."""
    if start.size > R:
        raise ValueError(f"more than {R} items for one stream in one call")
    if start[0] < last_start or (start.size > 1 and np.diff(start).min() < 0):
        raise ValueError(ORDER_MESSAGE)


def stream_order(streams: np.ndarray, start: np.ndarray, last_item_start: np.ndarray, R: int):
    """The items of several streams in one call, grouped by stream (first steps ascending within
    one) and checked: each stream's first item not before its last item's start, at most ``R``
    per stream. Returns ``(order, first, group_start, rank, last)``: the grouping permutation;
    over the grouped items, whether each is its stream's first, the groups' first and last
    positions, and each item's rank within its stream."""
    m = streams.size
    order = np.lexsort((start, streams))  # group by stream, starts ascending within a stream
    so = streams[order]
    first = np.r_[True, so[1:] != so[:-1]]
    if (start[order][first] < last_item_start[so[first]]).any():
        raise ValueError(ORDER_MESSAGE)
    group_start = np.flatnonzero(first)
    rank = np.arange(m) - np.repeat(group_start, np.diff(np.r_[group_start, m]))
    if rank.max() >= R:
        raise ValueError(f"more than {R} items for one stream in one call")
    last = np.r_[group_start[1:] - 1, m - 1]
    return order, first, group_start, rank, last


def drop_expired(prio, num_steps, s, ends, pos, trust, streams):
    """``create_items(expired="drop")``: its arguments without the items that start before the
    ring's trusted steps (``ends[j] - num_steps[j] < pos[s[j]] - trust``), and how many were
    dropped. ``s`` is each item's stream (``streams`` as passed: returned unchanged when nothing
    is dropped, or when ``s`` does not match the items and the usual checks say what is wrong)."""
    m = prio.size
    if m == 0 or s.size != m:
        return prio, num_steps, streams, ends, 0
    lengths = np.broadcast_to(np.asarray(num_steps, dtype=np.int64), (m,))
    end = pos[s] if ends is None else np.broadcast_to(np.asarray(ends, dtype=np.int64), (m,))
    keep = end - lengths >= pos[s] - trust
    if keep.all():
        return prio, num_steps, streams, ends, 0
    return prio[keep], lengths[keep], s[keep], end[keep], int(m - keep.sum())
