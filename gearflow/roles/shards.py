"""The shard nodes a learner samples, as a role (the ``shards`` role of a ``shards`` plan)."""

from __future__ import annotations

from collections.abc import Callable

from gearflow.roles.base import Part

__all__ = ["Shards"]


class Shards(Part):
    """The shard nodes a learner samples (:class:`~gearflow.transport.learner.shards.RemoteShards`) as a
    role: their progress is polled on ``drain`` and once more, forced, on ``stop``; ``finish``
    sends ``run.stop`` (the publishing learner only); ``summarize`` names the nodes the run went on
    without (``transport/nodes_lost``); ``close`` closes its sampler and publisher."""

    name = "shards"

    def __init__(self, shards, progress):
        self.shards, self.progress = shards, progress

    def drain(self, progress) -> None:
        self.shards.poll(progress)

    def stop(self, drain: Callable[[], None] = lambda: None) -> None:
        self.shards.poll(self.progress, force=True)

    def finish(self, reason: str) -> None:
        if self.shards.publisher:
            self.shards.end_run(reason)

    def summarize(self, summary: dict) -> None:
        if lost := self.shards.lost():  # the run went on without them
            summary["transport/nodes_lost"] = lost

    def close(self) -> None:
        self.shards.close()
