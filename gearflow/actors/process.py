"""Local actors: one over shared-memory replay (:func:`make_actor`), and the spawn target of
an actor process (:func:`run_actor_process`), which attaches replay and weights by name.

    actor = make_actor(cfg, 0, agent, env, storage, np.arange(8), store)   # Writer over 8 partitions
    actor = make_actor(cfg, 0, agent, env, None, None, None, epsilon=0.0)  # act only (evaluation)
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Optional

import numpy as np
import torch

from gearflow.actors import actor_class_for
from gearflow.actors.base import ActorBase, actor_epsilon, env_seed
from gearflow.actors.checks import describe_failure
from gearflow.errors import ContractError
from gearflow.replay.storage import SharedStorage
from gearflow.replay.writer import Writer

log = logging.getLogger("gearflow.actor")

__all__ = ["actor_process_main", "make_actor", "run_actor_process"]


def make_actor(cfg, actor_index: int, agent, env, storage: Optional[SharedStorage], partitions, param_source,
               *, epsilon=None, **kwargs) -> ActorBase:
    """The agent's actor (by item kind) over ``env``, writing ``partitions`` of ``storage``
    through a :class:`~gearflow.replay.Writer` (``storage=None``: no writer). ``epsilon``
    defaults to the actor's slice of the run's ε ladder, ``seed`` to :func:`env_seed`; ``kwargs`` go
    to the actor. The one place a whole run config becomes an actor's groups."""
    writer = None
    if storage is not None:
        writer = Writer(storage, partitions, insert_timeout_s=float(cfg.replay.timeout_s))
    if epsilon is None:
        epsilon = actor_epsilon(cfg, actor_index, env.num_envs)
    kwargs.setdefault("seed", env_seed(cfg, actor_index))
    return actor_class_for(agent)(env, agent, writer, param_source, epsilon, cfg=cfg.actor, env_cfg=cfg.env,
                                  actor_index=actor_index, **kwargs)  # fmt: skip


class _OrphanGuard:
    """``stop_event``, also set once the learner that spawned us is gone (even by SIGKILL,
    which runs no cleanup): an orphaned actor stops instead of stepping forever."""

    def __init__(self, stop_event, parent_pid: int):
        self._event, self._parent = stop_event, parent_pid

    def is_set(self) -> bool:
        return self._event.is_set() or os.getppid() != self._parent


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
    """Spawn target of one actor process (picklable: only names and plain values cross).

    Attaches the replay storage and the parameter store by name, builds the env,
    the agent and the actor, and runs until ``stop_event`` is set or the process
    ``parent_pid`` (the learner) is gone, even if it was SIGKILLed. Sends through
    ``metrics_queue`` dicts with a ``type``:

    * ``episode``: ``actor``, ``env`` (global index), ``actor/episode_return``,
      ``actor/episode_length``, ``actor/epsilon``
    * ``counters`` (about once a second and at exit): ``actor``, ``time``,
      ``actor/env_steps``, ``actor/episodes``, ``actor/items``, ``actor/weight_version``,
      ``actor/env_steps_per_s``
    * ``error``: ``actor``, ``error`` (a traceback; a :class:`~gearflow.errors.ContractError`'s one
      line), ``where``, ``culprit``, ``message``, ``signature``, ``contract``
      (:func:`~gearflow.actors.checks.describe_failure`); then the exception is re-raised
      (:func:`actor_process_main` turns it into exit status 1 without printing it a second time)
    """
    from omegaconf import OmegaConf

    from gearflow.agent import make_agent, resolve_device
    from gearflow.envs import make_vec_env
    from gearflow.log import inherited_verbosity, setup_logging

    # Ctrl-C in a terminal reaches the whole process group: the learner stops us through
    # stop_event (after its final checkpoint), so the actor itself ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(inherited_verbosity())
    torch.set_num_threads(1)  # many actor processes share the cores
    cfg = OmegaConf.create(cfg_yaml)
    os.nice(int(cfg.actor.get("nice", 0)))  # the learner wins a contended core
    storage = params = env = actor = None
    try:
        storage = SharedStorage.attach(storage_name)
        if params_name:
            from gearflow.params import ParameterStore

            params = ParameterStore.attach(params_name)
        env = make_vec_env(cfg.env, seed=env_seed(cfg, actor_index))
        agent = make_agent(cfg, env.env_spec, resolve_device(str(cfg.actor.device)))

        def on_episode(env_index: int, ret: float, length: int, epsilon: float) -> None:
            metrics_queue.put({
                "type": "episode", "actor": actor_index, "env": env_index,
                "actor/episode_return": ret, "actor/episode_length": length,
                "actor/epsilon": epsilon,
            })  # fmt: skip

        actor = make_actor(cfg, actor_index, agent, env, storage, partitions, params, on_episode=on_episode)
        actor.writer.hold = _Paused(actor_index)  # no learner sampling: the actor waits, its restarts untouched
        last = {"t": time.monotonic(), "steps": 0}

        def on_tick(a: ActorBase) -> None:
            now = time.monotonic()
            rate = (a.env_steps - last["steps"]) / max(now - last["t"], 1e-9)
            last.update(t=now, steps=a.env_steps)
            metrics_queue.put({"type": "counters", "actor": actor_index, "time": time.time(), **a.counters(),
                               "actor/env_steps_per_s": rate})  # fmt: skip

        log.info("actor %d: %d envs (%s), partitions %s", actor_index, actor.num_envs, env.backend,
                 np.asarray(partitions).tolist())  # fmt: skip
        actor.run(_OrphanGuard(stop_event, parent_pid or os.getppid()), on_tick=on_tick)
        on_tick(actor)
    except Exception as exc:
        text = str(exc) if isinstance(exc, ContractError) else traceback.format_exc()  # the agent's/env's fault: one line
        try:
            metrics_queue.put({"type": "error", "actor": actor_index, "error": text, **describe_failure(exc, cfg)})
            exc.gearflow_reported = True  # actor_process_main exits 1 without printing it again
        except Exception:
            pass
        raise
    finally:
        if actor is not None:
            actor.close()
        elif env is not None:
            env.close()
        if params is not None:
            params.close()
        if storage is not None:
            storage.close()
