"""The errors a shard's replies carry, raised on the client side as themselves.

A handler's exception reaches the caller as an ERROR reply naming its type; the client raises
that type again where :func:`~gearflow.transport.client.register_error` registered it (else a
``RemoteError``). Importing this module registers replay's errors and defines
:class:`SessionLost`, so every side that talks to a shard — the actor side's writers, the
learner side's sampler, the server — imports it, and a ``RateLimiterTimeout`` of the shard's
rate limiter is a ``RateLimiterTimeout`` (a ``TimeoutError``: "no batch yet" to a prefetcher)
in the learner, an ``InsertAborted`` one in the actor.

    try:
        batch = sampler.sample(256, timeout_s=1.0)
    except RateLimiterTimeout: ...          # the shard's, raised here as itself
"""

from __future__ import annotations

from gearflow.replay.inserts import InsertAborted
from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.storage import PartitionOwned, TableClosed
from gearflow.transport.client import ServiceUnavailable, register_error

__all__ = ["SHARD_ERRORS", "InsertAborted", "PartitionOwned", "RateLimiterTimeout", "SessionLost", "TableClosed"]


@register_error
class SessionLost(ServiceUnavailable):
    """A writer session is gone (its connection was lost, or the service restarted): the writer
    must open a new one."""


SHARD_ERRORS = (RateLimiterTimeout, InsertAborted, PartitionOwned, TableClosed, SessionLost)
for _cls in SHARD_ERRORS:
    register_error(_cls)
