"""Remote actors: actor processes on other machines that join a ``gearflow train`` run over TCP.

With ``actor.remote_actors = K``, the last ``K`` of the run's ``actor.num_actors`` actors are
not started here: the learner serves its replay table and parameter store through a
:class:`~gearflow.transport.shard.ShardService` on ``transport.host:transport.port`` and
waits for them (``gearflow actor --connect HOST:PORT CONFIG``, :mod:`gearflow.actors.remote`)::

    remote = RemoteActors(cfg, table, params, {2: parts_2, 3: parts_3})
    port = remote.start()                       # logs the address and the actors' command
    remote.drain(progress); remote.check()      # in the learner loop, as LocalLauncher
    remote.stop(); remote.close()               # joined actors are told the run is over

Besides the shard's own messages (``replay.*``, ``params.get``) the service answers:

* ``run.join`` — a remote actor process asks for a place: the learner gives it a free remote
  actor index (or the one it asks for), its partitions and the run's resolved config (YAML:
  the learner's config is the one the table was built for). The place is the connection's:
  it is freed when the connection closes, and a restarted actor gets it back.
* ``run.report`` — what a local actor puts on its metrics queue (``episode``, ``counters``,
  ``error`` dicts, :func:`~gearflow.actors.process.run_actor_process`), as JSON, folded into
  the run's progress by :meth:`drain`. The reply says whether the run is over (``stop``).

A lost remote actor is logged and its place waits for it; the learner keeps training on
what the table holds (it has no process to restart: the remote side restarts its own).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Mapping

import numpy as np
from omegaconf import DictConfig

from gearflow.config import to_yaml
from gearflow.errors import ConfigError

log = logging.getLogger("gearflow.runner")

__all__ = ["RemoteActors", "REPORT_TYPES"]

REPORT_TYPES = ("episode", "counters", "error")
MAX_REPORTS = 4096  # messages of one run.report (a second's episodes of a fast actor fit many times)


class RemoteActors:
    """Serves ``table`` and ``params`` to the remote actors ``partitions`` (actor index →
    its partitions) and folds what they report into the run's progress."""

    def __init__(self, cfg: DictConfig, table, params, partitions: Mapping[int, np.ndarray]):
        from gearflow.transport.auth import resolve_token
        from gearflow.transport.shard import ShardService

        t = cfg.transport
        try:
            token = resolve_token(t.token or None).decode()
        except ValueError as exc:
            raise ConfigError(f"actor.remote_actors={len(partitions)}: {exc}") from None
        self.cfg_yaml = to_yaml(cfg)
        self.partitions = {int(a): np.asarray(p, dtype=np.int64) for a, p in partitions.items()}
        every = sorted(int(p) for parts in self.partitions.values() for p in parts)
        self.shard = ShardService(table, params=params, partitions=every, host=str(t.host), port=int(t.port),
                                  token=token, loop=str(t.loop))  # fmt: skip
        self.shard.service.register("run.join", self._join, with_connection=True)
        self.shard.service.register("run.report", self._report, with_connection=True, inline=True)
        self.reports: queue.SimpleQueue = queue.SimpleQueue()
        self.errors: dict[int, str] = {}  # last line of each remote actor's last traceback
        self.joined: dict[int, str] = {}  # actor index -> peer
        self._lock = threading.Lock()
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        port = self.shard.start()
        host = self.shard.service.host
        log.info("waiting for %d remote actor(s) (indices %s) on %s:%d: run gearflow actor --connect %s:%d CONFIG "
                 "(with the same transport.token / $GEARFLOW_TOKEN)", len(self.partitions), sorted(self.partitions),
                 host, port, host, port)  # fmt: skip
        return port

    @property
    def port(self) -> int:
        return self.shard.port

    def check(self) -> int:
        """Nothing to restart here (a remote actor's machine restarts it): always 0."""
        return 0

    def drain(self, progress) -> None:
        """Fold what remote actors reported into ``progress`` (as LocalLauncher.drain)."""
        while True:
            try:
                msg = self.reports.get_nowait()
            except queue.Empty:
                return
            kind, actor = msg["type"], int(msg["actor"])
            if kind == "episode":
                progress.add_episode(actor, float(msg["actor/episode_return"]))
            elif kind == "counters":
                progress.actor_counters[actor] = msg
            else:
                log.error("remote actor %d raised:\n%s", actor, msg.get("error"))
                lines = str(msg.get("error", "")).strip().splitlines()
                self.errors[actor] = lines[-1] if lines else "?"

    def stop(self, drain: Callable[[], None] = lambda: None, timeout: float = 5.0) -> None:
        """Tell joined actors the run is over (their next report's reply says so) and give them
        ``timeout`` seconds to leave (their final reports are drained meanwhile)."""
        self._stopping = True
        self.shard.service.stopping = True  # inserts the rate limiter holds give up (InsertAborted)
        deadline = time.monotonic() + timeout
        while self.joined and time.monotonic() < deadline:
            drain()
            time.sleep(0.05)
        drain()

    def close(self) -> None:
        self._stopping = True
        self.shard.stop()

    # ------------------------------------------------------------------ handlers
    def _join(self, meta: dict, bufs, conn):
        if self._stopping:
            return {"stop": True}, []
        want = meta.get("actor")
        if want is not None and (type(want) is not int or want not in self.partitions):
            raise ValueError(f"actor {want!r} is not a remote actor of this run (remote actors: {sorted(self.partitions)})")
        with self._lock:
            free = [a for a in sorted(self.partitions) if a not in self.joined]
            if want is not None:
                if want not in free:
                    raise ValueError(f"remote actor {want} is already joined (from {self.joined[want]})")
                actor = want
            elif free:
                actor = free[0]
            else:
                raise ValueError(f"all {len(self.partitions)} remote actor places are taken "
                                 f"({', '.join(f'{a}: {p}' for a, p in sorted(self.joined.items()))})")  # fmt: skip
            self.joined[actor] = str(conn.peer)
        conn.state["actor"] = actor
        conn.on_close(lambda: self._left(actor))
        log.info("remote actor %d joined from %s: partitions %s", actor, conn.peer, self.partitions[actor].tolist())
        return {"actor": actor, "partitions": self.partitions[actor].tolist(), "config": self.cfg_yaml}, []

    def _left(self, actor: int) -> None:
        with self._lock:
            peer = self.joined.pop(actor, None)
        if not self._stopping:
            log.warning("remote actor %d (%s) left; its place waits for it, the learner goes on", actor, peer)

    def _report(self, meta: dict, bufs, conn):
        actor = conn.state.get("actor")
        if actor is None:
            raise ValueError("run.report before run.join on this connection")
        msgs = meta.get("messages")
        if not isinstance(msgs, list) or len(msgs) > MAX_REPORTS:
            raise ValueError(f"run.report: messages must be a list of at most {MAX_REPORTS} dicts")
        for m in msgs:
            if not isinstance(m, dict) or m.get("type") not in REPORT_TYPES:
                raise ValueError(f"run.report: each message is a dict whose type is one of {REPORT_TYPES}")
            if m["type"] == "episode" and not isinstance(m.get("actor/episode_return"), (int, float)):
                raise ValueError("run.report: an episode message needs a numeric actor/episode_return")
        for m in msgs:
            m["actor"] = actor  # a connection reports for the place it joined, nothing else
            self.reports.put(m)
        return {"stop": self._stopping}, []
