"""Actors: step EnvPool-shaped envs with an agent's policy; an adder writes what they collect.

* :mod:`~gearflow.actors.base` — :class:`ActorBase` (env loop, ε ladder, weight sync,
  episode statistics), :func:`epsilon_ladder`, :func:`env_seed`, the registry by item kind.
* :mod:`~gearflow.actors.adders` — :class:`TransitionAdder`, :class:`WindowAdder`,
  :class:`EpisodeAdder` over the writer interface (:mod:`gearflow.replay.protocols`).
* :mod:`~gearflow.actors.transition`, :mod:`~gearflow.actors.sequence`,
  :mod:`~gearflow.actors.episode` — :class:`Actor` (Ape-X), :class:`SequenceActor` (R2D2),
  :class:`EpisodeActor` (Decision Transformer): how each asks its agent to act.
* :mod:`~gearflow.actors.process` — :func:`make_actor` (a local actor over shared memory)
  and :func:`run_actor_process` (the spawn target of an actor process).

A new item kind is an adder (``ADDERS``) plus an actor class registered with
``@register_actor(kind_name)``.
"""

from gearflow.actors.adders import ADDERS, Adder, EpisodeAdder, TransitionAdder, WindowAdder
from gearflow.actors.base import ACTOR_CLASSES, ActorBase, actor_epsilon, env_seed, epsilon_ladder, register_actor
from gearflow.actors.episode import EpisodeActor
from gearflow.actors.sequence import SequenceActor
from gearflow.actors.transition import Actor


def actor_class_for(agent) -> type[ActorBase]:
    """The actor class registered for ``agent.item_kind().name``."""
    name = agent.item_kind().name
    try:
        return ACTOR_CLASSES[name]
    except KeyError:
        raise ValueError(f"no actor writes {name!r} items (known: {', '.join(sorted(ACTOR_CLASSES))})") from None


__all__ = [
    "ACTOR_CLASSES", "ADDERS", "Actor", "ActorBase", "Adder", "EpisodeActor", "EpisodeAdder", "SequenceActor",
    "TransitionAdder", "WindowAdder", "actor_class_for", "actor_epsilon", "env_seed", "epsilon_ladder",
    "register_actor",
]  # fmt: skip
