"""A ``serve`` (or ``shard``) plan run in this process: one node's replay shard with that node's
actors, for learners elsewhere (``gearflow serve CONFIG``; a Ray shard role).

A shard node owns this machine's replay table (shared memory) and parameter store, runs the
node's ``actor.num_actors`` actor processes against them (:class:`LocalLauncher`, exactly as
``gearflow train`` does; the last ``actor.remote_actors`` of them join over TCP with
``gearflow actor --connect``), and serves the table to learners on other machines through a
:class:`~gearflow.transport.server.node.NodeService` (the server side of the transport: the
shard's ``replay.*`` and ``params.get``, the learner's ``params.push``, ``run.progress`` and
``run.stop``; the handlers live there). Every part is built by the one builder
(:class:`~gearflow.topology.build.Builder`: agent, table, parameter store, the ``shard_service``
role, actor processes) in its plan's order and taken through one
:class:`~gearflow.topology.lifecycle.Lifecycle` (start, drain and check while serving, stop and
close); this class is the loop around them.

::

    node = ShardNode(cfg)            # table, parameter store, service, actor launcher
    address = node.start()           # "host:port" once listening; actors started
    node.serve_forever()             # supervise until run.stop, a signal, or a failed actor
    node.close()

A node is one of several when the learners' ``transport.shards`` lists several addresses: give
each node its slice of the run's Ape-X ε ladder with ``actor.ladder_offset`` /
``actor.ladder_total`` (the Ray launcher does).
"""

from __future__ import annotations

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
from gearflow.roles.failures import ActorFailed
from gearflow.roles.shard_service import Relay
from gearflow.topology.build import Builder
from gearflow.topology.lifecycle import Lifecycle
from gearflow.topology.plan import RunPlan, plan_run

log = logging.getLogger("gearflow.serve")

__all__ = ["ShardNode", "serve_node"]


class ShardNode:
    """This machine's replay shard, parameter store and actors (see the module docstring).
    ``launch_actors=False``: a ``shard`` plan, whose actors someone else starts (a Ray actor group)."""

    def __init__(self, cfg: DictConfig, launch_actors: bool = True, *, plan: RunPlan | None = None):
        from gearflow.replay.storage import run_tag
        from gearflow.run.private import config_token
        from gearflow.run.tables import make_run_dir
        from gearflow.transport.auth import configure, resolve_token

        self.plan = plan if plan is not None else plan_run(cfg, command="serve", actors=launch_actors)
        self.cfg = cfg
        configure(cfg.transport)
        try:
            token = resolve_token(config_token(cfg.transport)).decode()
        except ValueError as exc:
            raise ConfigError(f"gearflow serve: {exc}") from None
        torch.manual_seed(cfg.run.seed)
        self.run_dir = make_run_dir(cfg)
        self.roles = Lifecycle()  # the node's table, parameter store, service and actor processes
        self.params = self.server = self.shard = self.table = None
        self.relay = Relay(int(cfg.actor.ladder_offset))  # what its actors report, for run.progress
        self.stop_event = threading.Event()
        self.stop_reason = ""
        try:
            build = Builder(cfg, self.plan, self.roles, tag=run_tag(self.run_dir), progress=self.relay)
            agent, _ = build.agent(torch.device("cpu"))  # the replay layout and the weights' template
            self.table = build.replay(agent)  # selected and gathered on this node's CPU
            self.geom = build.geom
            self.params = build.params(agent)
            build.publish(self.params, agent)  # version 1: the actors' weights until a learner pushes
            self.partitions = [self.geom.partitions_of(a) for a in range(self.geom.num_actors)]
            self.server = build.shard_service(agent, self.table, self.params, token=token, stop_event=self.stop_event,
                                              on_stop=self._stopped_by, run_dir=self.run_dir)  # fmt: skip
            self.shard, self.transport, self.data_path = self.server.shard, self.server.transport, self.server.data_path
            self.epoch = self.server.epoch
            build.actors(agent, self.table, self.params)  # "actors": the node's actor processes, a role
        except BaseException:
            self.close()
            raise

    def _stopped_by(self, reason: str) -> None:
        self.stop_reason = reason
        self.stop_event.set()

    # ----------------------------------------------------------------- lifecycle
    @property
    def address(self) -> str:
        return f"{self.cfg.transport.host}:{self.shard.port}"

    def start(self) -> str:
        """Listen, then start the actors (the roles in build order); returns ``host:port``."""
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
        """Stop the actors (their last reports into the relay), then close every role, last built
        first: the actors' queue, the service and its transport's server end, the parameter store,
        the table."""
        try:
            self.roles.stop(self.relay)
        finally:
            self.roles.close()
            self.server = self.shard = self.data_path = self.params = self.table = None


def serve_node(cfg: DictConfig, plan: RunPlan, *, address_file: str | None = None) -> dict[str, Any]:
    """Run a shard node until the run is over; returns its summary. ``address_file``: written with
    ``host:port`` once listening (for scripts and launchers)."""
    from gearflow.run.tables import env_steps_in

    node = ShardNode(cfg, plan=plan)
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
