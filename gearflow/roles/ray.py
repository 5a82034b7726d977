"""``gearflow train CONFIG launcher=ray``: shard nodes, actor groups and learners placed by Ray.

Ray places and restarts the roles; gearflow's own data plane carries the data (shared memory
between a node's actors and its shard, TCP — or RDMA — between shards and learners)::

    driver (gearflow train ... launcher=ray)
      ├─ ShardRole × cluster.shards       SPREAD over the nodes: ShardNode (launch_actors=False)
      │     its replay table + parameter store in the node's /dev/shm, served on the node's IP
      ├─ ActorGroupRole × cluster.shards  pinned to its shard's node (NodeAffinity): the node's
      │     actor.num_actors actor processes attach the shard's segment by name (no network);
      │     max_restarts=cluster.max_restarts — a killed group is restarted by Ray, its actors
      │     continue their partitions after the last committed step
      └─ LearnerRole × cluster.learners   learner.world_size=K data-parallel learners
            (torch.distributed; rank 0 publishes and checkpoints), transport.shards = the
            shards' addresses, num_gpus=cluster.learner_gpus

The ``ray`` plan's three roles are this module's, made on the driver
(:func:`~gearflow.topology.cluster.ray_shards` and the two after it) and driven by
:func:`~gearflow.topology.run.run_plan` like any plan's: :class:`RayShards` (Ray itself, the run's
registry, the placement and the shard roles), :class:`RayActorGroups` and :class:`RayLearners`
(whose ``wait`` is the run: the learners' summaries, then the nodes', one summary). What runs
in Ray's workers is :mod:`gearflow.roles.ray_workers`; each is a plan of its own run by the one
builder there: a shard role a ``shard`` plan (:func:`~gearflow.topology.plan.shard_node_config`),
a learner role a ``shards`` plan (:func:`~gearflow.topology.plan.learner_config`) run by the same
``Runner`` as ``gearflow train``, an actor group a ``LocalLauncher``.

Addresses travel through Ray (the shards' ``info()``, rank 0's rendezvous address), nothing
is hard-coded. Each node's actors get their slice of the run's Ape-X ε ladder
(``actor.ladder_offset`` = node × ``actor.num_actors``, ``actor.ladder_total`` = every node's).
The run ends when the learners end it (rank 0's ``run.stop`` stops the shards); the driver
then removes every role and, if it started Ray, shuts it down.

A shard role is restarted by Ray like a group (``cluster.max_restarts``), pinned to its node:
it binds the port it had, with a fresh table (the dead instance's segment is removed), its
group moves its actors to the new segment and the learners reconnect. At the end the driver
removes whatever segment of this run is left in each live node's ``/dev/shm``.

**Placement by resources.** Each role asks Ray for its resources (``cluster.shard_cpus``,
``actor.num_actors`` × ``cluster.actor_cpus``, ``cluster.learner_cpus``,
``cluster.learner_gpus``, ``cluster.shard_resources``); :func:`~gearflow.roles.ray_plan.place_roles` puts each shard and
its group on a node that holds both (workers before the head, fewest shards first) and each
learner in what is left (most free GPUs, then CPUs); the roles are pinned there. A cluster that
cannot hold the run is one GearflowError line naming what each role needs and what each node
has, before any role starts.

**The run's files reach the driver as they are written.** The driver writes a marker into
``run.dir``; a learner that does not see it (another host, no shared filesystem) writes its
metrics, ``train.log`` and checkpoints under the same path on its own host, and the driver
process pulls them every ``cluster.file_sync_s`` and once more when the learners end (or fail)
into the ``run.dir`` it sees (:mod:`gearflow.roles.run_files`): ``gearflow plot``/``eval``
read them there, also mid-run; rank R > 0's under ``learner-R/``. A learner whose host dies
leaves the driver what it had pulled. A shard node's replay checkpoints (``run.dir/replay``)
stay on that node's disk. ``run.module_dirs`` and the driver's ``PYTHONPATH`` must exist at the
same paths on every node: a role that misses a module dir says so in one line, missing
``PYTHONPATH`` entries are logged with the node's address.

A node whose host dies is marked down by the learners after one ``transport.node_timeout_s``
(:mod:`gearflow.transport.learner.health`): they train on the survivors, and the driver ends
with rank 0's summary (``cluster/nodes_lost``) and one line naming the lost node, exit status 0
when the run otherwise completed.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from gearflow.errors import GearflowError, MissingDependencyError
from gearflow.roles.base import Part
from gearflow.roles.ray_plan import learner_gpus, needs_line, place_roles, run_summary
from gearflow.roles.ray_workers import RUN_MARK, ActorGroupRole, LearnerRole, Registry, ShardRole
from gearflow.roles.run_files import FileSink, Puller

log = logging.getLogger("gearflow.runner")

__all__ = ["RayActorGroups", "RayLearners", "RayShards", "driver_config", "require_ray"]


def require_ray():
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(f"launcher=ray needs Ray: pip install 'gearflow[cluster]' ({exc})") from None
    return ray


def driver_config(cfg: DictConfig) -> DictConfig:
    """The driver's copy of a ``launcher=ray`` run's config: ``run.dir`` made and absolute (a role's
    working directory is Ray's, not ours), marked as the driver's (:data:`RUN_MARK`), and a secret
    for this run only when none is set (the roles' shared ``transport.token``)."""
    from gearflow.run.tables import make_run_dir

    cfg = cfg.copy()
    run_dir = make_run_dir(cfg).resolve()
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_MARK).write_text(secrets.token_hex(8))
    if not cfg.transport.token and not os.environ.get("GEARFLOW_TOKEN"):
        cfg.transport.token = secrets.token_hex(16)  # the roles' shared secret, for this run only
    return cfg


class RayShards(Part):
    """The ``ray_shards`` role: Ray (joined at ``cluster.address``, or started on this machine with
    enough logical CPUs for every role), the run's :class:`~gearflow.roles.ray_workers.Registry`, the
    placement of every role (:func:`~gearflow.roles.ray_plan.place_roles`, before any starts) and
    ``cluster.shards`` :class:`~gearflow.roles.ray_workers.ShardRole` s, each pinned to its node.
    ``wait`` gives the nodes' summaries once the learners ended the run (a lost node is one warning
    line); ``stop`` stops and closes the shards (not a lost node's); ``close`` kills every handle
    left, removes the run's segments on each live node and shuts Ray down if it started it."""

    name, key = "ray_shards", "shards"

    def __init__(self, cfg: DictConfig):
        self.cfg, self.ray, self.started = cfg, None, False
        self.handles: list = []
        self.infos: list[dict] = []
        self.waits: list = []
        self.registry = None
        self.place_at: list = []  # each shard's (and its group's) NodeAffinity
        self.learner_nodes: list[str] = []
        self.gpus = 0.0
        self.lost: set[int] = set()  # nodes whose host is gone (nothing to stop there)
        self._lost_ids: set[str] = set()
        self.summaries: list[dict] = []
        self.node_configs: list[str] = []  # each node's config (YAML), as placed: its actor group's too

    def place(self, node_cls: type, configs: list[str]) -> None:
        """Join or start Ray, place every role, start the shard roles (``node_cls``: the shard
        node they run; ``configs``: each node's config, YAML) and wait until they serve."""
        self.node_configs = list(configs)
        ray = self.ray = require_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cfg, cl = self.cfg, self.cfg.cluster
        S, K, M = int(cl.shards), int(cl.learners), int(cfg.actor.num_actors)
        shard_cpus, group_cpus, learner_cpus = float(cl.shard_cpus), M * float(cl.actor_cpus), float(cl.learner_cpus)
        self.started = not ray.is_initialized()
        if self.started:
            ray.init(**init_kwargs(cfg))
        self.gpus = gpus = learner_gpus(cfg, ray.cluster_resources().get("GPU", 0.0))
        extra = {k: float(v) for k, v in (cl.shard_resources or {}).items()}
        nodes, self.learner_nodes = place_roles(ray.nodes(), S, {"CPU": shard_cpus + group_cpus, **extra}, K,
                                                {"CPU": learner_cpus, "GPU": gpus}, what=needs_line(cfg, gpus))  # fmt: skip
        self.nodes = nodes
        self.place_at = [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes]
        # the run's shared state lives with the driver: a lost worker does not take it
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.registry = ray.remote(num_cpus=0)(Registry).options(scheduling_strategy=here).remote()
        Shard = ray.remote(num_cpus=shard_cpus, resources=extra or None, max_restarts=int(cl.max_restarts),
                           max_task_retries=-1, max_concurrency=8)(ShardRole)  # fmt: skip
        self.handles = [Shard.options(scheduling_strategy=self.place_at[i]).remote(configs[i], i, self.registry, node_cls)
                        for i in range(S)]  # fmt: skip
        self.infos = _started(ray, [s.info.remote() for s in self.handles], "a shard node")
        log.info("ray: %d shard node(s) at %s", S, ", ".join(i["address"] for i in self.infos))
        self.waits = [s.wait.remote() for s in self.handles]

    @property
    def addresses(self) -> list[str]:
        return [i["address"] for i in self.infos]

    def wait(self, down: dict[str, str]) -> list[dict]:
        """Each node's summary once the learners ended the run (``down``: the nodes they found down)."""
        self.summaries = _wait_nodes(self.ray, self.waits, self.addresses, down=down)
        self.lost = {i for i, n in enumerate(self.summaries) if "lost" in n}  # their host is gone
        self._lost_ids = {self.nodes[i] for i in self.lost}
        return self.summaries

    def restarts(self) -> dict[str, int]:
        return self.ray.get(self.registry.restarts.remote())

    def live(self, handles: list) -> list:
        """``handles`` (one per node) but those of lost nodes."""
        return [h for i, h in enumerate(handles) if i not in self.lost]

    def stop(self, drain: Callable[[], None] = lambda: None) -> None:
        if self.ray is not None:
            shards = self.live(self.handles)
            for s in shards:
                s.stop.remote()
            _settle(self.ray, [s.close.remote() for s in shards], "shard close")

    def close(self) -> None:
        ray = self.ray
        if ray is None:
            return
        try:
            _kill(ray, [*self.handles, *([self.registry] if self.registry is not None else [])])
            _clean_nodes(ray, Path(str(self.cfg.run.dir)), skip=self._lost_ids)
        finally:
            if self.started:
                ray.shutdown()


class RayActorGroups(Part):
    """The ``ray_actor_groups`` role: one :class:`~gearflow.roles.ray_workers.ActorGroupRole` per
    shard, pinned to its shard's node (restarted by Ray up to ``cluster.max_restarts``); ``stop``
    stops them all together (not a lost node's), ``close`` kills them."""

    name, key = "ray_actor_groups", "groups"

    def __init__(self, shards: RayShards, configs: list[str]):
        ray, cl = shards.ray, shards.cfg.cluster
        self.shards, self.ray = shards, ray
        cpus = int(shards.cfg.actor.num_actors) * float(cl.actor_cpus)
        Group = ray.remote(num_cpus=cpus, max_restarts=int(cl.max_restarts), max_task_retries=-1)(ActorGroupRole)
        self.handles = [Group.options(scheduling_strategy=shards.place_at[i]).remote(configs[i], i, s, shards.registry)
                        for i, s in enumerate(shards.handles)]  # fmt: skip
        _started(ray, [g.ping.remote() for g in self.handles], "an actor group")

    def stop(self, drain: Callable[[], None] = lambda: None) -> None:
        _settle(self.ray, [g.stop.remote() for g in self.shards.live(self.handles)], "actor group stop")

    def close(self) -> None:
        _kill(self.ray, self.handles)


class RayLearners(Part):
    """The ``ray_learners`` role: ``cluster.learners`` :class:`~gearflow.roles.ray_workers.LearnerRole` s
    (``runner_cls``: the learner run they run), each on the node placement gave it, rank 0's
    rendezvous address for the others; ``start`` sets them running (``config(rank, shard addresses,
    rendezvous)``: each rank's config, YAML) and the driver's pulls of their run files. ``wait`` is
    the run: the learners' summaries (pulling their files meanwhile), then the nodes', as one
    summary (:func:`~gearflow.roles.ray_plan.run_summary`)."""

    name, key = "ray_learners", "learners"

    def __init__(self, shards: RayShards, runner_cls: type, config: Callable[[int, list[str], str], str]):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        ray, cl = shards.ray, shards.cfg.cluster
        self.shards, self.ray, self.config = shards, ray, config
        self.run_dir = Path(str(shards.cfg.run.dir))
        Learner = ray.remote(num_cpus=float(cl.learner_cpus), num_gpus=shards.gpus, max_restarts=0,
                             max_concurrency=2)(LearnerRole)  # fmt: skip
        self.handles = [Learner.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            runner_cls) for n in shards.learner_nodes]  # fmt: skip
        self.dist = _started(ray, [self.handles[0].rendezvous.remote()], "learner rank 0")[0]
        self.puller: Puller | None = None
        self.runs: list = []

    def start(self) -> None:
        mark = (self.run_dir / RUN_MARK).read_text()
        self.puller = _puller(self.ray, self.handles, self.run_dir, mark, float(self.shards.cfg.cluster.file_sync_s))
        addresses = self.shards.addresses
        self.runs = [lr.run.remote(self.config(r, addresses, self.dist)) for r, lr in enumerate(self.handles)]

    def wait(self) -> dict[str, Any]:
        """The run's summary: rank 0's with the cluster's figures (the learners' highest env steps,
        restarts, each node's steps, the nodes lost)."""
        try:
            summaries = _wait_learners(self.ray, self.runs, self.puller)
        finally:
            self.puller.pull()  # the learners' last files (also after a failure: what a live one wrote)
        down = {a: str(why) for sm in summaries for a, why in (sm.get("transport/nodes_lost") or {}).items()}
        nodes = self.shards.wait(down)
        summary = run_summary(summaries, nodes, self.shards.restarts(), len(self.shards.handles), len(self.handles))
        summary["cluster/run_files_pulled"] = self.puller.sink.files
        if self.puller.sink.files:
            log.info("ray: %d run file write(s) (%.1f MiB) pulled from learners on other hosts into %s",
                     self.puller.sink.files, self.puller.sink.bytes / 2**20, self.run_dir)  # fmt: skip
        return summary

    def close(self) -> None:
        _kill(self.ray, self.handles)


# ---------------------------------------------------------------------- the driver's helpers


def init_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """``ray.init``'s arguments for a run: ``cluster.address`` joined where it is set; else a Ray
    instance of its own on this machine (``address="local"``: never one that ``ray start`` or a
    test's cluster left running here, which a bare ``ray.init()`` would join and then refuse its
    ``num_cpus``), with enough logical CPUs for every role."""
    cl = cfg.cluster
    kwargs: dict[str, Any] = {"include_dashboard": False, "runtime_env": _runtime_env(), "log_to_driver": True}
    if cl.address:
        kwargs["address"] = str(cl.address)
        return kwargs
    S, K, M = int(cl.shards), int(cl.learners), int(cfg.actor.num_actors)
    need = S * (float(cl.shard_cpus) + M * float(cl.actor_cpus)) + K * float(cl.learner_cpus)
    kwargs["address"] = "local"
    kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(need))
    kwargs["resources"] = {k: float(v) * S for k, v in (cl.shard_resources or {}).items()}
    return kwargs


def _runtime_env() -> dict[str, Any]:
    """Roles import gearflow, the agents and a user's modules as the driver does (its sys.path
    entries that are directories outside the interpreter's own)."""
    base = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    paths = [p for p in sys.path if p and os.path.isdir(p) and not any(os.path.realpath(p).startswith(b) for b in base)]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys([os.getcwd(), *paths]))}
    if "GEARFLOW_LOG_LEVEL" in os.environ:
        env["GEARFLOW_LOG_LEVEL"] = os.environ["GEARFLOW_LOG_LEVEL"]
    return {"env_vars": env}


def _kill(ray, handles: list) -> None:
    for h in handles:
        try:
            ray.kill(h, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - a role of a lost node is already gone
            log.debug("ray.kill: %s", exc)


def _settle(ray, refs: list, what: str, timeout_s: float = 20.0) -> None:
    """Wait up to ``timeout_s`` for ``refs`` (all together); a role that fails or does not answer
    has nothing left to stop."""
    ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a dead role has nothing left to stop
            log.debug("%s: %s", what, exc)
    if late:
        log.debug("%s: %d did not answer in %.0f s", what, len(late), timeout_s)


def _started(ray, refs: list, role: str) -> list:
    """``ray.get(refs)``, a role that could not start (placed on a node that died, an import or
    path error on that node) raised as one GearflowError line."""
    try:
        return ray.get(refs)
    except Exception as exc:  # noqa: BLE001 - Ray's error types vary by cause and version
        cause = getattr(exc, "cause", None) or exc
        text = str(cause).strip().splitlines()
        raise GearflowError(f"launcher=ray: {role} did not start: {type(cause).__name__}: "
                            f"{text[-1] if text else ''}") from None  # fmt: skip


def _puller(ray, learners: list, run_dir: Path, mark: str, period_s: float) -> Puller:
    """The driver's pulls of the run files of every learner that does not see its ``run_dir``."""
    seen = _started(ray, [lr.sees.remote(str(run_dir), mark, r, period_s) for r, lr in enumerate(learners)],
                    "a learner")  # fmt: skip
    timeout = max(60.0, 3 * period_s)  # a large checkpoint takes a while; a dead host is known to Ray by then

    def pull(lr):
        return lambda ack: ray.get(lr.pull_files.remote(ack), timeout=timeout)

    return Puller(FileSink(run_dir), {r: pull(lr) for r, lr in enumerate(learners) if not seen[r]}, period_s)


def _clean_nodes(ray, run_dir: Path, skip: set[str] = frozenset()) -> None:
    """Remove this run's shared-memory segments left on each live node (a shard killed and not
    restarted, a node whose shard did not close): one zero-CPU task pinned to each node but
    those in ``skip`` (a lost node's NodeID, which Ray may still count alive)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def gc(path: str) -> list:  # the tag from the node's own view of the path, as its shard made it
        from gearflow.replay.storage import gc_segments, run_tag

        return gc_segments(prefix="gearflow", include_live=True, run=run_tag(path))

    try:
        task = ray.remote(num_cpus=0, max_retries=0)(gc)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            str(run_dir)) for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in skip]  # fmt: skip
        for removed in ray.get(refs, timeout=30):
            for name, size in removed:
                log.info("ray: removed /dev/shm/%s (%.1f MiB) left by this run", name, size / 2**20)
    except Exception as exc:  # noqa: BLE001 - best effort: `gearflow replay gc` on that node does the same
        log.warning("ray: this run's segments could not be cleaned on every node: %s", exc)


def _wait_nodes(ray, waits: list, addresses: list[str], timeout_s: float = 60.0,
                down: dict[str, str] | None = None, grace_s: float = 5.0) -> list[dict]:
    """Each shard node's summary once the learners ended the run; a node that is gone (its host
    died: Ray cannot restart its shard there) or does not end within ``timeout_s`` is a summary
    ``{"address", "lost": why}`` and one warning line, never the run's error: the learners went on
    without it and their summary stands. A node the learners found down at their end (``down``:
    address -> why, their ``transport/nodes_lost``) is given ``grace_s`` only: Ray may take a
    minute to call a dead host's actor unschedulable, and the run is over."""
    down = down or {}
    ready: list = []
    for group, wait_s in (([w for w, a in zip(waits, addresses) if a not in down], timeout_s),
                          ([w for w, a in zip(waits, addresses) if a in down], grace_s)):  # fmt: skip
        if group:
            ready += ray.wait(group, num_returns=len(group), timeout=wait_s)[0]
    out = []
    for i, (w, address) in enumerate(zip(waits, addresses)):
        why = (f"down since the learners' last call: {down[address]}" if address in down
               else f"it did not end within {timeout_s:.0f} s of the learners")  # fmt: skip
        if w in ready:
            try:
                out.append(ray.get(w))
                continue
            except Exception as exc:  # noqa: BLE001 - ActorDiedError, ActorUnschedulableError, ...
                cause = getattr(exc, "cause", None) or exc
                why = f"{type(exc).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        why = why[:300]
        log.warning("ray: lost shard node %d at %s (%s); the learners went on without it", i, address, why)
        out.append({"address": address, "lost": why, "actor/env_steps": None})
    return out


def _wait_learners(ray, runs: list, puller: Puller) -> list[dict]:
    """Every learner's summary, pulling their run files when due meanwhile; the first failure is
    raised as one GearflowError line."""
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=puller.period_s if puller.sources else None)
        if puller.due():
            puller.pull()
        if not done:
            continue
        try:
            ray.get(done[0])
        except Exception as exc:  # noqa: BLE001 - a role's error, re-raised as the run's
            cause = getattr(exc, "cause", None) or exc
            raise GearflowError(f"launcher=ray: a learner failed: {type(cause).__name__}: {cause}") from None
    return ray.get(runs)
