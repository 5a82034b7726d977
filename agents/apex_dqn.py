"""Ape-X DQN: dueling double DQN with n-step targets and prioritized replay.

Horgan et al. 2018, "Distributed Prioritized Experience Replay", https://arxiv.org/abs/1803.00933

Reads top to bottom: the config, the networks (MLP torso for vector
observations, Nature CNN for stacked uint8 frames, dueling head), then the
agent: replay columns, acting (ε-greedy, Q-values for the actor's initial
priorities), and learning (double-Q n-step targets, PER-weighted Huber loss,
|TD error| as new priorities, periodic target copies).

The actors store one row per step, ``obs``/``action``/``version`` plus the
n-step ``ret`` and discount ``disc`` of the transition starting there; a
transition item spans rows t..t+n and its last row gives ``next_obs``::

    y = ret + disc * Q_target(next_obs, argmax_a Q_online(next_obs, a))
    disc = γ^k (k ≤ n steps to the bootstrap row), 0 if the episode terminated in the window
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents import plain_config
from gearflow.agent import ActOutput, AgentSettings, EnvSpec, learner_state, load_learner_state
from gearflow.errors import ConfigError
from gearflow.kinds.transition import Transition
from gearflow.precision import bf16_forward, fp32


@dataclass
class Config:
    network: str = "mlp"
    """Torso: ``mlp`` for vector observations, ``nature_cnn`` for stacked Atari frames."""
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    """Widths of the MLP torso's hidden layers."""
    dueling: bool = True
    """Dueling value/advantage heads (Wang et al. 2016)."""
    double: bool = True
    """Double-Q targets: the online network picks the bootstrap action, the target network values it."""
    optimizer: str = "adam"
    """``adam`` or ``rmsprop`` (Ape-X used centred RMSProp)."""
    lr: float = 1e-4
    """Learning rate."""
    adam_eps: float = 1.5e-4
    """Adam / RMSProp epsilon."""
    target_update_period: int = 2500
    """Learner updates between copies of the online network into the target network."""
    max_grad_norm: float = 40.0
    """Global gradient-norm clip."""
    huber_delta: float = 1.0
    """Huber loss threshold (the loss is quadratic below it, linear above)."""


# ----------------------------------------------------------------------------- networks


class MLPTorso(nn.Module):
    """Flattened vector observation → ReLU MLP features (no hidden layers: the obs itself)."""

    def __init__(self, obs_shape, hidden_sizes):
        super().__init__()
        sizes = [int(np.prod(obs_shape)), *hidden_sizes]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers)
        self.out_dim = sizes[-1]

    def forward(self, obs):
        return self.net(obs.float())  # (B, out_dim)


class NatureCNN(nn.Module):
    """Mnih et al. 2015 torso for uint8 frames (B, 4, 84, 84), scaled to [0, 1]."""

    def __init__(self, obs_shape):
        super().__init__()
        c = obs_shape[0]
        self.convs = nn.Sequential(
            nn.Conv2d(c, 32, 8, stride=4),
            nn.ReLU(),  # (B, 32, 20, 20)
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),  # (B, 64, 9, 9)
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),  # (B, 64, 7, 7)
            nn.Flatten(),  # (B, 3136)
        )
        with torch.no_grad():
            flat = self.convs(torch.zeros(1, *obs_shape)).shape[1]
        self.fc = nn.Sequential(nn.Linear(flat, 512), nn.ReLU())
        self.out_dim = 512

    def forward(self, obs):
        return self.fc(self.convs(obs.float() / 255.0))  # (B, 512)


class QNetwork(nn.Module):
    """Torso + (dueling) head: Q(s, ·) of shape (B, A), float32 (the head runs in fp32 under
    bf16 autocast: targets and TD errors need more than bf16's 8 bits; gearflow/precision.py)."""

    def __init__(self, torso: nn.Module, num_actions: int, dueling: bool):
        super().__init__()
        self.torso = torso
        self.dueling = dueling
        if dueling:
            self.value = nn.Linear(torso.out_dim, 1)
            self.advantage = nn.Linear(torso.out_dim, num_actions)
        else:
            self.q = nn.Linear(torso.out_dim, num_actions)

    def forward(self, obs):
        h = self.torso(obs)  # (B, D), bf16 under the learner's autocast
        with fp32(h):
            h = h.float()
            if not self.dueling:
                return self.q(h)  # (B, A)
            adv = self.advantage(h)  # (B, A)
            return self.value(h) + adv - adv.mean(dim=1, keepdim=True)  # (B, A)


def n_step_targets(online: nn.Module, target: nn.Module, next_obs, ret, disc, double: bool, bf16: bool = False):
    """y = ret + disc · Q_target(next_obs, a*), a* = argmax Q_online (double) or Q_target; (B,) float32.
    ``bf16``: the forward passes under bf16 autocast, the targets in fp32."""
    with torch.no_grad():
        with bf16_forward(next_obs.device, bf16):
            next_q_target = target(next_obs)  # (B, A)
            best = (online(next_obs) if double else next_q_target).argmax(dim=1, keepdim=True)  # (B, 1)
        bootstrap = next_q_target.float().gather(1, best).squeeze(1)  # (B,)
        return ret.float() + disc.float() * bootstrap  # (B,)


# ----------------------------------------------------------------------------- agent


class Agent:
    """Ape-X DQN; see the module docstring. Learner state lives in ``setup_learner``."""

    ITEM = Transition  # the item kind it learns from (replay.item)

    def __init__(self, cfg: Config, spec: EnvSpec, settings: AgentSettings, device: torch.device):
        if spec.num_actions is None:
            raise ConfigError(
                f"agent.name=agents.apex_dqn needs a discrete action space, but env "
                f"{spec.env_id or '?'!r} has {spec.action_space} (DQN picks one of A actions)"
            )
        if cfg.network not in ("mlp", "nature_cnn"):
            raise ConfigError(f"agent.network={cfg.network!r}: must be 'mlp' or 'nature_cnn'")
        if cfg.optimizer not in ("adam", "rmsprop"):
            raise ConfigError(f"agent.optimizer={cfg.optimizer!r}: must be 'adam' or 'rmsprop'")
        if cfg.network == "nature_cnn" and len(spec.obs_shape) != 3:
            raise ConfigError(
                f"agent.network=nature_cnn needs (C, H, W) frames, got obs shape {spec.obs_shape}"
            )
        self.cfg = plain_config(cfg, Config)  # plain attributes: a read costs ns, not OmegaConf's µs
        self.spec, self.device = spec, torch.device(device)
        self.num_actions = int(spec.num_actions)
        self.kind = settings.learns_from(self.ITEM, type(self).__module__)  # Transition(next_columns=("obs",))
        self.gamma = settings.gamma
        self.n_step = settings.n_step
        self.rng = np.random.default_rng(settings.seed)
        self.bf16 = settings.bf16  # the learner's forward passes under bf16 autocast
        self.online: nn.Module | None = None

    # ---- replay: one row per step; a transition spans rows t..t+n
    def replay_columns(self) -> dict[str, str]:
        shape = ",".join(str(d) for d in self.spec.obs_shape)
        return {
            "obs": f"{np.dtype(self.spec.obs_dtype).name}[{shape}]",
            "action": "int64",
            "ret": "float32",  # n-step return of the transition starting at this row
            "disc": "float32",  # γ^k, 0 if terminated within the window
            "version": "int64",  # weights version the actor acted with
        }

    def item_kind(self) -> Transition:
        return self.kind

    # ---- acting
    def make_network(self) -> nn.Module:
        if self.cfg.network == "nature_cnn":
            torso = NatureCNN(self.spec.obs_shape)
        else:
            torso = MLPTorso(self.spec.obs_shape, list(self.cfg.hidden_sizes))
        return QNetwork(torso, self.num_actions, self.cfg.dueling).to(self.device)

    def act(self, network, obs, epsilon, rng=None) -> ActOutput:
        rng = self.rng if rng is None else rng
        q = network(torch.as_tensor(obs, device=self.device))  # (k, A)
        values = q.float().cpu().numpy()
        actions = values.argmax(axis=1)  # (k,) int64
        k = actions.shape[0]
        explore = rng.random(k) < epsilon
        if explore.any():
            actions = np.where(explore, rng.integers(self.num_actions, size=k), actions)
        return ActOutput(actions=actions.astype(np.int64, copy=False), values=values)

    # ---- learning
    def setup_learner(self) -> None:
        cfg = self.cfg
        self.online = self.make_network()
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        # fused Adam / foreach RMSProp: a few kernels per step and no host read of the step counts
        # (the for-loop Adam reads each parameter's step back with .item()); not on the meta device
        fast = self.device.type in ("cpu", "cuda")
        if cfg.optimizer == "adam":
            self.optimizer = torch.optim.Adam(self.online.parameters(), lr=cfg.lr, eps=cfg.adam_eps,
                                              **({"fused": True} if fast else {}))  # fmt: skip
        else:
            self.optimizer = torch.optim.RMSprop(self.online.parameters(), lr=cfg.lr, alpha=0.95, eps=cfg.adam_eps,
                                                 centered=True, **({"foreach": True} if fast else {}))  # fmt: skip
        self.updates = 0

    def learner_network(self) -> nn.Module:
        if self.online is None:
            raise RuntimeError("call setup_learner() first")
        return self.online

    def loss(self, batch):
        """PER-weighted Huber loss, targets y (B,), TD errors (B,) and Q(s, ·) (B, A): fp32."""
        d = {
            k: batch.data[k].to(self.device, non_blocking=True)
            for k in ("obs", "action", "ret", "disc", "next_obs")
        }
        weights = batch.weights.to(self.device, non_blocking=True)  # (B,) importance weights

        y = n_step_targets(
            self.online, self.target, d["next_obs"], d["ret"], d["disc"], self.cfg.double, self.bf16
        )  # (B,)
        with bf16_forward(self.device, self.bf16):
            q = self.online(d["obs"]).float()  # (B, A)
        q_sa = q.gather(1, d["action"].long().unsqueeze(1)).squeeze(1)  # (B,)
        td = y - q_sa  # (B,)
        loss = (
            weights * F.huber_loss(q_sa, y, reduction="none", delta=self.cfg.huber_delta)
        ).mean()
        return loss, y, td, q

    def learn(self, batch, update=None):
        """One update: metrics (0-dim tensors the learner reads once per metric row, never here)
        and the new priorities |TD error| (B,). ``update``: what runs :meth:`update` (``learner.graph``:
        its CUDA graph's replay, gearflow/learner/graph.py)."""
        metrics, td_abs = (update or self.update)(batch)
        self.updated()
        metrics["learner/updates"] = float(self.updates)
        return metrics, td_abs

    def update(self, batch):
        """The update's tensor work, with no host read and fixed shapes (``learner.graph`` captures
        it whole): loss, backward, clipping, the optimizer step. Returns the metrics as 0-dim
        tensors and |TD error| (B,)."""
        loss, _, td, q = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.online.parameters(), self.cfg.max_grad_norm)  # no host read
        self.optimizer.step()
        td_abs = td.detach().abs()
        metrics = {
            "learner/loss": loss.detach(),
            "learner/q_mean": q.detach().mean(),
            "learner/td_abs_mean": td_abs.mean(),
            "learner/grad_norm": grad_norm,
        }
        return metrics, td_abs  # new priorities: |TD error| (B,)

    def updated(self) -> None:
        """After each update, on the host: the count, and the periodic target copy (in place)."""
        self.updates += 1
        if self.updates % self.cfg.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())

    def state_dict(self) -> dict:
        return learner_state(self, "online", "target", "optimizer")

    def load_state_dict(self, state: dict) -> None:
        load_learner_state(self, state, "online", "target", "optimizer")
