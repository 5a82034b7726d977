"""The client end: one authenticated connection, driven by a background event-loop thread.

    client = Client("127.0.0.1:7000", token="s3cret-token", timeout_s=10)
    meta, buffers = client.call("replay.stats")                 # blocks, at most timeout_s
    fut = client.submit("replay.write", meta, [rows], on_sent=release)   # pipelined
    meta, buffers = fut.result(timeout=10)
    client.close()

Every blocking call has a timeout and raises a named error: :class:`ServiceUnavailable` (no
service at the address, or the connection was lost with the call in flight),
:class:`RequestTimeout` (no reply in time, or no free in-flight slot), :class:`AuthenticationError`
(the service refused the secret, or could not prove it holds it), and for a handler's own
error the same exception type where it is registered (:func:`register_error`: ``ValueError``,
``TypeError``, ``KeyError``, ``IndexError``, and what modules add), else :class:`RemoteError` with
the remote type and message. At most ``max_in_flight`` calls are unanswered at once.
A lost connection is re-made by the next call, with exponential backoff between attempts
(50 ms doubling to 2 s); ``generation`` counts the connections made, so a caller that keeps
per-connection state on the service (a writer session) can tell it must re-open it.
Requests are written from the calling thread (``sendmsg`` of the arrays themselves, on a
duplicate of the socket; the loop thread only reads and handshakes), so ``submit`` returns
once the request has left: its buffers may then change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gearflow.errors import GearflowError
from gearflow.transport import auth
from gearflow.transport import integrity as frames_mac
from gearflow.transport.auth import AuthenticationError, AuthorizationError, IntegrityMismatch
from gearflow.transport.framing import (
    AUTH,
    AUTH_OK,
    CHALLENGE,
    ERROR,
    REPLY,
    REQUEST,
    FramedProtocol,
    FrameError,
    FrameLimits,
    FrameReader,
    encode,
    new_event_loop,
)
from gearflow.transport.records import KeyExchange
from gearflow.transport.tls import pieces

log = logging.getLogger(__name__)

__all__ = ["AuthenticationError", "Client", "RemoteError", "RequestTimeout", "ServiceUnavailable", "as_client",
           "parse_address", "register_error"]  # fmt: skip


class ServiceUnavailable(GearflowError, ConnectionError):
    """No service answers at the address, or the connection was lost while a call was in flight."""


class RequestTimeout(GearflowError, TimeoutError):
    """A call got no reply (or no free in-flight slot) within its timeout."""


class RemoteError(GearflowError):
    """A handler on the service raised an error of a type this side does not map: ``remote_type``
    and the message."""

    def __init__(self, remote_type: str, message: str):
        super().__init__(f"{remote_type}: {message}")
        self.remote_type, self.message = remote_type, message


_ERRORS: dict[str, type] = {c.__name__: c for c in (ValueError, TypeError, KeyError, IndexError, FrameError,
                                                     AuthenticationError, AuthorizationError, IntegrityMismatch,
                                                     ServiceUnavailable)}  # fmt: skip


def register_error(cls: type) -> type:
    """Raise a remote error named ``cls.__name__`` as ``cls(message)`` (usable as a decorator)."""
    _ERRORS[cls.__name__] = cls
    return cls


def remote_exception(meta: dict) -> BaseException:
    name, message = str(meta.get("type", "Error")), str(meta.get("message", ""))
    cls = _ERRORS.get(name)
    return cls(message) if cls is not None else RemoteError(name, message)


def parse_address(address: Any) -> tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` → ``(host, port)``."""
    if isinstance(address, (tuple, list)) and len(address) == 2:
        return str(address[0]), int(address[1])
    text = str(address)
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _tls_write(proto: _ClientProtocol, data: bytes) -> None:
    """In the loop: a frame to a TLS transport (TLS's records), a piece at a time."""
    t = proto.transport
    if t is not None and not t.is_closing():
        for piece in pieces([data]):  # each piece's records leave before the next is encrypted
            t.writelines(piece)


def _poll_out(sock, timeout_s: float) -> bool:
    p = select.poll()
    p.register(sock.fileno(), select.POLLOUT)
    return bool(p.poll(max(1, int(timeout_s * 1000))))


class _ClientProtocol(FramedProtocol):
    def __init__(self, client: Client):
        super().__init__(FrameReader(self._on_frame, client.limits, {CHALLENGE, ERROR}))
        self.client = client
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.nonce = auth.new_nonce()
        self.server_nonce = ""
        self.script = b""  # the handshake's transcript (auth.transcript)
        self.wsock: socket.socket | None = None  # the calling threads' duplicate, for sending
        self.asked = False  # this side closed it (Client.close, a send cut short): not a loss to report

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client.records:  # TLS's handshake and the key exchange; the service's challenge follows
            self.start_records(KeyExchange(self.client._ssl, False, transport.write))

    def records_failed(self, exc: BaseException) -> None:
        if not isinstance(exc, AuthenticationError):  # a settings mismatch is not retried; a failed TLS is
            exc = ServiceUnavailable(f"the connection to {self.client.address_text} failed: {exc}")
        self._fail_handshake(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail_handshake(self, exc: BaseException) -> None:
        if not self.ready.done():
            self.ready.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def _on_frame(self, kind, rid, op, meta, arrays, block) -> None:
        cred, client = self.client._credential, self.client
        if kind == CHALLENGE:
            sn, theirs = meta.get("nonce"), meta.get("integrity")
            if not auth.valid_nonce(sn) or meta.get("version") != auth.PROTOCOL or not isinstance(theirs, bool):
                return self._fail_handshake(AuthenticationError(
                    f"the service at {client.address_text} sent a challenge of another protocol (this side speaks "
                    f"version {auth.PROTOCOL}): upgrade both ends"))
            if theirs != client.integrity:
                on = {True: "true", False: "false"}
                return self._fail_handshake(IntegrityMismatch(
                    f"transport.integrity differs: the service at {client.address_text} has {on[theirs]}, this "
                    f"client {on[client.integrity]}; set the same on both ends (true protects every frame with a MAC)"))
            self.server_nonce = sn
            lim = client.limits  # what this side accepts: the service keeps its replies within it
            limits = [lim.max_frame_bytes, lim.max_meta_bytes, lim.max_buffers, lim.max_dims]
            self.script = auth.transcript(sn, self.nonce, cred.role, cred.name, client.integrity, limits)
            self.reader.kinds = frozenset({AUTH_OK, ERROR})
            self.send(encode(AUTH, 0, "", {"nonce": self.nonce, "role": cred.role, "name": cred.name,
                                           "integrity": client.integrity, "limits": limits,
                                           "mac": auth.client_mac(cred.secret, self.script)}))  # fmt: skip
        elif kind == AUTH_OK:
            if not auth.check(auth.server_mac(cred.secret, self.script), meta.get("mac")):
                return self._fail_handshake(AuthenticationError(
                    f"the service at {client.address_text} did not prove it holds the secret"))
            if client.integrity:  # every later frame, both ways, carries a MAC and a sequence number
                c2s, s2c = auth.frame_keys(cred.secret, self.script, self.server_nonce, self.nonce)
                rows = frames_mac.row_key(cred.secret) if client.row_digests else None  # replies with row digests
                self.reader.opener, self.sealer = frames_mac.Opener(s2c, rows), frames_mac.Sealer(c2s)
            self.reader.kinds = frozenset({REPLY, ERROR})
            self.read_blocks_in_wire_thread()  # a big reply's block: read and MACed by a wire thread
            if not self.ready.done():
                self.ready.set_result(True)
        elif rid == 0 or rid not in self.pending:  # a connection-level error (auth, limits, framing)
            exc = remote_exception(meta)
            if isinstance(exc, RemoteError) or type(exc) is FrameError:
                exc = ServiceUnavailable(f"the service at {self.client.address_text} closed the connection: {exc}")
            self._fail_handshake(exc)
            self._fail_all(exc)
        else:
            fut = self.pending.pop(rid)
            if kind == REPLY:
                fut.set_result((meta, arrays))
            else:
                fut.set_exception(remote_exception(meta))

    def frame_error(self, exc: FrameError) -> None:
        what = "frame integrity check failed" if isinstance(exc, frames_mac.IntegrityError) else "malformed frame"
        log.warning("transport: %s from %s: %s; closing the connection, the frame was not applied", what,
                    self.client.address_text, exc)  # fmt: skip
        err = ServiceUnavailable(f"{what} from {self.client.address_text}: {exc}")
        self.closed = True  # for callers now: one woken by the error below connects afresh, not through this one
        if self.transport is not None:
            self.transport.abort()
        self._fail_handshake(err)
        self._fail_all(err)

    def _fail_all(self, exc: BaseException) -> None:
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        err = ServiceUnavailable(f"connection to {self.client.address_text} lost" + (f": {exc}" if exc else ""))
        self._fail_handshake(err)
        self._fail_all(err)
        self.client._lost(self)


class Client:
    """A connection to a :class:`~gearflow.transport.service.Service` (see the module docstring)."""

    BACKOFF_S = (0.05, 2.0)  # first and longest wait between connection attempts

    def __init__(self, address: Any, token: str | None = None, *, timeout_s: float = 30.0,
                 connect_timeout_s: float = 5.0, max_in_flight: int = 8, limits: FrameLimits | None = None,
                 loop: str = "auto", integrity: bool | None = None, tls: str | None = None,
                 tls_records: str | None = None):  # fmt: skip
        self.host, self.port = parse_address(address)
        self.address_text = f"{self.host}:{self.port}"
        self._credential = auth.credential(auth.resolve_token(token))
        self.role = self._credential.role
        self.integrity = auth.default_integrity() if integrity is None else bool(integrity)
        if self.integrity:
            frames_mac.require()
        # a sample reply's MAC may take its wide rows' digests (the shard keeps them: not read again a send)
        self.row_digests = self.integrity and auth.default_row_digests() and frames_mac.rows_available()
        self.tls = auth.default_tls() if tls is None else str(tls or "")
        self._ssl = None
        if self.tls:  # mutual TLS: frames go through the loop's TLS transport (see _write)
            from gearflow.transport.tls import client_context

            self._ssl = client_context(self.tls)
        mode = auth.default_tls_records() if tls_records is None else auth.tls_records_mode(tls_records)
        # gearflow's records: TLS's handshake, then records of its own (records.py); sent as on plain TCP
        self.records = bool(self._ssl) and self.integrity and mode == "gearflow"
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.limits = limits or FrameLimits()
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be ≥ 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._ids = itertools.count(1)
        self._loop = new_event_loop(loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"gearflow-client-{self.address_text}",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        self._proto: _ClientProtocol | None = None
        self._connect_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._last_error = ""  # why the last connection attempt failed (said while backing off)
        self.generation = 0  # connections made so far
        self.closed = False

    # ----------------------------------------------------------------- connection
    @property
    def connected(self) -> bool:
        p = self._proto
        return p is not None and not p.closed

    def connect(self, timeout_s: float | None = None) -> None:
        """Connect and authenticate now if not connected (with backoff after failures)."""
        self._ensure(time.monotonic() + (self.connect_timeout_s if timeout_s is None else timeout_s))

    def _ensure(self, deadline: float) -> _ClientProtocol:
        p = self._proto
        if p is not None and not p.closed:
            return p
        if self.closed:
            raise ServiceUnavailable(f"client of {self.address_text} is closed")
        with self._connect_lock:
            while True:
                p = self._proto
                if p is not None and not p.closed:
                    return p
                now = time.monotonic()
                wait = self._next_attempt - now
                if wait > 0:
                    if now + wait > deadline:
                        raise ServiceUnavailable(f"no service at {self.address_text} (last attempt: {self._last_error}; "
                                                 f"retrying with backoff, next attempt in {wait:.2f} s)")  # fmt: skip
                    time.sleep(wait)
                if p is not None:
                    self._drop_wsock(p)
                try:
                    fut = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
                    self._proto = fut.result(timeout=max(0.05, min(self.connect_timeout_s, deadline - time.monotonic())))
                    self._backoff = 0.0
                    self.generation += 1
                    return self._proto
                except AuthenticationError:
                    raise
                except (concurrent.futures.TimeoutError, OSError, ServiceUnavailable) as exc:
                    self._last_error = str(exc) or type(exc).__name__
                    lo, hi = self.BACKOFF_S
                    self._backoff = lo if self._backoff == 0 else min(hi, self._backoff * 2)
                    self._next_attempt = time.monotonic() + self._backoff
                    if time.monotonic() >= deadline:
                        raise ServiceUnavailable(f"no service at {self.address_text}: {exc or type(exc).__name__}") from None

    async def _open(self) -> _ClientProtocol:
        loop = asyncio.get_running_loop()
        proto_box: list[_ClientProtocol] = []

        def factory():
            proto_box.append(_ClientProtocol(self))
            return proto_box[0]

        try:
            ssl = None if self.records else self._ssl  # gearflow's records: the protocol runs TLS's handshake
            await asyncio.wait_for(loop.create_connection(factory, self.host, self.port, ssl=ssl,
                                                          server_hostname=self.host if ssl else None),
                                   self.connect_timeout_s)  # fmt: skip
            await asyncio.wait_for(proto_box[0].ready, self.connect_timeout_s)
        except BaseException:
            if proto_box and proto_box[0].transport is not None:
                proto_box[0].transport.abort()
            raise
        proto = proto_box[0]
        # requests are sent from the calling threads on a duplicate of the socket (see _write);
        # the loop only reads. The duplicate shares the non-blocking flag and TCP_NODELAY.
        if self._ssl is None or self.records:
            proto.wsock = socket.socket(fileno=os.dup(proto.transport.get_extra_info("socket").fileno()))
        return proto

    def _drop_wsock(self, proto: _ClientProtocol) -> None:
        with self._send_lock:
            if proto.wsock is not None:
                proto.wsock.close()
                proto.wsock = None

    def _lost(self, proto: _ClientProtocol) -> None:
        """Log a connection the service (or the network) ended; one this side closed is not a loss."""
        if self._proto is proto and not (proto.asked or self.closed):
            log.info("transport: connection to %s lost", self.address_text)

    # ----------------------------------------------------------------- calls
    def submit(self, op: str, meta: dict | None = None, buffers: Sequence[Any] = (), *,
               timeout_s: float | None = None, on_sent: Callable[[], None] | None = None) -> concurrent.futures.Future:
        """Send a request without waiting for its reply: a future of ``(meta, buffers)``. Waits (up
        to ``timeout_s``) for a free in-flight slot and for the connection; the request is sent
        from this thread before it returns (``on_sent()`` is then called: the buffers are free)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if not self._slots.acquire(timeout=max(0.0, timeout_s)):
            raise RequestTimeout(f"{op}: {self.max_in_flight} calls to {self.address_text} still unanswered "
                                 f"after {timeout_s:.1f} s")  # fmt: skip
        try:
            proto = self._ensure(deadline)
            parts = encode(REQUEST, 0, op, meta, buffers, self.limits)  # request id set below
        except BaseException:
            self._slots.release()
            if on_sent is not None:
                on_sent()
            raise
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.add_done_callback(lambda _: self._slots.release())
        rid = next(self._ids)
        parts[0] = parts[0][:8] + rid.to_bytes(8, "little") + parts[0][16:]  # the header's request id
        proto.pending[rid] = fut  # before the first byte leaves: the reply can come at once
        try:
            self._write(proto, parts, deadline, op)
        except BaseException as exc:
            proto.pending.pop(rid, None)
            if not fut.done():
                fut.set_exception(exc)
            raise
        finally:
            if on_sent is not None:
                on_sent()
        if proto.closed and not fut.done():  # lost while we sent: connection_lost may have missed it
            proto.pending.pop(rid, None)
            fut.set_exception(ServiceUnavailable(f"connection to {self.address_text} lost while {op} was sent"))
        return fut

    def _write(self, proto: _ClientProtocol, parts: list, deadline: float, op: str) -> None:
        """Send one whole frame from the calling thread (``sendmsg`` of the parts: the arrays go
        to the kernel without a copy here, and no hand-off to the loop thread), under the send lock
        so frames never interleave. The socket is a duplicate of the transport's (non-blocking:
        a full send buffer is waited on with ``poll``). A frame cut short poisons the stream, so a
        timeout mid-frame closes the connection."""
        with self._send_lock:
            sock = proto.wsock
            tx = proto.send_cipher  # gearflow's records under TLS: encrypted here, in wire order
            tls = self._ssl is not None and tx is None  # TLS's records: the loop's transport encrypts
            if proto.closed or (sock is None and not tls):
                raise ServiceUnavailable(f"connection to {self.address_text} lost before {op} was sent")
            sealer, mac, written = proto.sealer, None, parts
            if sealer is not None:  # sealed here, under the lock: sequence numbers in wire order
                written = proto.begin_frame(parts)
                if not tls and sum(len(p) for p in parts) >= sealer.thread_bytes:
                    # a big request: a MAC thread reads it while sendmsg hands it to the kernel
                    mac = concurrent.futures.Future()
                    sealer.seal_async(parts, mac.set_result)
                else:
                    sealer.update_spans(parts)
                    written = [*written, sealer.trailer()]
            if tls:  # a copy, queued in order
                self._loop.call_soon_threadsafe(_tls_write, proto, b"".join(written))
                return
            try:
                self._send_parts(proto, sock, tx, written, deadline, op)
            finally:
                error = mac.result() if mac is not None else None  # the parts stay untouched until it is done
            if error is not None:
                self._loop.call_soon_threadsafe(self._abort, proto)
                raise ServiceUnavailable(f"{op}: the frame's MAC failed ({error}); the connection to "
                                         f"{self.address_text} is closed")  # fmt: skip
            if mac is not None:
                self._send_parts(proto, sock, tx, [sealer.trailer()], deadline, op, started=True)

    def _send_parts(self, proto: _ClientProtocol, sock, tx, parts: list, deadline: float, op: str,
                    started: bool = False) -> None:  # fmt: skip
        """:meth:`_send_views` of ``parts``; with gearflow's records (``tx``) each piece encrypted
        just before it is sent."""
        if tx is None:
            self._send_views(proto, sock, [memoryview(p) for p in parts], deadline, op, started)
            return
        for piece in tx.seal_iter(parts):
            self._send_views(proto, sock, [memoryview(piece)], deadline, op, started)
            started = True

    def _send_views(self, proto: _ClientProtocol, sock, views: list, deadline: float, op: str,
                    started: bool = False) -> None:  # fmt: skip
        """``sendmsg`` every byte of ``views`` (``started``: bytes of this frame left before)."""
        while views:
            try:
                n = sock.sendmsg(views[:512])
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:  # reset or shut: lost for every caller from now on, though the
                # loop may see it only later (a caller checking ``connected`` must not find it live)
                proto.closed = True
                self._loop.call_soon_threadsafe(self._abort, proto, False)  # its pending calls fail there
                raise ServiceUnavailable(f"connection to {self.address_text} lost sending {op}: {exc}") from None
            started = started or n > 0
            while n and views:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0], n = views[0][n:], 0
            if not views:
                return
            left = deadline - time.monotonic()
            if left <= 0 or not _poll_out(sock, left):
                if started or proto.sealer is not None:  # a sealed frame not sent: the next one's number is off
                    self._loop.call_soon_threadsafe(self._abort, proto)
                raise RequestTimeout(f"{op}: could not send to {self.address_text} in time (the service is not reading)")

    @staticmethod
    def _abort(proto: _ClientProtocol, asked: bool = True) -> None:
        """End ``proto``'s connection (in the loop); ``asked``: this side's choice, not a loss to log."""
        if asked:
            proto.asked = True
        if proto.transport is not None:
            proto.transport.abort()

    def call(self, op: str, meta: dict | None = None, buffers: Sequence[Any] = (), timeout_s: float | None = None):
        """Send a request and wait for its reply ``(meta, buffers)``, at most ``timeout_s``."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        fut = self.submit(op, meta, buffers, timeout_s=timeout_s)
        return self.result(fut, op, max(0.0, deadline - time.monotonic()))

    def result(self, fut: concurrent.futures.Future, op: str, timeout_s: float):
        """``fut``'s reply, or its named error; :class:`RequestTimeout` after ``timeout_s``."""
        # not fut.result(timeout): a remote TimeoutError (RateLimiterTimeout) is also a
        # concurrent.futures.TimeoutError, and must not read as this call's own timeout
        if not concurrent.futures.wait([fut], timeout=timeout_s).done:
            raise RequestTimeout(f"{op}: no reply from {self.address_text} in {timeout_s:.1f} s")
        return fut.result()

    def drop(self) -> None:
        """Abort the current connection now (a host marked down): its unanswered calls fail with
        :class:`ServiceUnavailable` at once, a send waiting on a full buffer too; the next call
        connects afresh."""
        p = self._proto
        if p is None or p.closed:
            return
        if p.wsock is not None:
            try:
                p.wsock.shutdown(socket.SHUT_RDWR)  # wakes a sender polling the silent peer's full buffer
            except OSError:
                pass
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._abort, p)

    def close(self) -> None:
        """Close the connection and stop the loop thread (idempotent)."""
        if self.closed:
            return
        self.closed = True

        def shut():
            if self._proto is not None:
                self._abort(self._proto)

        if self._proto is not None:
            self._drop_wsock(self._proto)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(shut)
            time.sleep(0.01)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_client(address_or_client: Any, token: str | None, timeout_s: float, loop: str) -> tuple[Client, bool]:
    """``(client, owned)``: the :class:`Client` given, or a new one to ``address_or_client`` that
    the caller owns (and closes)."""
    if isinstance(address_or_client, Client):
        return address_or_client, False
    return Client(address_or_client, token, timeout_s=timeout_s, loop=loop), True
