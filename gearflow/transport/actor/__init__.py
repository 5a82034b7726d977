"""The actor side of the transport: an actor on another machine writes a shard's replay and
reads its weights (see README.md).

Which writer a remote actor writes through is one table, :data:`WRITERS`, read in order: the
first whose rule fits the run's config (``gearflow actor --connect`` asks :func:`remote_writer`).
An actor-side transport beside these is its module here and one entry in the table."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from gearflow.transport.actor.params import RemoteParams
from gearflow.transport.actor.shipping import ShippingWriter
from gearflow.transport.actor.writer import RemoteWriter

__all__ = ["WRITERS", "RemoteParams", "RemoteWriter", "ShippingWriter", "remote_writer"]

# (name, "module:class", rule): the first entry whose rule(cfg) holds writes the actor's steps
WRITERS: list[tuple[str, str, Callable[[Any], bool]]] = [
    # stacked-frame columns: the shipped ring does not carry them, so each call is staged and sent
    ("staged", "gearflow.transport.actor.writer:RemoteWriter", lambda cfg: bool(cfg.replay.frame_stack)),
    # a local ring shipped to the shard: the adder's C path runs on the actor's machine
    ("shipping", "gearflow.transport.actor.shipping:ShippingWriter", lambda cfg: True),
]


def remote_writer(cfg, address: Any, partitions: list[int], token: str | None, **kwargs):
    """The writer of a remote actor over ``partitions`` of the shard at ``address`` (the first of
    :data:`WRITERS` that fits ``cfg``); ``kwargs`` go to it (``insert_timeout_s``, ``timeout_s``, ``loop``)."""
    _, path, _ = next(w for w in WRITERS if w[2](cfg))
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)(address, len(partitions), token, partitions=partitions,
                                                         **kwargs)  # fmt: skip
