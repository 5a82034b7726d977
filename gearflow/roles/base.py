"""What a role is: anything a run starts, watches or must release, with the same six methods
(:class:`~gearflow.topology.lifecycle.Lifecycle` takes every role of a plan through them)::

    start()               begin (spawn processes, listen)
    check() -> int        supervise between batches: restarts made; raises ActorFailed to stop the run
    drain(progress)       fold what it reported (episodes, counters, errors) into ``progress``
    stop(drain)           stop gracefully; ``drain()`` keeps reading reports meanwhile
    finish(reason)        the run ended by itself for ``reason`` (not by a signal): tell others
    close()               release everything (always called, also after a failure)

and, optionally, ``summarize(summary)``: what it adds to the run's summary at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Part", "Role"]


@runtime_checkable
class Role(Protocol):
    """What :class:`~gearflow.topology.lifecycle.Lifecycle` calls (``finish`` and ``summarize`` are optional)."""

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
