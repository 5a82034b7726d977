"""One builder of every role of every plan — agent, replay, parameters, learner, actors, a
shard node's service, a cluster's roles — so that a part is made one way wherever it runs.

Every process runs a plan (:func:`~gearflow.topology.plan.plan_run`) through
:func:`~gearflow.topology.run.run_plan`: a learner's (:class:`~gearflow.topology.learn.Runner`:
``local``, ``serial``, ``offline``, ``shards``), a shard node's
(:class:`~gearflow.topology.shard_node.ShardNode`: ``serve``, ``shard``), a cluster driver's
(``ray``) or the dry run; each builds the roles its plan names with this class, in the plan's
order. Every role is registered on the run's :class:`~gearflow.topology.lifecycle.Lifecycle` as it
is made: a failure later in the build closes what was built (the caller's ``roles.close()``)::

    roles = Lifecycle()
    build = Builder(cfg, plan_run(cfg), roles, tag=run_tag(run_dir), progress=progress)
    agent, env_spec = build.agent(device)
    parallel = build.data_parallel(device, agent)   # "data_parallel" (learner.world_size > 1), else None
    table = build.replay(agent, device)             # "replay" (build.geom), or the "shards" nodes' sampler
    params = build.params(agent)                    # "params", or the shard nodes' publisher
    build.publish(params, agent, version)           # the first weights (only the publishing learner)
    learner = build.learner(agent, table, params, parallel=parallel, env_steps=..., actor_version=...)
    build.actors(agent, table, params)              # "dataset", "serial_actor", "actors", "remote_actors"
    build.evaluator(params, env_steps=..., emit=...)  # "eval" (run.eval_every)
    batches = build.batches(learner, table)         # a serial actor's, or the prefetcher
    build.env_steps(), build.actor_version()        # the run's counters, wherever they are kept

Each part is handed the config groups it reads: the table its ``replay`` group (and the run's
seed and the learner's prefetch depth), the agent its ``agent`` group and
:class:`~gearflow.agent.AgentSettings`, an actor its ``actor`` and ``env`` groups
(:func:`~gearflow.actors.process.make_actor`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from gearflow.agent import make_agent
from gearflow.envs import EnvSpec, probe_env_spec
from gearflow.errors import ConfigError
from gearflow.geometry import replay_geometry
from gearflow.roles.actor_processes import LocalLauncher
from gearflow.topology.lifecycle import Lifecycle
from gearflow.topology.plan import RunPlan

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
    (:class:`~gearflow.roles.actor_processes.LocalLauncher`): a run's, a shard node's."""
    return LocalLauncher(cfg, storage_name, params_name, partitions)


class Builder:
    """Builds the roles of ``plan`` from ``cfg``, registering each on ``roles`` (module docstring);
    ``progress``: where the roles' reports are folded (a learner's ``Progress``, a node's relay)."""

    def __init__(self, cfg: DictConfig, plan: RunPlan, roles: Lifecycle, *, tag: str, progress=None):
        self.cfg, self.plan, self.roles, self.tag, self.progress = cfg, plan, roles, tag, progress
        self.geom = None  # the table's ReplayGeometry, once replay() made it
        self.env_spec: EnvSpec | None = None
        self.parallel = None  # the data-parallel group, once data_parallel() made it
        self.shards = None  # RemoteShards ("shards"): the nodes' sampler and publisher
        self.serial_actor = None  # "serial_actor": the one actor, stepped by the batches
        self._env_steps = lambda: 0

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
        ``learner_device`` None: a shard node's table, selected and gathered on the CPU. In a
        ``shards`` plan: the shard nodes' sampler (the ``shards`` role; the replay stays on the
        nodes, so the run's checkpoints hold the learner only)."""
        from gearflow.replay.spec import replay_spec
        from gearflow.run.tables import env_steps_in, make_table, restore_table

        cfg = self.cfg
        if "shards" in self.plan:
            return self._shards(agent).sampler
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
        self._env_steps = lambda: env_steps_in(table)
        log.info("replay: %d partitions × %d steps (%.1f MiB), item=%s, selector=%s", geom.num_partitions,
                 geom.steps_per_partition, table.storage.nbytes / 2**20, cfg.replay.item, cfg.replay.selector)
        return table

    def params(self, agent):
        """The parameter store of the agent's learner network (nothing published yet); in a
        ``shards`` plan the shard nodes' publisher (``params.push``)."""
        from gearflow.params import ParameterStore

        if "shards" in self.plan:
            return self._shards(agent).params
        return self.roles.closes(ParameterStore.create(agent.learner_network(), run_tag=self.tag), "params")

    def publish(self, params, agent, version: int | None = None) -> None:
        """The first weights (``version``: a resumed run's, None: 1), unless another learner of a
        data-parallel ``shards`` plan publishes (rank 0 does)."""
        if self.shards is None or self.shards.publisher:
            params.publish(agent.learner_network(), version=version)

    def learner(self, agent, sampler, params, **kwargs):
        """The learner loop over ``sampler`` (a table or shard nodes), publishing to ``params``; β is
        annealed to 1 over ``run.max_env_steps`` when the selector weighs by importance."""
        from gearflow.learner import BetaSchedule, Learner

        cfg = self.cfg
        beta = None
        if sampler.selector.importance_sampled and cfg.run.max_env_steps:
            beta = BetaSchedule(float(cfg.replay.beta), int(cfg.run.max_env_steps))
        return Learner(cfg.learner, agent, sampler, params, self.progress, run=cfg.run, beta=beta, **kwargs)

    def data_parallel(self, device: torch.device, agent):
        """This learner's data-parallel group (``learner.world_size > 1``), joined and set up."""
        from gearflow.distributed import DataParallel

        if "data_parallel" not in self.plan:
            return None
        parallel = self.parallel = self.roles.closes(DataParallel.from_config(self.cfg, device), "data_parallel")
        parallel.init()  # waits for every rank at learner.dist_address
        parallel.setup(agent)  # rank 0's learner state everywhere; gradient averaging hooks
        return parallel

    def _shards(self, agent):
        """The ``shards`` role (made once): the shard nodes of ``transport.shards`` as this learner's
        sampler and publisher; each rank draws its own share (its own split seed), rank 0 publishes."""
        from gearflow.roles.shards import Shards
        from gearflow.transport.learner.shards import RemoteShards

        if self.shards is None:
            cfg = self.cfg
            if cfg.run.checkpoint_replay:  # each node's replay stays on its node (replay.checkpoint there)
                log.info("transport.shards: checkpoints hold the learner only (the replay stays on the shard nodes)")
                cfg.run.checkpoint_replay = False
            rank = self.parallel.rank if self.parallel is not None else 0
            self.shards = RemoteShards(cfg, agent, publisher=rank == 0, seed=cfg.run.seed + 1009 * rank)
            self.roles.add(Shards(self.shards, self.progress))
            self._env_steps = self.shards.env_steps
        return self.shards

    def batches(self, learner, table):
        """Where the learner's batches come from: the serial actor's steps (``serial_actor``), else
        the prefetcher's thread (a table, shard nodes, a dataset), registered to be closed."""
        from gearflow.learner import Prefetcher, SerialBatches

        cfg = self.cfg
        if self.serial_actor is not None:
            return SerialBatches(self.serial_actor, table, cfg.learner.batch_size, self.progress,
                                 paced=float(cfg.replay.samples_per_insert) > 0)  # fmt: skip
        share = cfg.learner.batch_size // int(cfg.learner.world_size)  # data-parallel: this rank's share
        return self.roles.closes(Prefetcher(table, learner.lock, share, cfg.learner.prefetch, learner.stop,
                                            self.progress), "prefetch")  # fmt: skip

    # ------------------------------------------------------------------ the run's counters
    def env_steps(self) -> int:
        """Env steps in the table (its commit counters), or the shard nodes' (as last polled)."""
        return self._env_steps()

    def actor_version(self) -> int:
        """The oldest weights version any actor acts with (-1 before actors report)."""
        if self.serial_actor is not None:
            return int(self.serial_actor.version)
        return self.progress.actor_weights_version()

    # ------------------------------------------------------------------ acting side
    def actors(self, agent, table, params):
        """What fills the table in this plan: the dataset (``offline``), one actor in this process
        (``serial_actor``: returned), actor processes (``actors``) and the remote actors' shard
        process (``remote_actors``), the last two registered as roles."""
        cfg, plan, geom = self.cfg, self.plan, self.geom
        if "dataset" in plan:  # a restored checkpoint already holds it
            from gearflow.run.offline import load_dataset

            if table.size == 0:
                load_dataset(cfg.run.dataset, table, agent, self.env_spec)
        if "serial_actor" in plan:
            self.serial_actor = self.roles.closes(self._serial_actor(agent, table, params), "serial_actor")
        partitions = [geom.partitions_of(a) for a in range(geom.num_actors)] if geom is not None else []
        if "actors" in plan:
            local = partitions[: plan.local_actors]
            self.roles.add(actor_processes(cfg, table.storage.name, params.name, local))
        if "remote_actors" in plan:
            from gearflow.roles.remote_actors import RemoteActors

            self.roles.add(RemoteActors(cfg, table, params, {a: partitions[a] for a in plan.remote_actors}))
        return self.serial_actor

    def evaluator(self, params, *, env_steps, emit):
        """The ``eval`` role (``run.eval_every``): greedy evaluation in a process of its own over
        ``params`` (:class:`~gearflow.roles.evaluator.EvalProcess`), its rows to ``emit``;
        None in a plan without it."""
        if "eval" not in self.plan:
            return None
        from gearflow.roles.evaluator import EvalProcess

        progress = self.progress
        return self.roles.add(EvalProcess(self.cfg, params.name, env_steps=env_steps, updates=lambda: progress.updates,
                                          elapsed=lambda: time.monotonic() - progress.start, emit=emit))  # fmt: skip

    def _serial_actor(self, agent, table, params):
        from gearflow.actors.process import build_actor

        progress = self.progress
        return build_actor(self.cfg, 0, agent=agent, storage=table.storage, partitions=self.geom.partitions_of(0),
                           param_source=params, on_episode=lambda env, ret, length, eps: progress.add_episode(0, ret))  # fmt: skip

    # ------------------------------------------------------------------ a shard node
    def shard_service(self, agent, table, params, *, token: str, stop_event, on_stop, run_dir: Path):
        """The ``shard_service`` role: the node's :class:`~gearflow.transport.server.node.NodeService`
        over ``table`` and ``params`` (the learners' ``params.push`` checked against ``agent``'s
        network; the remote actors' ``run.join`` / ``run.report`` when the node has any), its
        reports from the builder's ``progress`` (the node's relay); returns the service."""
        from gearflow.config import to_yaml
        from gearflow.roles.remote_actors import Members, written_in
        from gearflow.roles.shard_service import ShardServiceRole
        from gearflow.run.private import redacted
        from gearflow.run.tables import env_steps_in
        from gearflow.transport.limits import service_limits
        from gearflow.transport.server.node import NodeService

        cfg, geom, relay = self.cfg, self.geom, self.progress
        t = cfg.transport
        remote = {a: [int(p) for p in geom.partitions_of(a)] for a in self.plan.remote_actors}
        members = Members(to_yaml(redacted(cfg)), remote, relay, stop_event,
                          written=written_in(table.storage.counters, params)) if remote else None  # fmt: skip
        template = {k: v for k, v in agent.learner_network().state_dict().items()}  # what a push must match
        server = NodeService(table, params, template, relay=relay, env_steps=lambda: env_steps_in(table),
                             stop_event=stop_event, on_stop=on_stop, num_actors=geom.num_actors,
                             ladder_offset=int(cfg.actor.ladder_offset), network=str(cfg.agent.name),
                             remote=[p for parts in remote.values() for p in parts], members=members,
                             host=str(t.host), port=int(t.port), token=token, loop=str(t.loop),
                             transport=str(t.kind), checkpoint_dir=str(run_dir / "replay"),
                             limits=service_limits(t.get("limits")))  # fmt: skip
        self.roles.add(ShardServiceRole(server))
        return server

    # ------------------------------------------------------------------ the dry run
    def dry_run(self) -> dict:
        """The ``dry_run`` role: the memory plan on the meta device (nothing started, no segment)."""
        from gearflow.tools.dryrun import dry_run

        return dry_run(self.cfg)
