"""What runs inside Ray's workers in a ``launcher=ray`` run: the run's registry and one class per
role (:mod:`gearflow.roles.ray` places them and drives the run).

* :class:`ShardRole` — one node's shard: a ``shard`` plan run by the shard-node class it is handed
  (:class:`~gearflow.topology.shard_node.ShardNode` without actors of its own), served on the
  node's IP. Restarted by Ray (pinned to its node), it binds the port it had, with a fresh table.
* :class:`ActorGroupRole` — the node's actor processes (:class:`~gearflow.roles.actor_processes.LocalLauncher`)
  over its shard's segment, attached by name (same node); it follows its shard to a new segment.
* :class:`LearnerRole` — one learner rank: a ``shards`` plan run by the runner class it is handed
  (:class:`~gearflow.topology.learn.Runner`, as ``gearflow train`` runs it); its run files
  are pulled by the driver when it does not share its disk (:mod:`gearflow.roles.run_files`).

The plan runs are handed in (their classes travel by reference through Ray), so these roles
import nothing above them: the builder (:mod:`gearflow.topology.build`) makes them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from gearflow.distributed import fingerprint, hold_rendezvous
from gearflow.errors import GearflowError
from gearflow.reports import ReportSink
from gearflow.roles.actor_processes import LocalLauncher
from gearflow.roles.run_files import FileStream

log = logging.getLogger("gearflow.runner")

__all__ = ["REPORT_S", "RUN_MARK", "ActorGroupRole", "LearnerRole", "Registry", "ShardRole"]

REPORT_S = 0.25  # how often an actor group forwards its actors' reports to its shard
RUN_MARK = ".gearflow-driver"  # in the driver's run.dir: a role that sees it shares the driver's disk


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
    """One node's replay shard and parameter store (:class:`~gearflow.topology.shard_node.ShardNode`
    without its own actors), served on the node's IP. Restarted by Ray (pinned to its node), it
    binds the port it had, with a fresh table (the dead one's segment is removed): its actor
    group re-attaches, learners reconnect and see a new ``epoch`` in ``run.progress``."""

    def __init__(self, cfg_yaml: str, index: int, registry, node_cls):
        import ray

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
        self.node = node_cls(cfg, launch_actors=False)  # ShardNode: a "shard" plan (its actors are its group's)
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
        self.launcher = LocalLauncher(self.cfg, info["storage"], info["params"], parts)
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

    def __init__(self, runner_cls):
        _logging()
        self.runner_cls = runner_cls  # Runner: a "shards" plan, as gearflow train runs it
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
        cfg = _cfg(cfg_yaml)
        runner = self.runner_cls(cfg)
        summary = runner.run()
        summary["learner/rank"] = int(cfg.learner.rank)
        summary["learner/node"] = _node_ip()
        summary["learner/parameters_fingerprint"] = fingerprint(runner.agent.learner_network())
        return summary
