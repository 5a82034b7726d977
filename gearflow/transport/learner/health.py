"""Which shard nodes answer: a dead host is marked down after one timeout, not waited on again.

A host that dies whole (power, kernel, a partitioned network) sends no RST: every call to it
waits its full timeout. The learner's pieces over shard nodes (the sampler, the weights' push,
the progress poll, the run's end) share one :class:`NodeHealth`: the first of them whose call
times out (or whose connection is refused or lost) marks the node down; from then on none of
them sends it anything — the sampler's split leaves it out, its priority updates are dropped,
``run.progress``, ``params.push`` and ``run.stop`` skip it — and their connections to it are
dropped (their unanswered calls fail at once). A background thread re-probes each down node
(a fresh connection and ``replay.total`` every ``probe_every_s``, each bounded by
``probe_timeout_s``) and re-admits it the moment it answers (a node restarted on its address,
a host back from a pause)::

    health = NodeHealth(addresses, token, probe_timeout_s=5.0)
    health.on_change(sampler.node_changed)      # called (index, up) from the marking thread
    if not health.is_down(i): ...               # send to node i
    health.mark_down(i, exc)                    # a call to node i timed out / was refused
    health.lost()                               # nodes down now: {address: why}
    health.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from gearflow.transport.ops import RPC

log = logging.getLogger("gearflow.runner")

__all__ = ["NodeHealth"]


class NodeHealth:
    """Up/down state of the shard nodes ``addresses`` (index = position), shared by the learner's
    sampler, publisher and poll (see the module docstring)."""

    def __init__(self, addresses: Sequence[str], token: str | None, *, probe_every_s: float = 1.0,
                 probe_timeout_s: float = 5.0, loop: str = "auto"):  # fmt: skip
        self.addresses = [str(a) for a in addresses]
        self.token, self.loop = token, loop
        self.probe_every_s, self.probe_timeout_s = float(probe_every_s), float(probe_timeout_s)
        self._lock = threading.Lock()
        self._down: dict[int, tuple[float, str]] = {}  # index -> (wall-clock time marked down, why)
        self.downs = [0] * len(self.addresses)  # times each node was marked down
        self._listeners: list[Callable[[int, bool], None]] = []
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- state
    def is_down(self, i: int) -> bool:
        return i in self._down

    def live(self) -> list[int]:
        return [i for i in range(len(self.addresses)) if i not in self._down]

    def on_change(self, fn: Callable[[int, bool], None]) -> None:
        """``fn(index, up)`` after a node is marked down (``up=False``) or re-admitted (``True``)."""
        self._listeners.append(fn)

    def mark_down(self, i: int, exc: BaseException | str) -> bool:
        """Node ``i`` did not answer (``exc``): down until a probe gets a reply. True if it was up."""
        with self._lock:
            if i in self._down or self._closed:
                return False
            self._down[i] = (time.time(), str(exc))
            self.downs[i] += 1
        others = len(self.addresses) - len(self._down)
        log.warning("shard node %s is down (%s): left out of the sampling split, the weights' push and the "
                    "progress poll; the learner goes on with %d other node(s) and re-probes it every %.0f s",
                    self.addresses[i], exc, others, self.probe_every_s)  # fmt: skip
        self._notify(i, False)
        self._ensure_thread()
        self._wake.set()
        return True

    def mark_up(self, i: int) -> None:
        with self._lock:
            was = self._down.pop(i, None)
        if was is not None:
            log.warning("shard node %s answers again after %.1f s down: back in the sampling split",
                        self.addresses[i], time.time() - was[0])  # fmt: skip
            self._notify(i, True)

    def lost(self) -> dict[str, str]:
        """The nodes down now: ``{address: "down since HH:MM:SS UTC: why"}``."""
        with self._lock:
            items = sorted(self._down.items())
        return {self.addresses[i]: f"down since {time.strftime('%H:%M:%S', time.gmtime(t))} UTC: {why}"
                for i, (t, why) in items}  # fmt: skip

    def _notify(self, i: int, up: bool) -> None:
        for fn in list(self._listeners):
            try:
                fn(i, up)
            except Exception as exc:  # noqa: BLE001 - one listener's error must not stop the others
                log.debug("node health listener: %s", exc)

    # ----------------------------------------------------------------- probing
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._probe_loop, name="gearflow-node-probe", daemon=True)
                self._thread.start()

    def _probe_loop(self) -> None:
        while not self._closed:
            for i in sorted(self._down):
                if self._closed:
                    return
                if self.probe(i):
                    self.mark_up(i)
            self._wake.wait(self.probe_every_s)
            self._wake.clear()

    def probe(self, i: int) -> bool:
        """One ``replay.total`` to node ``i`` on a fresh connection, within ``probe_timeout_s``."""
        from gearflow.errors import GearflowError
        from gearflow.transport.client import Client

        c = Client(self.addresses[i], self.token, timeout_s=self.probe_timeout_s,
                   connect_timeout_s=self.probe_timeout_s, loop=self.loop)  # fmt: skip
        try:
            c.call(RPC.REPLAY_TOTAL, timeout_s=self.probe_timeout_s)
            return True
        except (GearflowError, OSError) as exc:
            log.debug("probe of shard node %s: %s", self.addresses[i], exc)
            return False
        finally:
            c.close()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout_s + 2)
