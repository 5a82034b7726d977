"""Ape-X actors: one vectorised env, ε-greedy over an ε ladder, n-step transitions into replay.

One :class:`Actor` drives ``env.num_envs`` environments; environment ``e``
writes its own replay partition ``partitions[e]`` (one stream of a
:class:`~gearflow.replay.Writer`). Per ``recv`` of a batch of ``b`` envs::

    obs, reward, terminated, truncated, ids = env.recv()     # (b, ...), (b,)
    out = agent.act(policy, obs, epsilon[ids])                # actions (b,), Q-values (b, A)
    env.send(out.actions, ids)                                # envs step while we write
    bookkeeping: a fixed number of numpy calls for the whole batch; a Python loop
    only over the envs whose episode ended

Replay layout (one row per step, no frame stored twice)::

    row t:  obs_t  action_t  ret_t  disc_t  version_t
    item t: rows t .. t+n   (obs = obs_t, next_obs = obs_{t+n})
            ret_t  = r_{t+1} + γ r_{t+2} + ... + γ^{n-1} r_{t+n}
            disc_t = γ^n

The writer is append-only, and ``ret_t`` / ``disc_t`` are known only when
``obs_{t+n}`` arrives, so an env's rows are appended *late*: step t is staged
in the actor (obs, action, version, running return and discount) and its row
is appended at time t+n, when it is complete; the item for t (rows t..t+n) is
created once row t+n is in, at time t+2n. At an episode's end (final
observation obs_L) every staged step is appended, then obs_L as its own row
(action 0, ret 0, disc 0: the bootstrap row, never the first row of an item),
and all the episode's outstanding items are created; the last n-1 have shorter
windows ending at row L, ret truncated there, and disc = 0 if the episode
terminated else γ^(L-t). Cost: about 2n steps of latency per env and one
staging copy of each observation in the actor; replay holds every frame once.

Items are queued and published with one ``Writer.create_items`` call every
``n`` recvs (its fixed cost is the largest on the insert path), and before a
stream's episode is closed in the writer.

Initial priorities (Ape-X, no max-priority): |ret + disc · max_a Q(s_last, a) − Q(s_t, a_t)|
from the Q-values computed when acting (Q(s_t, a_t) is staged with step t;
max_a Q(s_last, ·) comes from the forward pass of the batch holding s_last).

    actor = Actor(cfg, actor_index=0, storage=storage, partitions=np.arange(8),
                  param_source=store, agent=agent)
    actor.run(stop_event, max_steps=10_000)
    actor.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Optional

import numpy as np
import torch

from gearflow.agent import resolve_device
from gearflow.replay.items import Transition
from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.storage import SharedStorage
from gearflow.replay.writer import InsertAborted, Writer

log = logging.getLogger(__name__)

ACTOR_COLUMNS = ("obs", "action", "ret", "disc", "version")
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


def env_seed(cfg, actor_index: int) -> int:
    """Seed of env 0 of actor ``actor_index`` (env ``e`` gets ``seed + e``)."""
    return (
        int(cfg.env.seed) + 100_003 * int(cfg.run.seed) + int(actor_index) * int(cfg.env.num_envs)
    )


def actor_class_for(agent) -> type:
    """The actor class that writes ``agent``'s item kind: :class:`Actor` for n-step
    transitions, :class:`~gearflow.sequence_actor.SequenceActor` for sequence windows,
    :class:`~gearflow.episode_actor.EpisodeActor` for whole episodes."""
    from gearflow.replay.items import Episode, Sequence

    if isinstance(agent.item_kind(), Episode):  # before Sequence: Episode is a subclass
        from gearflow.episode_actor import EpisodeActor

        return EpisodeActor
    if isinstance(agent.item_kind(), Sequence):
        from gearflow.sequence_actor import SequenceActor

        return SequenceActor
    return Actor


@contextlib.contextmanager
def scratch_actor(cfg, agent, env, steps_per_partition: int, **kwargs):
    """The agent's actor (:func:`actor_class_for`) over ``env``, writing into a private segment
    of ``steps_per_partition`` steps per env (at least the actor's ``min_steps``) that nobody
    samples (benchmarks, evaluation).
    On exit the actor (or, if it could not be made, ``env``) is closed and the segment unlinked::

        with scratch_actor(cfg, agent, env, 4096, network=net) as actor:
            actor.step()
    """
    from gearflow.replay.spec import TableSpec

    E = int(env.num_envs)
    cls = actor_class_for(agent)
    steps = max(int(steps_per_partition), cls.min_steps(cfg, agent.item_kind()))
    storage = SharedStorage.create(TableSpec.parse(agent.replay_columns()), E, steps)
    actor = None
    try:
        actor = cls(cfg, 0, storage, np.arange(E), None, agent, env=env, **kwargs)
        yield actor
    finally:
        if actor is not None:
            actor.close()
        else:
            env.close()
        storage.close()
        storage.unlink()


class ActorBase:
    """What every actor shares: the env, one writer over its partitions, the policy network,
    the Ape-X ε ladder, weight syncing, the run loop, counters and closing.

    Subclasses (:class:`Actor`, :class:`~gearflow.sequence_actor.SequenceActor`,
    :class:`~gearflow.episode_actor.EpisodeActor`) say what they write: ``COLUMNS``,
    ``_check_kind`` / ``_check_size`` (refuse a table they cannot fill, before an env
    exists), ``_setup_state`` (their per-env buffers), ``step``, and ``_finish`` (publish
    what is queued when a run or the actor ends).

    ``param_source`` is anything with ``load_into(module, min_version) -> int | None``
    (a :class:`~gearflow.params.ParameterStore`), or ``None`` for fixed weights.
    ``env`` and ``network`` may be injected (tests, serial runs, evaluation); by
    default the actor makes them from the config and the agent.
    """

    NAME = "the actor"
    COLUMNS: tuple[str, ...] = ()

    def __init__(
        self,
        cfg,
        actor_index: int,
        storage: SharedStorage,
        partitions,
        param_source,
        agent,
        *,
        network: Optional[torch.nn.Module] = None,
        env=None,
        on_episode: Optional[Callable[[int, float, int, float], None]] = None,
        seed: Optional[int] = None,
    ):
        from gearflow.envs import make_vec_env

        self.cfg, self.actor_index, self.agent = cfg, int(actor_index), agent
        self.param_source, self.on_episode = param_source, on_episode
        self.sync_period = int(cfg.actor.weight_sync_period)
        self._configure(cfg)
        kind = self.kind = agent.item_kind()
        self._check_kind(kind)
        spec = storage.spec
        if set(spec.names) != set(self.COLUMNS):
            raise ValueError(f"{self.NAME} writes columns {self.COLUMNS}; the table has {spec.names}")
        self._check_size(storage.steps_per_partition)
        self.env = env if env is not None else make_vec_env(cfg.env, seed=env_seed(cfg, actor_index))
        try:
            self._setup(cfg, storage, partitions, network, seed)
        except BaseException:
            if env is None:  # ours: do not leak its threads
                self.env.close()
            raise

    # ------------------------------------------------------------------ subclass hooks
    def _configure(self, cfg) -> None:
        """Read subclass settings from ``cfg`` (before the checks)."""

    def _check_kind(self, kind) -> None:
        raise NotImplementedError

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        """The fewest steps per partition this actor can write ``kind`` items into."""
        raise NotImplementedError

    def _check_size(self, steps_per_partition: int) -> None:
        raise NotImplementedError

    def _setup_state(self, cfg, spec) -> None:
        raise NotImplementedError

    def _finish(self, stopped: bool) -> None:
        """Publish what is queued; ``stopped``: without waiting on the rate limiter."""

    def step(self) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------------ setup
    def _setup(self, cfg, storage, partitions, network, seed) -> None:
        spec = storage.spec
        E = self.num_envs = int(self.env.num_envs)
        self.partitions = np.asarray(partitions, dtype=np.int64).reshape(-1)
        if self.partitions.size != E:
            raise ValueError(f"{self.partitions.size} partitions for {E} envs (one per env)")
        obs_col = spec["obs"]
        if tuple(self.env.obs_shape) != obs_col.shape or np.dtype(self.env.obs_dtype) != obs_col.dtype:
            raise ValueError(
                f"env observations are {np.dtype(self.env.obs_dtype).name}{list(self.env.obs_shape)}, "
                f"the table's obs column is {obs_col.describe()}"
            )
        self.writer = Writer(storage, self.partitions, insert_timeout_s=float(cfg.replay.timeout_s))
        self.network = network if network is not None else self.agent.make_network()
        self.network.eval()

        N = int(cfg.actor.num_actors) * E
        ladder = epsilon_ladder(N, float(cfg.actor.epsilon), float(cfg.actor.epsilon_alpha))
        self.global_env_index = self.actor_index * E + np.arange(E)
        self.epsilon = ladder[self.global_env_index]  # (E,)
        seed = env_seed(cfg, self.actor_index) if seed is None else seed
        self.rng = np.random.default_rng([int(seed), self.actor_index])

        self.version = 0  # weights version the policy holds
        self.env_steps = 0
        self.episodes = 0
        self.items = 0
        self._since_sync = 0
        self._started = False
        self._closed = False
        self._setup_state(cfg, spec)

    # ------------------------------------------------------------------ weights
    def sync_weights(self) -> bool:
        """Load newer weights from the parameter source, if any (never waits for the learner)."""
        self._since_sync = 0
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
        # an insert held by the rate limiter gives up when we are told to stop
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
        self._finish(stopped)
        return done

    def counters(self) -> dict[str, float]:
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
            self._finish(stopped=True)
        except Exception:  # never let a broken table keep the env open
            log.exception("actor %d: could not publish the last items", self.actor_index)
        self.env.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Actor(ActorBase):
    """Steps one vectorised env with an agent's policy and writes n-step transitions
    (constructor arguments: :class:`ActorBase`)."""

    NAME = "the actor"
    COLUMNS = ACTOR_COLUMNS

    def _configure(self, cfg) -> None:
        self.n, self.gamma = int(cfg.actor.n_step), float(cfg.actor.gamma)

    def _check_kind(self, kind) -> None:
        if not isinstance(kind, Transition) or "obs" not in kind.next_columns:
            raise ValueError(
                f"the Ape-X actor writes n-step transition items with next_obs; "
                f"agent {type(self.agent).__module__} asks for {kind}"
            )

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        return 2 * (int(cfg.actor.n_step) + 1)  # n staged steps, then the item's n + 1 rows

    def _check_size(self, steps_per_partition: int) -> None:
        if steps_per_partition < self.min_steps(self.cfg, self.kind):
            raise ValueError(
                f"steps_per_partition={steps_per_partition} is too small for n_step={self.n}; "
                f"need at least {self.min_steps(self.cfg, self.kind)}"
            )

    def _setup_state(self, cfg, spec) -> None:
        E, obs_col = self.num_envs, spec["obs"]
        # Staged steps: step t of env e sits in slot t % n until its row is appended.
        n = self.n
        dt = {c.name: c.dtype for c in spec}
        self._dt = dt
        self._obs = np.zeros((E, n, *obs_col.shape), dtype=obs_col.dtype)  # (E, n, *obs)
        self._action = np.zeros((E, n), dtype=dt["action"])
        self._version = np.zeros((E, n), dtype=dt["version"])
        # running n-step return and γ^(rewards so far) of each staged step; disc 0 = empty slot
        self._acc = np.zeros((E, n, 2), dtype=np.float64)  # (E, n, [ret, disc])
        self._qsa = np.zeros((E, n), dtype=np.float64)  # Q(s_t, a_t) when acting
        # Appended rows whose item waits for row t+n: priority of item t in slot t % n.
        self._item_prio = np.zeros((E, n), dtype=np.float64)
        # Per env: step index in the episode of the next obs, first row of the episode.
        self._t = np.zeros(E, dtype=np.int64)
        self._episode_row = self.writer.positions  # absolute row of the episode's step 0
        self._episode_return = np.zeros(E, dtype=np.float64)
        self._arange = np.arange(max(E, 2 * n))
        # Items are queued and published with one create_items every `flush_every` recvs (its
        # fixed cost dominates the insert path). Closing an episode in the writer waits for the
        # flush too; that is safe because a stream appends no row of its next episode before
        # its (n+1)-th recv after the end, and flush_every <= n.
        self.flush_every = n
        self._pending_items: list[tuple] = []
        self._end_pending = np.zeros(E, dtype=bool)
        self._recvs_since_flush = 0

    # ------------------------------------------------------------------ stepping
    def step(self) -> int:
        """One recv → act → send → replay writes. Returns the env steps done (the batch size)."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        with torch.no_grad():
            out = self.agent.act(self.network, obs, self.epsilon[ids], self.rng)
        actions = out.actions
        self.env.send(actions, env_ids)  # the envs step while we write replay
        self._record(ids, obs, reward, terminated, truncated, actions, out.values)
        return self._count_steps(ids.size)

    def _record(self, ids, obs, reward, terminated, truncated, actions, values) -> None:
        """Replay bookkeeping for one recv: a fixed number of numpy calls for the batch, plus
        one ``extend`` per env whose episode ended; items are queued for :meth:`flush_items`."""
        n = self.n
        b = ids.size
        if values is None:  # an agent without Q-values: priorities fall back to |ret|
            qsa = max_q = np.zeros(b)
        else:
            qsa = values[self._arange[:b], actions]  # Q(s_t, a_t) (b,)
            max_q = values.max(axis=1)  # max_a Q(s_t, a) (b,)
        t = self._t[ids]  # (b,) step index of obs in its episode
        slot = t % n

        # 1. the reward that came with obs_t belongs to every staged step of its env
        self._episode_return[ids] += reward
        acc = self._acc[ids]  # (b, n, 2)
        acc[..., 0] += acc[..., 1] * reward[:, None]  # ret += γ^k r
        acc[..., 1] *= self.gamma
        self._acc[ids] = acc

        done = terminated | truncated
        if not done.any():
            self._queue_items(self._steady(ids, slot, t, obs, actions, qsa, max_q))
        else:
            live = ~done
            self._queue_items(
                self._steady(
                    ids[live], slot[live], t[live], obs[live], actions[live], qsa[live], max_q[live]
                )
            )
            ended = ids[done]
            if self._end_pending[ended].any():  # a stream ends twice between two flushes
                self.flush_items()
            self._queue_items(self._flush_ended(ended, obs[done], terminated[done], max_q[done]))
            self._close_episodes(ended)
        self._recvs_since_flush += 1
        if self._recvs_since_flush >= self.flush_every:
            self.flush_items()

    def _queue_items(self, items) -> None:
        if items is not None and items[0].size:
            self._pending_items.append(items)

    def flush_items(self, block: bool = True) -> int:
        """Publish the queued items (one ``create_items`` call), then close the episodes that
        ended since the last flush. Returns the items published.

        ``block=False`` (shutdown) drops the items instead of waiting on the rate limiter."""
        w = self.writer
        self._recvs_since_flush = 0
        pending, self._pending_items = self._pending_items, []
        published = 0
        if pending:
            prio, lengths, streams, ends = (
                np.concatenate(c) if len(pending) > 1 else c[0] for c in zip(*pending)
            )
            saved = w.insert_timeout_s
            if not block:
                w.insert_timeout_s = 0.0
            try:
                w.create_items(prio, lengths, streams, ends)
                published = prio.size
            except RateLimiterTimeout:
                if block:
                    raise
                log.debug(
                    "actor %d: dropped %d items at shutdown (rate limiter)",
                    self.actor_index,
                    prio.size,
                )
            finally:
                w.insert_timeout_s = saved
        ended = np.flatnonzero(self._end_pending)
        if ended.size:
            w.end_episode(ended)
            self._end_pending[ended] = False
        self.items += published
        return published

    def _steady(self, e, s, t, obs, actions, qsa, max_q):
        """Envs ``e`` whose obs_t continues an episode: append row t-n, stage step t.

        Returns the items now complete, (priorities, lengths, streams, ends), or None."""
        n = self.n
        items = None
        # step t-n is complete: append its row; item t-2n now has its last row (t-n)
        ready = t >= n
        num_ready = np.count_nonzero(ready)
        if num_ready:
            full = num_ready == e.size
            er, sr, tr, mq = (
                (e, s, t, max_q) if full else (e[ready], s[ready], t[ready], max_q[ready])
            )
            acc = self._acc[er, sr]  # (k, 2)
            ret, disc = acc[:, 0], acc[:, 1]
            prio = np.abs(ret + disc * mq - self._qsa[er, sr])
            self.writer.append(
                {
                    "obs": self._obs[er, sr],
                    "action": self._action[er, sr],
                    "ret": ret.astype(self._dt["ret"]),
                    "disc": disc.astype(self._dt["disc"]),
                    "version": self._version[er, sr],
                },
                streams=er,
            )
            has_item = tr >= 2 * n
            num_items = np.count_nonzero(has_item)
            if num_items:
                full = num_items == er.size
                ei, si, ti = (er, sr, tr) if full else (er[has_item], sr[has_item], tr[has_item])
                ends = self._episode_row[ei] + ti - n + 1  # exclusive: just after row t-n
                items = (self._item_prio[ei, si], np.full(ei.size, n + 1), ei, ends)
            self._item_prio[er, sr] = prio  # item t-n waits for row t
        # stage step t: obs_t, the action taken, the weights' version, Q(s_t, a_t)
        self._obs[e, s] = obs
        self._action[e, s] = actions
        self._version[e, s] = self.version
        self._qsa[e, s] = qsa
        self._acc[e, s] = (0.0, 1.0)
        self._t[e] = t + 1
        return items

    def _flush_ended(self, e, final_obs, terminated, max_q_last):
        """Envs ``e`` returned their final obs_L: append steps max(0, L-n)..L-1 and row L,
        and return the episode's outstanding items (steps max(0, L-2n)..L-1)."""
        n, w = self.n, self.writer
        L = self._t[e]  # (D,)
        # a (D, 2n) grid of steps L-2n .. L-1: the first n have rows and wait for their item,
        # the last n are staged (ret/disc final now; truncated at L, disc 0 if terminated)
        grid = L[:, None] - 2 * n + self._arange[None, : 2 * n]  # (D, 2n)
        slots = grid % n
        E = e[:, None]
        old = self._arange[None, : 2 * n] < n
        acc = self._acc[E, slots[:, n:]]  # (D, n, 2)
        ret_s = acc[..., 0]
        disc_s = np.where(terminated[:, None], 0.0, acc[..., 1])
        prio_s = np.abs(ret_s + disc_s * max_q_last[:, None] - self._qsa[E, slots[:, n:]])
        prio = np.concatenate([self._item_prio[E, slots[:, :n]], prio_s], axis=1)  # (D, 2n)
        ends = np.where(old, grid + n + 1, L[:, None] + 1)  # exclusive, in episode steps
        valid = grid >= 0
        starts = grid[valid]
        D = e.size
        items = (
            prio[valid],
            ends[valid] - starts,
            np.repeat(e, valid.sum(axis=1)),
            self._episode_row[e].repeat(valid.sum(axis=1)) + ends[valid],
        )
        # rows: the staged steps (the last min(L, n) of the grid's staged half) then obs_L
        dt = self._dt
        sl = slots[:, n:]
        rows = {
            "obs": np.concatenate([self._obs[E, sl], final_obs[:, None]], axis=1),  # (D, n+1, ...)
            "action": np.concatenate([self._action[E, sl], np.zeros((D, 1), dt["action"])], axis=1),
            "ret": np.concatenate([ret_s, np.zeros((D, 1))], axis=1).astype(dt["ret"]),
            "disc": np.concatenate([disc_s, np.zeros((D, 1))], axis=1).astype(dt["disc"]),
            "version": np.concatenate(
                [self._version[E, sl], np.full((D, 1), self.version, dt["version"])], axis=1
            ),
        }
        first = n - np.minimum(L, n)  # first staged column holding a step of this episode
        for d in range(D):  # rare: only the envs whose episode ended
            f = int(first[d])
            w.extend({k: v[d, f:] for k, v in rows.items()}, stream=int(e[d]))
        return items

    def _close_episodes(self, e) -> None:
        self._end_pending[e] = True  # writer.end_episode at the next flush, after the items
        L = self._t[e]
        self._episode_row[e] += L + 1
        self.episodes += e.size
        if self.on_episode is not None:
            for d, length, ret in zip(e.tolist(), L.tolist(), self._episode_return[e].tolist()):
                self.on_episode(int(self.global_env_index[d]), ret, length, float(self.epsilon[d]))
        self._t[e] = 0
        self._acc[e] = 0.0  # empty slots: the reset step's reward reaches nothing
        self._episode_return[e] = 0.0

    def _finish(self, stopped: bool) -> None:
        self.flush_items(block=not stopped)


# ---------------------------------------------------------------------- process entry


class _OrphanGuard:
    """``stop_event``, also set once the learner that spawned us is gone (even by SIGKILL,
    which runs no cleanup): an orphaned actor stops instead of stepping forever."""

    def __init__(self, stop_event, parent_pid: int):
        self._event, self._parent = stop_event, parent_pid

    def is_set(self) -> bool:
        return self._event.is_set() or os.getppid() != self._parent


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
    * ``error``: ``actor``, ``error`` (a traceback), then the exception is re-raised
    """
    from omegaconf import OmegaConf

    from gearflow.agent import make_agent
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

        actor = actor_class_for(agent)(
            cfg, actor_index, storage, partitions, params, agent, env=env, on_episode=on_episode
        )
        last = {"t": time.monotonic(), "steps": 0}

        def on_tick(a: Actor) -> None:
            now = time.monotonic()
            rate = (a.env_steps - last["steps"]) / max(now - last["t"], 1e-9)
            last.update(t=now, steps=a.env_steps)
            metrics_queue.put(
                {
                    "type": "counters",
                    "actor": actor_index,
                    "time": time.time(),
                    **a.counters(),
                    "actor/env_steps_per_s": rate,
                }
            )

        log.info(
            "actor %d: %d envs (%s), partitions %s",
            actor_index,
            actor.num_envs,
            env.backend,
            np.asarray(partitions).tolist(),
        )
        actor.run(_OrphanGuard(stop_event, parent_pid or os.getppid()), on_tick=on_tick)
        on_tick(actor)
    except BaseException:
        try:
            metrics_queue.put(
                {"type": "error", "actor": actor_index, "error": traceback.format_exc()}
            )
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
