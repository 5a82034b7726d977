"""Sequence actors (R2D2): act over each env's recent context, write steps, create windows.

One :class:`SequenceActor` drives ``env.num_envs`` environments; env ``e``
writes replay partition ``partitions[e]``, like the Ape-X
:class:`~gearflow.actor.Actor` (same constructor, ``step``/``run``/``counters``/
``close``, ε ladder, weight sync). What differs is what is written and how the
agent is asked for actions. Per ``recv`` of a batch of ``b`` envs::

    obs, reward, terminated, truncated, ids = env.recv()
    context[ids] ← obs            # each env's last C observations, left-aligned, reset at episode start
    out = agent.act(policy, context[ids], epsilon[ids], rng, lengths=context_len[ids])
    env.send(out.actions, ids)
    rows, windows (below)

Replay layout (one row per step; an episode of L actions is L + 1 rows)::

    row t:   obs_t  action_t  reward_t  discount_t  first_t  version_t
             reward_t = r after action_t, discount_t = 0 if that transition terminated
    row L:   obs_L (the final observation)  0  0  0  False  version

Row t is complete when the reward of action_t arrives with obs_{t+1}, so each
env stages one step and appends its row one recv later (at the end of an
episode, the staged row and the final-observation row together). Windows are
created with the item kind's schedule (``Sequence.due_on_append`` after every
appended row, ``due_at_end`` when the episode ends): windows start every
``period`` rows, never cross an episode, and the tail windows of an episode
are shorter (padded and masked when sampled).

Initial priorities are R2D2's, computed here from the Q-values the actor acted
with (``agent.initial_priorities(values, action, reward, discount, first,
lengths)``, the same TD/priority code the learner uses, with the actor's one
network as online and target). The Q-values of an env's last ``T + 1`` rows
are kept in a small ring for that. An agent without ``initial_priorities``
gets priority 1 for every new window: there is no max-priority convention in
the table, and a constant puts new windows on an equal footing with each other
until the learner has seen them.

    actor = SequenceActor(cfg, actor_index=0, storage=storage, partitions=np.arange(8),
                          param_source=store, agent=agent)
    actor.run(stop_event, max_steps=10_000)
    actor.close()
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from gearflow.actor import ActorBase
from gearflow.replay.items import Sequence

log = logging.getLogger(__name__)

SEQUENCE_COLUMNS = ("obs", "action", "reward", "discount", "first", "version")


class SequenceActor(ActorBase):
    """Steps one vectorised env with a sequence agent's policy and writes sequence windows
    (constructor arguments: :class:`~gearflow.actor.ActorBase`)."""

    NAME = "the sequence actor"
    COLUMNS = SEQUENCE_COLUMNS

    def _check_kind(self, kind) -> None:
        if not isinstance(kind, Sequence):
            raise TypeError(
                f"the sequence actor writes sequence windows; agent {type(self.agent).__module__} asks for {kind}"
            )

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        return kind.max_length + 1  # a whole window plus the staged step

    def _check_size(self, steps_per_partition: int) -> None:
        if steps_per_partition < self.min_steps(self.cfg, self.kind):
            raise ValueError(
                f"steps_per_partition={steps_per_partition} is too small for windows of "
                f"{self.kind.max_length} steps; need at least {self.kind.max_length + 1}"
            )

    def _setup_state(self, cfg, spec) -> None:
        E, obs_col = self.num_envs, spec["obs"]
        self._dt = {c.name: c.dtype for c in spec}

        # Context per env: the last C observations of its episode, left-aligned.
        C = self.context = int(self.agent.context_length()) if hasattr(self.agent, "context_length") else self.kind.max_length
        self._ctx = np.zeros((E, C, *obs_col.shape), dtype=obs_col.dtype)  # (E, C, *obs)
        self._ctx_len = np.zeros(E, dtype=np.int64)
        self._new_episode = np.ones(E, dtype=bool)  # the next obs of env e starts an episode
        # The staged step of each env (its row waits for the reward of its action).
        self._staged = np.zeros(E, dtype=bool)
        self._s_obs = np.zeros((E, *obs_col.shape), dtype=obs_col.dtype)
        self._s_action = np.zeros(E, dtype=np.int64)
        self._s_first = np.zeros(E, dtype=bool)
        self._s_version = np.zeros(E, dtype=np.int64)
        self._s_values: np.ndarray | None = None  # (E, A) once the first act reports values
        # Ring of the last W = T + 1 rows per env (by absolute row % W), for actor priorities.
        self._W = self.kind.max_length + 1
        self._r_values: np.ndarray | None = None  # (E, W, A)
        self._r_action = np.zeros((E, self._W), dtype=np.int64)
        self._r_reward = np.zeros((E, self._W), dtype=np.float32)
        self._r_discount = np.zeros((E, self._W), dtype=np.float32)
        self._r_first = np.zeros((E, self._W), dtype=bool)
        self._episode_return = np.zeros(E, dtype=np.float64)
        self._episode_steps = np.zeros(E, dtype=np.int64)
        self._pending: list[tuple[int, int, int]] = []  # windows (stream, length, end) of this recv

    # ------------------------------------------------------------------ stepping
    def step(self) -> int:
        """One recv → context → act → send → rows and windows. Returns the env steps done."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        first = self._new_episode[ids]  # (b,) obs is an episode's step 0
        self._push_context(ids, obs, first)
        with torch.no_grad():
            out = self.agent.act(self.network, self._ctx[ids], self.epsilon[ids], self.rng,
                                 lengths=self._ctx_len[ids])  # fmt: skip
        self.env.send(out.actions, env_ids)  # the envs step while we write replay
        self._record(ids, obs, np.asarray(reward), np.asarray(terminated), np.asarray(truncated), first,
                     out.actions, out.values)  # fmt: skip
        return self._count_steps(ids.size)

    def _push_context(self, ids, obs, first) -> None:
        """Append obs to each env's context (emptied at an episode's first step; the oldest
        step dropped when full)."""
        C = self.context
        self._ctx_len[ids[first]] = 0
        self._new_episode[ids] = False
        full = self._ctx_len[ids] >= C
        if full.any():
            f = ids[full]
            self._ctx[f, :-1] = self._ctx[f, 1:]
            self._ctx_len[f] = C - 1
        self._ctx[ids, self._ctx_len[ids]] = obs
        self._ctx_len[ids] += 1

    def _record(self, ids, obs, reward, terminated, truncated, first, actions, values) -> None:
        if values is not None and self._r_values is None:
            A = values.shape[1]
            self._s_values = np.zeros((self.num_envs, A), dtype=np.float32)
            self._r_values = np.zeros((self.num_envs, self._W, A), dtype=np.float32)
        done = terminated | truncated
        self._episode_return[ids] += reward
        # 1. the staged step of each env is complete: its row (reward of its action, discount)
        st = self._staged[ids]
        if st.any():
            e = ids[st]
            discount = np.where(terminated[st], 0.0, 1.0).astype(np.float32)
            self._append(e, {
                "obs": self._s_obs[e], "action": self._s_action[e], "reward": reward[st].astype(np.float32),
                "discount": discount, "first": self._s_first[e], "version": self._s_version[e],
            }, None if self._s_values is None else self._s_values[e])  # fmt: skip
            self._staged[e] = False
            self._episode_steps[e] += 1
        # 2. episodes that ended: the final observation as its own row, then the tail windows
        if done.any():
            e = ids[done]
            D = e.size
            self._append(e, {
                "obs": np.ascontiguousarray(obs[done]), "action": np.zeros(D, np.int64),
                "reward": np.zeros(D, np.float32), "discount": np.zeros(D, np.float32),
                "first": np.zeros(D, bool), "version": np.full(D, self.version, np.int64),
            }, None if values is None else values[done])  # fmt: skip
            ends = self.writer.positions
            for stream, L in zip(e.tolist(), self.writer.episode_lengths(e).tolist()):
                self._pending += [(stream, n, int(ends[stream])) for n in self.kind.due_at_end(L)]
        self._create_windows()
        if done.any():
            e = ids[done]
            self.writer.end_episode(e)
            self._close_episodes(e)
        # 3. stage the new steps of envs that continue
        live = ~done
        if live.any():
            e = ids[live]
            self._s_obs[e] = obs[live]
            self._s_action[e] = actions[live]
            self._s_first[e] = first[live]
            self._s_version[e] = self.version
            if values is not None:
                self._s_values[e] = values[live]
            self._staged[e] = True

    def _append(self, e, row, values) -> None:
        """Append one row per env ``e`` (streams), keep it in the priority ring, queue the
        windows now due."""
        pos = self.writer.append(row, streams=e)  # (k,) absolute row
        slot = pos % self._W
        self._r_action[e, slot] = row["action"]
        self._r_reward[e, slot] = row["reward"]
        self._r_discount[e, slot] = row["discount"]
        self._r_first[e, slot] = row["first"]
        if values is not None and self._r_values is not None:
            self._r_values[e, slot] = values
        lengths = self.writer.episode_lengths(e)  # rows in each episode so far
        for stream, L, p in zip(e.tolist(), lengths.tolist(), pos.tolist()):
            self._pending += [(stream, n, p + 1) for n in self.kind.due_on_append(L)]

    def _create_windows(self) -> None:
        """Publish the windows queued in this recv with one ``create_items`` call."""
        if not self._pending:
            return
        win = np.asarray(self._pending, dtype=np.int64)  # (m, 3): stream, length, end
        self._pending = []
        streams, lengths, ends = win[:, 0], win[:, 1], win[:, 2]
        self.writer.create_items(self._priorities(streams, lengths, ends), lengths, streams, ends)
        self.items += streams.size

    def _priorities(self, streams, lengths, ends) -> np.ndarray:
        fn = getattr(self.agent, "initial_priorities", None)
        if fn is None or self._r_values is None:
            return np.ones(streams.size)
        T = self.kind.max_length
        offs = np.arange(T)
        rows = ends[:, None] - lengths[:, None] + np.minimum(offs, lengths[:, None] - 1)  # (m, T)
        slot = rows % self._W
        s = streams[:, None]
        pad = offs[None, :] >= lengths[:, None]  # (m, T)
        vals = self._r_values[s, slot]  # (m, T, A)
        vals[pad] = 0.0
        prio = fn(vals, np.where(pad, 0, self._r_action[s, slot]), np.where(pad, 0, self._r_reward[s, slot]),
                  np.where(pad, 0, self._r_discount[s, slot]), self._r_first[s, slot] & ~pad, lengths)  # fmt: skip
        return np.nan_to_num(np.asarray(prio, dtype=np.float64), nan=1.0, posinf=1.0)

    def _close_episodes(self, e) -> None:
        self.episodes += e.size
        if self.on_episode is not None:
            for d, length, ret in zip(e.tolist(), self._episode_steps[e].tolist(), self._episode_return[e].tolist()):
                self.on_episode(int(self.global_env_index[d]), ret, length, float(self.epsilon[d]))
        self._episode_return[e] = 0.0
        self._episode_steps[e] = 0
        self._new_episode[e] = True
        self._staged[e] = False


__all__ = ["SEQUENCE_COLUMNS", "SequenceActor"]
