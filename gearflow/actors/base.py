"""What every actor shares: the env loop, the Ape-X ε ladder, weight syncing, episode
statistics, counters and closing; what is written is the adder's business.

An actor is built from an env, an agent, a writer (anything with the
:class:`~gearflow.replay.protocols.WriterLike` interface, or ``None``: act
only, as evaluation does), a parameter source and its ε (one per env)::

    actor = Actor(env, agent, writer, store, epsilon_ladder(8, 0.4, 7.0), cfg=cfg.actor,
                  env_cfg=cfg.env, seed=env_seed(cfg, 0))
    actor.run(stop_event, max_steps=10_000)
    actor.close()

Per ``recv`` of a batch of ``b`` envs (:meth:`ActorBase.step` of each subclass)::

    obs, reward, terminated, truncated, ids = env.recv()     # (b, ...), (b,)
    out = agent.act(policy, <obs or context>, epsilon[ids], rng, ...)
    env.send(out.actions, ids)                                # envs step while we write
    self._observe(...)                                        # adder.add + episode statistics

Each item kind's actor class lives in its kind module (:mod:`gearflow.kinds`); the kind
registry names it, and :func:`gearflow.actors.actor_class_for` picks it from
``agent.item_kind().name``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch

from gearflow.actors.adders import Adder
from gearflow.actors.contract import guard
from gearflow.kinds.registry import kind_def
from gearflow.params.protocol import ParameterSource
from gearflow.replay.inserts import InsertAborted
from gearflow.replay.protocols import WriterLike

# per-recv episode stats in C; None where not built (_count_episodes is the reference)
from gearflow.replay.hotpath import C as _hotpath

log = logging.getLogger(__name__)

STOP_CHECK_EVERY = 16  # recvs between looks at the stop event (it costs a lock)

def epsilon_ladder(num_envs_total: int, epsilon: float = 0.4, alpha: float = 7.0) -> np.ndarray:
    """Ape-X exploration: env ``i`` of ``N`` uses ε^(1 + α·i/(N−1)); ``N = 1`` → ``[ε]``.

    >>> epsilon_ladder(3, 0.4, 7.0)       # [0.4, 0.4**4.5, 0.4**8]
    """
    n = int(num_envs_total)
    if n < 1:
        raise ValueError(f"num_envs_total must be ≥ 1, got {n}")
    if n == 1:
        return np.array([epsilon], dtype=np.float64)
    i = np.arange(n, dtype=np.float64)
    return np.power(float(epsilon), 1.0 + float(alpha) * i / (n - 1))


def actor_epsilon(cfg, actor_index: int, num_envs: int) -> np.ndarray:
    """The ε of each env of actor ``actor_index``: its slice of the run's ladder (E,). On a node
    of a several-node run the ladder spans every node's actors (``actor.ladder_total``) and this
    node's start at ``actor.ladder_offset``."""
    a = cfg.actor
    total = int(a.get("ladder_total", 0) or 0) or int(a.num_actors)
    offset = int(a.get("ladder_offset", 0) or 0)
    N = total * int(num_envs)
    ladder = epsilon_ladder(N, float(a.epsilon), float(a.epsilon_alpha))
    return ladder[(offset + int(actor_index)) * int(num_envs) + np.arange(int(num_envs))]


def env_seed(cfg, actor_index: int) -> int:
    """Seed of env 0 of actor ``actor_index`` (env ``e`` gets ``seed + e``; a node of a several-node
    run counts its actors from ``actor.ladder_offset``, so no two nodes repeat an env's seed)."""
    index = int(cfg.actor.get("ladder_offset", 0) or 0) + int(actor_index)
    return int(cfg.env.seed) + 100_003 * int(cfg.run.seed) + index * int(cfg.env.num_envs)


class ActorBase:
    """The env loop around an agent's policy (subclasses: how the agent is asked to act).

    ``env``: an EnvPool-shaped vector env (:mod:`gearflow.envs`); ``agent``: the agent;
    ``writer``: where the adder writes, or ``None`` (no replay: evaluation);
    ``param_source``: a :class:`~gearflow.params.ParameterSource` or ``None`` (fixed
    weights); ``epsilon``: ε per env (E,) or one for all. Keywords: ``cfg`` (the run's
    ``actor`` group, the only one an actor reads: n-step, γ, weight sync period),
    ``env_cfg`` (the ``env`` group, or ``None``: only named in error messages),
    ``actor_index`` (global env index ``actor_index * E + e`` for ``on_episode``),
    ``network`` (default ``agent.make_network()``), ``on_episode(env_index, return, length,
    epsilon)``, ``seed`` of the exploration generator (a run's builder passes
    :func:`env_seed`; default 0), drawn per actor with ``actor_index``.

    The actor closes ``env`` in :meth:`close`; if construction fails, the caller does.
    """

    NAME = "the actor"

    def __init__(
        self,
        env,
        agent,
        writer: Optional[WriterLike],
        param_source: Optional[ParameterSource],
        epsilon,
        *,
        cfg,
        env_cfg=None,
        actor_index: int = 0,
        network: Optional[torch.nn.Module] = None,
        on_episode: Optional[Callable[[int, float, int, float], None]] = None,
        seed: Optional[int] = None,
    ):
        if "actor" in cfg:  # a whole run config: the builder slices it (make_actor), the actor gets its group
            raise TypeError("an actor takes the run's actor group (cfg=cfg.actor, env_cfg=cfg.env, "
                            "seed=env_seed(cfg, i)), not the whole run config; make_actor(cfg, ...) does that")  # fmt: skip
        self.cfg, self.actor_index, self.agent, self.env = cfg, int(actor_index), agent, env
        self.agent, self.env = guard(agent, env, env_cfg)  # boundary checks of act() and recv() (actors/contract.py)
        self.param_source, self.on_episode, self.writer = param_source, on_episode, writer
        self.sync_period = int(cfg.weight_sync_period)
        self.kind = agent.item_kind()
        adder_cls = kind_def(self.kind.name).adder  # the registry's adder of the agent's kind
        adder_cls.check_kind(self.kind, type(agent).__module__)
        E = self.num_envs = int(env.num_envs)
        self.adder: Adder | None = None
        if writer is not None:
            self._check_writer(writer, adder_cls)
            self.adder = self._make_adder(writer)
        self.epsilon = np.broadcast_to(np.asarray(epsilon, dtype=np.float64), (E,)).copy()  # (E,)
        self.global_env_index = self.actor_index * E + np.arange(E)
        self.network = network if network is not None else agent.make_network()
        self.network.eval()
        seed = 0 if seed is None else seed
        self.rng = np.random.default_rng([int(seed), self.actor_index])

        self.version = 0  # weights version the policy holds
        self.env_steps = 0
        self.episodes = 0
        self._since_sync = 0
        self._started = False
        self._closed = False
        self._new_episode = np.ones(E, dtype=bool)  # the next obs of env e starts an episode
        self._episode_return = np.zeros(E, dtype=np.float64)
        self._episode_length = np.zeros(E, dtype=np.int64)  # actions taken in the episode
        self._setup_state()

    def _check_writer(self, writer: WriterLike, adder_cls: type[Adder]) -> None:
        """Refuse a writer the adder cannot fill (columns, streams, observation, ring size)."""
        spec, E = writer.spec, self.num_envs
        if set(spec.names) != set(adder_cls.COLUMNS):
            raise ValueError(f"{self.NAME} writes columns {adder_cls.COLUMNS}; the table has {spec.names}")
        if writer.steps_per_stream < adder_cls.min_steps(self.cfg, self.kind):
            raise ValueError(adder_cls.size_error(self.cfg, self.kind, writer.steps_per_stream))
        if writer.num_streams != E:
            raise ValueError(f"{writer.num_streams} partitions for {E} envs (one per env)")
        obs_col, env = spec["obs"], self.env
        if tuple(env.obs_shape) != obs_col.shape or np.dtype(env.obs_dtype) != obs_col.dtype:
            raise ValueError(
                f"env observations are {np.dtype(env.obs_dtype).name}{list(env.obs_shape)}, "
                f"the table's obs column is {obs_col.describe()}"
            )

    # ------------------------------------------------------------------ subclass hooks
    def _make_adder(self, writer: WriterLike) -> Adder:
        raise NotImplementedError

    def _setup_state(self) -> None:
        """Per-env buffers of the subclass (contexts)."""

    def step(self) -> int:
        raise NotImplementedError

    @property
    def items(self) -> int:
        """Items published (0 without a writer)."""
        return 0 if self.adder is None else self.adder.items

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> bool:
        """Load newer weights from the parameter source, if any (never waits for the learner)."""
        self._since_sync = 0
        if self.writer is not None:
            self.writer.flush()  # heartbeat for the supervisor
        if self.param_source is None:
            return False
        v = self.param_source.load_into(self.network, min_version=self.version)
        if v is None:
            return False
        self.version = int(v)
        return True

    # ------------------------------------------------------------------ stepping (shared parts)
    def _recv(self):
        """The next batch: ``env.recv()`` plus the env ids as int64 (resets the envs and loads
        the first weights on the first call)."""
        if not self._started:
            self.env.async_reset()
            self._started = True
            self.sync_weights()
        obs, reward, terminated, truncated, env_ids = self.env.recv()
        return obs, reward, terminated, truncated, env_ids, np.asarray(env_ids, dtype=np.int64)

    def _observe(self, ids, obs, reward, terminated, truncated, actions, values) -> None:
        """After ``send``: the adder writes; episode returns and lengths are counted (the reward
        that comes with an episode's first obs is 0) and reported when an episode ends.

        The counting is one C call (``_hotpath.episode_stats``) where built, else
        :meth:`_count_episodes` (the numpy reference)."""
        reward, terminated, truncated = np.asarray(reward), np.asarray(terminated), np.asarray(truncated)
        if self.adder is not None:
            first = self._new_episode[ids] if self.adder.USES_FIRST else None
            self.adder.add(ids, obs, reward, terminated, truncated, first, actions, values, self.version)
        if _hotpath is None:
            ended = self._count_episodes(ids, reward, terminated, truncated)
        else:
            try:
                ended = _hotpath.episode_stats(ids, reward, terminated, truncated, self._episode_return,
                                               self._episode_length, self._new_episode)  # fmt: skip
            except (TypeError, ValueError, BufferError):  # not the exact arrays: the reference
                ended = self._count_episodes(ids, reward, terminated, truncated)
        if not ended:
            return
        e = ids[terminated | truncated]
        self.episodes += e.size
        if self.on_episode is not None:
            for d, length, ret in zip(e.tolist(), self._episode_length[e].tolist(), self._episode_return[e].tolist()):
                self.on_episode(int(self.global_env_index[d]), ret, int(length), float(self.epsilon[d]))
        self._episode_return[e] = 0.0
        self._episode_length[e] = 0

    def _count_episodes(self, ids, reward, terminated, truncated) -> int:
        """Returns += reward, lengths += 1 where the episode goes on, ``_new_episode`` = done;
        returns how many episodes ended (the caller reports and zeroes them)."""
        done = terminated | truncated
        self._episode_return[ids] += reward
        self._new_episode[ids] = done
        self._episode_length[ids[~done]] += 1
        return int(np.count_nonzero(done))

    def _count_steps(self, b: int) -> int:
        """Count ``b`` env steps; look for newer weights every ``actor.weight_sync_period``."""
        self.env_steps += b
        self._since_sync += b
        if self._since_sync >= self.sync_period:
            self.sync_weights()
        return b

    # ------------------------------------------------------------------ loop
    def run(
        self,
        stop_event=None,
        max_steps: Optional[int] = None,
        on_tick: Optional[Callable[["ActorBase"], None]] = None,
        tick_s: float = 1.0,
    ) -> int:
        """Step until ``stop_event`` is set or ``max_steps`` env steps were done; returns them.

        Queued items are published before returning (without waiting on the rate limiter
        when stopped by ``stop_event``). ``on_tick(actor)`` is called about every ``tick_s``
        seconds (counters, heartbeats).
        """
        done = recvs = 0
        stopped = False
        next_tick = time.monotonic() + tick_s
        if self.writer is not None:  # an insert held by the rate limiter gives up when we are told to stop
            self.writer.abort = stop_event.is_set if stop_event is not None else None
        try:
            while max_steps is None or done < max_steps:
                if recvs % STOP_CHECK_EVERY == 0:
                    if stop_event is not None and stop_event.is_set():
                        stopped = True
                        break
                    if on_tick is not None and time.monotonic() >= next_tick:
                        on_tick(self)
                        next_tick = time.monotonic() + tick_s
                done += self.step()
                recvs += 1
        except InsertAborted:
            stopped = True
        if self.adder is not None:
            try:
                self.adder.finish(block=not stopped)
            except InsertAborted:  # told to stop while the last flush waited on the rate limiter
                self.adder.finish(block=False)  # its items are dropped; close the ended episodes
        return done

    def counters(self) -> dict[str, Any]:
        return {
            "actor/env_steps": self.env_steps,
            "actor/episodes": self.episodes,
            "actor/items": self.items,
            "actor/weight_version": self.version,
        }

    def close(self) -> None:
        """Publish queued items if the table takes them now, close the env (idempotent).
        Rows of unfinished episodes (and their items) are left without items."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.adder is not None:
                self.adder.finish(block=False)
        except Exception:  # never let a broken table keep the env open
            log.exception("actor %d: could not publish the last items", self.actor_index)
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
