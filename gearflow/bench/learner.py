"""``gearflow bench learner``: the learner loop against its own floor (filled in below)."""

from __future__ import annotations

import numpy as np

from gearflow.errors import GearflowError

__all__ = ["filled_table"]


def _item_steps(cfg, kind) -> tuple[int, int]:
    """(rows per item, rows between item ends) of the agent's items, as its actors write them."""
    from gearflow.kinds.sequence import Sequence
    from gearflow.kinds.transition import Transition

    if isinstance(kind, Transition):
        return int(cfg.actor.n_step) + 1, 1
    if isinstance(kind, Sequence):
        return int(kind.length), int(kind.period)
    raise GearflowError(f"bench learner fills transition and sequence items; agent {cfg.agent.name} samples "
                        f"{type(kind).__name__} items")  # fmt: skip


def _rows(spec, n: int, num_actions: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n`` stored rows of ``spec``: uint8 noise, integers in ``[0, num_actions)`` (valid actions),
    floats in ``[0, 1)`` (valid discounts and actions in a unit box), bools False."""
    out = {}
    for col in spec:
        shape = (n, *col.row_shape)
        if col.dtype == np.uint8:
            out[col.name] = rng.integers(0, 255, shape, dtype=np.uint8)
        elif col.dtype == np.bool_:
            out[col.name] = np.zeros(shape, dtype=bool)
        elif np.issubdtype(col.dtype, np.integer):
            out[col.name] = rng.integers(0, max(1, num_actions), shape).astype(col.dtype)
        else:
            out[col.name] = rng.random(shape).astype(col.dtype)
    return out


def filled_table(cfg, agent, *, device: str = "cpu", steps_per_partition: int = 4096, partitions: int = 2,
                 seed: int = 0, tag: int = 0):  # fmt: skip
    """A replay table of ``agent``'s columns and items as the runner makes it for ``cfg`` (selector,
    buffer sets for ``learner.prefetch``, ``device``), of ``partitions`` × ``steps_per_partition``
    rows, every row written with random values and every item an actor would create over them
    committed (random priorities); no rate limit (nothing inserts while a benchmark samples)."""
    from omegaconf import OmegaConf

    from gearflow.geometry import ReplayGeometry
    from gearflow.replay import Writer
    from gearflow.replay.items import records_per_partition
    from gearflow.replay.spec import replay_spec
    from gearflow.run.tables import make_table

    rng = np.random.default_rng(seed)
    kind = agent.item_kind()
    length, period = _item_steps(cfg, kind)
    S = max(int(steps_per_partition), 4 * length) // 64 * 64
    geom = ReplayGeometry(1, int(partitions), S, records_per_partition(kind, S))
    replay = OmegaConf.merge(cfg.replay, {"samples_per_insert": 0.0, "min_size_to_sample": 1})
    spec = replay_spec(agent.replay_columns(), cfg.replay.frame_stack)
    table = make_table(replay, kind, spec, geom, device, tag, seed=seed,
                       prefetch=int(cfg.learner.prefetch))  # fmt: skip
    try:
        writer = Writer(table.storage, list(range(geom.num_partitions)))
        num_actions = int(getattr(agent, "num_actions", 0) or 1)
        rows = _rows(table.storage.spec, 64, num_actions, rng)
        for _ in range(S // 64):
            for s in range(geom.num_partitions):
                first = writer.extend(rows, stream=s)
                ends = first + np.arange(1, 65)
                ends = ends[(ends - length >= writer.episode_starts([s])[0]) & ((ends - length) % period == 0)]
                if ends.size:
                    writer.create_items(rng.random(ends.size) + 0.01, length, streams=s, ends=ends)
        table.scan()
    except BaseException:
        table.close()
        raise
    return table
