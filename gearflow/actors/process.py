"""Actor processes, built one way: the one factory every actor-side process uses — a run's local
actor processes (:func:`run_actor_process`), the remote actors of ``gearflow actor --connect``
(:mod:`gearflow.actors.connect`) and the evaluation process (:mod:`gearflow.run.evaluate`'s
``play``) — and the reports they send.

    enter_actor_process(cfg.actor.nice)             # SIGINT left to the parent, logging, 1 thread, niced
    reports = ActorReports(queue.put, i)            # episode / counters / error dicts, one shape
    actor = build_actor(cfg, i, storage=storage, partitions=parts, param_source=params,
                        on_episode=reports.episode)  # env (seeded), agent (actor.device), the kind's actor
    actor.run(StopWhen(stop_event, parent_pid), on_tick=reports.counters)

    actor = make_actor(cfg, 0, agent, env, storage, np.arange(8), store)   # Writer over 8 partitions
    actor = make_actor(cfg, 0, agent, env, None, None, None, epsilon=0.0)  # act only (evaluation)

:func:`make_actor` is the one place a whole run config is sliced into an actor's groups
(``cfg.actor``, ``cfg.env``, its ε slice and seed); :func:`build_actor` adds the env and the agent
an actor process makes for itself. How a process that owns actor processes stops them is
:func:`stop_processes` (a local launcher's, the evaluation role's, ``gearflow actor``'s).
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Optional

import numpy as np
import torch

from gearflow.actors import actor_class_for
from gearflow.actors.base import ActorBase, actor_epsilon, env_seed
from gearflow.actors.contract import describe_failure
from gearflow.errors import ContractError
from gearflow.replay.storage import SharedStorage
from gearflow.replay.writer import Writer

log = logging.getLogger("gearflow.actor")

__all__ = ["ActorReports", "StopWhen", "actor_process_main", "build_actor", "enter_actor_process", "make_actor",
           "run_actor_process", "stop_processes"]  # fmt: skip


def make_actor(cfg, actor_index: int, agent, env, storage: Optional[SharedStorage], partitions, param_source,
               *, epsilon=None, writer=None, **kwargs) -> ActorBase:
    """The agent's actor (by item kind) over ``env``, writing ``partitions`` of ``storage``
    through a :class:`~gearflow.replay.Writer` (``storage=None``: no writer; ``writer``: this
    ``WriterLike`` instead, a remote one). ``epsilon`` defaults to the actor's slice of the run's
    ε ladder, ``seed`` to :func:`env_seed`; ``kwargs`` go to the actor. The one place a whole run
    config becomes an actor's groups."""
    if writer is None and storage is not None:
        writer = Writer(storage, partitions, insert_timeout_s=float(cfg.replay.timeout_s))
    if epsilon is None:
        epsilon = actor_epsilon(cfg, actor_index, env.num_envs)
    kwargs.setdefault("seed", env_seed(cfg, actor_index))
    return actor_class_for(agent)(env, agent, writer, param_source, epsilon, cfg=cfg.actor, env_cfg=cfg.env,
                                  actor_index=actor_index, **kwargs)  # fmt: skip


def actor_agent(cfg, env_spec):
    """The agent an actor process acts with: ``cfg.agent`` on ``actor.device``."""
    from gearflow.agent import make_agent, resolve_device

    return make_agent(cfg, env_spec, resolve_device(str(cfg.actor.device)))


def build_actor(cfg, actor_index: int, *, env=None, agent=None, writer=None, storage=None, partitions=None,
                param_source=None, **kwargs) -> ActorBase:
    """Actor ``actor_index`` of the run ``cfg`` as an actor process builds it: its env (``env``
    group, seeded by :func:`env_seed`; or the ``env`` given), its agent (:func:`actor_agent`; or the
    ``agent`` given) and the agent's kind's actor over them (:func:`make_actor`, which gets
    ``storage``/``partitions``, ``param_source`` and ``kwargs``). ``writer``: a ``WriterLike``, or a
    function of the env that makes one once the env exists (its partitions checked against the envs
    there); None: a local ``Writer`` over ``storage``, or none. What it made is closed when building
    fails; once built, ``actor.close()`` closes the env (a writer it was given is the caller's)."""
    from gearflow.envs import make_vec_env

    made_env = env is None
    if made_env:
        env = make_vec_env(cfg.env, seed=env_seed(cfg, actor_index))
    made = None
    try:
        if agent is None:
            agent = actor_agent(cfg, env.env_spec)
        if callable(writer):
            writer = made = writer(env)
        return make_actor(cfg, actor_index, agent, env, storage, partitions, param_source, writer=writer, **kwargs)
    except BaseException:
        if made is not None and hasattr(made, "close"):
            made.close()
        if made_env:
            env.close()
        raise


def enter_actor_process(nice: int = 0, verbosity: Optional[int] = None) -> None:
    """What every actor-side process does first: SIGINT ignored (Ctrl-C in a terminal reaches the
    whole process group; its parent stops it through an event, after its final checkpoint),
    logging at the parent's verbosity, one torch thread (many actor processes share the cores),
    niced by ``nice`` (``actor.nice``: the learner wins a contended core)."""
    from gearflow.log import inherited_verbosity, setup_logging

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(inherited_verbosity() if verbosity is None else verbosity)
    torch.set_num_threads(1)
    os.nice(int(nice))


class StopWhen:
    """A stop event for an actor process: set when ``event`` is, when the process that spawned it
    (``parent_pid``) is gone — even by SIGKILL, which runs no cleanup: an orphaned actor stops
    instead of stepping forever — or once :attr:`run_over` (a remote run said so)."""

    def __init__(self, event=None, parent_pid: Optional[int] = None):
        self.event, self.parent, self.run_over = event, parent_pid, False

    def is_set(self) -> bool:
        if self.run_over or (self.event is not None and self.event.is_set()):
            return True
        return self.parent is not None and os.getppid() != self.parent


class ActorReports:
    """What an actor process reports, one shape for every actor process; each dict goes to
    ``put`` (a queue's ``put``, a ``run.report`` batch's ``append``) with plain Python values
    (it crosses a queue or goes out as JSON)::

        reports = ActorReports(queue.put, 3)
        actor = build_actor(..., on_episode=reports.episode)
        actor.run(stop, on_tick=reports.counters); reports.counters(actor)
        reports.error(exc, cfg)                       # in the process's ``except``

    * ``episode``: ``actor``, ``env`` (global index), ``actor/episode_return``,
      ``actor/episode_length``, ``actor/epsilon``
    * ``counters`` (about once a second and at exit): ``actor``, ``time``, ``actor/env_steps``,
      ``actor/episodes``, ``actor/items``, ``actor/weight_version``, ``actor/env_steps_per_s``
    * ``error``: ``actor``, ``error`` (a traceback; a :class:`~gearflow.errors.ContractError`'s one
      line), ``where``, ``culprit``, ``message``, ``signature``, ``contract``
      (:func:`~gearflow.actors.contract.describe_failure`)
    """

    def __init__(self, put: Callable[[dict], None], actor_index: int):
        self.put, self.actor_index = put, int(actor_index)
        self._t, self._steps = time.monotonic(), 0

    def episode(self, env_index: int, ret: float, length: int, epsilon: float) -> None:
        self.put({"type": "episode", "actor": self.actor_index, "env": int(env_index),
                  "actor/episode_return": float(ret), "actor/episode_length": int(length),
                  "actor/epsilon": float(epsilon)})  # fmt: skip

    def counters(self, actor: ActorBase) -> None:
        now = time.monotonic()
        rate = (actor.env_steps - self._steps) / max(now - self._t, 1e-9)
        self._t, self._steps = now, actor.env_steps
        counters = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in actor.counters().items()}
        self.put({"type": "counters", "actor": self.actor_index, "time": time.time(), **counters,
                  "actor/env_steps_per_s": rate})  # fmt: skip

    def error(self, exc: BaseException, cfg) -> None:
        """The report of ``exc``, which the actor died of (call it in the ``except`` block)."""
        text = str(exc) if isinstance(exc, ContractError) else traceback.format_exc()  # the agent's/env's fault: one line
        self.put({"type": "error", "actor": self.actor_index, "error": text, **describe_failure(exc, cfg)})


class _Paused:
    """``Writer.hold`` of an actor process: an insert the rate limiter held past ``replay.timeout_s``
    means no learner samples this table (a shard node between learners, a learner resuming or
    checkpointing). Killing the actor would not bring one back and would spend a restart
    (``actor.max_restarts``), so it pauses, as a Reverb writer's insert blocks: logged once per
    pause (and every 10 minutes of it); it goes on the moment sampling makes room, and a stop
    (``Writer.abort``) still ends the wait."""

    def __init__(self, actor_index: int):
        self.actor_index = actor_index
        self._said = self._last = -1.0

    def __call__(self, held_s: float) -> bool:
        new_pause = held_s <= self._last  # within one pause held_s only grows
        self._last = held_s
        if self._said < 0 or new_pause or held_s - self._said >= 600:
            log.warning("actor %d paused: its insert has been held %.0f s by the rate limiter (no learner has "
                        "sampled enough to make room); it waits for one", self.actor_index, held_s)  # fmt: skip
            self._said = held_s
        return True


def actor_process_main(*args) -> None:
    """The spawn target of a local actor process: :func:`run_actor_process`, exiting 1 after an error it
    reported (the launcher logs the report once; multiprocessing would print the traceback again)."""
    try:
        run_actor_process(*args)
    except Exception as exc:
        if getattr(exc, "gearflow_reported", False):
            raise SystemExit(1) from None
        raise


def run_actor_process(
    cfg_yaml: str,
    actor_index: int,
    storage_name: str,
    partitions,
    params_name: Optional[str],
    metrics_queue,
    stop_event,
    parent_pid: Optional[int] = None,
) -> None:
    """Spawn target of one local actor process (picklable: only names and plain values cross).

    Attaches the replay storage and the parameter store by name, builds its actor
    (:func:`build_actor`) and runs until ``stop_event`` is set or the process ``parent_pid`` (the
    learner) is gone, even if it was SIGKILLed. Sends its :class:`ActorReports` through
    ``metrics_queue``; an error is reported, then re-raised (:func:`actor_process_main` turns it
    into exit status 1 without printing it a second time).
    """
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(cfg_yaml)
    enter_actor_process(int(cfg.actor.get("nice", 0)))
    reports = ActorReports(metrics_queue.put, actor_index)
    storage = params = actor = None
    try:
        storage = SharedStorage.attach(storage_name)
        if params_name:
            from gearflow.params import ParameterStore

            params = ParameterStore.attach(params_name)
        actor = build_actor(cfg, actor_index, storage=storage, partitions=partitions, param_source=params,
                            on_episode=reports.episode)  # fmt: skip
        actor.writer.hold = _Paused(actor_index)  # no learner sampling: the actor waits, its restarts untouched
        log.info("actor %d: %d envs (%s), partitions %s", actor_index, actor.num_envs, actor.env.backend,
                 np.asarray(partitions).tolist())  # fmt: skip
        actor.run(StopWhen(stop_event, parent_pid or os.getppid()), on_tick=reports.counters)
        reports.counters(actor)
    except Exception as exc:
        try:
            reports.error(exc, cfg)
            exc.gearflow_reported = True  # actor_process_main exits 1 without printing it again
        except Exception:
            pass
        raise
    finally:
        if actor is not None:
            actor.close()
        if params is not None:
            params.close()
        if storage is not None:
            storage.close()


def stop_processes(procs: list, drain: Callable[[], None] = lambda: None, timeout: float = 10.0,
                   kill: bool = True) -> None:  # fmt: skip
    """Wait up to ``timeout`` for ``procs`` (already told to stop) to exit, calling ``drain`` meanwhile
    (a child cannot exit while its queue buffer is unflushed) and once after; then terminate what is
    left (and, with ``kill``, SIGKILL what survives that)."""
    live = [p for p in procs if p is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in live):
        drain()
        time.sleep(0.05)
    drain()
    for proc in live:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if kill and proc.is_alive():
            proc.kill()
            proc.join()

