"""Actor reports (``episode``, ``counters``, ``error`` messages) folded into a run's progress.

Every place a run reads its actors' reports — the local actor processes' queue
(:class:`~gearflow.launchers.local.LocalLauncher`), remote actors joined to a shard
(:class:`~gearflow.launchers.remote.RemoteActors`, a shard node's relay), a learner polling its
shard nodes (:class:`~gearflow.transport.learner.shards.RemoteShards`) and a Ray actor group — folds
them with :func:`fold_report`. Where reports are passed on rather than kept (a shard node
relays them to its learners), :class:`ReportSink` takes them as a Progress would and turns
them back into messages.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("gearflow.runner")

__all__ = ["ReportSink", "fold_report"]


def fold_report(
    progress, msg: Any, errors: dict[int, str] | None = None, source: str = "actor"
) -> str | None:
    """Fold one report into ``progress`` (a :class:`~gearflow.learner.Progress` or a
    :class:`ReportSink`): an episode's return, an actor's latest counters; an error is logged
    (``"<source> <actor> raised:"`` and its traceback) and its last line kept in ``errors``.
    Returns the message's type (other types, and anything not a dict, are left to the caller)."""
    kind = msg.get("type") if isinstance(msg, dict) else None
    if kind == "episode":
        progress.add_episode(int(msg["actor"]), float(msg["actor/episode_return"]))
    elif kind == "counters":
        progress.actor_counters[int(msg["actor"])] = msg
    elif kind == "error":
        log.error("%s %s raised:\n%s", source, msg.get("actor"), msg.get("error"))
        if errors is not None:
            lines = str(msg.get("error") or "").strip().splitlines()
            errors[int(msg["actor"])] = lines[-1] if lines else "?"
    return kind


class ReportSink:
    """Takes reports as a Progress does (``add_episode``, ``actor_counters[actor] = msg``) and
    hands each on to :meth:`add` as a message again — for a process that relays its actors'
    reports to where the run's progress is kept."""

    def __init__(self):
        sink = self

        class _Counters(dict):
            def __setitem__(self, actor, msg):
                super().__setitem__(actor, msg)
                sink.add({**msg, "type": "counters", "actor": int(actor)})

        self.actor_counters: dict[int, dict] = _Counters()

    def add_episode(self, actor: int, ret: float) -> None:
        self.add({"type": "episode", "actor": int(actor), "actor/episode_return": float(ret)})

    def add(self, msg: dict) -> None:
        raise NotImplementedError
