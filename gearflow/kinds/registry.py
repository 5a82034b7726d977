"""The registry of item kinds: the one place that maps a kind's name to its module's parts.

A leaf: it imports nothing of gearflow at module level, so the config (``replay.item``),
the replay core (decoding a checkpoint's kind), the actors, the dry run and the transports
all read it without pulling in torch. The built-in kinds are named here by module and
loaded on first use; another kind (a user's, a test's) registers itself when its module is
imported::

    kind_names()                      # ('transition', 'sequence', 'episode', ...registered)
    d = kind_def("sequence")          # KindDef: item rule, adder, actor, config_min_steps, from_config
    d.item, d.adder, d.actor          # Sequence, WindowAdder, SequenceActor
    make_kind(cfg.replay)             # the run's item rule: Sequence(length=80, period=40, burn_in=40)
    kind_from_dict({"kind": "sequence", "length": 8, "period": 4, "burn_in": 0})

A kind module ends with ``KIND = KindDef(...)`` (a built-in: its name in :data:`BUILTIN`;
any other: ``register_kind(KindDef(...))`` at import).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["BUILTIN", "KindDef", "kind_def", "kind_from_dict", "kind_names", "make_kind", "register_kind", "unregister_kind"]

# name → module of the built-in kinds (each module defines ``KIND``), loaded on first use
BUILTIN: dict[str, str] = {
    "transition": "gearflow.kinds.transition",
    "sequence": "gearflow.kinds.sequence",
    "episode": "gearflow.kinds.episode",
}


def _no_config_minimum(cfg: Any) -> Optional[int]:
    return None




@dataclass(frozen=True)
class KindDef:
    """One item kind as the framework reads it.

    ``item``: the item rule, an :class:`~gearflow.replay.items.ItemKind` subclass (batch
    layout, rows, gather, records per partition, ``from_dict``, and the optional device gather
    hook ``gather_on_device``); ``adder``: the :class:`~gearflow.actors.adders.Adder` subclass
    that writes its items (``check_kind``, ``min_steps``, ``size_error``, ``COLUMNS``);
    ``actor``: the :class:`~gearflow.actors.base.ActorBase` subclass that acts for it;
    ``config_min_steps(cfg)``: the fewest steps per partition the config alone implies
    (``None`` where only the agent's kind says it: the actor's adder checks it then);
    ``from_config(replay)``: the item rule of a run, its parameters read from the run's ``replay``
    group by the kind itself (``Sequence``: ``sequence_length``, ``sequence_period``,
    ``burn_in``); None: ``item()``, a kind without parameters.
    """

    name: str
    item: type
    adder: type
    actor: type
    config_min_steps: Callable[[Any], Optional[int]] = _no_config_minimum
    from_config: Optional[Callable[[Any], Any]] = None

    def of(self, replay: Any) -> Any:
        """The item rule of the run whose ``replay`` group is given."""
        return self.item() if self.from_config is None else self.from_config(replay)


_REGISTERED: dict[str, KindDef] = {}


def register_kind(d: KindDef) -> KindDef:
    """Make ``d`` known by ``d.name`` (a built-in's module is registered when first loaded);
    registering another definition under a known name is an error."""
    if d.item.name != d.name:
        raise ValueError(f"kind {d.name!r}: its item rule {d.item.__name__} is named {d.item.name!r}")
    old = _REGISTERED.get(d.name)
    if old is not None and old != d:
        raise ValueError(f"item kind {d.name!r} is already registered ({old.item.__module__})")
    _REGISTERED[d.name] = d
    return d


def unregister_kind(name: str) -> None:
    """Forget a registered kind (not a built-in): what a test that registered one calls."""
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in item kind")
    _REGISTERED.pop(name, None)


def kind_names() -> tuple[str, ...]:
    """Every kind name the registry knows, the built-ins first (nothing is imported)."""
    return tuple(BUILTIN) + tuple(n for n in _REGISTERED if n not in BUILTIN)


def kind_def(name: str) -> KindDef:
    """The definition of kind ``name``; ValueError naming the known kinds for any other."""
    d = _REGISTERED.get(name)
    if d is not None:
        return d
    module = BUILTIN.get(name)
    if module is None:
        raise ValueError(f"unknown item kind {name!r}; known kinds: {', '.join(kind_names())}")
    return register_kind(importlib.import_module(module).KIND)


def make_kind(replay: Any) -> Any:
    """The run's item rule: the kind ``replay.item`` names, its parameters read from the ``replay``
    group by the kind (:meth:`KindDef.of`). The one place a run's kind is made; the agent gets it
    (``AgentSettings.kind``), the table and the actors get it from the agent."""
    return kind_def(str(replay.item)).of(replay)


def kind_from_dict(d: dict[str, Any]) -> Any:
    """The item rule written by ``kind.to_dict()`` (checkpoints, a shard's layout)."""
    d = dict(d)
    return kind_def(d.pop("kind")).item.from_dict(d)
