"""A shard node's service as a role (the ``shard_service`` role of a ``serve`` or ``shard`` plan),
and the relay of what its actors report, numbered for the learners' ``run.progress``.

    relay = Relay(ladder_offset)                          # the node's reports, as its Progress
    service = ShardServiceRole(NodeService(table, store, template, relay=relay, ...))
    service.start()                                       # listen (before the actors start)
    service.close()                                       # the service and its transport's server end
"""

from __future__ import annotations

import collections
import logging
import threading

from gearflow.reports import ReportSink, fold_report
from gearflow.roles.base import Part

log = logging.getLogger("gearflow.serve")

__all__ = ["MAX_PROGRESS", "MAX_PROGRESS_REPLY", "Relay", "ShardServiceRole"]

MAX_PROGRESS = 100_000  # reports kept for learners that poll late (oldest dropped first)
MAX_PROGRESS_REPLY = 4096  # reports per run.progress reply


class Relay(ReportSink):
    """What the node's actors report, numbered, for ``run.progress``: LocalLauncher.drain folds
    into it as into a Progress, remote actors' reports arrive through ``put`` (the queue
    interface of :class:`~gearflow.roles.remote_actors.Members`)."""

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


class ShardServiceRole(Part):
    """A :class:`~gearflow.transport.server.node.NodeService` as a role: ``start`` listens,
    ``close`` stops the service and its transport's server end (RDMA's export); the table and
    the parameter store it serves are roles of their own."""

    name = "shard_service"

    def __init__(self, server):
        self.server = server

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.close()
