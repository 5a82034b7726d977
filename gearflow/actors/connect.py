"""Actors on another machine: ``gearflow actor --connect HOST:PORT [CONFIG]``.

A ``gearflow train`` run with ``actor.remote_actors = K`` serves its replay and weights
over TCP (:mod:`gearflow.roles.remote_actors`). Each remote actor process here joins it
(``run.join``: an actor index, its partitions, the run's config), then builds its actor with the
same factory as a local actor process (:func:`~gearflow.actors.process.build_actor`), with the
transport's seams in place of shared memory::

    writer = lambda env: remote_writer(cfg, address, parts, token)  # ShippingWriter: the C adder runs here
    actor = build_actor(cfg, k, writer=writer, param_source=RemoteParams(control),
                        on_episode=reports.episode)                           # ParameterSource over TCP

Its :class:`~gearflow.actors.process.ActorReports` (the same dicts a local actor puts on its
queue) go back with ``run.report`` (about once a second), whose reply says
when the run is over. When the learner is unreachable the actor keeps trying for
``wait_s`` seconds (backoff), then rejoins in the same place and continues its partitions
where the learner's table left them; past ``wait_s`` it gives up with a one-line error.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from typing import Any, Optional

import torch

from gearflow.actors.process import (
    ActorReports,
    StopWhen,
    build_actor,
    enter_actor_process,
    stop_processes,
)
from gearflow.errors import GearflowError
from gearflow.transport.ops import RPC

log = logging.getLogger("gearflow.actor")

__all__ = ["ActorSet", "remote_actor_process", "run_remote_actor"]

LOCAL_KEYS = ("actor.device", "actor.nice")  # what this machine may set differently from the learner


def _learner_config(text: str, local) -> Any:
    """The run's config, with this machine's ``LOCAL_KEYS``; ``local`` (the user's CONFIG, or
    None) must agree with it on the env and the agent."""
    from omegaconf import OmegaConf

    from gearflow.config import use_module_dirs

    cfg = OmegaConf.create(text)
    use_module_dirs(cfg.run.get("module_dirs") or [])  # where they exist here too
    if local is None:
        return cfg
    for group in ("env", "agent"):
        mine, theirs = OmegaConf.to_container(local[group]), OmegaConf.to_container(cfg[group])
        if mine != theirs:
            key = next((k for k in sorted(set(mine or {}) | set(theirs or {}))
                        if (mine or {}).get(k) != (theirs or {}).get(k)), "?")  # fmt: skip
            raise GearflowError(
                f"CONFIG does not match the learner's run: {group}.{key} is {(mine or {}).get(key)!r} here, "
                f"{(theirs or {}).get(key)!r} in the learner's config (remote actors act with the learner's config)"
            )
    for key in LOCAL_KEYS:
        OmegaConf.update(cfg, key, OmegaConf.select(local, key), merge=False)
    return cfg


def run_remote_actor(address: str, local_cfg=None, *, token: Optional[str] = None, actor: Optional[int] = None,
                     stop_event=None, parent_pid: Optional[int] = None, wait_s: float = 60.0,
                     timeout_s: float = 30.0, loop: str = "auto") -> int:  # fmt: skip
    """Join the run at ``address`` and act until it is over (or ``stop_event``); returns the env
    steps done. Raises :class:`GearflowError` when the learner stays unreachable for ``wait_s``.
    An insert the shard's rate limiter held past ``replay.timeout_s`` (the learner paused, not
    sampling) ends the membership, not the actor: it rejoins and waits again."""
    from gearflow.replay.rate_limiter import RateLimiterTimeout
    from gearflow.transport.client import Client, ServiceUnavailable
    from gearflow.transport.errors import SessionLost

    stop = StopWhen(stop_event, parent_pid)
    control = Client(address, token, timeout_s=timeout_s, loop=loop)
    steps, since, place = 0, time.monotonic(), [actor]
    try:
        while not stop.is_set():
            try:
                steps += _act(control, address, local_cfg, token, place, stop, timeout_s, loop)
                since = time.monotonic()
            except (ServiceUnavailable, SessionLost) as exc:
                if time.monotonic() - since > wait_s:
                    raise GearflowError(f"the learner at {address} has been unreachable for {wait_s:.0f} s: {exc}") from None
                log.warning("learner at %s unreachable (%s); retrying for up to %.0f s", address, exc, wait_s)
                time.sleep(min(1.0, wait_s / 10))
            except RateLimiterTimeout as exc:  # the learner answers but has not sampled: wait on, from a new membership
                log.warning("remote actor: %s; rejoining the run", exc)
                since = time.monotonic()
        return steps
    finally:
        control.close()


def _act(control, address, local_cfg, token, place: list, stop: StopWhen, timeout_s: float, loop: str) -> int:
    """One membership: join (``place[0]``: the place asked for, None for any; set to the one
    given, so that a rejoin asks for it again), act until stopped or the connection fails;
    returns env steps."""
    from gearflow.transport.actor import RemoteParams, remote_writer

    meta, _ = control.call(RPC.RUN_JOIN, {"actor": place[0]})
    if meta.get("stop"):
        stop.run_over = True
        return 0
    k, parts = int(meta["actor"]), [int(p) for p in meta["partitions"]]
    cfg = _learner_config(meta["config"], local_cfg)
    place[0] = k  # a rejoin asks for the same place
    torch.set_num_threads(1)
    actor = None
    # reporting starts with the membership, not after the env and agent are built: a run that
    # ends while this actor is still setting up (seconds on a loaded machine) reaches it as
    # "stop" on the next report, before the shard stops (it waits up to LEAVE_S = 30 s for joined actors)
    reporter = _Reporter(control, stop)
    reporter.start()
    reports = ActorReports(reporter.put, k)

    def writer(env):
        if env.num_envs != len(parts):
            raise GearflowError(f"the learner gave actor {k} {len(parts)} partitions for env.num_envs={env.num_envs}")
        # the transport's table (transport/actor: ShippingWriter, the adder's C path here; RemoteWriter
        # for stacked-frame columns)
        return remote_writer(cfg, address, parts, token, insert_timeout_s=float(cfg.replay.timeout_s),
                             timeout_s=timeout_s, loop=loop)  # fmt: skip

    try:
        actor = build_actor(cfg, k, writer=writer, param_source=RemoteParams(control), on_episode=reports.episode)
        log.info("remote actor %d: %d envs (%s), partitions %s of %s", k, actor.num_envs, actor.env.backend, parts,
                 address)  # fmt: skip
        try:
            actor.run(stop, on_tick=reports.counters)
            reports.counters(actor)
        except Exception as exc:
            from gearflow.transport.client import ServiceUnavailable

            if stop.is_set():  # the run ended while an insert or the last flush was on its way: not an error
                log.debug("remote actor %d: %s: %s while stopping", k, type(exc).__name__, exc)
            elif isinstance(exc, (ServiceUnavailable, GearflowError)):
                raise
            else:
                reports.error(exc, cfg)
                reporter.close(flush=True)
                raise
        reporter.close(flush=True)
        return int(actor.env_steps)
    finally:
        reporter.close()
        if actor is not None:
            actor.close()
            try:
                actor.writer.close()
            except Exception as exc:
                if not stop.is_set():
                    raise
                log.debug("remote actor %d: closing the writer while stopping: %s", k, exc)


class _Reporter:
    """Sends what the actor reports (``run.report``) about once a second from its own thread, so
    that the learner's "the run is over" reaches ``stop`` even while the actor waits in an insert."""

    def __init__(self, control, stop: StopWhen, period_s: float = 1.0):
        import collections
        import threading

        self.control, self.stop, self.period_s = control, stop, period_s
        self.pending: collections.deque = collections.deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gearflow-reporter", daemon=True)

    def put(self, msg: dict) -> None:
        self.pending.append(msg)

    def start(self) -> None:
        self._thread.start()

    def send(self, timeout_s: Optional[float] = None) -> None:
        batch = []
        while self.pending:
            batch.append(self.pending.popleft())
        reply, _ = self.control.call(RPC.RUN_REPORT, {"messages": batch}, timeout_s=timeout_s)
        if reply.get("stop"):
            self.stop.run_over = True

    def _loop(self) -> None:
        while not self._closed.wait(self.period_s):
            try:
                self.send()
            except Exception as exc:  # the actor thread meets the same outage and handles it
                log.debug("run.report failed: %s", exc)

    def close(self, flush: bool = False) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()
        if flush:
            try:
                self.send(timeout_s=5.0)
            except Exception as exc:
                log.debug("final run.report failed: %s", exc)


def remote_actor_process(address: str, local_yaml: Optional[str], token: Optional[str], actor: Optional[int],
                         stop_event, parent_pid: int, wait_s: float, verbosity: int) -> None:  # fmt: skip
    """Spawn target: one remote actor; a :class:`GearflowError` is one log line and exit status 2."""
    from omegaconf import OmegaConf

    local = OmegaConf.create(local_yaml) if local_yaml else None
    enter_actor_process(int(local.actor.get("nice", 0)) if local is not None else 0, verbosity)
    try:
        run_remote_actor(address, local, token=token, actor=actor, stop_event=stop_event, parent_pid=parent_pid,
                         wait_s=wait_s)  # fmt: skip
    except GearflowError as exc:
        log.error("remote actor: %s", exc)
        raise SystemExit(2) from None


class ActorSet:
    """``gearflow actor --connect``: ``n`` remote actor processes, restarted (up to
    ``max_restarts`` each) when one dies; :meth:`wait` returns when all have finished."""

    def __init__(self, address: str, local_yaml: Optional[str], n: int, *, token: Optional[str] = None,
                 first_actor: Optional[int] = None, wait_s: float = 60.0, max_restarts: int = 3, verbosity: int = 0):  # fmt: skip
        self.ctx = mp.get_context("spawn")
        self.stop_event = self.ctx.Event()
        self.args = (address, local_yaml, token)
        self.first, self.n, self.wait_s, self.verbosity = first_actor, int(n), float(wait_s), int(verbosity)
        self.max_restarts = int(max_restarts)
        self.procs: list = [None] * self.n
        self.restarts = [0] * self.n

    def _start(self, i: int) -> None:
        want = None if self.first is None else self.first + i
        p = self.ctx.Process(target=remote_actor_process, name=f"remote-actor-{i}",
                             args=(*self.args, want, self.stop_event, os.getpid(), self.wait_s, self.verbosity),
                             daemon=True)  # fmt: skip
        p.start()
        self.procs[i] = p

    def start(self) -> None:
        for i in range(self.n):
            self._start(i)

    def wait(self, poll_s: float = 0.2) -> int:
        """Until every process has exited (restarting crashed ones); the worst exit status."""
        codes: dict[int, int] = {}
        while len(codes) < self.n:
            for i, p in enumerate(self.procs):
                if i in codes or p.is_alive():
                    continue
                p.join()
                code = p.exitcode
                if code in (0, 2) or self.stop_event.is_set() or self.restarts[i] >= self.max_restarts:
                    codes[i] = code
                    continue
                self.restarts[i] += 1
                log.error("remote actor process %d died (exit code %s); restarting it (%d/%d)", i, code,
                          self.restarts[i], self.max_restarts)  # fmt: skip
                self._start(i)
            time.sleep(poll_s)
        return max((abs(c) for c in codes.values()), default=0)

    def stop(self, timeout: float = 10.0) -> None:
        self.stop_event.set()
        stop_processes(self.procs, timeout=timeout, kill=False)
