"""An authenticated asyncio service on one TCP port, in a background thread with its own loop.

    service = Service(host="127.0.0.1", port=0, token="s3cret-token")
    service.register("echo", lambda meta, buffers: (meta, buffers))
    port = service.start()            # the bound port (port=0: the OS picks one)
    ...
    service.stop()

Handlers. ``register(name, handler)``: a handler takes ``(meta: dict, buffers: list[np.ndarray])``
(``with_connection=True``: also the :class:`Connection`) and returns ``(meta, buffers)``, or
``(meta, buffers, on_sent)`` where ``on_sent()`` is called once the reply's buffers have left
the transport (until then they must not change), or ``(meta, buffers, on_sent, tail)``: the
last buffer (non-empty) is written only once everything before it has left the process and
``tail()`` has filled it in place — a trailer that can say what happened while the rest was
written (the shard's torn items); no other reply of the connection starts before it — or
``None`` (an empty reply). The request's
buffers are views of a pooled receive buffer: valid only during the call (copy to keep).
Sync handlers run in the service's thread pool (they may block: rate limiters, locks);
``inline=True`` runs a quick one on the loop (no thread hop) — one that finds it would block
raises :class:`Defer` and is called again in the pool with ``deferred=True``; a coroutine
function is awaited on the loop.
A handler's exception becomes an ERROR reply naming its type and message (the client
raises it as that type where it knows it: :func:`gearflow.transport.client.register_error`).
The requests of one connection are handled one after another, in order; several
connections run concurrently.

Limits (:class:`ServiceLimits`): frame sizes (:class:`~gearflow.transport.framing.FrameLimits`),
connections, and requests in flight per connection: a request counts until its reply has
drained, and a connection with ``max_in_flight`` of them is not read any further
(``pause_reading``), so one client holds at most ``max_in_flight + 1`` receive buffers
of at most ``max_frame_bytes`` each. A frame that breaks the format or a limit closes its
connection with a logged reason; a failed handshake too; the service stays up.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gearflow.transport import auth
from gearflow.transport import integrity as frames_mac
from gearflow.transport.framing import (
    AUTH,
    AUTH_OK,
    CHALLENGE,
    ERROR,
    HEADER,
    REPLY,
    REQUEST,
    FramedProtocol,
    FrameError,
    FrameLimits,
    FrameReader,
    encode,
    frame_buffers,
    new_event_loop,
)
from gearflow.transport.limits import ReceivePool, ServiceLimits, service_limits
from gearflow.transport.records import KeyExchange

log = logging.getLogger(__name__)

__all__ = ["ANY_ROLE", "Connection", "Defer", "Handler", "Service", "ServiceLimits", "service_limits"]

ANY_ROLE = (auth.ACTOR, auth.LEARNER)  # register(..., roles=ANY_ROLE): what an actor may call too

# what a peer may send before it has authenticated: one small AUTH frame
_AUTH_LIMITS = FrameLimits(max_frame_bytes=HEADER.size + 1024, max_meta_bytes=1024, max_buffers=1, max_dims=1)


class Defer(Exception):
    """Raised by an ``inline`` handler that would block now: the service calls it again in its
    thread pool, with ``deferred=True``."""


_DEFERRED = object()


@dataclass
class Handler:
    fn: Callable
    inline: bool = False
    with_connection: bool = False
    is_async: bool = False
    roles: frozenset = frozenset({auth.LEARNER})  # the roles whose connections may call it


class Connection:
    """One authenticated client, as a ``with_connection`` handler sees it: ``id``, ``peer``,
    ``role`` (``"learner"`` or ``"actor"``: the secret it proved at the handshake),
    ``actor_name`` (its actor credential's name; ``""`` for a learner), ``peer_limits`` (the
    :class:`FrameLimits` the client accepts: every reply is kept within them, a handler whose
    reply can grow pages it to fit), ``state`` (a dict for the
    handlers' own per-connection data), ``closed``, and :meth:`on_close` (called once, in the
    loop thread, when the connection ends)."""

    _ids = itertools.count(1)

    def __init__(self, peer: str):
        self.id, self.peer = next(self._ids), peer
        self.role, self.actor_name = "", ""  # set by the handshake, before any handler runs
        self.row_key: bytes | None = None  # with integrity: the key of row digests (integrity.row_key)
        self.peer_limits = FrameLimits()  # what the client accepts in a frame (announced at the handshake)
        self.state: dict[str, Any] = {}
        self.closed = False
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, callback: Callable[[], None]) -> None:
        if self.closed:
            callback()
        else:
            self._on_close.append(callback)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for cb in self._on_close:
            try:
                cb()
            except Exception:
                log.exception("transport: on_close callback of connection %s failed", self.peer)


class _ServerProtocol(FramedProtocol):
    def __init__(self, service: Service):
        self.service = service
        limits = service.limits
        self.pool = ReceivePool(limits.max_in_flight + 1, service._allocated, limits.max_queued_bytes)
        super().__init__(FrameReader(self._on_frame, limits.frame, {AUTH}, alloc=self.pool.get))
        self.reader.limits = _AUTH_LIMITS
        self.conn: Connection | None = None
        self.nonce = auth.new_nonce()
        self.authed = False
        self.in_flight = 0
        self.queue: collections.deque = collections.deque()
        self.wakeup: asyncio.Event | None = None
        self.task: asyncio.Task | None = None
        self.timer = None

    # ----------------------------------------------------------------- lifecycle
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        svc = self.service
        peer = transport.get_extra_info("peername")
        self.conn = Connection(f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer))
        svc._protocols.add(self)
        svc._admit_preauth(self)
        svc.counts["connections"] += 1
        self.timer = asyncio.get_running_loop().call_later(svc.limits.auth_timeout_s, self._auth_timeout)
        if svc.records:  # the TLS handshake and key exchange first; the challenge once they are done
            self.start_records(KeyExchange(svc._ssl, True, transport.write))
        else:
            self.records_ready()

    def records_ready(self) -> None:
        self.send(encode(CHALLENGE, 0, "", {"nonce": self.nonce, "version": auth.PROTOCOL, "integrity": self.service.integrity}))

    def records_failed(self, exc: BaseException) -> None:
        self.service._refuse(self.conn.peer, str(exc), auth_failure=True)
        self.transport.abort()

    def _auth_timeout(self) -> None:
        if not self.authed and not self.closed:
            self.service._refuse(self.conn.peer, "no authentication before the timeout", auth_failure=True)
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.service._protocols.discard(self)
        self.service._preauth.pop(self, None)
        if self.authed:
            self.service._authed.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.wakeup is not None:
            self.queue.append(None)
            self.wakeup.set()
        if self.conn is not None:
            self.conn._close()
        self.pool.clear()

    def frame_error(self, exc: FrameError) -> None:
        what = "frame integrity check failed" if isinstance(exc, frames_mac.IntegrityError) else "malformed frame"
        self.service._refuse(self.conn.peer if self.conn else "?", f"{what}: {exc}; closing the connection, "
                             "the frame was not applied", auth_failure=not self.authed)  # fmt: skip
        self.send(encode(ERROR, 0, "", {"type": "FrameError", "message": str(exc)}))
        self.transport.close()

    # ----------------------------------------------------------------- frames
    def _on_frame(self, kind, rid, op, meta, arrays, block) -> None:
        if kind == AUTH:
            self.pool.put(block)
            return self._authenticate(meta)
        self.in_flight += 1
        self.queue.append((rid, op, meta, arrays, block))
        self.wakeup.set()
        if self._over_limits() and not self.reader.hold:
            self.reader.hold = True
            self.transport.pause_reading()

    def _over_limits(self) -> bool:
        """The connection holds its in-flight requests or queued bytes: read no further for now."""
        limits = self.service.limits
        return self.in_flight >= limits.max_in_flight or self.pool.in_use >= limits.max_queued_bytes

    def _authenticate(self, meta: dict) -> None:
        """Check the client's AUTH (see :mod:`gearflow.transport.auth`): its role's secret, then that
        both ends agree on frame integrity; on success the connection's role is set, AUTH_OK sent,
        and (integrity on) every later frame in either direction carries a MAC under its own key."""
        svc = self.service
        cn, mac, role, name, wants = (meta.get(k) for k in ("nonce", "mac", "role", "name", "integrity"))
        secret = auth.role_secret(svc._secret, role, name) if isinstance(wants, bool) else None
        limits, bad = _peer_limits(meta.get("limits"))
        script = (auth.transcript(self.nonce, cn, role, name, wants, meta.get("limits"))
                  if secret is not None and auth.valid_nonce(cn) and not bad else b"")  # fmt: skip
        if not script or not auth.check(auth.client_mac(secret, script), mac):
            if bad:
                return self._refuse_auth("FrameError", bad, bad)
            return self._refuse_auth("AuthenticationError", "authentication failed",
                                     "authentication failed (wrong secret, unknown role or replayed handshake)")
        if wants != svc.integrity:
            return self._refuse_auth("IntegrityMismatch", _mismatch(svc.integrity, wants, "the service", "this client"),
                                     _mismatch(svc.integrity, wants, "this service", "the client"))  # fmt: skip
        if not svc._admit_authed(self):
            self.send(encode(ERROR, 0, "", {"type": "ServiceUnavailable", "message": "the service is at its connection limit"}))
            self.transport.close()
            self.reader.hold = True
            return
        self.authed = True
        self.timer.cancel()
        self.conn.role, self.conn.actor_name, self.conn.peer_limits = role, name, limits
        self.reader.kinds = frozenset({REQUEST})
        self.reader.limits = svc.limits.frame
        self.send(encode(AUTH_OK, 0, "", {"mac": auth.server_mac(secret, script)}))
        if svc.integrity:
            c2s, s2c = auth.frame_keys(secret, script, self.nonce, cn)
            self.reader.opener, self.sealer = frames_mac.Opener(c2s), frames_mac.Sealer(s2c)
            self.conn.row_key = frames_mac.row_key(secret)  # a sample reply's row digests (asked for)
        self.wakeup = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def _refuse_auth(self, kind: str, told: str, logged: str) -> None:
        self.service._refuse(self.conn.peer, logged, auth_failure=True)
        self.send(encode(ERROR, 0, "", {"type": kind, "message": told}))
        self.transport.close()
        self.reader.hold = True

    # ----------------------------------------------------------------- requests
    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        svc = self.service
        while True:
            if not self.queue:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            item = self.queue.popleft()
            if item is None or self.closed:
                return
            rid, op, meta, arrays, block = item
            h = svc._handlers.get(op)
            on_sent = tail = spans = None
            try:
                if h is None:
                    raise KeyError(f"no handler for message type {op!r} (registered: {sorted(svc._handlers)[:20]})")
                if self.conn.role not in h.roles:
                    svc.counts["forbidden"] += 1
                    log.warning("transport: %s refused %s from %s: the %s role may not call it", svc.name, op[:128],
                                self.conn.peer, self.conn.role)  # fmt: skip
                    raise auth.AuthorizationError(f"{op} needs the {' or '.join(sorted(h.roles))} role; this connection "
                                                  f"proved the {self.conn.role} secret")  # fmt: skip
                args = (meta, arrays, self.conn) if h.with_connection else (meta, arrays)
                if h.is_async:
                    result = await h.fn(*args)
                else:
                    result = _DEFERRED
                    if h.inline:
                        try:
                            result = h.fn(*args)
                        except Defer:  # it would block: run it off the loop instead
                            pass
                    if result is _DEFERRED:
                        result = await loop.run_in_executor(svc._pool, functools.partial(h.fn, *args, deferred=True)
                                                            if h.inline else functools.partial(h.fn, *args))  # fmt: skip
                if result is None:
                    meta_out, bufs = {}, []
                elif len(result) == 4:
                    meta_out, bufs, on_sent, tail = result
                elif len(result) == 3:
                    meta_out, bufs, on_sent = result
                else:
                    meta_out, bufs = result
                spans = [] if self.sealer is not None else None
                try:  # within what the client accepts: an oversized reply is an error reply, not a dropped connection
                    parts = encode(REPLY, rid, op, meta_out, bufs, self.conn.peer_limits, spans=spans)
                except FrameError as exc:
                    svc.counts["oversized"] += 1
                    raise FrameError(f"the reply to {op[:128]} breaks the limits this client accepts ({exc}); "
                                     "nothing was sent") from None  # fmt: skip
                svc.counts["requests"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the handler's error goes back to the caller
                if on_sent is not None:
                    on_sent()
                    on_sent = None
                tail = None
                name = type(exc).__name__
                message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
                log.debug("transport: %s from %s failed: %s: %s", op, self.conn.peer, name, message)
                spans = None  # (a message is cut to fit the client's envelope limit: JSON escapes take ≤ 6 B a char)
                cut = min(4000, (self.conn.peer_limits.max_meta_bytes - 1024) // 6)
                parts = encode(ERROR, rid, op, {"type": name, "message": str(message)[:cut]})
                svc.counts["errors"] += 1
            finally:
                del arrays
                self.pool.put(block)
            if tail is None:
                self.send(parts, functools.partial(self._replied, on_sent), spans=spans)
                continue
            # the last buffer is written once the rest has drained (left the process) and
            # ``tail`` has filled it; no other reply may start before it on this connection
            done = loop.create_future()
            self.send(parts[:-1], functools.partial(self._tail, tail, parts[-1], on_sent, done, (parts[0], bufs)),
                      more=True, spans=spans if spans is None else spans[:-1])  # fmt: skip
            await done

    def _tail(self, tail: Callable[[], None], last, on_sent, done: asyncio.Future, frame: tuple) -> None:
        try:
            tail()
            if self.sealer is not None and frame[1][-1].any():
                self._reseal(tail, *frame)
        except Exception:  # its reply cannot be completed truthfully: end the connection
            log.exception("transport: completing a reply to %s failed; closing the connection", self.conn.peer)
            self.transport.close()
        self.send([last], functools.partial(self._replied, on_sent))
        if not done.done():
            done.set_result(None)

    def _reseal(self, tail: Callable[[], None], head: bytes, bufs: list) -> None:
        """The reply's tail marked torn items (its last buffer, ``bufs[-1]``): its MAC again without
        their rows (:func:`~gearflow.transport.integrity.masked_frame`), ``tail()`` again after each
        pass, until a pass's marks are the marks after it (at most ``RESEAL_PASSES``; then every
        item is marked: what is left never changes). The trailer is finalised once, after."""
        marks = np.asarray(bufs[-1])
        pieces = frame_buffers(bufs)
        for _ in range(frames_mac.RESEAL_PASSES):
            used = marks.copy()
            self.sealer.restart()
            self.sealer.update_spans(list(frames_mac.masked_frame([head], pieces, used)))
            tail()
            if np.array_equal(used, marks):
                return
        marks[:] = 1
        self.sealer.restart()
        self.sealer.update_spans(list(frames_mac.masked_frame([head], pieces, marks)))

    def _replied(self, on_sent: Callable[[], None] | None) -> None:
        """A reply has drained: its request no longer counts; reading resumes below the limit."""
        if on_sent is not None:
            on_sent()
        self.in_flight -= 1
        if self.reader.hold and not self._over_limits() and not self.closed:
            try:
                self.reader.resume()
            except FrameError as exc:
                return self.frame_error(exc)
            if not self.reader.hold:
                self.transport.resume_reading()


MIN_PEER_META_BYTES = 8 << 10  # a client must accept envelopes this big (an error reply's message is cut to fit)


def _peer_limits(announced) -> tuple[FrameLimits, str]:
    """The frame limits a client announced at the handshake (``[max_frame_bytes, max_meta_bytes,
    max_buffers, max_dims]``; None: the defaults), or the defaults and why they are refused."""
    if announced is None:
        return FrameLimits(), ""
    names = ("max_frame_bytes", "max_meta_bytes", "max_buffers", "max_dims")
    if not (isinstance(announced, list) and len(announced) == 4 and all(type(n) is int for n in announced)):
        return FrameLimits(), f"the client's frame limits must be 4 ints ({', '.join(names)}), got {str(announced)[:80]}"
    if announced[1] < MIN_PEER_META_BYTES or announced[2] < 4 or announced[3] < 1:
        return FrameLimits(), (f"the client's frame limits {announced} are too small to answer it (max_meta_bytes ≥ "
                               f"{MIN_PEER_META_BYTES}, max_buffers ≥ 4, max_dims ≥ 1)")  # fmt: skip
    try:
        return FrameLimits(*announced), ""
    except ValueError as exc:
        return FrameLimits(), f"the client's frame limits are invalid: {exc}"


def _mismatch(ours: bool, theirs: bool, us: str, them: str) -> str:
    on = {True: "true", False: "false"}
    return (f"transport.integrity differs: {us} has {on[ours]}, {them} {on[theirs]}; set the same on both ends "
            "(true protects every frame with a MAC)")


class Service:
    """The TCP service: handlers registered by name, served on ``host:port`` by a loop in a
    background thread (see the module docstring)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None, *,
                 limits: ServiceLimits | None = None, loop: str = "auto", name: str = "gearflow",
                 integrity: bool | None = None, tls: str | None = None, tls_records: str | None = None):  # fmt: skip
        self.host, self.port, self.name = host, int(port), name
        self._secret = auth.resolve_token(token)
        if auth.credential(self._secret).role != auth.LEARNER:
            raise ValueError("a service holds the learner's secret; this is an actor credential (gfa1.…)")
        self.integrity = auth.default_integrity() if integrity is None else bool(integrity)
        if self.integrity:
            frames_mac.require()  # a missing libcrypto fails here, with how to fix it
        self.tls = auth.default_tls() if tls is None else str(tls or "")
        self._ssl = None
        if self.tls:  # mutual TLS (transport.tls): missing or bad files fail here, naming them
            from gearflow.transport.tls import server_context

            self._ssl = server_context(self.tls)
        mode = auth.default_tls_records() if tls_records is None else auth.tls_records_mode(tls_records)
        # gearflow's records: the TLS handshake on each connection, then its own records (records.py)
        self.records = bool(self._ssl) and self.integrity and mode == "gearflow"
        self.limits = limits or ServiceLimits()
        self.loop_kind = loop
        new_event_loop(loop).close()  # an unknown or missing loop kind fails here, not in the thread
        self._handlers: dict[str, Handler] = {}
        self._protocols: set[_ServerProtocol] = set()  # every open socket
        self._preauth: dict[_ServerProtocol, None] = {}  # not yet authenticated, oldest first
        self._authed: set[_ServerProtocol] = set()  # authenticated: at most limits.max_connections
        self._refusals: dict[str, Any] = {"logged_at": None, "unlogged": 0, "last": "", "timer": None}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.stopping = False
        self.counts = collections.Counter()  # connections, requests, errors, refused, auth_refused
        self.block_bytes = 0  # receive buffer blocks allocated and not dropped, all connections
        self.peak_block_bytes = 0  # the most block_bytes has been
        self.register("ping", lambda meta, buffers: ({"pong": True, "service": self.name}, []), inline=True, roles=ANY_ROLE)

    # ----------------------------------------------------------------- handlers
    def register(self, name: str, handler: Callable, *, inline: bool = False, with_connection: bool = False,
                 roles=(auth.LEARNER,)) -> None:  # fmt: skip
        """Serve message type ``name`` with ``handler`` (see the module docstring) to connections of
        ``roles`` (default: the learner's only; :data:`ANY_ROLE` for what an actor may call too)."""
        roles = frozenset(roles)
        if not roles or not roles <= set(auth.ROLES):
            raise ValueError(f"roles must be some of {auth.ROLES}, got {sorted(roles)}")
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ValueError(f"a message type is a non-empty string of at most 128 characters, got {name!r}")
        if name in self._handlers:
            raise ValueError(f"message type {name!r} already has a handler")
        self._handlers[name] = Handler(handler, inline, with_connection, inspect.iscoroutinefunction(handler), roles)

    @property
    def handlers(self) -> list[str]:
        return sorted(self._handlers)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> int:
        """Bind and serve in a background thread; returns the bound port. A stopped service
        starts again on the same port."""
        if self._thread is not None:
            raise RuntimeError("the service is already running")
        self.stopping = False
        self._pool = concurrent.futures.ThreadPoolExecutor(self.limits.max_connections + 2,
                                                           thread_name_prefix=f"{self.name}-handler")  # fmt: skip
        self._loop = new_event_loop(self.loop_kind)
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"{self.name}-service", daemon=True)
        self._thread.start()
        try:
            self.port = ready.result(timeout=30)
        except BaseException:
            self._thread.join(timeout=5)
            self._thread = None
            raise
        log.info("transport: %s serving on %s:%d (%s loop)", self.name, self.host, self.port, type(self._loop).__module__.split(".")[0])
        return self.port

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)

        async def serve():
            ssl = None if self.records else self._ssl  # gearflow's records: each protocol runs TLS's handshake
            self._server = await loop.create_server(lambda: _ServerProtocol(self), self.host, self.port,
                                                    reuse_address=True, ssl=ssl,
                                                    ssl_handshake_timeout=self.limits.auth_timeout_s if ssl else None)  # fmt: skip
            return self._server.sockets[0].getsockname()[1]

        try:
            ready.set_result(loop.run_until_complete(serve()))
        except BaseException as exc:
            ready.set_exception(exc)
            loop.close()
            return
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self) -> None:
        """Close the listening socket and every connection, stop the loop and its thread. A
        handler still running is told by :attr:`stopping` (the shard's blocked inserts poll it)."""
        if self._thread is None:
            return
        self.stopping = True
        loop = self._loop

        async def shutdown():
            self._server.close()
            for p in list(self._protocols):
                if p.transport is not None:
                    p.transport.abort()
            await asyncio.sleep(0)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("transport: %s did not shut down cleanly in 10 s", self.name)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._thread = self._loop = self._server = None
        log.info("transport: %s on port %d stopped", self.name, self.port)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def __enter__(self) -> Service:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----------------------------------------------------------------- accounting
    def _admit_preauth(self, proto: _ServerProtocol) -> None:
        """A new socket joins the pre-auth pool; when the pool is full its oldest member (the
        one that has idled longest without logging in) is dropped for it."""
        self._preauth[proto] = None
        while len(self._preauth) > self.limits.max_preauth:
            oldest = next(iter(self._preauth))
            del self._preauth[oldest]
            self._refuse(oldest.conn.peer, f"pre-auth pool full ({self.limits.max_preauth}): the oldest socket not "
                                           f"logged in is dropped for a new one", auth_failure=True)  # fmt: skip
            oldest.transport.abort()

    def _admit_authed(self, proto: _ServerProtocol) -> bool:
        """A socket that has logged in leaves the pre-auth pool and takes a connection slot, if one is free."""
        self._preauth.pop(proto, None)
        if len(self._authed) >= self.limits.max_connections:
            self._refuse(proto.conn.peer, f"connection limit ({self.limits.max_connections}) reached")
            return False
        self._authed.add(proto)
        return True

    def _refuse(self, peer: str, why: str, auth_failure: bool = False) -> None:
        """Count a refusal; log it, at most one line per ``refusal_log_interval_s`` (the line after
        a quiet spell says how many were refused meanwhile)."""
        self.counts["auth_refused" if auth_failure else "refused"] += 1
        r = self._refusals
        now = time.monotonic()
        if r["logged_at"] is None or now - r["logged_at"] >= self.limits.refusal_log_interval_s:
            more = f" (and {r['unlogged']} more refused in the last {now - r['logged_at']:.0f} s)" if r["unlogged"] else ""
            log.warning("transport: %s refused %s: %s%s", self.name, peer, why, more)
            r["logged_at"], r["unlogged"] = now, 0
            return
        r["unlogged"] += 1
        r["last"] = f"{peer}: {why}"
        if r["timer"] is None and self._loop is not None:
            left = self.limits.refusal_log_interval_s - (now - r["logged_at"])
            r["timer"] = self._loop.call_later(max(left, 0.0), self._flush_refusals)

    def _flush_refusals(self) -> None:
        r = self._refusals
        r["timer"] = None
        if r["unlogged"]:
            log.warning("transport: %s refused %d more connections in the last %.0f s (the last: %s)", self.name,
                        r["unlogged"], time.monotonic() - r["logged_at"], r["last"])  # fmt: skip
            r["logged_at"], r["unlogged"] = time.monotonic(), 0

    def _allocated(self, n: int) -> None:  # each connection's ReceivePool reports here
        self.block_bytes += n
        self.peak_block_bytes = max(self.peak_block_bytes, self.block_bytes)

    def buffer_bytes(self) -> int:
        """Bytes of receive buffers the service holds now (pooled buffer blocks and each
        connection's staging buffer): what clients can make it allocate."""
        return sum(p.pool.nbytes + p.reader.staging_bytes for p in list(self._protocols))

    def stats(self) -> dict[str, int]:
        return {
            "transport/connections_open": len(self._authed),
            "transport/preauth_open": len(self._preauth),
            "transport/connections": self.counts["connections"],
            "transport/requests": self.counts["requests"],
            "transport/errors": self.counts["errors"],
            "transport/refused": self.counts["refused"],
            "transport/auth_refused": self.counts["auth_refused"],
            "transport/forbidden": self.counts["forbidden"],
            "transport/replies_oversized": self.counts["oversized"],
            "transport/buffer_bytes": self.buffer_bytes(),
            "transport/in_flight": sum(p.in_flight for p in list(self._protocols)),
            "transport/paused": sum(1 for p in list(self._protocols) if p.reader.hold and not p.closed),
            "transport/replies_unsent": sum(p.replies_unsent for p in list(self._protocols)),
            "transport/peak_block_bytes": self.peak_block_bytes,
        }

    def call_soon(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` in the service's loop thread (thread-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(fn, *args)
