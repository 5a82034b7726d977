"""Item kinds, one module each: the item rule, its adder, its actor, its minimum steps, its
record count and its device gather hook, named in one registry.

* :mod:`~gearflow.kinds.transition` — ``Transition``, ``TransitionAdder``, ``Actor`` (Ape-X).
* :mod:`~gearflow.kinds.sequence` — ``Sequence``, ``WindowAdder``, ``SequenceActor`` (R2D2).
* :mod:`~gearflow.kinds.episode` — ``Episode``, ``EpisodeAdder``, ``EpisodeActor`` (Decision Transformer).
* :mod:`~gearflow.kinds.registry` — :class:`KindDef`, :func:`register_kind`, :func:`kind_def`,
  :func:`kind_names`, :func:`kind_from_dict`: what the config, the actors, the dry run, the
  checkpoints and the transports read.

Importing this package loads only the registry (no torch); a kind's module loads on first use::

    from gearflow.kinds.transition import Transition
    kind_def("transition").actor        # gearflow.kinds.transition.Actor
"""

from gearflow.kinds.registry import (
    KindDef,
    kind_def,
    kind_from_dict,
    kind_names,
    make_kind,
    register_kind,
    unregister_kind,
)

__all__ = ["KindDef", "kind_def", "kind_from_dict", "kind_names", "make_kind", "register_kind", "unregister_kind"]
