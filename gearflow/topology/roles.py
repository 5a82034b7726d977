"""The one lifecycle every role of a run goes through, and the roles that are not launchers.

A **role** is anything a run starts, watches or must release: actor processes
(:class:`~gearflow.launchers.local.LocalLauncher`), the remote actors' shard process
(:class:`~gearflow.launchers.remote.RemoteActors`), the shard nodes a learner samples
(:class:`Shards`), and the parts that only need closing (the replay table, the parameter
store, a serial actor, the prefetcher: :class:`Closes`). Each offers the same methods::

    start()               begin (spawn processes, listen)
    check() -> int        supervise between batches: restarts made; raises ActorFailed to stop the run
    drain(progress)       fold what it reported (episodes, counters, errors) into ``progress``
    stop(drain)           stop gracefully; ``drain()`` keeps reading reports meanwhile
    finish(reason)        the run ended by itself for ``reason`` (not by a signal): tell others
    close()               release everything (always called, also after a failure)

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
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

log = logging.getLogger("gearflow.runner")

__all__ = ["Closes", "Lifecycle", "Role", "Shards"]

T = TypeVar("T")


@runtime_checkable
class Role(Protocol):
    """What :class:`Lifecycle` calls (``finish`` is optional)."""

    def start(self) -> Any: ...

    def check(self) -> int: ...

    def drain(self, progress) -> None: ...

    def stop(self, drain: Callable[[], None] = ...) -> None: ...

    def close(self) -> None: ...


class Part:
    """A role with nothing to start, check, drain, stop or finish (override what applies)."""

    name = "part"

    def start(self) -> None:
        pass

    def check(self) -> int:
        return 0

    def drain(self, progress) -> None:
        pass

    def stop(self, drain: Callable[[], None] = lambda: None) -> None:
        pass

    def finish(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


class Closes(Part):
    """A part of the run that only needs ``obj.close()`` at the end (table, parameter store,
    serial actor, prefetcher, data-parallel group)."""

    def __init__(self, obj: Any, name: str = ""):
        self.obj, self.name = obj, name or type(obj).__name__

    def close(self) -> None:
        self.obj.close()


class Shards(Part):
    """The shard nodes a learner samples (:class:`~gearflow.transport.learner.shards.RemoteShards`) as a
    role: their progress is polled on ``drain`` and once more, forced, on ``stop``; ``finish``
    sends ``run.stop`` (the publishing learner only); ``close`` closes its sampler and publisher."""

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

    def close(self) -> None:
        self.shards.close()


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
