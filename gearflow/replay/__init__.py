"""Replay: shared-memory trajectory tables with Reverb's semantics and Ape-X's priorities.

Small roles, each swappable:

* :mod:`~gearflow.replay.spec` — :class:`TableSpec`: the typed columns of a step.
* :mod:`~gearflow.replay.storage` — :class:`SharedStorage`: columnar rings in one
  shared-memory segment, one partition per environment stream, one writer each.
* :mod:`~gearflow.replay.writer` — :class:`Writer` / :class:`TrajectoryWriter`:
  ``append``, ``extend``, ``create_item``, ``end_episode``, ``flush``.
* :mod:`~gearflow.replay.items` — item kinds: :class:`Transition`,
  :class:`Sequence`, :class:`Episode`.
* :mod:`~gearflow.replay.selectors` — uniform, prioritized (sum tree), FIFO,
  LIFO, max/min heap, top-k.
* :mod:`~gearflow.replay.rate_limiter` — :class:`RateLimiter` (Reverb semantics).
* :mod:`~gearflow.replay.table` — :class:`Table`: scan, evict, sample, update.
* :mod:`~gearflow.replay.checkpoint` — consistent checkpoints and exact restore.
"""

from gearflow.replay.items import Episode, ItemKind, Sequence, Transition
from gearflow.replay.rate_limiter import RateLimiter, RateLimiterTimeout
from gearflow.replay.selectors import Selection, Selector, make_selector
from gearflow.replay.spec import Column, TableSpec
from gearflow.replay.storage import SharedStorage, gc_segments
from gearflow.replay.table import Sample, Table
from gearflow.replay.writer import TrajectoryWriter, Writer

__all__ = [
    "Column", "Episode", "ItemKind", "RateLimiter", "RateLimiterTimeout", "Sample", "Selection",
    "Selector", "Sequence", "SharedStorage", "Table", "TableSpec", "TrajectoryWriter",
    "Transition", "Writer", "gc_segments", "make_selector",
]  # fmt: skip
