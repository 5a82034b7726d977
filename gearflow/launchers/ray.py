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

Each role is a plan of its own run by the one builder (:mod:`gearflow.topology`): a shard role
is a ``shard`` plan (:func:`~gearflow.topology.plan.shard_node_config`), a learner role a
``shards`` plan (:func:`~gearflow.topology.plan.learner_config`) run by the same ``Runner`` as
``gearflow train``, an actor group the builder's
:func:`~gearflow.topology.build.actor_processes`.

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
``cluster.learner_gpus``, ``cluster.shard_resources``); :func:`place_roles` puts each shard and
its group on a node that holds both (workers before the head, fewest shards first) and each
learner in what is left (most free GPUs, then CPUs); the roles are pinned there. A cluster that
cannot hold the run is one GearflowError line naming what each role needs and what each node
has, before any role starts.

**The run's files reach the driver as they are written.** The driver writes a marker into
``run.dir``; a learner that does not see it (another host, no shared filesystem) writes its
metrics, ``train.log`` and checkpoints under the same path on its own host, and the driver
process pulls them every ``cluster.file_sync_s`` and once more when the learners end (or fail)
into the ``run.dir`` it sees (:mod:`gearflow.launchers.run_files`): ``gearflow plot``/``eval``
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
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from gearflow.config import to_yaml
from gearflow.distributed import fingerprint, hold_rendezvous
from gearflow.errors import GearflowError, MissingDependencyError
from gearflow.launchers.ray_plan import learner_gpus, needs_line, place_roles, run_summary
from gearflow.launchers.run_files import FileSink, FileStream, Puller
from gearflow.reports import ReportSink
from gearflow.topology.plan import learner_config, shard_node_config

log = logging.getLogger("gearflow.runner")

__all__ = ["learner_gpus", "place_roles", "require_ray", "run_summary", "train_on_ray"]  # the first: ray_plan.py

REPORT_S = 0.25  # how often an actor group forwards its actors' reports to its shard
RUN_MARK = ".gearflow-driver"  # in the driver's run.dir: a role that sees it shares the driver's disk


def require_ray():
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(f"launcher=ray needs Ray: pip install 'gearflow[cluster]' ({exc})") from None
    return ray


def _cfg(cfg_yaml: str) -> DictConfig:
    from gearflow.config import use_module_dirs
    from gearflow.transport.auth import configure

    cfg = OmegaConf.create(cfg_yaml)
    _check_paths(cfg)
    use_module_dirs(cfg.run.get("module_dirs") or [])  # a user's agent module, found as by the driver
    configure(cfg.transport)  # the role's connections: transport.integrity, transport.tls
    return cfg


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _check_paths(cfg: DictConfig) -> None:
    """``run.module_dirs`` and the driver's ``PYTHONPATH`` are assumed at the same paths on every
    node: a missing module dir is one line naming the node, missing PYTHONPATH entries a warning."""
    for d in cfg.run.get("module_dirs") or []:
        if not os.path.isdir(str(d)):
            raise GearflowError(f"launcher=ray: run.module_dirs entry {d} does not exist on node {_node_ip()}: "
                                "every node needs the run's module_dirs (and the driver's PYTHONPATH) at the same "
                                "path (a shared filesystem, or copy them there)")  # fmt: skip
    missing = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not os.path.isdir(p)]
    if missing:
        log.warning("launcher=ray: the driver's PYTHONPATH entries %s do not exist on node %s", missing, _node_ip())


def _logging() -> None:
    from gearflow.log import inherited_verbosity, setup_logging

    setup_logging(inherited_verbosity())


# ---------------------------------------------------------------------- roles (Ray actor classes)


class Registry:
    """The run's small shared state on Ray (one actor): each shard's port (a restarted shard binds
    the same one, so learners and actor groups reconnect to the address they know) and how many
    times each role started."""

    def __init__(self):
        self.values: dict[str, Any] = {}
        self.starts: dict[str, int] = {}

    def put(self, key: str, value: Any) -> None:
        self.values[key] = value

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def started(self, role: str) -> int:
        self.starts[role] = self.starts.get(role, 0) + 1
        return self.starts[role]

    def restarts(self) -> dict[str, int]:
        return {k: v - 1 for k, v in self.starts.items()}


class ShardRole:
    """One node's replay shard and parameter store (:class:`~gearflow.launchers.serve.ShardNode`
    without its own actors), served on the node's IP. Restarted by Ray (pinned to its node), it
    binds the port it had, with a fresh table (the dead one's segment is removed): its actor
    group re-attaches, learners reconnect and see a new ``epoch`` in ``run.progress``."""

    def __init__(self, cfg_yaml: str, index: int, registry):
        import ray

        from gearflow.launchers.serve import ShardNode
        from gearflow.replay.storage import gc_segments, run_tag

        _logging()
        cfg = _cfg(cfg_yaml)
        self.index, self.registry = index, registry
        starts = ray.get(registry.started.remote(f"shard-{index}"))
        cfg.transport.host = ray.util.get_node_ip_address()
        if starts > 1:  # restarted by Ray: the same port, and the dead instance's segment removed
            cfg.transport.port = int(ray.get(registry.get.remote(f"shard-{index}/port")) or 0)
            for name, size in gc_segments(prefix="gearflow", run=run_tag(cfg.run.dir)):
                log.info("shard %d restarted: removed /dev/shm/%s (%.1f MiB) of its dead instance", index, name,
                         size / 2**20)  # fmt: skip
        self.node = ShardNode(cfg, launch_actors=False)
        self.address = self.node.start()
        ray.get(registry.put.remote(f"shard-{index}/port", self.node.shard.port))
        self.node_id = ray.get_runtime_context().get_node_id()
        if starts > 1:
            log.warning("shard %d restarted by Ray on %s (start %d): a fresh table", index, self.address, starts)

    def info(self) -> dict[str, Any]:
        n = self.node
        return {"address": self.address, "node_id": self.node_id, "storage": n.table.storage.name,
                "params": n.params.name, "partitions": [p.tolist() for p in n.partitions]}  # fmt: skip

    def report(self, messages: list[dict]) -> None:
        for m in messages:
            self.node.relay.put(m)

    def wait(self) -> dict[str, Any]:
        """Serve until a learner ends the run; the node's summary."""
        from gearflow.run.tables import env_steps_in

        reason = self.node.serve_forever()
        return {"stop_reason": reason, "address": self.address, "actor/env_steps": env_steps_in(self.node.table),
                "actor/episodes": self.node.relay.episodes, "weights_version": self.node.params.latest_version()}  # fmt: skip

    def stop(self) -> None:
        self.node.stop_event.set()

    def close(self) -> None:
        self.node.close()


class _Collected(ReportSink):
    """What a group's LocalLauncher drains (as into a Progress), kept for the shard."""

    def __init__(self):
        super().__init__()
        self.messages: list[dict] = []

    def add(self, msg: dict) -> None:
        self.messages.append(msg)

    def take(self) -> list[dict]:
        out, self.messages = self.messages, []
        return out


class ActorGroupRole:
    """A node's actor processes, attached to its shard's segment by name (same node). Restarted
    by Ray, its actors continue their partitions; when its shard is restarted (a new segment),
    it moves its actors to the new one."""

    def __init__(self, cfg_yaml: str, index: int, shard, registry):
        import ray

        _logging()
        self.cfg = _cfg(cfg_yaml)
        self.index, self.shard = index, shard
        self.starts = ray.get(registry.started.remote(f"group-{index}"))
        self.collected = _Collected()
        self.launcher = None
        self._attach(ray.get(shard.info.remote()))
        if self.starts > 1:
            log.warning("actor group %d restarted by Ray (start %d)", index, self.starts)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="actor-group", daemon=True)
        self._thread.start()

    def _attach(self, info: dict[str, Any]) -> None:
        from gearflow.replay.storage import WRITER_PID, SharedStorage, pid_alive
        from gearflow.topology.build import actor_processes

        parts = [np.asarray(p, dtype=np.int64) for p in info["partitions"]]
        # a killed group's actor processes leave when they see their parent gone: wait for them,
        # or the new writers would find the partitions still owned
        storage = SharedStorage.attach(info["storage"])
        try:
            every = np.concatenate(parts)
            deadline = time.monotonic() + 30.0
            me = os.getpid()
            while time.monotonic() < deadline:
                pids = storage.counters[every, WRITER_PID].tolist()
                if not any(p and p != me and pid_alive(int(p)) for p in pids):
                    break
                time.sleep(0.1)
        finally:
            storage.close()
        self.storage_name = info["storage"]
        self.launcher = actor_processes(self.cfg, info["storage"], info["params"], parts)
        self.launcher.start()

    def _moved(self):
        """The shard's info when it now serves another segment (it was restarted), else None."""
        import ray

        ref = self.shard.info.remote()
        ready, _ = ray.wait([ref], timeout=2.0)
        if not ready:
            return None  # restarting: asked again next time
        try:
            info = ray.get(ready[0])
        except Exception as exc:  # noqa: BLE001 - the shard is between instances
            log.debug("actor group %d: shard info: %s", self.index, exc)
            return None
        return info if info["storage"] != self.storage_name else None

    def _supervise(self) -> None:
        last_check = time.monotonic()
        try:
            while not self._stop.is_set():
                self.launcher.drain(self.collected)
                self.launcher.check()  # restarts a dead actor process (actor.max_restarts)
                if msgs := self.collected.take():
                    self.shard.report.remote(msgs)
                for actor, err in self.launcher.errors.items():
                    self.shard.report.remote([{"type": "error", "actor": actor, "error": err}])
                self.launcher.errors.clear()
                if time.monotonic() - last_check >= 1.0:
                    last_check = time.monotonic()
                    if (info := self._moved()) is not None:
                        log.warning("actor group %d: its shard was restarted; moving its actors to %s", self.index,
                                    info["storage"])  # fmt: skip
                        self.launcher.stop()
                        self.launcher.close()
                        self._attach(info)
                self._stop.wait(REPORT_S)
        except BaseException as exc:  # an actor failed past actor.max_restarts: the group dies, Ray restarts it
            log.error("actor group %d failed: %s: %s", self.index, type(exc).__name__, exc)
            os._exit(1)

    def ping(self) -> int:
        return self.starts

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.launcher.stop(drain=lambda: self.launcher.drain(self.collected))
        self.launcher.close()


class LearnerRole:
    """One learner (rank ``learner.rank`` of ``learner.world_size``) of a run over the shards. A
    threaded actor (two threads): the driver pulls its run files (``pull_files``) while ``run``
    trains."""

    def __init__(self):
        _logging()
        self.files: FileStream | None = None

    def rendezvous(self) -> str:
        """A ``HOST:PORT`` on this node's cluster address for rank 0's torch.distributed store, its
        port held (bound and listening) until rank 0 serves its store on it in this process."""
        return hold_rendezvous(_node_ip())

    def sees(self, run_dir: str, mark: str, rank: int, period_s: float) -> bool:
        """Whether this node sees the driver's ``run_dir`` (the marker ``mark`` the driver wrote
        there). When it does not (another host, no shared filesystem), this rank's files are
        written under the same path here and the driver pulls them (``pull_files``)."""
        try:
            seen = (Path(run_dir) / RUN_MARK).read_text() == mark
        except OSError:
            seen = False
        if not seen:
            own = Path(run_dir) if rank == 0 else Path(run_dir) / f"learner-{rank}"  # as learner_config puts it
            prefix, skip = ("", ("learner-", "replay")) if rank == 0 else (f"learner-{rank}/", ())
            self.files = FileStream(own, prefix, skip)
            log.warning("learner rank %d on %s does not see the driver's run.dir: its files are written to %s on "
                        "this node and pulled into the driver's every %g s", rank, _node_ip(), own, period_s)  # fmt: skip
        return seen

    def pull_files(self, ack: int) -> tuple[int, list, list]:
        """What the driver's copy of this rank's files lacks (:meth:`FileStream.pull`)."""
        return self.files.pull(ack)

    def run(self, cfg_yaml: str) -> dict[str, Any]:
        from gearflow.runner import Runner

        cfg = _cfg(cfg_yaml)
        runner = Runner(cfg)
        summary = runner.run()
        summary["learner/rank"] = int(cfg.learner.rank)
        summary["learner/node"] = _node_ip()
        summary["learner/parameters_fingerprint"] = fingerprint(runner.agent.learner_network())
        return summary


# ---------------------------------------------------------------------- the driver


def _runtime_env() -> dict[str, Any]:
    """Roles import gearflow, the agents and a user's modules as the driver does (its sys.path
    entries that are directories outside the interpreter's own)."""
    base = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    paths = [p for p in sys.path if p and os.path.isdir(p) and not any(os.path.realpath(p).startswith(b) for b in base)]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys([os.getcwd(), *paths]))}
    if "GEARFLOW_LOG_LEVEL" in os.environ:
        env["GEARFLOW_LOG_LEVEL"] = os.environ["GEARFLOW_LOG_LEVEL"]
    return {"env_vars": env}


def _node_config(cfg: DictConfig, i: int) -> str:
    return to_yaml(shard_node_config(cfg, i))


def _learner_config(cfg: DictConfig, rank: int, shards: list[str], dist: str) -> str:
    return to_yaml(learner_config(cfg, rank, shards, dist))


def train_on_ray(cfg: DictConfig, *, on_started=None) -> dict[str, Any]:
    """Run ``cfg`` on Ray (see the module docstring); returns rank 0's summary with the cluster's
    figures. ``on_started(handles)`` is called once every role runs (tests kill a group there)."""
    ray = require_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from gearflow.run.tables import make_run_dir

    cl = cfg.cluster
    cfg = cfg.copy()
    run_dir = make_run_dir(cfg).resolve()  # absolute: a role's working directory is Ray's, not ours
    cfg.run.dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mark = secrets.token_hex(8)
    (run_dir / RUN_MARK).write_text(mark)
    if not cfg.transport.token and not os.environ.get("GEARFLOW_TOKEN"):
        cfg.transport.token = secrets.token_hex(16)  # the roles' shared secret, for this run only
    S, K, M = int(cl.shards), int(cl.learners), int(cfg.actor.num_actors)
    shard_cpus, group_cpus, learner_cpus = float(cl.shard_cpus), M * float(cl.actor_cpus), float(cl.learner_cpus)
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "runtime_env": _runtime_env(), "log_to_driver": True}
        if cl.address:
            kwargs["address"] = str(cl.address)
        else:  # a Ray instance on this machine: enough logical CPUs for every role
            kwargs["num_cpus"] = max(os.cpu_count() or 1, math.ceil(S * (shard_cpus + group_cpus) + K * learner_cpus))
            kwargs["resources"] = {k: float(v) * S for k, v in (cl.shard_resources or {}).items()}
        ray.init(**kwargs)
    shards: list = []
    groups: list = []
    learners: list = []
    registry = puller = None
    node_summaries: list[dict] = []
    try:
        gpus = learner_gpus(cfg, ray.cluster_resources().get("GPU", 0.0))
        extra = {k: float(v) for k, v in (cl.shard_resources or {}).items()}
        nodes, learner_nodes = place_roles(ray.nodes(), S, {"CPU": shard_cpus + group_cpus, **extra}, K,
                            {"CPU": learner_cpus, "GPU": gpus}, what=needs_line(cfg, gpus))  # fmt: skip
        place = [NodeAffinitySchedulingStrategy(n, soft=False) for n in nodes]
        # the run's shared state lives with the driver: a lost worker does not take it
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        registry = ray.remote(num_cpus=0)(Registry).options(scheduling_strategy=here).remote()
        R = int(cl.max_restarts)
        Shard = ray.remote(num_cpus=shard_cpus, resources=extra or None, max_restarts=R, max_task_retries=-1,
                           max_concurrency=8)(ShardRole)  # fmt: skip
        shards = [Shard.options(scheduling_strategy=place[i]).remote(_node_config(cfg, i), i, registry) for i in range(S)]
        infos = _started(ray, [s.info.remote() for s in shards], "a shard node")
        log.info("ray: %d shard node(s) at %s", S, ", ".join(i["address"] for i in infos))
        waits = [s.wait.remote() for s in shards]
        Group = ray.remote(num_cpus=group_cpus, max_restarts=R, max_task_retries=-1)(ActorGroupRole)
        groups = [Group.options(scheduling_strategy=place[i]).remote(_node_config(cfg, i), i, s, registry)
                  for i, s in enumerate(shards)]  # fmt: skip
        _started(ray, [g.ping.remote() for g in groups], "an actor group")
        Learner = ray.remote(num_cpus=learner_cpus, num_gpus=gpus, max_restarts=0, max_concurrency=2)(LearnerRole)
        learners = [Learner.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
                    for n in learner_nodes]  # fmt: skip
        dist = _started(ray, [learners[0].rendezvous.remote()], "learner rank 0")[0]
        puller = _puller(ray, learners, run_dir, mark, float(cl.file_sync_s))
        addresses = [i["address"] for i in infos]
        runs = [lr.run.remote(_learner_config(cfg, r, addresses, dist)) for r, lr in enumerate(learners)]
        if on_started is not None:
            on_started({"shards": shards, "groups": groups, "learners": learners})
        try:
            summaries = _wait_learners(ray, runs, puller)
        finally:
            puller.pull()  # the learners' last files (also after a failure: what a live one wrote)
        down = {a: str(why) for sm in summaries for a, why in (sm.get("transport/nodes_lost") or {}).items()}
        node_summaries = _wait_nodes(ray, waits, [i["address"] for i in infos], down=down)
        restarts = ray.get(registry.restarts.remote())
    finally:
        lost = {i for i, n in enumerate(node_summaries) if "lost" in n}  # their host is gone: nothing to stop there
        _stop_nodes(ray, [g for i, g in enumerate(groups) if i not in lost],
                    [s for i, s in enumerate(shards) if i not in lost])  # fmt: skip
        for h in [*groups, *shards, *learners, *([registry] if registry is not None else [])]:
            try:
                ray.kill(h, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - a role of a lost node is already gone
                log.debug("ray.kill: %s", exc)
        _clean_nodes(ray, run_dir, skip={nodes[i] for i in lost})
        if started:
            ray.shutdown()
    summary = run_summary(summaries, node_summaries, restarts, S, K)
    summary["cluster/run_files_pulled"] = puller.sink.files if puller is not None else 0
    if puller is not None and puller.sink.files:
        log.info("ray: %d run file write(s) (%.1f MiB) pulled from learners on other hosts into %s",
                 puller.sink.files, puller.sink.bytes / 2**20, run_dir)  # fmt: skip
    log.info("done on Ray (%s): %d shard node(s), %d learner(s), %d env steps, %d updates in %.0f s; return over "
             "the last 100 episodes %.1f; learners' parameters identical: %s", summary["stop_reason"], S, K,
             summary["actor/env_steps"], summary["learner/updates"], summary["time/elapsed_s"],
             summary["actor/return_last100"], summary["cluster/parameters_identical"])  # fmt: skip
    return summary


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


def _stop_nodes(ray, groups: list, shards: list, timeout_s: float = 20.0) -> None:
    """Stop the actor groups, then the shards (``stop``, then ``close``: their segments go), all
    groups together and all shards together, ``timeout_s`` at most for each step."""

    def settle(refs: list, what: str) -> None:
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a dead role has nothing left to stop
                log.debug("%s: %s", what, exc)
        if late:
            log.debug("%s: %d did not answer in %.0f s", what, len(late), timeout_s)

    settle([g.stop.remote() for g in groups], "actor group stop")
    for s in shards:
        s.stop.remote()
    settle([s.close.remote() for s in shards], "shard close")


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
