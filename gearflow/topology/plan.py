"""A run's plan: which roles this process runs, decided once from the config.

Every entry point asks the plan first (``gearflow train``, ``gearflow serve``, the Ray roles),
then builds the roles it names (:mod:`gearflow.topology.build`) and runs them through one
lifecycle (:mod:`gearflow.topology.lifecycle`)::

    plan = plan_run(cfg)                       # gearflow train
    plan.mode                                  # "local"
    plan.roles                                 # ("replay", "params", "learner", "actors")
    plan_run(cfg, command="serve").roles       # ("replay", "params", "shard_service", "actors")

=========  ==========================================================  =========================
mode       what this process runs (``roles``, in build order)          chosen by
=========  ==========================================================  =========================
dry_run    the memory plan only (no shared memory, no run directory)   ``run.dry_run=true``
ray        the driver of Ray's shard, actor-group and learner roles    ``launcher=ray``
shards     a learner over shard nodes (``data_parallel``, ``shards``,  ``transport.shards``
           ``learner``)
offline    a learner over a dataset (``replay``, ``params``,           ``run.mode=offline``
           ``learner``, ``dataset``)
serial     one actor and the learner in one process (``...``,          ``run.serial=true``
           ``serial_actor``)
local      the learner and actor processes (``...``, ``actors``,       the default
           ``remote_actors`` with ``actor.remote_actors > 0``)
serve      a shard node: replay, parameters, shard service, actors     ``gearflow serve``
shard      a shard node without actors of its own (Ray's shard role)   ``gearflow serve`` with
                                                                       ``actors=False``
=========  ==========================================================  =========================

``offline``, ``serial`` and ``local`` end with the ``eval`` role when ``run.eval_every`` is set:
greedy evaluation during training in a process of its own, reading this process's parameter
store (:mod:`gearflow.roles.evaluator`)::

    plan_run(load_config(path, ["run.eval_every=20000"])).roles
    # ("replay", "params", "learner", "actors", "eval")

A new launch mode is one entry here (its roles) and its role's class. The configs of Ray's
roles are made here too (:func:`shard_node_config`, :func:`learner_config`): each role is a
plan of its own (``serve``/``shard`` and ``shards``) run by the same builder.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from omegaconf import DictConfig

from gearflow.errors import ConfigError, GearflowError

__all__ = ["CLUSTERS", "COMMANDS", "LAUNCHERS", "MODES", "ROLES", "RUN_MODES", "RunPlan", "evaluates", "learner_config",
           "plan_run", "shard_node_config"]  # fmt: skip

COMMANDS = ("train", "serve")
# launcher=<name> of a cluster launch mode → the roles its driver runs, in build order (the builder
# makes each: Builder.<role>); its mode is named after it. config.validate reads the names here.
CLUSTERS = {"ray": ("ray_shards", "ray_actor_groups", "ray_learners")}
LAUNCHERS = ("local", *CLUSTERS)
RUN_MODES = ("online", "offline")  # run.mode: actors fill the replay, or a dataset does (config.validate reads it)
MODES = ("dry_run", *CLUSTERS, "shards", "offline", "serial", "local", "serve", "shard")
ROLES = ("dry_run", "ray_shards", "ray_actor_groups", "ray_learners", "data_parallel", "shards", "replay",
         "params", "learner", "dataset", "serial_actor", "actors", "remote_actors", "shard_service", "eval")  # fmt: skip


@dataclass(frozen=True)
class RunPlan:
    """Which roles one process runs (see the module docstring for the modes)."""

    mode: str
    """One of :data:`MODES`."""
    roles: tuple[str, ...]
    """The roles this process builds and runs, in build order (names from :data:`ROLES`)."""
    local_actors: int = 0
    """Actor processes this process starts (``actors``): the first ``actor.num_actors − actor.remote_actors``."""
    remote_actors: tuple[int, ...] = ()
    """Indices of the actors that join over TCP (``gearflow actor --connect``)."""

    def __contains__(self, role: str) -> bool:
        return role in self.roles

    @property
    def learns(self) -> bool:
        """Whether this process trains (a learner role)."""
        return "learner" in self.roles


def plan_run(cfg: DictConfig, command: str = "train", *, resume: bool = False, actors: bool = True) -> RunPlan:
    """The plan of ``command`` (``train`` or ``serve``) for ``cfg``; ``resume``: ``gearflow train
    --resume``; ``actors=False``: a shard node whose actors someone else starts (a Ray actor group).
    A config that no mode of ``command`` runs is a one-line :class:`~gearflow.errors.ConfigError`."""
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}: must be one of {', '.join(COMMANDS)}")
    run, a = cfg.run, cfg.actor
    num, remote = int(a.num_actors), int(a.remote_actors)
    joining = tuple(range(num - remote, num))
    if command == "serve":
        if run.serial or run.mode == "offline":
            raise ConfigError("gearflow serve runs actor processes: not with run.serial=true or run.mode=offline")
        if cfg.transport.shards:
            raise ConfigError("transport.shards is a learner's key (the shards it samples): a shard node serves "
                              "its own table; remove it from the node's config")  # fmt: skip
        if not actors:
            return RunPlan("shard", ("replay", "params", "shard_service"), remote_actors=joining)
        return RunPlan("serve", ("replay", "params", "shard_service", "actors"), num - remote, joining)
    if run.dry_run:  # before the launcher: a dry run starts nothing anywhere
        return RunPlan("dry_run", ("dry_run",))
    if cfg.launcher in CLUSTERS:  # this process drives roles placed on a cluster
        if resume:
            raise GearflowError(f"--resume with launcher={cfg.launcher} is not supported yet: resume the learner with "
                                "gearflow train --resume RUN_DIR transport.shards=[...] against running shard nodes")
        return RunPlan(str(cfg.launcher), CLUSTERS[cfg.launcher])
    if cfg.launcher != "local":
        raise ConfigError(f"launcher={cfg.launcher}: must be {', '.join(LAUNCHERS[:-1])} or {LAUNCHERS[-1]}")
    if cfg.transport.shards:  # the replay and the actors are on shard nodes (gearflow serve)
        parallel = ("data_parallel",) if int(cfg.learner.world_size) > 1 else ()
        return RunPlan("shards", (*parallel, "shards", "learner"))
    evals = ("eval",) if evaluates(cfg) else ()  # greedy evaluation in a process of its own, last built
    if run.mode == "offline":  # the dataset is the replay; no actors
        return RunPlan("offline", ("replay", "params", "learner", "dataset", *evals))
    if run.serial:
        return RunPlan("serial", ("replay", "params", "learner", "serial_actor", *evals))
    return RunPlan("local", ("replay", "params", "learner", "actors", *(("remote_actors",) if remote else ()), *evals),
                   num - remote, joining)  # fmt: skip


def evaluates(cfg: DictConfig) -> bool:
    """Whether ``run.eval_every`` asks for evaluation during training (its form is checked by
    :func:`gearflow.config.validate`: a positive number of steps or a duration)."""
    m = re.match(r"\s*(\d+(?:\.\d*)?)", str(cfg.run.get("eval_every") or 0))
    return bool(m) and float(m.group(1)) > 0


# ---------------------------------------------------------------------- Ray's roles


def shard_node_config(cfg: DictConfig, i: int) -> DictConfig:
    """The config of shard node ``i`` of a ``launcher=ray`` run (a ``shard`` plan; its actor group
    runs ``actor.num_actors`` actors): its slice of the ε ladder, its own run directory."""
    c = cfg.copy()
    n, S = int(cfg.actor.num_actors), int(cfg.cluster.shards)
    c.actor.ladder_offset, c.actor.ladder_total = i * n, S * n
    c.actor.remote_actors = 0
    c.transport.port = 0
    c.run.dir = os.path.join(str(cfg.run.dir), f"shard-{i}")
    c.launcher = "local"
    return c


def learner_config(cfg: DictConfig, rank: int, shards: list[str], dist: str) -> DictConfig:
    """The config of learner ``rank`` of a ``launcher=ray`` run (a ``shards`` plan over ``shards``,
    data-parallel with the others at ``dist``)."""
    c = cfg.copy()
    c.transport.shards = shards
    c.learner.world_size, c.learner.rank, c.learner.dist_address = int(cfg.cluster.learners), rank, dist
    if rank:
        c.run.dir = os.path.join(str(cfg.run.dir), f"learner-{rank}")
        c.run.progress = "log"
    c.launcher = "local"
    return c
