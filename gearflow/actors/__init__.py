"""Actors: step EnvPool-shaped envs with an agent's policy; an adder writes what they collect.

* :mod:`~gearflow.actors.base` — :class:`ActorBase` (env loop, ε ladder, weight sync,
  episode statistics), :func:`epsilon_ladder`, :func:`env_seed`.
* :mod:`~gearflow.actors.adders` — :class:`Adder`: what every adder offers over the writer
  interface (:mod:`gearflow.replay.protocols`).
* :mod:`~gearflow.actors.policy` — :func:`traced_policy` (a network's forward traced with TorchScript).
* :mod:`~gearflow.actors.process` — :func:`make_actor` (a local actor over shared memory)
  and :func:`run_actor_process` (the spawn target of an actor process).

Each item kind's actor class and adder live in its kind module (:mod:`gearflow.kinds`:
``Actor`` / ``TransitionAdder``, ``SequenceActor`` / ``WindowAdder``, ``EpisodeActor`` /
``EpisodeAdder``), named by the kind registry; :func:`actor_class_for` reads it.
"""

from gearflow.actors.adders import Adder
from gearflow.actors.base import ActorBase, actor_epsilon, env_seed, epsilon_ladder
from gearflow.kinds.registry import kind_def


def actor_class_for(agent) -> type[ActorBase]:
    """The actor class of ``agent.item_kind()`` (the kind registry's ``actor``); ValueError
    naming the known kinds for a kind the registry does not know."""
    return kind_def(agent.item_kind().name).actor


__all__ = ["ActorBase", "Adder", "actor_class_for", "actor_epsilon", "env_seed", "epsilon_ladder"]
