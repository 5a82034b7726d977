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

A shard role killed on a live node is restarted by Ray on its port with a fresh table. A node
whose host dies is marked down by the learners after one ``transport.node_timeout_s``
(:mod:`gearflow.transport.learner.health`): they train on the survivors, and the driver ends
with rank 0's summary (``cluster/nodes_lost``) and one line naming the lost node, exit status 0
when the run otherwise completed.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from gearflow.config import to_yaml
from gearflow.distributed import fingerprint
from gearflow.errors import GearflowError, MissingDependencyError
from gearflow.reports import ReportSink
from gearflow.topology.plan import learner_config, shard_node_config

log = logging.getLogger("gearflow.runner")

__all__ = ["require_ray", "train_on_ray"]

REPORT_S = 0.25  # how often an actor group forwards its actors' reports to its shard


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
    use_module_dirs(cfg.run.get("module_dirs") or [])  # a user's agent module, found as by the driver
    configure(cfg.transport)  # the role's connections: transport.integrity, transport.tls
    return cfg


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
    """One learner (rank ``learner.rank`` of ``learner.world_size``) of a run over the shards."""

    def __init__(self):
        _logging()

    def rendezvous(self) -> str:
        """A ``HOST:PORT`` on this node for rank 0's torch.distributed store."""
        import socket

        import ray

        s = socket.socket()
        s.bind(("", 0))
        port = s.getsockname()[1]
        s.close()
        return f"{ray.util.get_node_ip_address()}:{port}"

    def run(self, cfg_yaml: str) -> dict[str, Any]:
        from gearflow.runner import Runner

        cfg = _cfg(cfg_yaml)
        runner = Runner(cfg)
        summary = runner.run()
        summary["learner/rank"] = int(cfg.learner.rank)
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
    cfg.run.dir = str(make_run_dir(cfg))
    if not cfg.transport.token and not os.environ.get("GEARFLOW_TOKEN"):
        cfg.transport.token = secrets.token_hex(16)  # the roles' shared secret, for this run only
    S, K, M = int(cl.shards), int(cl.learners), int(cfg.actor.num_actors)
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "runtime_env": _runtime_env(), "log_to_driver": True}
        if cl.address:
            kwargs["address"] = str(cl.address)
        else:  # a Ray instance on this machine: enough logical CPUs for every role
            kwargs["num_cpus"] = max(os.cpu_count() or 1, S * (M + 1) + K)
        ray.init(**kwargs)
    shards: list = []
    groups: list = []
    learners: list = []
    registry = None
    try:
        registry = ray.remote(num_cpus=0)(Registry).remote()
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
        place = [NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False) for i in range(S)]  # one per node
        R = int(cl.max_restarts)
        Shard = ray.remote(num_cpus=1, max_restarts=R, max_task_retries=-1, max_concurrency=8)(ShardRole)
        shards = [Shard.options(scheduling_strategy=place[i]).remote(_node_config(cfg, i), i, registry) for i in range(S)]
        infos = ray.get([s.info.remote() for s in shards])
        log.info("ray: %d shard node(s) at %s", S, ", ".join(i["address"] for i in infos))
        waits = [s.wait.remote() for s in shards]
        Group = ray.remote(num_cpus=M, max_restarts=R, max_task_retries=-1)(ActorGroupRole)
        groups = [Group.options(scheduling_strategy=place[i]).remote(_node_config(cfg, i), i, s, registry)
                  for i, s in enumerate(shards)]  # fmt: skip
        ray.get([g.ping.remote() for g in groups])
        gpus = learner_gpus(cfg, ray.cluster_resources().get("GPU", 0.0))
        Learner = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(LearnerRole)
        learners = [Learner.remote() for _ in range(K)]
        dist = ray.get(learners[0].rendezvous.remote())
        addresses = [i["address"] for i in infos]
        runs = [lr.run.remote(_learner_config(cfg, r, addresses, dist)) for r, lr in enumerate(learners)]
        if on_started is not None:
            on_started({"shards": shards, "groups": groups, "learners": learners})
        summaries = _wait_learners(ray, runs)
        node_summaries = _wait_nodes(ray, waits, [i["address"] for i in infos])
        restarts = ray.get(registry.restarts.remote())
    finally:
        for g in groups:
            try:
                ray.get(g.stop.remote(), timeout=20)
            except Exception as exc:  # noqa: BLE001 - a dead group has nothing left to stop
                log.debug("actor group stop: %s", exc)
        for s in shards:
            try:
                s.stop.remote()
                ray.get(s.close.remote(), timeout=20)
            except Exception as exc:  # noqa: BLE001
                log.debug("shard close: %s", exc)
        for h in [*groups, *shards, *learners, *([registry] if registry is not None else [])]:
            try:
                ray.kill(h, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - a role of a lost node is already gone
                log.debug("ray.kill: %s", exc)
        if started:
            ray.shutdown()
    summary = run_summary(summaries, node_summaries, restarts, S, K)
    log.info("done on Ray (%s): %d shard node(s), %d learner(s), %d env steps, %d updates in %.0f s; return over "
             "the last 100 episodes %.1f; learners' parameters identical: %s", summary["stop_reason"], S, K,
             summary["actor/env_steps"], summary["learner/updates"], summary["time/elapsed_s"],
             summary["actor/return_last100"], summary["cluster/parameters_identical"])  # fmt: skip
    return summary


def run_summary(summaries: list[dict], node_summaries: list[dict], restarts: dict[str, int], shards: int,
                learners: int) -> dict[str, Any]:
    """The run's summary from its learners' (rank 0 first), its nodes' and the registry's restarts.

    Each learner counts the env steps the nodes reported to it and the learners share their highest
    at every iteration (``DataParallel.agree``); a rank's count can still rise by a poll after the
    last agree, so the summary gives the highest of the learners' final counts."""
    summary = dict(summaries[0])
    summary["actor/env_steps"] = max(s["actor/env_steps"] for s in summaries)
    summary["cluster/shards"], summary["cluster/learners"] = shards, learners
    summary["cluster/group_restarts"] = sum(v for k, v in restarts.items() if k.startswith("group-"))
    summary["cluster/shard_restarts"] = sum(v for k, v in restarts.items() if k.startswith("shard-"))
    summary["cluster/parameters_identical"] = len({s["learner/parameters_fingerprint"] for s in summaries}) == 1
    summary["cluster/node_env_steps"] = [n.get("actor/env_steps") for n in node_summaries]
    lost = {n["address"]: n["lost"] for n in node_summaries if n.get("lost")}
    if lost:
        summary["cluster/nodes_lost"] = lost
    return summary


def _wait_nodes(ray, waits: list, addresses: list[str], timeout_s: float = 60.0) -> list[dict]:
    """Each shard node's summary once the learners ended the run; a node that is gone (its host
    died: Ray cannot restart its shard there) or does not end within ``timeout_s`` is a summary
    ``{"address", "lost": why}`` and one warning line, never the run's error: the learners went on
    without it and their summary stands."""
    ready, _ = ray.wait(waits, num_returns=len(waits), timeout=timeout_s)
    out = []
    for i, (w, address) in enumerate(zip(waits, addresses)):
        why = f"it did not end within {timeout_s:.0f} s of the learners"
        if w in ready:
            try:
                out.append(ray.get(w))
                continue
            except Exception as exc:  # noqa: BLE001 - ActorDiedError, ActorUnschedulableError, ...
                cause = getattr(exc, "cause", None) or exc
                why = f"{type(exc).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"[:300]
        log.warning("ray: lost shard node %d at %s (%s); the learners went on without it", i, address, why)
        out.append({"address": address, "lost": why, "actor/env_steps": None})
    return out


def learner_gpus(cfg: DictConfig, cluster_gpus: float) -> float:
    """GPUs each learner asks Ray for: ``cluster.learner_gpus`` when set; else one each when the
    cluster has a GPU per learner and ``learner.device`` allows CUDA (``auto`` or ``cuda``), so
    learners land on GPU nodes where there are any."""
    asked = float(cfg.cluster.learner_gpus)
    if asked > 0 or str(cfg.learner.device) == "cpu":
        return asked
    K = int(cfg.cluster.learners)
    if cluster_gpus >= K:
        log.info("ray: %g GPU(s) in the cluster: each of the %d learner(s) gets one (cluster.learner_gpus=0 and "
                 "learner.device=%s)", cluster_gpus, K, cfg.learner.device)  # fmt: skip
        return 1.0
    if str(cfg.learner.device).startswith("cuda"):
        raise GearflowError(f"learner.device={cfg.learner.device} but the Ray cluster has {cluster_gpus:g} GPU(s) for "
                            f"{K} learner(s): add GPU nodes, or use learner.device=cpu")  # fmt: skip
    return 0.0


def _wait_learners(ray, runs: list) -> list[dict]:
    """Every learner's summary; the first failure is raised as one GearflowError line."""
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except Exception as exc:  # noqa: BLE001 - a role's error, re-raised as the run's
            cause = getattr(exc, "cause", None) or exc
            raise GearflowError(f"launcher=ray: a learner failed: {type(cause).__name__}: {cause}") from None
    return ray.get(runs)
