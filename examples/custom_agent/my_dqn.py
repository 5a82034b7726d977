"""A minimal DQN that lives outside gearflow: the whole agent protocol in one file.

Mnih et al. 2015, "Human-level control through deep reinforcement learning",
https://www.nature.com/articles/nature14236 — here with the n-step returns and
initial priorities that gearflow's Ape-X actors compute. Name it in YAML by its
import path (``agent: {name: my_dqn}``) and run ``gearflow train my_dqn.yaml``
from the directory that holds this file (see docs/custom_agent.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gearflow.agent import ActOutput
from gearflow.kinds.transition import Transition


@dataclass
class Config:
    hidden: int = 64
    """Width of the two hidden layers."""
    lr: float = 1e-3
    """Adam learning rate."""
    target_update_period: int = 200
    """Learner updates between copies of the online network into the target network."""


class Agent:
    def __init__(self, cfg: Config, spec, settings, device: torch.device):
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        self.num_actions = int(spec.num_actions)
        self.rng = np.random.default_rng(settings.seed)
        self.kind = settings.learns_from(Transition, type(self).__module__)  # replay.item's kind, or one line
        self.online = None

    # ---- replay: the Ape-X actor writes these five columns, one row per step
    def replay_columns(self) -> dict[str, str]:
        shape = ",".join(str(d) for d in self.spec.obs_shape)
        return {
            "obs": f"{np.dtype(self.spec.obs_dtype).name}[{shape}]",
            "action": "int64",
            "ret": "float32",  # n-step return of the transition starting at this row
            "disc": "float32",  # γ^k to the bootstrap row, 0 if the episode terminated
            "version": "int64",  # weights version the actor acted with
        }

    def item_kind(self) -> Transition:
        return self.kind  # the run's Transition(next_columns=("obs",)): batches also get next_obs (row t+n)

    # ---- acting (actor processes)
    def make_network(self) -> nn.Module:
        obs_dim, h = int(np.prod(self.spec.obs_shape)), self.cfg.hidden
        return nn.Sequential(
            nn.Flatten(), nn.Linear(obs_dim, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
            nn.Linear(h, self.num_actions),
        ).to(self.device)

    def act(self, network, obs, epsilon, rng=None) -> ActOutput:
        rng = self.rng if rng is None else rng
        q = network(torch.as_tensor(obs, device=self.device).float()).cpu().numpy()  # (k, A)
        explore = rng.random(len(q)) < epsilon  # per-env ε (the Ape-X ladder)
        actions = np.where(explore, rng.integers(self.num_actions, size=len(q)), q.argmax(axis=1))
        return ActOutput(actions=actions.astype(np.int64), values=q)  # values: initial priorities

    # ---- learning (the learner process)
    def setup_learner(self) -> None:
        self.online = self.make_network()
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=self.cfg.lr)
        self.updates = 0

    def learner_network(self) -> nn.Module:
        return self.online  # the weights published to the actors

    def learn(self, batch):
        d = {k: v.to(self.device) for k, v in batch.data.items()}
        with torch.no_grad():  # y = R_t^(n) + γ^n max_a Q_target(s_{t+n}, a)
            y = d["ret"] + d["disc"] * self.target(d["next_obs"].float()).max(dim=1).values  # (B,)
        q = self.online(d["obs"].float()).gather(1, d["action"][:, None]).squeeze(1)  # (B,)
        weights = batch.weights.to(self.device)  # (B,) importance weights of prioritized replay
        loss = (weights * F.smooth_l1_loss(q, y, reduction="none")).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.cfg.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())
        metrics = {"learner/loss": loss.detach(), "learner/updates": float(self.updates)}  # read at metric rows
        return metrics, (y - q).detach().abs()  # new priorities: |TD error| (B,)

    def state_dict(self) -> dict:
        return {"online": self.online.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "updates": self.updates}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if self.online is None:
            self.setup_learner()
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
