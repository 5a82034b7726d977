"""Remote actors: actor processes on other machines that join a ``gearflow train`` run over TCP.

With ``actor.remote_actors = K``, the last ``K`` of the run's ``actor.num_actors`` actors are
not started here: a **shard process** attaches the run's replay segment and parameter store
by name (as a local actor process does), serves them with a
:class:`~gearflow.transport.server.shard.ShardService` (``learners=False``: the learner samples its
own table) on ``transport.host:transport.port``, and waits for them
(``gearflow actor --connect HOST:PORT CONFIG``, :mod:`gearflow.actors.connect`)::

    remote = RemoteActors(cfg, table, params, {2: parts_2, 3: parts_3})
    port = remote.start()                       # logs the address and the actors' command
    remote.drain(progress); remote.check()      # in the learner loop, as LocalLauncher
    remote.stop(drain=...); remote.close()      # joined actors are told the run is over

Its own process, so that decoding frames and writing remote actors' steps never compete with
the learner for its interpreter lock (in the learner's process the service halved the
learner's updates/s on a 2-core machine). Besides the shard's messages (``replay.*``,
``params.get``) the service answers:

* ``run.join`` — a remote actor process asks for a place: it gets a free remote actor index
  (or the one it asks for), its partitions and the run's resolved config (YAML: the table
  was built for the learner's config). The place is the connection's: it is freed when the
  connection closes, and a restarted actor gets it back. ``{"stop": true}`` once the run is over.
* ``run.report`` — what a local actor puts on its metrics queue (``episode``, ``counters``,
  ``error`` dicts, :func:`~gearflow.actors.process.run_actor_process`), as JSON; the reply
  says whether the run is over (``stop``).

Reports, joins and departures reach the learner on one queue, folded into the run's
progress by :meth:`RemoteActors.drain` (as :class:`~gearflow.roles.actor_processes.LocalLauncher`
does). A lost remote actor is logged and its place waits for it; the learner keeps training
on what the table holds. A shard process that dies is restarted on the same port (up to
``actor.max_restarts`` times): remote actors reconnect and rejoin by themselves.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import numpy as np
from omegaconf import DictConfig

from gearflow.actors.process import stop_processes
from gearflow.config import to_yaml
from gearflow.errors import ConfigError, GearflowError
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED
from gearflow.reports import check_report, fold_report, queued
from gearflow.roles.actor_processes import ActorFailed
from gearflow.transport.ops import RPC

log = logging.getLogger("gearflow.runner")

__all__ = ["REPORT_TYPES", "Members", "RemoteActors", "serve_remote_actors"]

REPORT_TYPES = ("episode", "counters", "error")
# how long the shard process waits, once the run is over, for joined actors to hear it (their next
# run.report, about once a second) and leave: an actor still building its env and agent on a loaded
# machine reported 5 s late and found no service (exit 2); a normal end waits about a second
LEAVE_S = 30.0
MAX_REPORTS = 4096  # messages of one run.report (a second's episodes of a fast actor fit many times)
START_TIMEOUT_S = 60.0


class RemoteActors:
    """The shard process serving ``table`` and ``params`` to the remote actors ``partitions``
    (actor index → its partitions), and what they report, for the learner."""

    def __init__(self, cfg: DictConfig, table, params, partitions: Mapping[int, np.ndarray]):
        from gearflow.run.private import config_token, redacted
        from gearflow.transport.auth import resolve_token

        t = cfg.transport
        try:
            self.token = resolve_token(config_token(t)).decode()
        except ValueError as exc:
            raise ConfigError(f"actor.remote_actors={len(partitions)}: {exc}") from None
        self.cfg_yaml = to_yaml(redacted(cfg))  # what joiners get (run.join): never the secret
        self.partitions = {int(a): [int(p) for p in parts] for a, parts in partitions.items()}
        self.where = (str(t.host), int(t.port), str(t.loop))
        self.names = (table.storage.name, params.name)
        sel = table.selector
        self.table_info = (table.kind.to_dict(), sel.name, bool(sel.importance_sampled))
        self.max_restarts = int(cfg.actor.max_restarts)
        self.ctx = mp.get_context("spawn")
        self.reports: mp.Queue = self.ctx.Queue()  # one per shard process: see start()
        self._retired: list = []
        self.stop_event = self.ctx.Event()
        self.proc = None
        self.port = 0
        self.restarts = 0
        self.errors: dict[int, str] = {}  # last line of each remote actor's last traceback

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> int:
        """Start the shard process; returns its port once it listens (a bind error is raised)."""
        ready = self.ctx.Queue()
        host, port, loop = self.where
        if self.proc is not None:  # a SIGKILLed process may have left its queue and event mid-operation
            self._retired.append(self.reports)
            self.reports, self.stop_event = self.ctx.Queue(), self.ctx.Event()
        self.proc = self.ctx.Process(
            target=serve_remote_actors, name="shard",
            args=(self.cfg_yaml, *self.names, self.partitions, self.table_info, self.token, host,
                  self.port or port, loop, self.reports, ready, self.stop_event, os.getpid()),
            daemon=True,
        )  # fmt: skip
        self.proc.start()
        try:
            kind, value = ready.get(timeout=START_TIMEOUT_S)
        except queue.Empty:
            kind, value = "error", f"the shard process did not start in {START_TIMEOUT_S:.0f} s"
        finally:
            ready.close()
        if kind != "port":
            self.proc.join(timeout=5)
            raise GearflowError(f"remote actors: cannot serve on {host}:{port}: {value}")
        if not self.port:
            log.info("waiting for %d remote actor(s) (indices %s) on %s:%d: run gearflow actor --connect %s:%d CONFIG "
                     "with $GEARFLOW_TOKEN set to that machine's actor credential (`gearflow secret actor NAME` "
                     "here prints it; it can only act) or to this secret", len(self.partitions), sorted(self.partitions),
                     host, value, host, value)  # fmt: skip
        self.port = int(value)
        return self.port

    def check(self) -> int:
        """Restart a dead shard process on the same port; raise past ``max_restarts``."""
        if self.proc is None or self.proc.is_alive() or self.stop_event.is_set():
            return 0
        code = self.proc.exitcode
        self.proc.join()
        if self.restarts >= self.max_restarts:
            raise ActorFailed(f"the remote actors' shard process died (exit code {code}) and was already restarted "
                                f"{self.restarts} times (actor.max_restarts={self.max_restarts})", actor=-1)  # fmt: skip
        self.restarts += 1
        log.error("the remote actors' shard process died (exit code %s); restarting it on port %d (%d/%d)", code,
                  self.port, self.restarts, self.max_restarts)  # fmt: skip
        self.start()
        return 1

    def drain(self, progress) -> None:
        """Fold what remote actors reported into ``progress`` (as LocalLauncher.drain)."""
        for msg in queued(self.reports):
            kind = fold_report(progress, msg, self.errors, source="remote actor")
            if kind == "joined":
                log.info("remote actor %d joined from %s: partitions %s", int(msg["actor"]), msg["peer"],
                         self.partitions[int(msg["actor"])])  # fmt: skip
            elif kind == "left":
                log.warning("remote actor %d (%s) left; its place waits for it, the learner goes on", int(msg["actor"]),
                            msg["peer"])  # fmt: skip

    def stop(self, drain: Callable[[], None] = lambda: None, timeout: float = LEAVE_S + 15.0) -> None:
        """Tell joined actors the run is over (held inserts give up, the next report's reply
        says so), wait for the shard process, which waits up to ``LEAVE_S`` for them to leave,
        then stop it."""
        self.stop_event.set()
        stop_processes([self.proc], drain, timeout, kill=False)

    def close(self) -> None:
        self.stop_event.set()
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        for q in (self.reports, *self._retired):
            q.close()
            q.join_thread()


# ---------------------------------------------------------------------- the shard process


class Members:
    """``run.join`` / ``run.report`` of the shard process: places of remote actors."""

    def __init__(self, cfg_yaml: str, partitions: dict[int, list[int]], reports, stop_event, written=None):
        self.cfg_yaml, self.partitions, self.reports, self.stop_event = cfg_yaml, partitions, reports, stop_event
        self.joined: dict[int, str] = {}  # actor index -> peer
        self.names: dict[int, str] = {}  # actor index -> the actor credential's name that joined it
        # actor index -> the credential name that first joined it, for the whole run: that name
        # gets the place back when it rejoins, and no other actor credential can take it
        self.bound: dict[int, str] = {}
        self.lock = threading.Lock()
        # ``written(partitions)``: what those partitions hold, from the storage counters and the
        # parameter store (:func:`written_in`): ``actor/episodes``, ``actor/env_steps``,
        # ``actor/items``, ``actor/weight_version``. An actor's episode reports past its episodes
        # wait (at most MAX_REPORTS) until its writes catch up; its counters are capped by them
        self.written = written
        self.reported: dict[int, int] = {}  # actor -> episode reports passed on
        self.held: dict[int, list] = {}  # actor -> episode reports ahead of its writes

    def writable(self, conn) -> set[int]:
        """The partitions an actor-role connection may open a writer on: those of the places
        joined with its credential's name (its control connection joined; its writers are others)."""
        with self.lock:
            return {p for a, name in self.names.items() if name == conn.actor_name for p in self.partitions[a]}

    def join(self, meta: dict, bufs, conn):
        if self.stop_event.is_set():
            return {"stop": True}, []
        want = meta.get("actor")
        if want is not None and (type(want) is not int or want not in self.partitions):
            raise ValueError(f"actor {want!r} is not a remote actor of this run (remote actors: {sorted(self.partitions)})")
        mine = conn.state.get("actor")
        if mine is not None:  # a rejoin on the connection that holds a place (its writer was reset): the same place
            if want not in (None, mine):
                raise ValueError(f"this connection holds remote actor {mine}'s place; it cannot join as actor {want}")
            self.reports.put({"type": "joined", "actor": mine, "peer": str(conn.peer)})
            return {"actor": mine, "partitions": self.partitions[mine], "config": self.cfg_yaml}, []
        name = conn.actor_name if conn.role == "actor" else ""
        with self.lock:
            free = [a for a in sorted(self.partitions) if a not in self.joined]
            if name:  # an actor credential: the place its name held before, else one no other name holds
                free = sorted((a for a in free if self.bound.get(a, name) == name), key=lambda a: a not in self.bound)
            if want is not None:
                if want in self.joined:
                    raise ValueError(f"remote actor {want} is already joined (from {self.joined[want]})")
                if want not in free:
                    raise ValueError(f"remote actor {want}'s place is bound to actor credential {self.bound[want]!r}: "
                                     "a place stays with the name that first joined it (join with that name's credential)")
                actor = want
            elif free:
                actor = free[0]
            elif len(self.joined) == len(self.partitions):
                raise ValueError(f"all {len(self.partitions)} remote actor places are taken "
                                 f"({', '.join(f'{a}: {p}' for a, p in sorted(self.joined.items()))})")  # fmt: skip
            else:
                raise ValueError(f"no remote actor place is free for actor credential {name!r}: the free ones are bound "
                                 f"to names {', '.join(f'{a}: {n}' for a, n in sorted(self.bound.items()))}")  # fmt: skip
            self.joined[actor] = str(conn.peer)
            self.names[actor] = name
            if name:
                self.bound[actor] = name
        conn.state["actor"] = actor
        conn.on_close(lambda: self._left(actor))
        self.reports.put({"type": "joined", "actor": actor, "peer": str(conn.peer)})
        return {"actor": actor, "partitions": self.partitions[actor], "config": self.cfg_yaml}, []

    def _left(self, actor: int) -> None:
        with self.lock:
            peer = self.joined.pop(actor, None)
            self.names.pop(actor, None)
        if not self.stop_event.is_set():
            self.reports.put({"type": "left", "actor": actor, "peer": str(peer)})

    def report(self, meta: dict, bufs, conn):
        actor = conn.state.get("actor")
        if actor is None:
            raise ValueError("run.report before run.join on this connection")
        msgs = meta.get("messages")
        if not isinstance(msgs, list) or len(msgs) > MAX_REPORTS:
            raise ValueError(f"run.report: messages must be a list of at most {MAX_REPORTS} dicts")
        msgs = [check_report(m) for m in msgs]  # every field checked before any is passed on
        for m in msgs:
            m["actor"] = actor  # a connection reports for the place it joined, nothing else
            if m["type"] == "episode" and self.written is not None:
                self._episode(actor, m)
            else:
                self.reports.put(self._capped(actor, m) if m.get("type") == "counters" else m)
        if self.written is not None:
            self._episode(actor, None)
        return {"stop": self.stop_event.is_set()}, []

    def _episode(self, actor: int, m: dict | None) -> None:
        """Pass on ``actor``'s episode reports as far as its partitions hold that many episodes:
        an actor cannot report more episodes than it wrote (the rest wait, then are dropped)."""
        held = self.held.setdefault(actor, [])
        if m is not None:
            if len(held) >= MAX_REPORTS:
                return  # far ahead of what it wrote: not an honest actor's lag
            held.append(m)
        if not held:
            return
        room = int(self.written(self.partitions[actor])["actor/episodes"]) - self.reported.get(actor, 0)
        take = held[:max(room, 0)]
        del held[:len(take)]
        self.reported[actor] = self.reported.get(actor, 0) + len(take)
        for e in take:
            self.reports.put(e)


    def _capped(self, actor: int, m: dict) -> dict:
        """``actor``'s counters, each of ``written``'s capped by what its partitions hold: a
        connection cannot claim more steps, episodes or items than it wrote, nor weights newer
        than the learner published (an honest actor's counters only lag behind them)."""
        if self.written is None:
            return m
        for k, most in self.written(self.partitions[actor]).items():
            v = m.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > most:
                m[k] = int(most)
        return m


def written_in(counters, params=None) -> Callable[[list[int]], dict[str, int]]:
    """``Members``' ``written``: what partitions hold, from a storage's ``counters`` (and the
    newest weights version of ``params``, a parameter store, when given)."""

    def written(parts: list[int]) -> dict[str, int]:
        c = counters[parts]
        out = {"actor/episodes": int(c[:, EPISODES].sum()), "actor/env_steps": int(c[:, COMMIT].sum()),
               "actor/items": int(c[:, PUBLISHED].sum())}  # fmt: skip
        if params is not None:
            out["actor/weight_version"] = int(params.latest_version())
        return out

    return written


def serve_remote_actors(cfg_yaml: str, storage_name: str, params_name: str, partitions: dict[int, list[int]],
                        table_info: tuple, token: str, host: str, port: int, loop: str, reports, ready,
                        stop_event, parent_pid: int) -> None:  # fmt: skip
    """Spawn target of the shard process: attach, serve until ``stop_event`` (or the learner is
    gone), let joined actors leave, stop. Puts ``("port", p)`` or ``("error", why)`` on ``ready``."""
    from gearflow.kinds.registry import kind_from_dict
    from gearflow.log import inherited_verbosity, setup_logging
    from gearflow.params import ParameterStore
    from gearflow.replay.storage import SharedStorage
    from gearflow.transport.server.shard import ShardService
    from gearflow.transport.service import ANY_ROLE

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner stops us through stop_event
    setup_logging(inherited_verbosity())
    storage = params = shard = None
    try:
        storage = SharedStorage.attach(storage_name)
        params = ParameterStore.attach(params_name)
        kind, selector, weighted = table_info
        # what ShardService(learners=False) reads of a table: the learner owns the real one
        view = SimpleNamespace(storage=storage, kind=kind_from_dict(kind),
                               selector=SimpleNamespace(name=selector, importance_sampled=weighted),
                               size=0, stats=lambda: _storage_stats(storage))  # fmt: skip
        members = Members(cfg_yaml, partitions, reports, stop_event,
                          written=written_in(storage.counters, params))  # fmt: skip
        every = sorted(p for parts in partitions.values() for p in parts)
        from omegaconf import OmegaConf

        from gearflow.transport.limits import service_limits

        limits = service_limits(OmegaConf.create(cfg_yaml).transport.get("limits"))
        shard = ShardService(view, params=params, partitions=every, host=host, port=port, token=token, loop=loop,
                             learners=False, limits=limits)  # fmt: skip
        shard.writable = members.writable  # an actor credential writes the partitions of places it joined
        shard.service.register(RPC.RUN_JOIN, members.join, with_connection=True, roles=ANY_ROLE)
        shard.service.register(RPC.RUN_REPORT, members.report, with_connection=True, inline=True, roles=ANY_ROLE)
        bound = shard.start()
    except BaseException as exc:
        ready.put(("error", f"{type(exc).__name__}: {exc}"))
        for closable in (storage, params):
            if closable is not None:
                closable.close()
        raise SystemExit(2) from None
    ready.put(("port", bound))
    try:
        # polled, never waited on: a waiter killed inside Event.wait() would leave the learner's
        # Event.set() waiting for it forever (multiprocessing's condition counts its sleepers)
        while not stop_event.is_set() and os.getppid() == parent_pid:  # or the learner is gone (even SIGKILLed)
            time.sleep(0.2)
        shard.service.stopping = True  # inserts the rate limiter holds give up (InsertAborted)
        deadline = time.monotonic() + LEAVE_S
        while members.joined and time.monotonic() < deadline:  # their next report says stop
            time.sleep(0.05)
    finally:
        shard.stop()
        storage.close()
        params.close()


def _storage_stats(storage) -> dict[str, float]:
    from gearflow.replay.storage import COMMIT, PUBLISHED

    c = storage.counters
    return {"replay/steps": int(c[:, COMMIT].sum()), "replay/inserts": int(c[:, PUBLISHED].sum())}
