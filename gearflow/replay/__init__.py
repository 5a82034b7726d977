"""Replay: shared-memory trajectory tables with Reverb's semantics and Ape-X's priorities.

Small roles, each swappable:

* :mod:`~gearflow.replay.spec` — :class:`TableSpec`: the typed columns of a step.
* :mod:`~gearflow.replay.storage` — :class:`SharedStorage`: columnar rings in one
  shared-memory segment, one partition per environment stream, one writer each.
* :mod:`~gearflow.replay.writer` — :class:`Writer` / :class:`TrajectoryWriter`:
  ``append``, ``extend``, ``create_item``, ``end_episode``, ``flush``.
* :mod:`~gearflow.replay.items` — the item interface (:class:`ItemKind`); the kinds
  themselves (``Transition``, ``Sequence``, ``Episode``) are :mod:`gearflow.kinds`.
* :mod:`~gearflow.replay.selectors` — uniform, prioritized (sum tree), FIFO,
  LIFO, max/min heap, top-k.
* :mod:`~gearflow.replay.rate_limiter` — :class:`RateLimiter` (Reverb semantics).
* :mod:`~gearflow.replay.table` — :class:`Table`: scan, evict, sample, update.
* :mod:`~gearflow.replay.table_checkpoint` — consistent checkpoints and exact restore.
* :mod:`~gearflow.replay.protocols` — :class:`WriterLike` (what adders write to) and
  :class:`SamplerLike` (what the learner reads): the seams a network transport plugs into.
"""

import importlib

# name → module: loaded on first use, so ``gearflow.replay.selectors`` or ``.storage`` can be
# imported (config validation, gc) without torch, which the table and item kinds need
_EXPORTS = {
    "ItemKind": "items",
    "RateLimiter": "rate_limiter", "RateLimiterTimeout": "rate_limiter",
    "Selection": "selectors", "Selector": "selectors", "make_selector": "selectors",
    "Column": "spec", "TableSpec": "spec",
    "SharedStorage": "storage", "TableClosed": "storage", "gc_segments": "storage",
    "Sample": "table", "Table": "table",
    "TrajectoryWriter": "writer", "Writer": "writer",
    "SamplerLike": "protocols", "WriterLike": "protocols",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gearflow.replay' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"gearflow.replay.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
