"""A cluster plan's roles (``launcher=ray``: :data:`~gearflow.topology.plan.CLUSTERS`), made on the
driver in the plan's order, each by its function in :data:`MAKERS` from the builder and the roles
made before it (by name); the last one's ``wait()`` is the run (:func:`~gearflow.topology.run.drive`)::

    last = build_cluster(Builder(cfg, plan, roles, tag=""))

Its own module, above :mod:`~gearflow.topology.learn` and :mod:`~gearflow.topology.shard_node`:
the cluster places their classes (a learner plan's :class:`~gearflow.topology.learn.Runner`, a
shard plan's :class:`~gearflow.topology.shard_node.ShardNode`) on Ray's nodes, and both build
their own roles with the :class:`~gearflow.topology.build.Builder`, which therefore cannot make
the cluster's roles itself without an import circle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gearflow.config import to_yaml
from gearflow.topology.build import Builder
from gearflow.topology.learn import Runner
from gearflow.topology.plan import learner_config, shard_node_config
from gearflow.topology.shard_node import ShardNode

__all__ = ["MAKERS", "build_cluster"]


def build_cluster(builder: Builder) -> Any:
    """Every role of ``builder``'s cluster plan, in the plan's order, each registered on its
    lifecycle as it is made. Returns the last (its ``wait()`` is the run)."""
    built: dict[str, Any] = {}
    for name in builder.plan.roles:
        built[name] = MAKERS[name](builder, built)
    return built[builder.plan.roles[-1]]


def ray_shards(builder: Builder, built: dict) -> Any:
    """The ``ray_shards`` role: Ray, the placement of every role, the shard nodes (each a ``shard``
    plan, :class:`~gearflow.topology.shard_node.ShardNode`, on its node)."""
    from gearflow.roles.ray import RayShards, driver_config

    cfg = builder.cfg = driver_config(builder.cfg)  # run.dir made and absolute, the run's secret
    shards = builder.roles.add(RayShards(cfg))
    shards.place(ShardNode, [to_yaml(shard_node_config(cfg, i)) for i in range(int(cfg.cluster.shards))])
    return shards


def ray_actor_groups(builder: Builder, built: dict) -> Any:
    """The ``ray_actor_groups`` role: each node's actor processes, pinned to its shard's node."""
    from gearflow.roles.ray import RayActorGroups

    shards = built["ray_shards"]
    return builder.roles.add(RayActorGroups(shards, shards.node_configs))


def ray_learners(builder: Builder, built: dict) -> Any:
    """The ``ray_learners`` role: the data-parallel learners (each a ``shards`` plan run by
    :class:`~gearflow.topology.learn.Runner`) over the nodes' addresses."""
    from gearflow.roles.ray import RayLearners

    cfg = builder.cfg
    return builder.roles.add(RayLearners(built["ray_shards"], Runner, lambda r, addresses, dist: to_yaml(
        learner_config(cfg, r, addresses, dist))))  # fmt: skip


MAKERS: dict[str, Callable[[Builder, dict], Any]] = {
    "ray_shards": ray_shards,
    "ray_actor_groups": ray_actor_groups,
    "ray_learners": ray_learners,
}
