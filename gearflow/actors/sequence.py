"""Sequence actors (R2D2): act over each env's recent context; the
:class:`~gearflow.actors.adders.WindowAdder` writes steps and sequence windows.

Per ``recv`` of a batch of ``b`` envs::

    obs, reward, terminated, truncated, ids = env.recv()
    context[ids] ← obs            # each env's last C observations, left-aligned, reset at episode start
    out = agent.act(policy, context[ids], epsilon[ids], rng, lengths=context_len[ids])
    env.send(out.actions, ids)
    adder.add(...)                # rows, windows, R2D2 priorities from out.values

``C = agent.context_length()`` (:class:`~gearflow.agent.SequenceAgent`).
"""

from __future__ import annotations

import numpy as np
import torch

from gearflow.actors.adders import WindowAdder
from gearflow.actors.base import ActorBase, register_actor


@register_actor("sequence")
class SequenceActor(ActorBase):
    """Steps one vectorised env with a sequence agent's policy and writes sequence windows
    (constructor arguments: :class:`~gearflow.actors.base.ActorBase`)."""

    NAME = "the sequence actor"

    def _make_adder(self, writer) -> WindowAdder:
        return WindowAdder(writer, self.kind, self.agent.initial_priorities)

    def _setup_state(self) -> None:
        E, obs_shape, obs_dtype = self.num_envs, tuple(self.env.obs_shape), np.dtype(self.env.obs_dtype)
        # Context per env: the last C observations of its episode, left-aligned.
        C = self.context = int(self.agent.context_length())
        self._ctx = np.zeros((E, C, *obs_shape), dtype=obs_dtype)  # (E, C, *obs)
        self._ctx_len = np.zeros(E, dtype=np.int64)

    def step(self) -> int:
        """One recv → context → act → send → rows and windows. Returns the env steps done."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        self._push_context(ids, obs, self._new_episode[ids])
        with torch.no_grad():
            out = self.agent.act(self.network, self._ctx[ids], self.epsilon[ids], self.rng,
                                 lengths=self._ctx_len[ids])  # fmt: skip
        self.env.send(out.actions, env_ids)  # the envs step while we write replay
        self._observe(ids, obs, reward, terminated, truncated, out.actions, out.values)
        return self._count_steps(ids.size)

    def _push_context(self, ids, obs, first) -> None:
        """Append obs to each env's context (emptied at an episode's first step; the oldest
        step dropped when full)."""
        C = self.context
        self._ctx_len[ids[first]] = 0
        full = self._ctx_len[ids] >= C
        if full.any():
            f = ids[full]
            self._ctx[f, :-1] = self._ctx[f, 1:]
            self._ctx_len[f] = C - 1
        self._ctx[ids, self._ctx_len[ids]] = obs
        self._ctx_len[ids] += 1


__all__ = ["SequenceActor"]
