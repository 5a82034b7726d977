"""``gearflow serve CONFIG``: one node's replay shard with that node's actors, for learners elsewhere.

A shard node owns this machine's replay table (shared memory) and parameter store, runs the
node's ``actor.num_actors`` actor processes against them (:class:`LocalLauncher`, exactly as
``gearflow train`` does; the last ``actor.remote_actors`` of them join over TCP with
``gearflow actor --connect``), and serves the table to learners on other machines through a
:class:`~gearflow.transport.server.node.NodeService` (the server side of the transport: the
shard's ``replay.*`` and ``params.get``, the learner's ``params.push``, ``run.progress`` and
``run.stop``; the handlers live there). This module only wires it: the node's table, parameter
store, actors and report relay, built from the config.

::

    node = ShardNode(cfg)            # table, parameter store, service, actor launcher
    address = node.start()           # "host:port" once listening; actors started
    node.serve_forever()             # supervise until run.stop, a signal, or a failed actor
    node.close()

The node's parts are built as every run's are: its plan (``plan_run(cfg, command="serve")``:
a ``serve`` plan, or ``shard`` without its own actors) and the one builder
(:class:`~gearflow.topology.build.Builder`: agent, table, parameter store, actor processes),
its roles taken through :class:`~gearflow.topology.roles.Lifecycle` (start, drain and check
while serving, stop and close).

A node is one of several when the learners' ``transport.shards`` lists several addresses: give
each node its slice of the run's Ape-X ε ladder with ``actor.ladder_offset`` /
``actor.ladder_total`` (the Ray launcher does).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from gearflow.errors import ConfigError
from gearflow.launchers.local import ActorFailed
from gearflow.reports import ReportSink, fold_report

log = logging.getLogger("gearflow.serve")

__all__ = ["ShardNode", "serve"]

MAX_PROGRESS = 100_000  # reports kept for learners that poll late (oldest dropped first)
MAX_PROGRESS_REPLY = 4096  # reports per run.progress reply


class _Relay(ReportSink):
    """What the node's actors report, numbered, for ``run.progress``: LocalLauncher.drain folds
    into it as into a Progress, remote actors' reports arrive through ``put`` (the queue
    interface of :class:`~gearflow.launchers.remote.Members`)."""

    def __init__(self, offset: int):
        super().__init__()
        self.offset = offset
        self.log: collections.deque = collections.deque(maxlen=MAX_PROGRESS)
        self.first = 0  # sequence number of log[0]
        self.lock = threading.Lock()
        self.episodes = 0
        self.returns: collections.deque = collections.deque(maxlen=100)

    def add(self, msg: dict) -> None:
        msg = {k: v for k, v in msg.items() if isinstance(v, (int, float, str, bool)) or v is None}
        msg["actor"] = self.offset + int(msg["actor"])
        with self.lock:
            if len(self.log) == self.log.maxlen:
                self.first += 1
            self.log.append(msg)

    def add_episode(self, actor: int, ret: float) -> None:
        self.episodes += 1
        self.returns.append(ret)
        super().add_episode(actor, ret)

    def put(self, msg: dict) -> None:  # remote actors (run.join / run.report of Members)
        kind = fold_report(self, msg, source="remote actor")
        if kind == "error":
            self.add(msg)
        elif kind in ("joined", "left"):
            log.info("remote actor %s %s (%s)", msg.get("actor"), kind, msg.get("peer"))

    def since(self, cursor: int) -> tuple[list[dict], int, int]:
        """(reports from ``cursor`` on, the next cursor, how many were dropped before it)."""
        with self.lock:
            start = max(cursor, self.first)
            lost = start - cursor
            end = min(self.first + len(self.log), start + MAX_PROGRESS_REPLY)
            items = [self.log[i - self.first] for i in range(start, end)]
        return items, end, lost


class ShardNode:
    """This machine's replay shard, parameter store and actors (see the module docstring)."""

    def __init__(self, cfg: DictConfig, launch_actors: bool = True):
        from gearflow.replay.storage import run_tag
        from gearflow.run.tables import make_run_dir
        from gearflow.topology.build import Builder
        from gearflow.topology.plan import plan_run
        from gearflow.topology.roles import Lifecycle
        from gearflow.run.private import config_token
        from gearflow.transport.auth import resolve_token

        # a "serve" plan (its actors here) or a "shard" plan (launch_actors=False: its actors
        # are started by someone else, a Ray actor group)
        self.plan = plan = plan_run(cfg, command="serve", actors=launch_actors)
        self.cfg = cfg
        from gearflow.transport.auth import configure

        configure(cfg.transport)
        try:
            self.token = resolve_token(config_token(cfg.transport)).decode()
        except ValueError as exc:
            raise ConfigError(f"gearflow serve: {exc}") from None
        torch.manual_seed(cfg.run.seed)
        self.run_dir = make_run_dir(cfg)
        self.roles = Lifecycle()  # the node's table, parameter store and actor processes
        self.params = self.shard = self.server = self.table = None
        try:
            build = Builder(cfg, plan, self.roles, tag=run_tag(self.run_dir))
            agent, _ = build.agent(torch.device("cpu"))  # the replay layout and the weights' template
            self.table = build.replay(agent)  # selected and gathered on this node's CPU
            geom = self.geom = build.geom
            self.params = build.params(agent)
            self.params.publish(agent.learner_network())  # version 1: the actors' weights until a learner pushes
            self._template = {k: v for k, v in agent.learner_network().state_dict().items()}
            self.relay = _Relay(int(cfg.actor.ladder_offset))
            self.stop_event = threading.Event()
            self.stop_reason = ""
            self.partitions = partitions = [geom.partitions_of(a) for a in range(geom.num_actors)]
            build.actors(agent, self.table, self.params, self.relay)  # "actors": the node's actor processes, a role
            remote = {a: [int(p) for p in partitions[a]] for a in plan.remote_actors}
            self._build_service(remote)
        except BaseException:
            self.close()
            raise

    def _build_service(self, remote: dict[int, list[int]]) -> None:
        from gearflow.config import to_yaml
        from gearflow.launchers.remote import Members, written_in
        from gearflow.run.private import redacted
        from gearflow.run.tables import env_steps_in
        from gearflow.transport.server.node import NodeService
        from gearflow.transport.limits import service_limits

        t, table = self.cfg.transport, self.table
        members = Members(to_yaml(redacted(self.cfg)), remote, self.relay, self.stop_event,
                          written=written_in(table.storage.counters, self.params)) if remote else None  # fmt: skip
        self.server = NodeService(table, self.params, self._template, relay=self.relay,
                                  env_steps=lambda: env_steps_in(table), stop_event=self.stop_event,
                                  on_stop=self._stopped_by, num_actors=self.geom.num_actors,
                                  ladder_offset=int(self.cfg.actor.ladder_offset), network=str(self.cfg.agent.name),
                                  remote=[p for parts in remote.values() for p in parts], members=members,
                                  host=str(t.host), port=int(t.port), token=self.token, loop=str(t.loop),
                                  transport=str(t.kind), checkpoint_dir=str(self.run_dir / "replay"),
                                  limits=service_limits(t.get("limits")))  # fmt: skip
        self.shard, self.transport, self.data_path, self.epoch = self.server.shard, self.server.transport, self.server.data_path, self.server.epoch

    def _stopped_by(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_event.set()

    # ----------------------------------------------------------------- lifecycle
    @property
    def address(self) -> str:
        return f"{self.cfg.transport.host}:{self.shard.port}"

    def start(self) -> str:
        """Listen, then start the actors; returns ``host:port``."""
        self.shard.start()
        self.roles.start()
        log.info("shard serving %d partitions × %d steps on %s (%d actor(s) here, ε-ladder offset %d)",
                 self.geom.num_partitions, self.geom.steps_per_partition, self.address,
                 self.plan.local_actors, int(self.cfg.actor.ladder_offset))  # fmt: skip
        return self.address

    def serve_forever(self, poll_s: float = 0.1) -> str:
        """Supervise the actors until ``run.stop``, :attr:`stop_event` or a failed actor; returns why."""
        from gearflow.run.tables import env_steps_in

        last_log = time.monotonic()
        while not self.stop_event.is_set():
            self.roles.drain(self.relay)
            try:
                self.roles.check()
            except ActorFailed as exc:
                self.stop_reason = f"actor failed: {exc}"
                self.stop_event.set()
                raise
            if time.monotonic() - last_log >= float(self.cfg.run.log_every_s):
                last_log = time.monotonic()
                r = self.relay.returns
                log.info("shard %s: %d env steps, %d episodes, return over the last 100 %.1f, weights version %d",
                         self.address, env_steps_in(self.table), self.relay.episodes,
                         float(np.mean(r)) if r else float("nan"), self.params.latest_version())  # fmt: skip
            self.stop_event.wait(poll_s)
        return self.stop_reason or "stopped"

    def close(self) -> None:
        """Stop the actors, then the service, then release the table and the parameter store."""
        try:
            self.roles.stop(getattr(self, "relay", None))  # the actors' last reports into the relay
        finally:
            if getattr(self, "server", None) is not None:  # the shard service and its transport's server end (RDMA's export)
                self.server.close()
                self.server = self.shard = self.data_path = None
            self.roles.close()  # the launcher's queue, the parameter store, the table
            self.params = self.table = None


def serve(cfg: DictConfig, *, address_file: str | None = None) -> dict[str, Any]:
    """Run a shard node until the run is over; returns its summary. ``address_file``: written with
    ``host:port`` once listening (for scripts and launchers)."""
    from gearflow.run.tables import env_steps_in

    node = ShardNode(cfg)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped: list[int] = []

    def on_signal(signum, frame):
        stopped.append(signum)
        node.stop_reason = f"stopped by {signal.Signals(signum).name}"
        node.stop_event.set()

    try:
        for s in previous:
            signal.signal(s, on_signal)
        address = node.start()
        print(json.dumps({"serving": address}), flush=True)
        if address_file:
            tmp = f"{address_file}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(address)
            os.replace(tmp, address_file)
        reason = node.serve_forever()
        summary = {"stop_reason": reason, "actor/env_steps": env_steps_in(node.table), "actor/episodes": node.relay.episodes,
                   "weights_version": node.params.latest_version()}  # fmt: skip
        if stopped:
            summary["stop_signal"] = signal.Signals(stopped[0]).name
        return summary
    finally:
        node.close()
        for s, h in previous.items():
            signal.signal(s, h)

