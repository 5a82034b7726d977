"""Episode actors (Decision Transformer): act over each env's (R̂, obs, action) context;
the :class:`~gearflow.actors.adders.EpisodeAdder` writes steps and one item per episode.

Per ``recv`` of a batch of ``b`` envs::

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
recompute (see :mod:`gearflow.actors.sequence` for why a cache cannot slide by
one step exactly).
"""

from __future__ import annotations

import numpy as np
import torch

from gearflow.actors.adders import EpisodeAdder
from gearflow.actors.base import ActorBase, register_actor
from gearflow.replay.spec import TableSpec


@register_actor("episode")
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


__all__ = ["EpisodeActor"]
