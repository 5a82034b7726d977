"""Adders: what an actor writes into replay, over the writer interface (Acme's adders).

An actor calls its adder once per ``recv`` with the batch it just acted on; the
adder stages steps, appends rows, creates items and closes episodes through a
:class:`~gearflow.replay.protocols.WriterLike` (a local
:class:`~gearflow.replay.Writer`, or later a remote one)::

    adder = TransitionAdder(writer, n=3, gamma=0.99)
    adder.add(ids, obs, reward, terminated, truncated, first, actions, values, version)
    ...
    adder.finish(block=True)        # publish what is queued
    adder.items                     # items published so far

This module holds what every adder offers (:class:`Adder`); each item kind's adder lives in
its kind module and is named by the kind registry (:mod:`gearflow.kinds.registry`):

* ``TransitionAdder`` (:mod:`gearflow.kinds.transition`) — Ape-X n-step transitions (``obs action ret disc version``),
* ``WindowAdder`` (:mod:`gearflow.kinds.sequence`) — R2D2 sequence windows (``obs action reward discount first version``),
* ``EpisodeAdder`` (:mod:`gearflow.kinds.episode`) — Decision Transformer episodes (``obs action reward timestep``).

Every argument of ``add`` is per env of the batch: ``ids`` (b,) int64 env indices
(= writer streams), ``obs`` (b, *obs) (with a stacked-frame ``obs`` column, ``stack=k``,
the env's stacks ``(b, k, *frame)``, of which only the newest frame is written), ``reward``/``terminated``/``truncated`` (b,),
``first`` (b,) bool (``obs`` is an episode's step 0), ``actions`` (b, ...) the
actions just sent (int (b,), or float (b, *action_shape) for continuous actions), ``values``
(b, A) the Q-values acted with or ``None`` (:class:`TransitionAdder` also takes the pair
``(q_action, q_bootstrap)`` (b,), (b,) of an agent whose actions cannot index Q-values),
``version`` the weights version acted with.
"""

from __future__ import annotations

import numpy as np

from gearflow.replay.items import ItemKind
from gearflow.replay.protocols import WriterLike

__all__ = ["Adder"]


class Adder:
    """What every adder offers (constructor arguments differ per kind: see its kind module)."""

    COLUMNS: tuple[str, ...] = ()
    WHAT = "items"
    USES_FIRST = True  # whether ``add`` reads ``first`` (else the actor passes None)

    def __init__(self, writer: WriterLike):
        self.writer = writer
        self.items = 0  # items published
        self._dt = {c.name: c.dtype for c in writer.spec}
        # a stacked-frame obs column (``stack=k``) stores one frame per step: the adder stages
        # and writes only the newest frame of each stacked observation (a view, obs[:, -1])
        self._obs_frames = "obs" in writer.spec and writer.spec["obs"].stack > 1

    def _frames(self, obs: np.ndarray) -> np.ndarray:
        """What the ``obs`` column stores of a batch of observations ``(b, *obs)``: the whole
        observation, or with stacked frames its newest frame ``(b, *frame)``, a view."""
        return obs[:, -1] if self._obs_frames else obs

    @classmethod
    def check_kind(cls, kind: ItemKind, agent_name: str) -> None:
        """Refuse an item kind this adder cannot write (before an env exists)."""
        raise NotImplementedError

    @classmethod
    def min_steps(cls, actor, kind: ItemKind) -> int:
        """The fewest steps per stream this adder can write ``kind`` items into (``actor``: the
        run's actor group, e.g. ``actor.n_step``; the adder reads no other group)."""
        raise NotImplementedError

    @classmethod
    def size_error(cls, actor, kind: ItemKind, steps: int) -> str:
        raise NotImplementedError

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version: int) -> None:
        raise NotImplementedError

    def finish(self, block: bool = True) -> None:
        """Publish what is queued; ``block=False`` (shutdown): without waiting on the rate limiter."""
