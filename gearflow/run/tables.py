"""A run's replay table (fresh, or restored from a checkpoint and checked against the config)
and its run directory's name: made by the one builder (:mod:`gearflow.topology.build`) for
``gearflow train`` and shard nodes (``gearflow serve``). A table is handed the ``replay`` group
it owns, with the run's seed and the learner's prefetch depth as values::

    table = make_table(cfg.replay, kind, spec, geom, "cpu", tag, seed=cfg.run.seed, prefetch=cfg.learner.prefetch)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig

from gearflow.errors import ConfigError
from gearflow.geometry import ReplayGeometry
from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, make_selector
from gearflow.replay.layout import buffer_sets
from gearflow.replay.selectors import selector_kwargs
from gearflow.replay.storage import COMMIT
from gearflow.replay.table_checkpoint import restore_checkpoint

log = logging.getLogger("gearflow.runner")

__all__ = ["env_steps_in", "make_run_dir", "make_table", "rate_limiter", "restore_table"]


def make_run_dir(cfg: DictConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.run.name}-{stamp}"


def env_steps_in(table: Table) -> int:
    return int(table.storage.counters[:, COMMIT].sum())


def rate_limiter(replay: DictConfig) -> RateLimiter:
    """The table's rate limiter from its ``replay`` group."""
    r = replay
    return RateLimiter(min_size_to_sample=r.min_size_to_sample, samples_per_insert=r.samples_per_insert,
                       error_buffer=r.error_buffer)  # fmt: skip


def make_table(replay: DictConfig, kind, spec: TableSpec, geom: ReplayGeometry, device: str, tag: str, *,
               seed: int, prefetch: int) -> Table:  # fmt: skip
    """A fresh replay table of ``geom`` in a new shared-memory segment: the ``replay`` group's
    selector, rate limiter and timeout; ``seed`` seeds the selector, ``prefetch`` (the consumer's
    depth) sizes the batch buffers."""
    storage = SharedStorage.create(spec, geom.num_partitions, geom.steps_per_partition, geom.items_per_partition,
                                   run_tag=tag)  # fmt: skip
    try:
        selector = make_selector(replay.selector, geom.num_partitions * geom.items_per_partition,
                                 seed=int(seed), **selector_kwargs(replay))  # fmt: skip
        return Table(storage, kind, selector, rate_limiter(replay), num_buffers=buffer_sets(int(prefetch)),
                     sample_timeout_s=replay.timeout_s, device=device)  # fmt: skip
    except BaseException:
        storage.close()
        storage.unlink()
        raise


def restore_table(replay: DictConfig, path: Path, kind, spec: TableSpec, geom: ReplayGeometry, device: str,
                  tag: str, *, prefetch: int) -> Table:  # fmt: skip
    """The replay table of a checkpoint, refused if the config no longer matches its layout,
    item kind or selector; its rate limiter, timeout and buffer count follow the ``replay`` group
    and ``prefetch``."""
    table = restore_checkpoint(path, device=device, run_tag=tag, rate_limiter=rate_limiter(replay),
                               num_buffers=buffer_sets(int(prefetch)), sample_timeout_s=replay.timeout_s)
    st = table.storage
    have = (st.num_partitions, st.steps_per_partition, st.items_per_partition)
    want = (geom.num_partitions, geom.steps_per_partition, geom.items_per_partition)
    problem = ""
    if have != want or st.spec.to_dict() != spec.to_dict():
        problem = (
            f"the checkpoint's replay has (partitions, steps, items) = {have} and columns "
            f"{list(st.spec.names)}, the config asks for {want} and {list(spec.names)} "
            "(replay.capacity, actor.num_actors, env.num_envs, run.serial and the agent must stay as they were)"
        )
    elif table.kind.to_dict() != kind.to_dict():
        problem = (
            f"the checkpoint's items are {table.kind.to_dict()}, the config asks for "
            f"{kind.to_dict()} (replay.item, sequence_length, sequence_period, burn_in "
            "and max_episode_length must stay as they were)"
        )
    elif table.selector.name != replay.selector:
        problem = (
            f"replay.selector={replay.selector!r}, but the checkpoint's table was filled with the "
            f"{table.selector.name!r} selector (its priorities and order are part of the checkpoint)"
        )
    if problem:
        table.close()
        raise ConfigError(f"cannot resume: {problem}")
    log.info("replay restored: %d items, %d env steps", table.size, env_steps_in(table))
    return table
