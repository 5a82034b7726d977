"""How much one client may make a :class:`~gearflow.transport.service.Service` hold: the
``transport.limits`` config group (:class:`ServiceLimits`, :func:`service_limits`) and the
receive buffers of one connection (:class:`ReceivePool`), which those limits cap."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearflow.transport.framing import FrameLimits

__all__ = ["ReceivePool", "ServiceLimits", "service_limits"]


@dataclass(frozen=True)
class ServiceLimits:
    """How much one client may make the service hold (the ``transport.limits`` config group).

    Per connection the service holds at most ``max_queued_bytes + frame.max_frame_bytes`` of
    receive buffers (requests read and not yet handled, and the free ones it keeps for reuse)
    plus its staging buffer (:attr:`~gearflow.transport.framing.FrameReader.staging_bytes`); a
    connection at its in-flight or queued-bytes limit is not read any further until a request
    is answered. Handlers that wait bound their wait by ``max_wait_s`` and end it when the
    connection closes; a ``replay.sample`` asks for at most ``max_batch`` items and a reply of
    at most ``max_reply_bytes``. Sockets that have not authenticated yet sit in their own pool
    of ``max_preauth`` (the oldest is dropped for a newcomer when it is full) and are closed
    after ``auth_timeout_s``: they never take one of the ``max_connections`` slots."""

    frame: FrameLimits = field(default_factory=FrameLimits)
    max_connections: int = 64  # authenticated connections
    max_in_flight: int = 8  # requests of one connection not yet answered (and drained)
    auth_timeout_s: float = 5.0  # a connection that has not authenticated by then is closed
    max_preauth: int = 16  # sockets not yet authenticated (their own pool)
    max_queued_bytes: int = 64 << 20  # receive buffers one connection may hold beyond its last frame
    max_wait_s: float = 60.0  # the longest a request may wait server-side (sample / insert timeouts)
    max_batch: int = 1 << 16  # items one replay.sample may ask for
    max_reply_bytes: int = 256 << 20  # bytes one reply may hold
    refusal_log_interval_s: float = 10.0  # refusals log one line per interval (with a count)

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_in_flight", "max_preauth", "max_queued_bytes", "max_batch", "max_reply_bytes"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"transport.limits.{name} must be an int ≥ 1, got {v!r}")
        for name in ("auth_timeout_s", "max_wait_s", "refusal_log_interval_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or not v > 0:
                raise ValueError(f"transport.limits.{name} must be a finite number > 0, got {v!r}")

    def wait_s(self, asked, default: float) -> float:
        """A request's wait: ``asked`` (None: ``default``) capped at :attr:`max_wait_s`; a value that
        is not a finite number ≥ 0 (``1e999`` parses as infinity, ``nan``) is a ``ValueError``."""
        if asked is None:
            asked = default
        try:
            ok = not isinstance(asked, bool) and isinstance(asked, (int, float)) and math.isfinite(asked) and asked >= 0
        except OverflowError:  # an int too large for a float
            ok = False
        if not ok:
            raise ValueError(f"timeout_s must be a finite number ≥ 0, got {str(asked)[:40]}")
        return min(float(asked), self.max_wait_s)


def service_limits(group: Any = None) -> ServiceLimits:
    """:class:`ServiceLimits` of a config's ``transport.limits`` group (None: the defaults)."""
    if group is None:
        return ServiceLimits()
    g = dict(group)
    frame = FrameLimits(max_frame_bytes=int(g.pop("max_frame_bytes", FrameLimits.max_frame_bytes)))
    return ServiceLimits(frame=frame, **{k: (int(v) if isinstance(v, int) else float(v)) for k, v in g.items()})


class ReceivePool:
    """Receive buffers of one connection, reused: at most ``keep`` free ones are kept, and free
    ones are dropped before ``cap`` bytes are passed. ``nbytes`` counts every buffer this pool has
    allocated and not dropped; ``allocated(n)`` is told of each change (the service's total)."""

    def __init__(self, keep: int, allocated: Callable[[int], None], cap: int):
        self.keep, self.free, self.nbytes, self.allocated, self.cap = keep, [], 0, allocated, cap

    @property
    def in_use(self) -> int:
        """Bytes of blocks handed out and not yet put back (requests read, not yet handled)."""
        return self.nbytes - sum(b.nbytes for b in self.free)

    def get(self, n: int) -> np.ndarray:
        best = None
        for i, b in enumerate(self.free):
            if b.nbytes >= n and (best is None or b.nbytes < self.free[best].nbytes):
                best = i
        if best is None:
            while self.free and self.nbytes + n > self.cap:  # the free ones go before the cap is passed
                self._drop(self.free.pop())
            base = np.empty(n, dtype=np.uint8)
            self.nbytes += n
            self.allocated(n)
        else:
            base = self.free.pop(best)
        return base[:n]

    def put(self, block: np.ndarray) -> None:
        base = block.base if isinstance(block.base, np.ndarray) else block
        if base.nbytes == 0 or self.keep == 0:  # keep 0: cleared (its connection is gone)
            return
        if self.nbytes > self.cap:  # over the connection's cap: not kept for reuse
            return self._drop(base)
        if len(self.free) < self.keep:
            self.free.append(base)
        else:
            smallest = min(range(len(self.free)), key=lambda i: self.free[i].nbytes)
            if self.free[smallest].nbytes < base.nbytes:
                self.allocated(-self.free[smallest].nbytes)
                self.nbytes -= self.free[smallest].nbytes
                self.free[smallest] = base
            else:
                self.allocated(-base.nbytes)
                self.nbytes -= base.nbytes

    def _drop(self, base: np.ndarray) -> None:
        self.allocated(-base.nbytes)
        self.nbytes -= base.nbytes

    def clear(self) -> None:
        """The connection is gone: its buffers are dropped (those in use go with their requests)."""
        self.allocated(-self.nbytes)
        self.nbytes, self.free, self.keep = 0, [], 0
