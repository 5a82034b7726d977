"""A connection's big incoming blocks read by a wire thread of its own, MACed as they land,
without the GIL (``_mac.c``'s ``recv_into``).

Why. A sample reply is ~14.5 MB. Through the event loop its block is read in pieces, each a
Python ``buffer_updated`` call, and with integrity on a MAC thread reads the block again behind
them, woken every 256 KiB. Here the connection's wire thread reads the rest of the block, then
its trailer, with ``recv`` in 256 KiB pieces and feeds each piece to the frame's NH just after the
kernel copied it in: the MAC reads it from this core's L2 (no second pass over the block from
memory), and neither a Python call nor a MAC-thread wake-up is paid per piece. The loop's reading
is paused meanwhile (nothing else reads the socket) and resumed once the frame is checked. Measured
on the learner of ``gearflow bench transport --workloads sample`` (2 cores): its CPU a 14.5 MB
round 4.3–4.7 → 3.7–3.8 ms with integrity on, the same 2.3 ms with it off.

Only reading: the same thread *sending* a big reply (``sendmsg`` of the rows, the MAC beside it or
inline) was measured no faster than uvloop's ``writelines`` on the shard, mostly slower (up to 0.85
against 0.95 of the raw socket with integrity off, 0.51–0.53 against 0.55–0.59 on): the shard's loop
is the loopback's busier side and the hand-offs to a thread cost it what they free.
``gearflow/transport/README.md`` (issue 47) has the runs; ``docs/architecture.md`` the design.

The wire thread owns a duplicate of the connection's socket (so the loop closing its own never
frees a descriptor the thread is using); :meth:`WireIO.close` shuts it down (a read waiting on a
silent peer returns with an error) and closes it once the thread is done. Plain TCP only (gearflow's records under TLS included: each piece is decrypted as it lands,
before its MAC, :mod:`gearflow.transport.records`): a TLS
transport decrypts in the loop (:meth:`WireIO.of` gives None there), as does a build without
``_mac.c``.

    wire = WireIO.of(transport)              # None: TLS, no socket, _mac.c not built
    wire.recv(view, nh, trailer, done)       # fills view (each piece to nh), then trailer; done(error) in the thread
    wire.close()
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Callable

try:
    from gearflow.transport import _mac as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["PIECE", "WIRE_BYTES", "WireIO", "available"]

WIRE_BYTES = 1 << 20  # buffer blocks at least this big are read by the wire thread
PIECE = 256 << 10  # bytes one recv moves at most: a piece MACed as it lands is still in L2


def available() -> bool:
    """Whether ``_mac.c`` is built with ``recv_into`` (else blocks are read through the loop)."""
    return _native is not None and hasattr(_native, "recv_into")


class WireIO:
    """The wire thread of one plain-TCP connection (see the module docstring): one block at a
    time (the frame reader asks for the next only after the last landed)."""

    @classmethod
    def of(cls, transport) -> WireIO | None:
        """A wire thread for ``transport``'s socket, or None where blocks must go through the loop."""
        if not available() or transport is None or transport.get_extra_info("sslcontext") is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None or sock.type != socket.SOCK_STREAM:
            return None
        return cls(sock.fileno())

    def __init__(self, fd: int):
        self._sock = socket.socket(fileno=os.dup(fd))
        self._jobs: queue.SimpleQueue | None = None
        self._lock = threading.Lock()
        self.closed = False
        self.received = 0  # blocks read

    def recv(self, view: memoryview, nh, trailer: bytearray | None, done: Callable[[BaseException | None], None],
             cipher=None) -> None:  # fmt: skip
        """Fill ``view`` from the socket in the wire thread, each piece decrypted by ``cipher`` (a
        :class:`~gearflow.transport.records.StreamCipher`, held until the job is done: gearflow's
        records under TLS) and fed to ``nh`` (a ``_mac.NH``, or None) as it lands, then ``trailer`` (if given);
        ``done(error)`` there (error: None, or what cut it short: the connection is then unusable).
        Nothing else may read the socket meanwhile (the caller pauses its loop's reading)."""
        with self._lock:
            if not self.closed:
                if self._jobs is None:  # a daemon thread: one blocked on a silent peer never holds up the exit
                    self._jobs = queue.SimpleQueue()
                    threading.Thread(target=self._run, name="gearflow-wire", daemon=True).start()
                self._jobs.put((view, nh, trailer, done, cipher))
                return
        done(ConnectionResetError("the connection's wire thread is closed"))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._recv_job(*job)
        self._sock.close()  # after the last read: the descriptor is never reused under it

    def _recv_job(self, view: memoryview, nh, trailer: bytearray | None, done: Callable, cipher) -> None:
        err = None
        try:
            fd = self._sock.fileno()
            native = cipher.native if cipher is not None else None  # its context's address: cipher stays referenced
            _native.recv_into(fd, view, nh, PIECE, native)
            if trailer is not None:
                _native.recv_into(fd, trailer, None, PIECE, native)
            self.received += 1
        except BaseException as exc:  # noqa: BLE001 - handed to done(): the caller closes its connection
            err = exc
        done(err)

    def close(self) -> None:
        """Shut the duplicate down (a read waiting on the peer returns with an error) and close it
        once the wire thread no longer uses it (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            jobs = self._jobs
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if jobs is None:
            self._sock.close()
        else:
            jobs.put(None)  # the thread closes the socket once it is done
