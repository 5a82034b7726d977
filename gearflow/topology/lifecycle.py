"""The one lifecycle every role of a run goes through.

A **role** (:mod:`gearflow.roles`) is anything a run starts, watches or must release: actor
processes (:class:`~gearflow.roles.actor_processes.LocalLauncher`), the remote actors' shard process
(:class:`~gearflow.roles.remote_actors.RemoteActors`), the shard nodes a learner samples
(:class:`~gearflow.roles.shards.Shards`), a shard node's service, a cluster's roles, and the parts
that only need closing (the replay table, the parameter store, a serial actor, the prefetcher:
:class:`Closes`). Each offers the same methods (``start``, ``check``, ``drain``, ``stop``,
``finish``, ``close``; ``summarize`` optional: :mod:`gearflow.roles.base`).

:class:`Lifecycle` runs a list of roles through them: start and check in build order, stop
and close in reverse (what was built last goes first), each role stopped and closed once,
and ``close`` reaches every role even when one of them raises (the first error is raised
after all are closed)::

    roles = Lifecycle()
    table = roles.closes(make_table(...))          # registered as it is built
    roles.add(LocalLauncher(...))
    roles.start()
    progress.restarts += roles.check()             # raises ActorFailed: the run stops
    roles.drain(progress)
    roles.stop(progress); roles.finish(reason)
    roles.close()                                  # in a finally
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from gearflow.roles.base import Part, Role

log = logging.getLogger("gearflow.runner")

__all__ = ["Closes", "Lifecycle", "Part", "Role"]

T = TypeVar("T")


class Closes(Part):
    """A part of the run that only needs ``obj.close()`` at the end (table, parameter store,
    serial actor, prefetcher, data-parallel group)."""

    def __init__(self, obj: Any, name: str = ""):
        self.obj, self.name = obj, name or type(obj).__name__

    def close(self) -> None:
        self.obj.close()


class Lifecycle:
    """A run's roles, started, supervised, stopped and closed together (see the module docstring)."""

    def __init__(self):
        self.roles: list = []
        self._stopped: set[int] = set()
        self.failed = None  # the role whose check raised (its ``errors`` explain the failure)

    def add(self, role: T) -> T:
        """Register ``role`` (closed by :meth:`close` from now on); returns it."""
        self.roles.append(role)
        return role

    def closes(self, obj: T, name: str = "") -> T:
        """Register ``obj`` as a part that only needs closing; returns ``obj``."""
        self.add(Closes(obj, name))
        return obj

    def __iter__(self):
        return iter(self.roles)

    def first(self, cls: type[T]) -> T | None:
        """The first role that is a ``cls`` (None when the plan has none)."""
        return next((r for r in self.roles if isinstance(r, cls)), None)

    def __len__(self) -> int:
        return len(self.roles)

    def start(self) -> None:
        for role in self.roles:
            role.start()

    def drain(self, progress) -> None:
        for role in self.roles:
            role.drain(progress)

    def check(self) -> int:
        """Every role's check (restarts made, summed); the first that raises stops the others'
        checks and is remembered in :attr:`failed`."""
        restarted = 0
        for role in self.roles:
            try:
                restarted += int(role.check())
            except BaseException:
                self.failed = role
                raise
        return restarted

    def stop(self, progress) -> None:
        """Stop the roles not stopped yet, last built first, reading reports into ``progress``
        meanwhile; one that raises does not keep the others from stopping (raised after)."""
        first = None
        for role in reversed(self.roles):
            if id(role) in self._stopped:
                continue
            self._stopped.add(id(role))
            try:
                role.stop(drain=lambda: self.drain(progress))
            except BaseException as exc:  # noqa: BLE001 - the others still stop
                log.error("stopping %s failed: %s: %s", _name(role), type(exc).__name__, exc)
                first = first or exc
        if first is not None:
            raise first

    def finish(self, reason: str) -> None:
        """The run ended by itself for ``reason``: roles that tell others so do it now."""
        for role in self.roles:
            finish = getattr(role, "finish", None)
            if finish is not None:
                finish(reason)

    def summarize(self, summary: dict) -> dict:
        """What the roles add to the run's ``summary`` (their optional ``summarize``); returns it."""
        for role in self.roles:
            add = getattr(role, "summarize", None)
            if add is not None:
                add(summary)
        return summary

    def close(self) -> None:
        """Close every role, last built first, each once; the first error is raised after all."""
        first = None
        while self.roles:
            role = self.roles.pop()
            try:
                role.close()
            except BaseException as exc:  # noqa: BLE001 - the others still close
                log.error("closing %s failed: %s: %s", _name(role), type(exc).__name__, exc)
                first = first or exc
        self._stopped.clear()
        if first is not None:
            raise first


def _name(role) -> str:
    return getattr(role, "name", "") or type(role).__name__
