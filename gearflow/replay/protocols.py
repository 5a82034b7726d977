"""The two seams of replay: what adders write to, and what the learner samples from.

A local run uses :class:`~gearflow.replay.Writer` (shared memory) and
:class:`~gearflow.replay.Table`; a network transport supplies a remote writer
(actor side) and a remote sampler (learner side) with the same methods, and
nothing else changes::

    writer: WriterLike = Writer(storage, partitions)        # or a remote writer
    adder = TransitionAdder(writer, n=3, gamma=0.99)         # gearflow.kinds.transition

    sampler: SamplerLike = table                             # or a remote sampler
    batch = sampler.sample(256)                              # Sample: keys, data, weights
    sampler.update_priorities(batch.keys, priorities)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from gearflow.replay.spec import TableSpec
    from gearflow.replay.table import Sample

__all__ = ["SamplerLike", "SelectorInfo", "SelectorLike", "WriterLike"]


@runtime_checkable
class WriterLike(Protocol):
    """The writer interface (Reverb's ``TrajectoryWriter`` names, batched over streams).

    Stream ``i`` is one environment's trajectory; steps are numbered by an absolute
    per-stream counter (``positions``) that continues across episodes.
    """

    insert_timeout_s: float  # how long create_items waits on the rate limiter
    abort: Optional[Callable[[], bool]]  # polled while an insert waits: True gives up

    @property
    def spec(self) -> "TableSpec": ...  # the columns of one row

    @property
    def num_streams(self) -> int: ...

    @property
    def steps_per_stream(self) -> int: ...  # the ring a stream's rows live in

    @property
    def positions(self) -> np.ndarray: ...  # (num_streams,) int64: next step of each stream

    def episode_lengths(self, streams=None) -> np.ndarray: ...  # rows of each current episode

    def append(self, steps: Mapping[str, Any], streams=None) -> np.ndarray:
        """One row per stream in ``streams``; returns their absolute step indices."""

    def extend(self, steps: Mapping[str, Any], stream: int = 0) -> int:
        """Several rows of one stream."""

    def create_items(self, priorities, num_steps, streams=None, ends=None, *, expired: str = "raise") -> None:
        """Items over each stream's last ``num_steps`` rows before ``ends`` (exclusive); items over
        steps the ring already overwrote raise ValueError (``expired="raise"``) or are dropped
        (``"drop"``: the n-step adder's queued items a small ring overtook)."""

    def end_episode(self, streams=None) -> None: ...

    def flush(self) -> None: ...  # heartbeat: the writer is alive


class SelectorLike(Protocol):
    """``sampler.selector``: what a learner reads and sets on the selector it samples with
    (a :class:`~gearflow.replay.selectors.Selector` locally, a :class:`SelectorInfo` over the
    network)."""

    name: str  # the selector's registry name ("prioritized", "uniform", ...)
    importance_sampled: bool  # samples carry IS weights with an exponent beta the learner anneals
    beta: Any  # float, assignable between samples (None on a remote sampler: each shard's own)


class SelectorInfo:
    """A remote sampler's :class:`SelectorLike`: the shards' selector ``name`` and
    ``importance_sampled``, and ``beta``, the IS exponent the learner anneals (None: each
    shard's own), sent with every request for a batch."""

    def __init__(self, name: str = "prioritized", importance_sampled: bool = True):
        self.name, self.importance_sampled = name, bool(importance_sampled)
        self.beta: float | None = None

    def request_fields(self) -> dict[str, float]:
        """What a request for a batch carries of it: ``{"beta": beta}``, or nothing (each shard's own)."""
        return {} if self.beta is None else {"beta": float(self.beta)}

    def __repr__(self) -> str:
        return f"SelectorInfo({self.name!r}, importance_sampled={self.importance_sampled}, beta={self.beta})"


@runtime_checkable
class SamplerLike(Protocol):
    """What the learner reads: batches with keys and IS weights, priorities written back;
    ``selector``: the selector whose ``beta`` it anneals (when ``importance_sampled``)."""

    selector: SelectorLike

    def sample(self, batch_size: int, timeout_s: Optional[float] = None) -> "Sample": ...

    def update_priorities(self, keys, priorities) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...
