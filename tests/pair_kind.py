"""A small item kind written as a user would, outside the package: ``pair``, two consecutive
steps of one episode (``tests/test_kinds.py`` runs it end to end). The whole kind is this
module; importing it registers it (the one other step a kind needs)::

    batch.data["obs"]       # (B, 2, *obs): steps t and t+1
    batch.data["reward"]    # (B, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gearflow.actors.adders import Adder
from gearflow.actors.base import ActorBase
from gearflow.kinds.registry import KindDef, register_kind
from gearflow.replay.items import TORCH_DTYPES, ItemKind, flat_index, gatherable
from gearflow.replay.layout import step_rows


@dataclass(frozen=True)
class Pair(ItemKind):
    """Items of two consecutive steps; batch ``[B, 2, *shape]`` per column."""

    name = "pair"

    def layout(self, spec, batch_size):
        return {c.name: ((batch_size, 2, *c.shape), TORCH_DTYPES[c.dtype]) for c in spec}

    def rows(self, parts, starts, lengths, S, stacks=None):
        return {"pair": step_rows(np.asarray(parts)[:, None], np.asarray(starts)[:, None] + np.arange(2), S)}  # (B, 2)

    def gather(self, tensors, out, rows, lengths):
        idx = flat_index(rows["pair"])  # (B*2,)
        for name, src in tensors.items():
            src, dst = gatherable(src), gatherable(out[name])
            torch.index_select(src, 0, idx, out=dst.view(-1, *src.shape[1:]))

    def to_dict(self):
        return {"kind": self.name}

    def records_per_partition(self, steps_per_partition):
        return int(steps_per_partition)  # at most one item per step

    def max_steps(self, steps_per_partition):
        return 2


class PairAdder(Adder):
    """One row per step (``obs reward``); after each step of an episode but its first, the item
    over the last two steps (priority 1)."""

    COLUMNS = ("obs", "reward")
    USES_FIRST = False

    @classmethod
    def check_kind(cls, kind, agent_name):
        if not isinstance(kind, Pair):
            raise ValueError(f"the pair actor writes pair items; agent {agent_name} asks for {kind}")

    @classmethod
    def min_steps(cls, cfg, kind):
        return 2

    @classmethod
    def size_error(cls, cfg, kind, steps):
        return f"steps_per_partition={steps} is too small for pairs; need at least 2"

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version):
        w = self.writer
        w.append({"obs": self._frames(obs), "reward": np.asarray(reward, np.float32)}, streams=ids)
        lengths = w.episode_lengths(ids)
        due = ids[lengths >= 2]
        if due.size:
            w.create_items(np.ones(due.size), np.full(due.size, 2), due, w.positions[due])
            self.items += due.size
        done = np.asarray(terminated) | np.asarray(truncated)
        if done.any():
            w.end_episode(ids[done])


class PairActor(ActorBase):
    """Acts with the agent on each env's current observation; its adder writes pairs."""

    NAME = "the pair actor"

    def _make_adder(self, writer):
        return PairAdder(writer)

    def step(self):
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        with torch.no_grad():
            out = self.agent.act(self.network, obs, self.epsilon[ids], self.rng)
        self.env.send(out.actions, env_ids)
        self._observe(ids, obs, reward, terminated, truncated, out.actions, None)
        return self._count_steps(ids.size)


KIND = register_kind(KindDef("pair", item=Pair, adder=PairAdder, actor=PairActor, config_min_steps=lambda cfg: 2))


# A user's agent for it, one file as agents are (``agent.name=pair_kind``): apex_dqn's network
# and acting; what it writes and samples are pairs.
from agents.apex_dqn import Agent as ApexAgent  # noqa: E402
from agents.apex_dqn import Config  # noqa: E402,F401  (the agent module's config dataclass)


class Agent(ApexAgent):
    """apex_dqn acting, over ``pair`` items of ``obs reward``."""

    ITEM = Pair  # replay.item=pair: the run's kind is handed in (settings.kind), as every agent's

    def replay_columns(self):
        return {"obs": super().replay_columns()["obs"], "reward": "float32"}
