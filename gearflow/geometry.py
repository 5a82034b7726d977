"""Replay geometry from a config: the one place that says how many partitions, steps and item
records a run's table has, used by the runner, the dry run and config validation::

    geom = replay_geometry(cfg, agent.item_kind())
    geom.num_partitions        # P = actors × envs (one actor when run.serial)
    geom.steps_per_partition   # S = replay.capacity // P
    geom.items_per_partition   # R = records_per_partition(kind, S)
    geom.partitions_of(1)      # actor 1's partitions: [E, 2E)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

__all__ = ["ReplayGeometry", "replay_geometry"]


@dataclass(frozen=True)
class ReplayGeometry:
    num_actors: int
    num_envs: int  # per actor: one partition each
    steps_per_partition: int
    items_per_partition: int  # 0 when the item kind is not known (config validation)

    @property
    def num_partitions(self) -> int:
        return self.num_actors * self.num_envs

    def partitions_of(self, actor: int) -> np.ndarray:
        """The partitions actor ``actor`` writes, one per env (E,)."""
        return np.arange(actor * self.num_envs, (actor + 1) * self.num_envs)


def replay_geometry(cfg: Any, kind: Optional[Any] = None) -> ReplayGeometry:
    """``cfg``'s table geometry; ``kind`` (an ``ItemKind``) sizes the record rings."""
    num_actors = 1 if cfg.run.serial else int(cfg.actor.num_actors)
    E = int(cfg.env.num_envs)
    S = int(cfg.replay.capacity) // max(1, num_actors * E)
    R = 0
    if kind is not None:
        from gearflow.replay.items import records_per_partition  # torch: only where a kind exists

        R = records_per_partition(kind, S)
    return ReplayGeometry(num_actors, E, S, R)
