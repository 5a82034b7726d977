"""Ape-X DPG: deterministic policy gradients with n-step targets and prioritized replay.

Horgan et al. 2018, "Distributed Prioritized Experience Replay", https://arxiv.org/abs/1803.00933
(the paper's continuous-control agent), with TD3's twin critics, target policy smoothing and
delayed policy updates as options (Fujimoto et al. 2018, https://arxiv.org/abs/1802.09477).

Reads top to bottom: the config, the networks (a tanh policy μ(s) and one or two critics
Q(s, a), both MLPs, held by one module that is what the actors receive), the n-step targets,
then the agent: replay columns, acting (Gaussian noise whose scale is the actor's ε, the
critic's values for the actor's initial priorities) and learning (IS-weighted critic loss,
|TD| as new priorities, the policy following ∇_a Q₁, Polyak or periodic target updates).

Actions are stored in the env's units (the ``action`` column is ``float32[A]``); the networks
work in the normalised box [-1, 1]^A, ``a = centre + half · u``. The actors store one row per
step, ``obs``/``action``/``version`` and the n-step ``ret``/``disc`` (as ``agents.apex_dqn``)::

    y  = ret + disc · min_j Q'_j(next_obs, clip(μ'(next_obs) + clip(σ' ε, −c, c), −1, 1))
    TD = y − Q₁(obs, action);  critic loss = mean_B(w · Σ_j ℓ(y − Q_j(obs, action)))
    policy loss = −mean_B Q₁(obs, μ(obs))      (every ``policy_delay`` updates)

Exploration: each env acts with ``u = clip(μ(s) + ε_i · N(0, I), −1, 1)``: the actor's ε
ladder (``actor.epsilon``, ``actor.epsilon_alpha``: ε_i = ε^(1 + α·i/(N−1))) is the noise's
standard deviation in units of the action box's half-width, so the greediest env acts with
σ ≈ 0 (ε = 0.4, α = 7: σ from 0.4 down to 0.4⁸ ≈ 0.0007) and ``gearflow eval`` (ε = 0) with μ.
Initial priorities: |ret + disc · V(s_{t+n}) − Q₁(s_t, a_t)| with V(s) = min_j Q_j(s, μ(s)),
the online critics the actor holds (the learner's TD with its online networks in place of
the targets). bf16 (``learner.bf16``, gearflow/precision.py): the forward passes run under
``bf16_forward``, each network's output layer under ``fp32`` (μ's pre-tanh and Q leave the
networks in float32), targets, TD errors, priorities and losses are float32 outside autocast, and
backward and the optimizer steps run outside it.
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
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])
    """Widths of the hidden layers of the policy and of each critic (ReLU MLPs)."""
    twin_critics: bool = True
    """Two critics, the target from their minimum (TD3's clipped double Q); false: one critic (DDPG)."""
    target_noise: float = 0.2
    """Target policy smoothing: σ of the Gaussian noise added to μ'(next_obs), in half-widths (0: none)."""
    target_noise_clip: float = 0.5
    """Target policy smoothing: the noise is clipped to ±this (half-widths)."""
    policy_delay: int = 2
    """Critic updates per policy update (TD3: 2; DDPG: 1); target updates happen with the policy's."""
    policy_lr: float = 3e-4
    """Adam learning rate of the policy."""
    critic_lr: float = 3e-4
    """Adam learning rate of the critics."""
    tau: float = 0.005
    """Polyak rate of the target networks, θ' ← (1 − τ) θ' + τ θ (used when target_update_period = 0)."""
    target_update_period: int = 0
    """> 0: copy the online networks into the targets every this many updates instead of Polyak."""
    huber_delta: float = 0.0
    """Critic loss: Huber with this threshold; 0: the squared TD error (TD3, DDPG)."""
    max_grad_norm: float = 0.0
    """Global gradient-norm clip of each network (0: no clipping; the norm is still reported)."""
    preact_l2: float = 0.0
    """λ of a λ·mean(pre-tanh²) term in the policy loss: keeps μ out of tanh's flat tails, where a
    policy that saturated early gets no gradient again (seen on CartpoleSwingup: 0 after 19 k updates)."""


# ----------------------------------------------------------------------------- networks


class FP32Linear(nn.Linear):
    """An output layer: runs in float32 on a float32 input under bf16 autocast (gearflow/precision.py)."""

    def forward(self, x):
        with fp32(x):
            return super().forward(x.float())


def mlp(in_dim: int, hidden_sizes, out_dim: int) -> nn.Sequential:
    sizes = [in_dim, *hidden_sizes]
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]  # bf16 under the learner's autocast
    return nn.Sequential(*layers, FP32Linear(sizes[-1], out_dim))  # (B, out) float32


class Critics(nn.Module):
    """C critics Q_j(s, u) of a normalised action u ∈ [-1, 1]^A as one batched MLP: layer l holds
    the C critics' weights (C, in, out), so twin critics cost one chain of ``baddbmm`` calls,
    not two of ``linear``. Each critic is initialised as ``nn.Linear`` would be.

    ``forward(obs (B, obs), u (B, A))`` → (C, B); ``first(obs, u)`` → Q₁ alone (B,)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_sizes, num_critics: int):
        super().__init__()
        sizes = [obs_dim + act_dim, *hidden_sizes, 1]
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for a, b in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / np.sqrt(a)  # nn.Linear's default: U(-1/sqrt(in), 1/sqrt(in)) for both
            self.weights.append(nn.Parameter(torch.empty(num_critics, a, b).uniform_(-bound, bound)))  # (C, in, out)
            self.biases.append(nn.Parameter(torch.empty(num_critics, 1, b).uniform_(-bound, bound)))  # (C, 1, out)
        self.num_critics = num_critics

    def forward(self, obs, u):
        x = torch.cat([obs.flatten(1).float(), u.float()], dim=1)  # (B, obs + A)
        x = x.unsqueeze(0).expand(self.num_critics, *x.shape)  # (C, B, in)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if i < last:
                x = torch.relu(torch.baddbmm(b, x, w))  # (C, B, out), bf16 under the learner's autocast
            else:
                with fp32(x):  # the output layer in float32
                    x = torch.baddbmm(b, x.float(), w)  # (C, B, 1) float32
        return x.squeeze(2)  # (C, B)

    def first(self, obs, u):
        x = torch.cat([obs.flatten(1).float(), u.float()], dim=1)  # (B, obs + A)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            if i < last:
                x = torch.relu(torch.addmm(b[0], x, w[0]))  # (B, out)
            else:
                with fp32(x):
                    x = torch.addmm(b[0], x.float(), w[0])  # (B, 1) float32
        return x.squeeze(1)  # (B,)


class ActorCritic(nn.Module):
    """The deterministic policy μ(s) = tanh(MLP(s)) ∈ [-1, 1]^A and its critics; the whole
    module is published, so actors can compute initial priorities.

    ``forward(obs)`` is what actors trace: (μ(s) (B, A), V(s) = min_j Q_j(s, μ(s)) (B,))."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_sizes, num_critics: int):
        super().__init__()
        self.policy = mlp(obs_dim, hidden_sizes, act_dim)
        self.critics = Critics(obs_dim, act_dim, hidden_sizes, num_critics)

    def preact(self, obs):
        return self.policy(obs.flatten(1).float())  # (B, A) before the tanh

    def mu(self, obs):
        return torch.tanh(self.preact(obs))  # (B, A)

    def q(self, obs, u):
        return self.critics(obs, u)  # (C, B)

    def forward(self, obs):
        u = self.mu(obs)
        return u, self.q(obs, u).min(dim=0).values  # (B, A), (B,)


def n_step_targets(target: ActorCritic, next_obs, ret, disc, noise: torch.Tensor | None, noise_clip: float,
                   bf16: bool = False):  # fmt: skip
    """y = ret + disc · min_j Q'_j(next_obs, clip(μ'(next_obs) + clip(noise, ±c), −1, 1)), float32 (B,).

    ``noise`` (B, A): target policy smoothing's σ'·N(0, I) draw, or None (no smoothing).
    ``bf16``: the forward passes under bf16 autocast; the smoothing and the targets in float32."""
    with torch.no_grad():
        with bf16_forward(next_obs.device, bf16):
            u = target.mu(next_obs).float()  # (B, A)
        if noise is not None:
            u = (u + noise.clamp(-noise_clip, noise_clip)).clamp(-1.0, 1.0)
        with bf16_forward(next_obs.device, bf16):
            q_next = target.q(next_obs, u)  # (C, B) float32 (the output layer runs in fp32)
        bootstrap = q_next.float().min(dim=0).values  # (B,) min over the critics
        return ret.float() + disc.float() * bootstrap  # (B,) float32 even under bf16 autocast


def polyak(target: nn.Module, online: nn.Module, tau: float) -> None:
    """θ' ← (1 − τ) θ' + τ θ for every parameter (one foreach call)."""
    with torch.no_grad():
        torch._foreach_lerp_(list(target.parameters()), list(online.parameters()), tau)


# ----------------------------------------------------------------------------- agent


class Agent:
    """Ape-X DPG; see the module docstring. Learner state lives in ``setup_learner``."""

    def __init__(self, cfg: Config, spec: EnvSpec, settings: AgentSettings, device: torch.device):
        space = spec.action_space
        shape = tuple(getattr(space, "shape", None) or ())
        low = np.asarray(getattr(space, "low", np.nan), np.float64)
        high = np.asarray(getattr(space, "high", np.nan), np.float64)
        if spec.num_actions is not None or len(shape) != 1 or not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise ConfigError(
                f"agent.name=agents.apex_dpg needs a bounded 1-D Box action space, but env "
                f"{spec.env_id or '?'!r} has {space} (DPG acts with a vector of real actions)"
            )
        if cfg.policy_delay < 1:
            raise ConfigError(f"agent.policy_delay={cfg.policy_delay}: must be ≥ 1")
        if not 0.0 < cfg.tau <= 1.0:
            raise ConfigError(f"agent.tau={cfg.tau}: must be in (0, 1]")
        if cfg.target_noise < 0 or cfg.target_noise_clip < 0:
            raise ConfigError("agent.target_noise and agent.target_noise_clip must be ≥ 0")
        self.cfg = plain_config(cfg, Config)  # plain attributes: a read costs ns, not OmegaConf's µs
        self.spec, self.device = spec, torch.device(device)
        self.act_dim = shape[0]
        low, high = np.broadcast_to(low, shape), np.broadcast_to(high, shape)
        self.centre = ((high + low) / 2).astype(np.float32)  # (A,) env units
        self.half = ((high - low) / 2).astype(np.float32)  # (A,)
        # the same on the agent's device, made once (not copied from pageable memory every update)
        self._box = (torch.as_tensor(self.centre, device=self.device), torch.as_tensor(self.half, device=self.device))
        self.obs_dim = int(np.prod(spec.obs_shape))
        self.kind = settings.learns_from(Transition, type(self).__module__)  # next_columns=("obs",)
        self.gamma = settings.gamma
        self.bf16 = settings.bf16  # the learner's forward passes under bf16 autocast
        self.seed = settings.seed
        self.rng = np.random.default_rng(self.seed)
        self.online: ActorCritic | None = None

    # ---- replay: one row per step; a transition spans rows t..t+n
    def replay_columns(self) -> dict[str, str]:
        shape = ",".join(str(d) for d in self.spec.obs_shape)
        return {
            "obs": f"{np.dtype(self.spec.obs_dtype).name}[{shape}]",
            "action": f"float32[{self.act_dim}]",  # in the env's units, exploration included
            "ret": "float32",  # n-step return of the transition starting at this row
            "disc": "float32",  # γ^k, 0 if terminated within the window
            "version": "int64",  # weights version the actor acted with
        }

    def item_kind(self) -> Transition:
        return self.kind

    def to_env(self, u: np.ndarray) -> np.ndarray:
        """Normalised actions (k, A) in [-1, 1] → the env's units."""
        return (self.centre + self.half * u).astype(np.float32)

    def normalise(self, action: torch.Tensor) -> torch.Tensor:
        """Actions in the env's units (B, A) → [-1, 1], float32."""
        centre, half = self._box  # (A,) each
        if centre.device != action.device:
            centre, half = centre.to(action.device), half.to(action.device)
        return ((action.float() - centre) / half).clamp(-1.0, 1.0)

    # ---- acting
    def make_network(self) -> ActorCritic:
        num_critics = 2 if self.cfg.twin_critics else 1
        return ActorCritic(self.obs_dim, self.act_dim, list(self.cfg.hidden_sizes), num_critics).to(self.device)

    def act(self, network, obs, epsilon, rng=None) -> ActOutput:
        """μ(s) plus Gaussian noise of σ = ε (per env, in half-widths), clipped to the box."""
        rng = self.rng if rng is None else rng
        x = torch.as_tensor(obs, device=self.device)
        mu, v = network(x)  # (k, A), (k,): μ(s), V(s) = min_j Q_j(s, μ(s))
        u = mu.float().cpu().numpy()
        sigma = np.asarray(epsilon, dtype=np.float64).reshape(-1, 1)  # (k, 1)
        if sigma.any():
            u = np.clip(u + sigma * rng.standard_normal(u.shape), -1.0, 1.0).astype(np.float32)
            q_a = network.critics.first(x, torch.from_numpy(u).to(self.device))  # (k,) Q₁(s, a sent)
        else:
            q_a = network.critics.first(x, mu)
        return ActOutput(actions=self.to_env(u), q_action=q_a.float().cpu().numpy(),
                         q_bootstrap=v.float().cpu().numpy())  # fmt: skip

    # ---- learning
    def setup_learner(self) -> None:
        cfg = self.cfg
        self.online = self.make_network()
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        fused = {"fused": True} if self.device.type in ("cpu", "cuda") else {}  # one kernel per step, not per tensor
        self.policy_optimizer = torch.optim.Adam(self.online.policy.parameters(), lr=cfg.policy_lr, **fused)
        self.critic_optimizer = torch.optim.Adam(self.online.critics.parameters(), lr=cfg.critic_lr, **fused)
        self.updates = 0
        self._last_policy = (0.0, 0.0)  # policy loss and grad norm of the latest policy update (tensors after it)
        self._noise_gen: torch.Generator | None = None  # made at the first learn (not on meta)

    def learner_network(self) -> nn.Module:
        if self.online is None:
            raise RuntimeError("call setup_learner() first")
        return self.online

    def _smoothing_noise(self, like: torch.Tensor) -> torch.Tensor | None:
        """σ'·N(0, I) of ``like``'s shape (B, A), from the learner's own generator; None without smoothing."""
        if self.cfg.target_noise <= 0:
            return None
        if self._noise_gen is None:
            self._noise_gen = torch.Generator(device=like.device).manual_seed(self.seed)
        noise = torch.randn(like.shape, generator=self._noise_gen, device=like.device, dtype=torch.float32)
        return noise * self.cfg.target_noise

    def _critic_loss(self, td: torch.Tensor) -> torch.Tensor:
        """ℓ(td) elementwise, float32: ½td² or Huber."""
        if self.cfg.huber_delta > 0:
            return F.huber_loss(td, torch.zeros_like(td), reduction="none", delta=self.cfg.huber_delta)
        return 0.5 * td.square()

    def _clip(self, params) -> torch.Tensor:
        """The gradients' global norm (a 0-dim tensor, never read here), clipped to ``max_grad_norm`` when > 0."""
        if self.cfg.max_grad_norm > 0:
            return nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def learn(self, batch, update=None):
        """One update: metrics (0-dim tensors the learner reads once per metric row, never here)
        and the new priorities |y − Q₁(s, a)| (B,). The policy learns every ``policy_delay`` updates.
        ``update``: what runs :meth:`update` (``learner.graph``: the CUDA graph of its form,
        gearflow/learner/graph.py)."""
        policy = (self.updates + 1) % self.cfg.policy_delay == 0
        metrics, td_abs = (update or self.update)(batch, policy)
        self.updated()
        if policy:
            self._last_policy = (metrics["learner/policy_loss"], metrics["learner/policy_grad_norm"])
        else:  # the latest policy update's
            metrics["learner/policy_loss"], metrics["learner/policy_grad_norm"] = self._last_policy
        metrics["learner/updates"] = float(self.updates)
        return metrics, td_abs

    def update(self, batch, policy: bool):
        """The update's tensor work, with no host read and fixed shapes (``learner.graph`` captures
        each of its two forms whole): the critics' step, and with ``policy`` the policy's step and the
        Polyak targets. Returns the metrics as 0-dim tensors and |TD| (B,)."""
        cfg = self.cfg
        d = {k: batch.data[k].to(self.device, non_blocking=True) for k in ("obs", "action", "ret", "disc", "next_obs")}
        weights = batch.weights.to(self.device, non_blocking=True).float()  # (B,) importance weights
        u = self.normalise(d["action"])  # (B, A) in [-1, 1]

        # critics: IS-weighted loss of every critic's TD error against the n-step target
        y = n_step_targets(self.target, d["next_obs"], d["ret"], d["disc"], self._smoothing_noise(u),
                           cfg.target_noise_clip, self.bf16)  # (B,) fp32  # fmt: skip
        with bf16_forward(self.device, self.bf16):
            q = self.online.q(d["obs"], u).float()  # (C, B)
        td = y.unsqueeze(0) - q  # (C, B) fp32
        critic_loss = (weights * self._critic_loss(td)).mean(dim=1).sum()
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        critic_norm = self._clip(self.online.critics.parameters())
        self.critic_optimizer.step()
        td_abs = td[0].detach().abs()  # (B,) |y − Q₁(s, a)|: the new priorities
        metrics = {
            "learner/loss": critic_loss.detach(),
            "learner/critic_loss": critic_loss.detach(),
            "learner/q_mean": q.detach()[0].mean(),
            "learner/td_abs_mean": td_abs.mean(),
            "learner/grad_norm": critic_norm,
        }

        # policy (every policy_delay updates): ascend Q₁(s, μ(s)); the critics are held fixed
        if policy:
            self.online.critics.requires_grad_(False)
            with bf16_forward(self.device, self.bf16):
                pre = self.online.preact(d["obs"]).float()  # (B, A)
                q1 = self.online.critics.first(d["obs"], torch.tanh(pre)).float()  # (B,)
            policy_loss = -q1.mean()
            if cfg.preact_l2 > 0:
                policy_loss = policy_loss + cfg.preact_l2 * pre.float().square().mean()
            self.policy_optimizer.zero_grad(set_to_none=True)
            policy_loss.backward()
            metrics["learner/policy_grad_norm"] = self._clip(self.online.policy.parameters())
            self.policy_optimizer.step()
            self.online.critics.requires_grad_(True)
            metrics["learner/policy_loss"] = policy_loss.detach()
            if cfg.target_update_period == 0:
                polyak(self.target, self.online, cfg.tau)
        return metrics, td_abs

    def updated(self) -> None:
        """After each update, on the host: the count, and the periodic target copy (in place)."""
        self.updates += 1
        if self.cfg.target_update_period > 0 and self.updates % self.cfg.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())

    def state_dict(self) -> dict:
        return {**learner_state(self, "online", "target", "policy_optimizer", "critic_optimizer"),
                "noise_gen": None if self._noise_gen is None else self._noise_gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        load_learner_state(self, state, "online", "target", "policy_optimizer", "critic_optimizer")
        if state.get("noise_gen") is not None:
            self._noise_gen = torch.Generator(device=self.device)
            self._noise_gen.set_state(state["noise_gen"])
