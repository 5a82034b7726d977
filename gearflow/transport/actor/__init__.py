"""The actor side of the transport: an actor on another machine writes a shard's replay and
reads its weights (see README.md)."""

from gearflow.transport.actor.params import RemoteParams
from gearflow.transport.actor.shipping import ShippingWriter
from gearflow.transport.actor.writer import RemoteWriter

__all__ = ["RemoteParams", "RemoteWriter", "ShippingWriter"]
