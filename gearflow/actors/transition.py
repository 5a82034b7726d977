"""The Ape-X actor: ε-greedy over an ε ladder, acting on each env's current observation;
its :class:`~gearflow.actors.adders.TransitionAdder` writes n-step transitions.

    out = agent.act(policy, obs, epsilon[ids], rng)     # actions (b,), Q-values (b, A)

The Q-values acted with give the items' initial priorities (Ape-X, no max-priority).
"""

from __future__ import annotations

import torch

from gearflow.actors.adders import TransitionAdder
from gearflow.actors.base import ActorBase, register_actor


@register_actor("transition")
class Actor(ActorBase):
    """Steps one vectorised env with an agent's policy and writes n-step transitions
    (constructor arguments: :class:`~gearflow.actors.base.ActorBase`)."""

    NAME = "the actor"

    def _make_adder(self, writer) -> TransitionAdder:
        return TransitionAdder(writer, int(self.cfg.actor.n_step), float(self.cfg.actor.gamma))

    def step(self) -> int:
        """One recv → act → send → replay writes. Returns the env steps done (the batch size)."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        with torch.no_grad():
            out = self.agent.act(self.network, obs, self.epsilon[ids], self.rng)
        self.env.send(out.actions, env_ids)  # the envs step while we write replay
        self._observe(ids, obs, reward, terminated, truncated, out.actions, out.values)
        return self._count_steps(ids.size)


__all__ = ["Actor"]
