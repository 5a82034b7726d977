"""A TCP relay on loopback between a client and a service: the tests that stand between the two
ends (tamper with frames, record what a service sends, go silent as a host whose link is down)
subclass :class:`LoopbackRelay` and say how a direction is pumped."""

from __future__ import annotations

import socket
import threading
from typing import Any


class LoopbackRelay:
    """Listens on an ephemeral loopback port (``port``, ``address``); each connection is joined to
    ``upstream`` (a port on loopback, or ``(host, port)``) and each direction, ``"c2s"`` and
    ``"s2c"``, is pumped by :meth:`pump` in its own thread, with what :meth:`connected` returned
    for that connection. A subclass sets its own attributes before calling ``__init__``: a
    connection may come as soon as the listener is up. :meth:`close` closes the listener and
    every socket."""

    def __init__(self, upstream: int | tuple[str, int]):
        self.upstream = ("127.0.0.1", upstream) if isinstance(upstream, int) else tuple(upstream)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            self.socks += [down, up]
            state = self.connected()
            for src, dst, direction in ((down, up, "c2s"), (up, down, "s2c")):
                threading.Thread(target=self.pump, args=(src, dst, direction, state), daemon=True).start()

    def connected(self) -> Any:
        """A new connection's state, handed to both of its pumps (default None)."""
        return None

    def pump(self, src: socket.socket, dst: socket.socket, direction: str, state: Any) -> None:
        raise NotImplementedError

    @staticmethod
    def shut(*socks: socket.socket) -> None:
        """Shut both ways down (the other end sees the connection end), errors ignored."""
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()
