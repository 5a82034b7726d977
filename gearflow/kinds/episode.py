"""The episode item kind (Decision Transformer): whole episodes, in one module.

* :class:`Episode` — the item rule: a whole episode up to ``max_episode_length`` steps, padded
  like a sequence (its gathers, on the CPU and the GPU, are :class:`~gearflow.kinds.sequence.Sequence`'s
  with ``T = max_episode_length``); at most one record per step.
* :class:`EpisodeAdder` — writes steps and one item per episode (``obs action reward timestep``).
* :class:`EpisodeActor` — acts over each env's (R̂, obs, action) context (below).
* :data:`KIND` — the registry's entry (:mod:`gearflow.kinds.registry`); the fewest steps per
  partition are the longest episode item (``EpisodeAdder.min_steps``).

**The actor** (Decision Transformer). Per ``recv`` of a batch of ``b`` envs::

    obs, reward, terminated, truncated, ids = env.recv()
    R̂[ids] -= reward              # return-to-go: R̂_0 = agent.initial_rtg(), minus what was collected
    context[ids] ← (R̂, obs, ·, t)  # each env's last K steps, left-aligned, reset at an episode's start
    out = agent.act(policy, obs_ctx, epsilon[ids], rng, lengths=, rtg=, actions=, timesteps=)
    env.send(out.actions, ids)
    adder.add(...)

ε here is the probability of sampling from the policy instead of taking its mode
(:class:`~gearflow.agent.EpisodeAgent`).

**Key/value cache.** An agent may offer ``make_kv_cache(E)`` (a
:class:`~agents.kv_cache.KVCache` of token keys/values, or None when switched
off), ``context_hop()`` and ``act_cached(network, cache, ids, ...)`` with
:meth:`act`'s context arguments (``agents.decision_transformer`` does,
``agent.kv_cache``). Each step then runs the network on a_{t−1}, R̂_t and s_t
only; a full context drops its oldest ``H = agent.context_hop()`` steps at once
and the cache is cleared there, at an episode's start and when the weights
change, so that the next step re-encodes the whole context. The context is
``K − H + 1`` to ``K`` steps; over the same steps the actions equal a full
recompute (see :mod:`gearflow.kinds.sequence` for why a cache cannot slide by
one step exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from gearflow.actors.adders import Adder
from gearflow.actors.base import ActorBase
from gearflow.kinds.registry import KindDef
from gearflow.kinds.sequence import Sequence
from gearflow.replay.protocols import WriterLike
from gearflow.replay.spec import TableSpec

__all__ = ["KIND", "Episode", "EpisodeActor", "EpisodeAdder"]


@dataclass(frozen=True)
class Episode(Sequence):
    """Whole episodes (items of up to ``max_episode_length`` steps), padded like sequences."""

    max_episode_length: int = 1000
    length: int = 0
    period: int = 1
    name = "episode"

    def __post_init__(self):
        if self.max_episode_length < 1:
            raise ValueError(f"max_episode_length must be ≥ 1, got {self.max_episode_length}")

    @property
    def max_length(self) -> int:
        return self.max_episode_length

    def due_on_append(self, episode_length):
        """An episode longer than ``max_episode_length`` is cut into chunks of that length."""
        T = self.max_episode_length
        return [T] if episode_length > 0 and episode_length % T == 0 else []

    def due_at_end(self, episode_length):
        rest = episode_length % self.max_episode_length
        return [rest] if rest else []

    def to_dict(self):
        return {"kind": self.name, "max_episode_length": self.max_episode_length}

    def records_per_partition(self, steps_per_partition):
        return int(steps_per_partition) + 2  # at most one per step


# ---------------------------------------------------------------------- the adder


class EpisodeAdder(Adder):
    """Whole episodes (Decision Transformer), one row per step; an episode of L actions is L rows::

        row t:  obs_t  action_t  reward_t (r after action_t)  timestep t

    Row t is complete when the reward of action_t arrives with obs_{t+1}, so each env
    stages one step and appends its row one recv later; the final observation is not
    stored (a DT does not bootstrap). When an episode ends, one item is created over
    its last ``min(L, T)`` rows (``T = kind.max_length``; earlier rows of a longer
    episode are stored but never sampled), with priority ``priority_fn(return of those
    rows, their number)`` (the agent's ``episode_priority``: the learner recomputes the
    same value, so priorities never drift).
    """

    COLUMNS = ("obs", "action", "reward", "timestep")

    def __init__(self, writer: WriterLike, kind: Episode, priority_fn: Callable):
        super().__init__(writer)
        self.kind, self.priority_fn = kind, priority_fn
        E, obs_col, act_col = writer.num_streams, writer.spec["obs"], writer.spec["action"]
        self._t = np.zeros(E, dtype=np.int64)  # timestep of each env's next obs
        # The staged step of each env (its row waits for the reward of its action).
        self._staged = np.zeros(E, dtype=bool)
        self._s_obs = np.zeros((E, *obs_col.row_shape), dtype=obs_col.dtype)  # (E, *obs) or (E, *frame)
        self._s_action = np.zeros((E, *act_col.shape), dtype=act_col.dtype)
        self._s_t = np.zeros(E, dtype=np.int64)
        # Rewards of each env's last T rows (by timestep % T): the item's return at the end.
        self._T = int(kind.max_length)
        self._rewards = np.zeros((E, self._T), dtype=np.float64)
        self.long_episodes = 0  # episodes longer than T (only their last T rows are sampled)

    @classmethod
    def check_kind(cls, kind, agent_name: str) -> None:
        if not isinstance(kind, Episode):
            raise ValueError(f"the episode actor writes episode items; agent {agent_name} asks for {kind}")

    @classmethod
    def min_steps(cls, actor, kind) -> int:
        return kind.max_length  # the longest episode item

    @classmethod
    def size_error(cls, actor, kind, steps: int) -> str:
        return (f"steps_per_partition={steps} is too small for episode items of {kind.max_length} steps "
                f"(replay.max_episode_length); need at least {kind.max_length}")  # fmt: skip

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version: int) -> None:
        reward = np.asarray(reward, dtype=np.float64)
        obs = self._frames(obs)  # (b, *obs), or the newest frames (b, *frame): a view
        done = np.asarray(terminated) | np.asarray(truncated)
        w = self.writer
        self._t[ids[first]] = 0
        # 1. the staged step of each env is complete: its row
        staged = self._staged[ids]
        if staged.any():
            e = ids[staged]
            r = reward[staged]
            w.append({"obs": self._s_obs[e], "action": self._s_action[e],
                      "reward": r.astype(np.float32), "timestep": self._s_t[e]}, streams=e)  # fmt: skip
            self._rewards[e, self._s_t[e] % self._T] = r
            self._staged[e] = False
        # 2. episodes that ended: one item over the last min(L, T) rows
        if done.any():
            e = ids[done]
            L = w.episode_lengths(e)
            has = L > 0
            if has.any():
                ei, Li = e[has], L[has]
                n = np.minimum(Li, self._T)
                self.long_episodes += int((Li > self._T).sum())
                window = (Li[:, None] - 1 - np.arange(self._T)[None, :]) % self._T  # slots of the last T rows
                keep = np.arange(self._T)[None, :] < n[:, None]
                ret = np.where(keep, self._rewards[ei[:, None], window], 0.0).sum(axis=1)
                prio = np.asarray(self.priority_fn(ret, n), dtype=np.float64)
                w.create_items(prio, n, ei, w.positions[ei])
                self.items += ei.size
            w.end_episode(e)
            self._rewards[e] = 0.0
        # 3. stage the new steps of envs that continue
        live = ~done
        if live.any():
            e = ids[live]
            self._s_obs[e] = obs[live]
            self._s_action[e] = actions[live]
            self._s_t[e] = self._t[e]
            self._t[e] += 1
            self._staged[e] = True


# ---------------------------------------------------------------------- the actor


class EpisodeActor(ActorBase):
    """Steps one vectorised env with a return-conditioned agent and writes episode items
    (constructor arguments: :class:`~gearflow.actors.base.ActorBase`)."""

    NAME = "the episode actor"

    def _make_adder(self, writer) -> EpisodeAdder:
        return EpisodeAdder(writer, self.kind, self.agent.episode_priority)

    @property
    def long_episodes(self) -> int:
        """Episodes longer than the item's T (only their last T rows are sampled)."""
        return 0 if self.adder is None else self.adder.long_episodes

    def _setup_state(self) -> None:
        E, obs_shape, obs_dtype = self.num_envs, tuple(self.env.obs_shape), np.dtype(self.env.obs_dtype)
        act_col = TableSpec.parse(self.agent.replay_columns())["action"]
        act_shape, act_dtype = act_col.shape, act_col.dtype
        # Context per env: its last K steps (R̂, obs, action, timestep), left-aligned.
        K = self.context = int(self.agent.context_length())
        self._act_shape, self._act_dtype = act_shape, act_dtype
        self._ctx_obs = np.zeros((E, K, *obs_shape), dtype=obs_dtype)  # (E, K, *obs)
        self._ctx_action = np.zeros((E, K, *act_shape), dtype=act_dtype)  # (E, K[, A])
        self._ctx_rtg = np.zeros((E, K), dtype=np.float32)
        self._ctx_t = np.zeros((E, K), dtype=np.int64)
        self._ctx_len = np.zeros(E, dtype=np.int64)
        self._rtg = np.zeros(E, dtype=np.float64)  # R̂ of each env's next step
        self._t = np.zeros(E, dtype=np.int64)  # timestep of each env's next obs
        make_cache = getattr(self.agent, "make_kv_cache", None)
        self.cache = make_cache(E) if make_cache is not None else None  # KVCache | None
        self.hop = int(self.agent.context_hop()) if self.cache is not None else 1  # steps a full context drops
        self._cache_version = -1  # weights version of the cached keys

    def step(self) -> int:
        """One recv → R̂ and context → act → send → rows and items. Returns the env steps done."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        reward = np.asarray(reward, dtype=np.float64)
        done = np.asarray(terminated) | np.asarray(truncated)
        first = self._new_episode[ids]
        self._rtg[ids[~first]] -= reward[~first]  # the reward of each env's last action
        live = ~done
        actions = np.zeros((ids.size, *self._act_shape), dtype=self._act_dtype)
        if live.any():
            el = ids[live]
            self._push_context(el, obs[live], first[live])
            ctx = {"lengths": self._ctx_len[el], "rtg": self._ctx_rtg[el], "actions": self._ctx_action[el],
                   "timesteps": self._ctx_t[el]}  # fmt: skip
            with torch.inference_mode():  # cheaper per op than no_grad; the cache is updated in place
                if self.cache is None:
                    out = self.agent.act(self.network, self._ctx_obs[el], self.epsilon[el], self.rng, **ctx)
                else:
                    if self._cache_version != self.version:  # new weights: every cached key is stale
                        self.cache.clear()
                        self._cache_version = self.version
                    out = self.agent.act_cached(self.network, self.cache, el, self._ctx_obs[el], self.epsilon[el],
                                                self.rng, **ctx)  # fmt: skip
            actions[live] = out.actions
        self.env.send(actions, env_ids)  # the envs step while we write replay (done envs reset)
        self._observe(ids, obs, reward, terminated, truncated, actions, None)
        if live.any():
            e = ids[live]
            self._ctx_action[e, self._ctx_len[e] - 1] = actions[live]  # a_t joins the context
            self._t[e] += 1
        return self._count_steps(ids.size)

    def _push_context(self, e, obs, first) -> None:
        """Append (R̂, obs, placeholder action, t) to each env's context (emptied at an
        episode's first step; when full, the oldest ``hop`` steps are dropped: 1 without a
        cache, ``agent.context_hop()`` with one, whose entries for the env are then cleared)."""
        if first.any():
            n = e[first]
            self._ctx_len[n] = 0
            self._t[n] = 0
            self._rtg[n] = self.agent.initial_rtg()
        K, H = self.context, self.hop
        full = self._ctx_len[e] >= K
        if full.any():
            f = e[full]
            for buf in (self._ctx_obs, self._ctx_action, self._ctx_rtg, self._ctx_t):
                buf[f, : K - H] = buf[f, H:]
            self._ctx_len[f] = K - H
        if self.cache is not None:
            self.cache.clear(e[first | full])
        i = self._ctx_len[e]
        self._ctx_obs[e, i] = obs
        self._ctx_action[e, i] = 0  # a_t is what we are about to choose; the model never sees it at s_t
        self._ctx_rtg[e, i] = self._rtg[e]
        self._ctx_t[e, i] = self._t[e]
        self._ctx_len[e] += 1


KIND = KindDef("episode", item=Episode, adder=EpisodeAdder, actor=EpisodeActor,
               from_config=lambda r: Episode(max_episode_length=int(r.max_episode_length)))
