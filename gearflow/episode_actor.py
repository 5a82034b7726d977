"""Episode actors (Decision Transformer): act over each env's (R̂, obs, action) context,
write steps, create one ``Episode`` item per finished episode.

One :class:`EpisodeActor` drives ``env.num_envs`` environments; env ``e`` writes
replay partition ``partitions[e]``, like the Ape-X :class:`~gearflow.actor.Actor`
(same constructor, ``step``/``run``/``counters``/``close``, ε ladder, weight
sync). Per ``recv`` of a batch of ``b`` envs::

    obs, reward, terminated, truncated, ids = env.recv()
    R̂[ids] -= reward              # return-to-go: R̂_0 = agent.initial_rtg(), minus what was collected
    context[ids] ← (R̂, obs, ·, t)  # each env's last K steps, left-aligned, reset at an episode's start
    out = agent.act(policy, obs_ctx, epsilon[ids], rng, lengths=, rtg=, actions=, timesteps=)
    env.send(out.actions, ids)
    rows, items (below)

Replay layout (one row per step; an episode of L actions is L rows)::

    row t:  obs_t  action_t  reward_t (r after action_t)  timestep t

Row t is complete when the reward of action_t arrives with obs_{t+1}, so each env
stages one step and appends its row one recv later; the final observation is not
stored (a DT does not bootstrap). When an episode ends, one item is created over
its last ``min(L, T)`` rows (``T = agent.item_kind().max_episode_length``; earlier
rows of a longer episode are stored but never sampled), with priority
``agent.episode_priority(return of those rows, their number)``: the learner
recomputes the same value, so priorities never drift.

    actor = EpisodeActor(cfg, actor_index=0, storage=storage, partitions=np.arange(8),
                         param_source=store, agent=agent)
    actor.run(stop_event, max_steps=10_000)
    actor.close()
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from gearflow.actor import ActorBase
from gearflow.replay.items import Episode

log = logging.getLogger(__name__)

EPISODE_COLUMNS = ("obs", "action", "reward", "timestep")


class EpisodeActor(ActorBase):
    """Steps one vectorised env with a return-conditioned agent and writes episode items
    (constructor arguments: :class:`~gearflow.actor.ActorBase`)."""

    NAME = "the episode actor"
    COLUMNS = EPISODE_COLUMNS

    def _check_kind(self, kind) -> None:
        if not isinstance(kind, Episode):
            raise ValueError(
                f"the episode actor writes episode items; agent {type(self.agent).__module__} asks for {kind}"
            )

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        return kind.max_length  # the longest episode item

    def _check_size(self, steps_per_partition: int) -> None:
        if steps_per_partition < self.min_steps(self.cfg, self.kind):
            raise ValueError(
                f"steps_per_partition={steps_per_partition} is too small for episode items of "
                f"{self.kind.max_length} steps (replay.max_episode_length); need at least {self.kind.max_length}"
            )

    def _setup_state(self, cfg, spec) -> None:
        E, obs_col, act_col = self.num_envs, spec["obs"], spec["action"]
        # ε here: the probability of sampling from the policy instead of taking its mode
        # Context per env: its last K steps (R̂, obs, action, timestep), left-aligned.
        K = self.context = int(self.agent.context_length())
        self._act_shape, self._act_dtype = act_col.shape, act_col.dtype
        self._ctx_obs = np.zeros((E, K, *obs_col.shape), dtype=obs_col.dtype)  # (E, K, *obs)
        self._ctx_action = np.zeros((E, K, *act_col.shape), dtype=act_col.dtype)  # (E, K[, A])
        self._ctx_rtg = np.zeros((E, K), dtype=np.float32)
        self._ctx_t = np.zeros((E, K), dtype=np.int64)
        self._ctx_len = np.zeros(E, dtype=np.int64)
        self._rtg = np.zeros(E, dtype=np.float64)  # R̂ of each env's next step
        self._t = np.zeros(E, dtype=np.int64)  # timestep of each env's next obs
        self._new_episode = np.ones(E, dtype=bool)  # the next obs of env e starts an episode
        # The staged step of each env (its row waits for the reward of its action).
        self._staged = np.zeros(E, dtype=bool)
        self._s_obs = np.zeros((E, *obs_col.shape), dtype=obs_col.dtype)
        self._s_action = np.zeros((E, *act_col.shape), dtype=act_col.dtype)
        self._s_t = np.zeros(E, dtype=np.int64)
        # Rewards of each env's last T rows (by timestep % T): the item's return at the end.
        self._T = int(self.kind.max_length)
        self._rewards = np.zeros((E, self._T), dtype=np.float64)
        self._episode_return = np.zeros(E, dtype=np.float64)
        self.long_episodes = 0  # episodes longer than T (only their last T rows are sampled)

    # ------------------------------------------------------------------ stepping
    def step(self) -> int:
        """One recv → R̂ and context → act → send → rows and items. Returns the env steps done."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        reward = np.asarray(reward, dtype=np.float64)
        done = np.asarray(terminated) | np.asarray(truncated)
        staged = self._staged[ids]  # these envs' staged step gets its reward now
        e = ids[staged]
        self._rtg[e] -= reward[staged]
        self._episode_return[e] += reward[staged]
        live = ~done
        actions = np.zeros((ids.size, *self._act_shape), dtype=self._act_dtype)
        if live.any():
            el = ids[live]
            self._push_context(el, obs[live])
            with torch.no_grad():
                out = self.agent.act(self.network, self._ctx_obs[el], self.epsilon[el], self.rng,
                                     lengths=self._ctx_len[el], rtg=self._ctx_rtg[el],
                                     actions=self._ctx_action[el], timesteps=self._ctx_t[el])  # fmt: skip
            actions[live] = out.actions
        self.env.send(actions, env_ids)  # the envs step while we write replay (done envs reset)
        self._record(ids, obs, reward, done, staged, actions)
        return self._count_steps(ids.size)

    def _push_context(self, e, obs) -> None:
        """Append (R̂, obs, placeholder action, t) to each env's context (emptied at an
        episode's first step; the oldest step dropped when full)."""
        new = self._new_episode[e]
        if new.any():
            n = e[new]
            self._ctx_len[n] = 0
            self._t[n] = 0
            self._rtg[n] = self.agent.initial_rtg()
            self._new_episode[n] = False
        K = self.context
        full = self._ctx_len[e] >= K
        if full.any():
            f = e[full]
            for buf in (self._ctx_obs, self._ctx_action, self._ctx_rtg, self._ctx_t):
                buf[f, :-1] = buf[f, 1:]
            self._ctx_len[f] = K - 1
        i = self._ctx_len[e]
        self._ctx_obs[e, i] = obs
        self._ctx_action[e, i] = 0  # a_t is what we are about to choose; the model never sees it at s_t
        self._ctx_rtg[e, i] = self._rtg[e]
        self._ctx_t[e, i] = self._t[e]
        self._ctx_len[e] += 1

    def _record(self, ids, obs, reward, done, staged, actions) -> None:
        # 1. the staged step of each env is complete: its row
        if staged.any():
            e = ids[staged]
            r = reward[staged]
            self.writer.append({"obs": self._s_obs[e], "action": self._s_action[e],
                                "reward": r.astype(np.float32), "timestep": self._s_t[e]}, streams=e)  # fmt: skip
            self._rewards[e, self._s_t[e] % self._T] = r
            self._staged[e] = False
        # 2. episodes that ended: one item over the last min(L, T) rows
        if done.any():
            e = ids[done]
            L = self.writer.episode_lengths(e)
            has = L > 0
            if has.any():
                ei, Li = e[has], L[has]
                n = np.minimum(Li, self._T)
                self.long_episodes += int((Li > self._T).sum())
                window = (Li[:, None] - 1 - np.arange(self._T)[None, :]) % self._T  # slots of the last T rows
                keep = np.arange(self._T)[None, :] < n[:, None]
                ret = np.where(keep, self._rewards[ei[:, None], window], 0.0).sum(axis=1)
                prio = np.asarray(self.agent.episode_priority(ret, n), dtype=np.float64)
                self.writer.create_items(prio, n, ei, self.writer.positions[ei])
                self.items += ei.size
            self.writer.end_episode(e)
            self._close_episodes(e, L)
        # 3. stage the new steps of envs that continue
        live = ~done
        if live.any():
            e = ids[live]
            self._s_obs[e] = obs[live]
            self._s_action[e] = actions[live]
            self._s_t[e] = self._t[e]
            self._ctx_action[e, self._ctx_len[e] - 1] = actions[live]  # a_t joins the context
            self._t[e] += 1
            self._staged[e] = True

    def _close_episodes(self, e, lengths) -> None:
        self.episodes += e.size
        if self.on_episode is not None:
            for d, length, ret in zip(e.tolist(), lengths.tolist(), self._episode_return[e].tolist()):
                self.on_episode(int(self.global_env_index[d]), ret, int(length), float(self.epsilon[d]))
        self._episode_return[e] = 0.0
        self._rewards[e] = 0.0
        self._new_episode[e] = True
        self._staged[e] = False


__all__ = ["EPISODE_COLUMNS", "EpisodeActor"]
