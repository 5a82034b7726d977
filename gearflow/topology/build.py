"""One builder of a run's parts — agent, replay, parameters, learner, actors — for a plan.

``gearflow train`` (:class:`~gearflow.runner.Runner`), ``gearflow serve``
(:class:`~gearflow.launchers.serve.ShardNode`) and the Ray roles (their shard nodes and learners
are those two; their actor groups start :func:`actor_processes`) build with it, so a part is
made one way wherever it runs. Every part is registered on the run's
:class:`~gearflow.topology.roles.Lifecycle` as it is made: a failure later in the build closes
what was built (the caller's ``roles.close()``)::

    roles = Lifecycle()
    build = Builder(cfg, plan_run(cfg), roles, tag=run_tag(run_dir))
    agent, env_spec = build.agent(device)
    table = build.replay(agent, device)            # build.geom: partitions, steps, items
    params = build.params(agent)
    learner = build.learner(agent, table, params, progress, env_steps=..., actor_version=...)
    serial_actor = build.actors(agent, table, params, progress)   # actor processes: roles
    build.evaluator(params, progress, env_steps=..., emit=...)    # run.eval_every: the eval role

Each part is handed the config groups it reads: the table its ``replay`` group (and the run's
seed and the learner's prefetch depth), the agent its ``agent`` group and
:class:`~gearflow.agent.AgentSettings`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from gearflow.agent import make_agent
from gearflow.envs import EnvSpec, probe_env_spec
from gearflow.errors import ConfigError
from gearflow.geometry import replay_geometry
from gearflow.topology.plan import RunPlan
from gearflow.topology.roles import Lifecycle, Shards

log = logging.getLogger("gearflow.runner")

__all__ = ["Builder", "actor_processes", "replay_device"]


def replay_device(cfg: DictConfig, learner_device: torch.device) -> str:
    """Where the table selects and gathers (``replay.device``), checked against the learner's device:
    batches assembled on a GPU land on the learner's GPU."""
    from gearflow.native.device_replay import resolve_replay_device

    device = resolve_replay_device(cfg.replay.device, cfg.replay.selector)  # before any segment
    if device.startswith("cuda") and learner_device.type != "cuda":
        raise ConfigError(
            f"replay.device={cfg.replay.device!r} assembles batches on the GPU, but the learner runs on "
            f"{learner_device} (learner.device={cfg.learner.device!r}); use learner.device=cuda or replay.device=cpu"
        )
    if device == "cuda" and learner_device.index is not None:
        return f"cuda:{learner_device.index}"  # the batches land on the learner's GPU
    if device.startswith("cuda:"):
        index = torch.cuda.current_device() if learner_device.index is None else learner_device.index
        if device != f"cuda:{index}":
            raise ConfigError(f"replay.device={device} assembles batches on another GPU than the learner's "
                              f"({learner_device}); give both the same index")  # fmt: skip
    return device


def actor_processes(cfg: DictConfig, storage_name: str, params_name: str, partitions: list[np.ndarray]):
    """The role of this machine's actor processes over the named replay segment and parameter store
    (:class:`~gearflow.launchers.local.LocalLauncher`): a run's, a shard node's, a Ray actor group's."""
    from gearflow.launchers.local import LocalLauncher

    return LocalLauncher(cfg, storage_name, params_name, partitions)


class Builder:
    """Builds the parts of ``plan`` from ``cfg``, registering each on ``roles`` (module docstring)."""

    def __init__(self, cfg: DictConfig, plan: RunPlan, roles: Lifecycle, *, tag: str):
        self.cfg, self.plan, self.roles, self.tag = cfg, plan, roles, tag
        self.geom = None  # the table's ReplayGeometry, once replay() made it
        self.env_spec: EnvSpec | None = None

    # ------------------------------------------------------------------ learner side
    def agent(self, device: torch.device):
        """The agent for the env (learner state set up; its item kind checked against ``replay.item``)
        and the env's spec."""
        cfg = self.cfg
        self.env_spec = probe_env_spec(cfg.env)
        agent = make_agent(cfg, self.env_spec, device)
        agent.setup_learner()
        kind = agent.item_kind()
        if kind.name != cfg.replay.item:
            raise ConfigError(f"replay.item={cfg.replay.item!r}: agent {cfg.agent.name} learns from {kind.name} items")
        return agent, self.env_spec

    def replay(self, agent, learner_device: torch.device | None = None, checkpoint_dir: Path | None = None):
        """The run's replay table in shared memory (restored from ``checkpoint_dir`` when given);
        ``learner_device`` None: a shard node's table, selected and gathered on the CPU."""
        from gearflow.replay.spec import replay_spec
        from gearflow.run.tables import make_table, restore_table

        cfg = self.cfg
        kind = agent.item_kind()
        geom = self.geom = replay_geometry(cfg, kind)
        spec = replay_spec(agent.replay_columns(), cfg.replay.frame_stack)  # frame_stack: obs as frames
        device = "cpu" if learner_device is None else replay_device(cfg, learner_device)
        prefetch = int(cfg.learner.prefetch)  # the consumer's depth: the table's batch buffer sets
        if checkpoint_dir is not None:
            table = restore_table(cfg.replay, checkpoint_dir, kind, spec, geom, device, self.tag, prefetch=prefetch)
        else:
            table = make_table(cfg.replay, kind, spec, geom, device, self.tag, seed=int(cfg.run.seed), prefetch=prefetch)
        self.roles.closes(table, "replay")
        log.info("replay: %d partitions × %d steps (%.1f MiB), item=%s, selector=%s", geom.num_partitions,
                 geom.steps_per_partition, table.storage.nbytes / 2**20, cfg.replay.item, cfg.replay.selector)
        return table

    def params(self, agent):
        """The parameter store of the agent's learner network (nothing published yet)."""
        from gearflow.params import ParameterStore

        return self.roles.closes(ParameterStore.create(agent.learner_network(), run_tag=self.tag), "params")

    def learner(self, agent, sampler, params, progress, **kwargs):
        """The learner loop over ``sampler`` (a table or shard nodes), publishing to ``params``; β is
        annealed to 1 over ``run.max_env_steps`` when the selector weighs by importance."""
        from gearflow.learner import BetaSchedule, Learner

        cfg = self.cfg
        beta = None
        if sampler.selector.importance_sampled and cfg.run.max_env_steps:
            beta = BetaSchedule(float(cfg.replay.beta), int(cfg.run.max_env_steps))
        return Learner(cfg.learner, agent, sampler, params, progress, run=cfg.run, beta=beta, **kwargs)

    def data_parallel(self, device: torch.device, agent):
        """This learner's data-parallel group (``learner.world_size > 1``), joined and set up."""
        from gearflow.distributed import DataParallel

        if "data_parallel" not in self.plan:
            return None
        parallel = self.roles.closes(DataParallel.from_config(self.cfg, device), "data_parallel")
        parallel.init()  # waits for every rank at learner.dist_address
        parallel.setup(agent)  # rank 0's learner state everywhere; gradient averaging hooks
        return parallel

    def shards(self, agent, progress, *, publisher: bool, seed: int):
        """The shard nodes of ``transport.shards`` as this learner's sampler and publisher."""
        from gearflow.transport.learner.shards import RemoteShards

        shards = RemoteShards(self.cfg, agent, publisher=publisher, seed=seed)
        self.roles.add(Shards(shards, progress))
        return shards

    # ------------------------------------------------------------------ acting side
    def actors(self, agent, table, params, progress):
        """What fills the table in this plan: the dataset (``offline``), one actor in this process
        (``serial_actor``: returned), actor processes (``actors``) and the remote actors' shard
        process (``remote_actors``), the last two registered as roles."""
        cfg, plan, geom = self.cfg, self.plan, self.geom
        if "dataset" in plan:  # a restored checkpoint already holds it
            from gearflow.run.offline import load_dataset

            if table.size == 0:
                load_dataset(cfg.run.dataset, table, agent, self.env_spec)
        serial = None
        if "serial_actor" in plan:
            serial = self.roles.closes(self._serial_actor(agent, table, params, progress), "serial_actor")
        partitions = [geom.partitions_of(a) for a in range(geom.num_actors)]
        if "actors" in plan:
            local = partitions[: plan.local_actors]
            self.roles.add(actor_processes(cfg, table.storage.name, params.name, local))
        if "remote_actors" in plan:
            from gearflow.launchers.remote import RemoteActors

            self.roles.add(RemoteActors(cfg, table, params, {a: partitions[a] for a in plan.remote_actors}))
        return serial

    def evaluator(self, params, progress, *, env_steps, emit):
        """The ``eval`` role (``run.eval_every``): greedy evaluation in a process of its own over
        ``params`` (:class:`~gearflow.launchers.evaluator.EvalProcess`), its rows to ``emit``;
        None in a plan without it."""
        if "eval" not in self.plan:
            return None
        import time

        from gearflow.launchers.evaluator import EvalProcess

        return self.roles.add(EvalProcess(self.cfg, params.name, env_steps=env_steps, updates=lambda: progress.updates,
                                          elapsed=lambda: time.monotonic() - progress.start, emit=emit))  # fmt: skip

    def _serial_actor(self, agent, table, params, progress):
        from gearflow.actors.process import build_actor

        return build_actor(self.cfg, 0, agent=agent, storage=table.storage, partitions=self.geom.partitions_of(0),
                           param_source=params, on_episode=lambda env, ret, length, eps: progress.add_episode(0, ret))  # fmt: skip
