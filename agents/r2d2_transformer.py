"""R2D2 with a causal transformer: Kapturowski et al. 2019, "Recurrent Experience Replay in Distributed Reinforcement Learning", https://openreview.net/forum?id=r1lyTjAqYX

Sequence Q-learning as in R2D2, with a small causal transformer where the
paper has an LSTM. Reads top to bottom: the config, value rescaling, the
transformer, the sequence TD errors and priorities (shared by actor and
learner), then the agent.

Replay layout (one row per step; an episode of L actions is L + 1 rows, the
last one the final observation with action 0, reward 0, discount 0)::

    row t:  obs_t  action_t  reward_t (r after action_t)  discount_t (0 if t→t+1 terminated)
            first_t (t is the episode's step 0)  version_t

Items are ``Sequence`` windows of ``replay.sequence_length`` rows starting every
``replay.sequence_period`` rows of an episode (padded at an episode's end).
Step ``i`` of a window gets a loss when row ``i + 1`` is in the window (its
transition exists) and ``i ≥ burn_in``: the burn-in prefix is context without
loss. A window that starts at an episode's first step has no burn-in: its
context is exact, the very context the actor had (R2D2 burns in to recover an
LSTM state; a transformer over a window that starts at the episode start has
nothing to recover). Targets, with Q in rescaled space::

    y_i = h( Σ_{k<m} γ^k Π_{j<k} d_{i+j} r_{i+k}  +  γ^m Π_{j<m} d_{i+j} · h⁻¹(Q_target(s_{i+m}, argmax_a Q(s_{i+m}, a))) )
    m = min(n, last row of the window − i)          (n-step, truncated at the window's end)
    h(x) = sign(x)(√(|x|+1) − 1) + εx
    priority = η · max_i |δ_i| + (1 − η) · mean_i |δ_i|     over the loss steps, η = 0.9

Actors act with the same network over each env's last ``context`` observations
(``gearflow.kinds.sequence.SequenceActor``) and compute initial priorities with
:meth:`Agent.initial_priorities` from the Q-values they acted with (the learner's
functions with their one network as online and target, in numpy:
:func:`actor_priorities`).

Positions are encoded with ALiBi (Press et al. 2022: a per-head linear penalty
on attention distance), not absolute embeddings: a step's output depends only
on how far back each context step is, so a window that starts mid-episode
(learner) and a rolling actor context give the same step the same encoding.

Actors cache keys and values (``agent.kv_cache``, :meth:`Agent.act_cached`,
:mod:`agents.kv_cache`): each env step runs the network on that step only. A
cache cannot slide by one step and stay exact (from the second block on, a
cached key depends on the steps its token attended to), so a full context hops:
it drops its oldest ``H = agent.context_hop`` steps (default ``C // 2``) and is
re-encoded in one batched call, as it is at an episode's start and after new
weights. The actor's context at episode step t is then steps ``s .. t``: ``s = 0``
while ``t < C``, after that ``s`` is a multiple of H with ``C − H < t − s + 1 ≤ C``;
the Q-values equal :meth:`TransformerQNetwork.forward`
over those steps up to float rounding. With ``C = sequence_length``,
``H = sequence_period`` and ``burn_in = C − H`` (R2D2's 80/40/40, and
cartpole_masked_r2d2's 40/20/20) that is exactly the window where the learner
gives step t its loss.

The cached steps themselves, compiled with TorchScript or in C (the one-token step and the
context re-encode), are acting accelerators and live beside this file in
``agents/r2d2_accel.py`` (``agents/_r2d2_decode.c``); this module names them where it acts.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents import plain_config
from agents.apex_dqn import NatureCNN
from agents.kv_cache import KVCache, hop_length
from agents.r2d2_accel import (
    NativeOneTokenStep,
    compile_context_encode,
    compile_one_token_step,
    native_one_token_step,
)
from gearflow.agent import ActOutput, AgentSettings, EnvSpec, learner_state, load_learner_state
from gearflow.errors import ConfigError
from gearflow.kinds.sequence import Sequence
from gearflow.precision import bf16_forward, fp32

log = logging.getLogger(__name__)


@dataclass
class Config:
    d_model: int = 64
    """Width of the transformer's residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads per block (``d_model`` must be divisible by it)."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP, in multiples of ``d_model``."""
    context: int = 0
    """Observations an actor attends over (its rolling window per env); 0: ``replay.sequence_length``."""
    kv_cache: bool = True
    """Actors cache each env's keys and values and run the network on one new step per env step,
    re-encoding the context when it hops and when the weights change (false: re-run the last
    ``context`` steps every step)."""
    native_step: bool = True
    """With ``kv_cache`` on the CPU: the one-token step in C (``agents._r2d2_decode``, built with the
    package) where it gives the TorchScript step's Q-values and cache writes; false: TorchScript."""
    context_hop: int = 0
    """With ``kv_cache``: steps a full context drops at once (0: ``context // 2``); the actor's context
    is then ``context − hop + 1`` to ``context`` steps, the same steps a recompute attends over."""
    torso: str = "auto"
    """Per-step token embedding: ``linear`` (vector observations), ``cnn`` (Nature CNN over uint8
    frames, then a linear map to ``d_model``), or ``auto`` (cnn for 3-D observations, else linear)."""
    lr: float = 1e-3
    """Adam learning rate."""
    adam_eps: float = 1e-4
    """Adam epsilon."""
    target_update_period: int = 500
    """Learner updates between copies of the online network into the target network (R2D2: 2500)."""
    max_grad_norm: float = 40.0
    """Global gradient-norm clip."""
    eta: float = 0.9
    """Priority mix η: η · max|δ| + (1 − η) · mean|δ| over a window's loss steps."""
    rescale_eps: float = 1e-3
    """ε of the value rescaling h(x) = sign(x)(√(|x|+1) − 1) + εx."""


# ----------------------------------------------------------------------------- value rescaling


def value_rescale(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """h(x) = sign(x)(√(|x|+1) − 1) + εx (Pohlen et al. 2018)."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + eps * x


def inverse_value_rescale(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """h⁻¹(x) = sign(x)(((√(1 + 4ε(|x| + 1 + ε)) − 1) / 2ε)² − 1)."""
    root = (torch.sqrt(1.0 + 4.0 * eps * (x.abs() + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return torch.sign(x) * (root * root - 1.0)


# ----------------------------------------------------------------------------- network


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes 2^(-8h/H), h = 1..H (the paper's geometric sequence)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention + MLP."""

    def __init__(self, d: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_ratio * d), nn.GELU(), nn.Linear(mlp_ratio * d, d))

    def forward(self, x, bias, kv_old=None):
        """``x`` (B, T, D), ``bias`` (nh, T, T) or, with ``kv_old`` (B, 2, nh, S, hs) cached keys and
        values, (B, nh, T, S + T) over the cached then the new keys. Returns the new x and, with
        ``kv_old``, this block's keys and values of the T tokens (B, 2, nh, T, hs), else None."""
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)  # 3 × (B, T, D)
        q, k, v = (z.view(B, T, self.heads, D // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        kv = None
        if kv_old is not None:
            kv = torch.stack([k, v], dim=1)  # (B, 2, nh, T, hs)
            k, v = torch.cat([kv_old, kv], dim=3).unbind(1)  # (B, nh, S+T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (B, nh, T, hs)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x)), kv  # (B, T, D)


class FrameEmbedding(nn.Module):
    """uint8 frames (B, T, C, H, W) → tokens (B, T, D): the Nature CNN on every step, then a
    linear map to the model width (one token per step, as R2D2's torso feeds its LSTM)."""

    acting_token = "frame"  # the cached steps' TorchScript form of it (agents/r2d2_accel.py)

    def __init__(self, obs_shape: tuple[int, ...], d: int):
        super().__init__()
        self.cnn = NatureCNN(obs_shape)
        self.proj = nn.Linear(self.cnn.out_dim, d)

    def forward(self, obs):
        B, T = obs.shape[:2]
        return self.proj(self.cnn(obs.reshape(B * T, *obs.shape[2:]))).view(B, T, -1)  # (B, T, D)


class VectorEmbedding(nn.Module):
    """Vector observations (B, T, *shape) → tokens (B, T, D), one linear map."""

    acting_token = "vector"  # the cached steps run it in TorchScript or in C (agents/r2d2_accel.py)

    def __init__(self, obs_shape: tuple[int, ...], d: int):
        super().__init__()
        self.linear = nn.Linear(int(np.prod(obs_shape)), d)

    def forward(self, obs):
        return self.linear(obs.float().flatten(2))  # (B, T, D)


def torso_for(obs_shape: tuple[int, ...], torso: str) -> str:
    """``auto`` → ``cnn`` for (C, H, W) observations, else ``linear``."""
    if torso == "auto":
        return "cnn" if len(obs_shape) == 3 else "linear"
    return torso


class TransformerQNetwork(nn.Module):
    """Observations (B, T, *obs_shape) → Q-values (B, T, A); step t attends to steps ≤ t.

    Causal, so padding after a sequence's last step never changes its outputs. The final norm
    and Q head run in fp32 under bf16 autocast (targets rescale Q: gearflow/precision.py).
    """

    def __init__(self, obs_shape: tuple[int, ...], num_actions: int, cfg: Config):
        super().__init__()
        d = cfg.d_model
        cnn = torso_for(tuple(obs_shape), cfg.torso) == "cnn"
        self.embed = FrameEmbedding(tuple(obs_shape), d) if cnn else VectorEmbedding(tuple(obs_shape), d)
        self.blocks = nn.ModuleList(Block(d, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.num_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, num_actions)
        self.register_buffer("slopes", alibi_slopes(cfg.num_heads), persistent=False)  # (nh,)
        H = cfg.num_heads  # the same slopes in numpy, for extend's and the cached steps' bias (never meta)
        self.neg_slopes = -np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], np.float32)[None, :, None, None]
        self._bias: torch.Tensor | None = None

    def attention_bias(self, T: int, device) -> torch.Tensor:
        """(nh, T, T): −slope·(i − j) for j ≤ i, −inf above the diagonal (cached per T)."""
        if self._bias is None or self._bias.shape[-1] != T or self._bias.device != device:
            pos = torch.arange(T, device=device)
            dist = (pos[:, None] - pos[None, :]).float()  # (T, T) i − j
            bias = -self.slopes.to(device)[:, None, None] * dist  # (nh, T, T)
            self._bias = bias.masked_fill(dist < 0, float("-inf"))
        return self._bias

    def forward(self, obs):
        x = self.embed(obs)  # (B, T, D)
        bias = self.attention_bias(x.shape[1], x.device)
        for block in self.blocks:
            x, _ = block(x, bias)
        with fp32(x):
            return self.head(self.ln(x.float()))  # (B, T, A) float32

    def extend(self, obs, kv_old, allowed, dist, last):
        """The cached step (:class:`agents.kv_cache.KVCache`): ``obs`` (k, Tn, *obs_shape) each
        row's new steps, ``kv_old`` (k, L, 2, nh, S, hs) its cached keys and values, ``allowed`` /
        ``dist`` (k, Tn, S + Tn) from ``KVCache.attention_bias``, ``last`` (k,) the new step to
        read. Returns Q-values (k, A) at ``last`` and the new keys/values (k, L, 2, nh, Tn, hs).
        ALiBi depends on distances only, so a step's bias is the same as in :meth:`forward`."""
        x = self.embed(obs)  # (k, Tn, D)
        bias = np.where(allowed[:, None], self.neg_slopes * dist[:, None], -np.inf).astype(np.float32)
        bias = torch.from_numpy(bias).to(x.device)  # (k, nh, Tn, S+Tn)
        kv_new = []
        for layer, block in enumerate(self.blocks):
            x, kv = block(x, bias, kv_old[:, layer])
            kv_new.append(kv)
        if x.shape[1] == 1:
            x = x[:, 0]  # (k, D) the one-step case: a view
        else:
            x = x[torch.arange(x.shape[0], device=x.device), torch.as_tensor(last, device=x.device)]  # (k, D)
        return self.head(self.ln(x)), torch.stack(kv_new, dim=1)  # (k, A), (k, L, 2, nh, Tn, hs)


# ----------------------------------------------------------------------------- TD errors and priorities


def loss_mask(mask: torch.Tensor, first: torch.Tensor, burn_in: int) -> torch.Tensor:
    """(B, T) bool: step i has a transition in the window (row i+1 exists) and is past the
    burn-in, unless the window starts at an episode's first step (then there is none)."""
    has_next = torch.zeros_like(mask)
    has_next[:, :-1] = mask[:, 1:]
    T = mask.shape[1]
    past_burn_in = torch.arange(T, device=mask.device)[None, :] >= burn_in  # (1, T)
    return has_next & (past_burn_in | first[:, :1])  # (B, T)


def sequence_td(q, q_next_online, q_next_target, action, reward, discount, lengths, n, gamma, eps):
    """TD errors δ (B, T) of n-step double-Q targets in rescaled space.

    ``q``: (B, T, A) online Q-values with gradient; ``q_next_online`` / ``q_next_target``:
    (B, T, A) without gradient (the same tensor for an actor). ``reward``/``discount``
    (B, T): of the transition leaving each row. Steps without a transition are garbage
    and must be masked (:func:`loss_mask`)."""
    B, T, _ = q.shape
    idx = torch.arange(T, device=q.device)  # (T,)
    last = (lengths - 1).to(q.device)[:, None]  # (B, 1): the window's last row
    best = q_next_online.argmax(dim=2, keepdim=True)  # (B, T, 1) double Q: online picks
    boot = inverse_value_rescale(q_next_target.gather(2, best).squeeze(2), eps)  # (B, T) unscaled
    ret = torch.zeros(B, T, dtype=torch.float32, device=q.device)
    scale = torch.ones(B, T, dtype=torch.float32, device=q.device)  # γ^k Π d
    steps = torch.zeros(B, T, dtype=torch.long, device=q.device)
    for k in range(n):
        j = (idx + k).clamp(max=T - 1)  # (T,)
        active = (idx + k)[None, :] < last  # (B, T): row i+k has a transition in the window
        ret = torch.where(active, ret + scale * reward[:, j], ret)
        scale = torch.where(active, scale * gamma * discount[:, j], scale)
        steps = steps + active.long()
    boot_idx = (idx[None, :] + steps).clamp(max=T - 1)  # (B, T) row s_{i+m}
    y = value_rescale(ret + scale * boot.gather(1, boot_idx), eps)  # (B, T)
    q_sa = q.gather(2, action.long().unsqueeze(2)).squeeze(2)  # (B, T)
    return y - q_sa  # (B, T)


def priority_mix(td_abs: torch.Tensor, valid: torch.Tensor, eta: float) -> torch.Tensor:
    """η · max|δ| + (1 − η) · mean|δ| over each row's valid steps (B,); 0 without any."""
    td_abs = torch.where(valid, td_abs, torch.zeros_like(td_abs))  # (B, T)
    count = valid.sum(dim=1).clamp(min=1)
    return eta * td_abs.max(dim=1).values + (1.0 - eta) * td_abs.sum(dim=1) / count  # (B,)


def actor_priorities(values, action, reward, discount, first, lengths, n, gamma, eps, burn_in, eta) -> np.ndarray:
    """Priorities (k,) float64 of windows from the Q-values an actor acted with, ``values`` (k, T, A),
    used as online and target network: :func:`sequence_td`, :func:`loss_mask` and
    :func:`priority_mix` over numpy arrays, in float32 as the learner computes them."""
    q = np.asarray(values, dtype=np.float32)
    reward, discount = np.asarray(reward, dtype=np.float32), np.asarray(discount, dtype=np.float32)
    lengths = np.asarray(lengths, dtype=np.int64)
    k, T, _ = q.shape
    idx, rows = np.arange(T), np.arange(k)[:, None]  # (T,), (k, 1)
    last = (lengths - 1)[:, None]  # (k, 1): the window's last row
    boot = _inverse_rescale_np(q.max(axis=2), eps)  # (k, T): online and target are one network
    # the n-step loop of sequence_td at once: term j of step i is active while i + j < last, so the
    # active terms are j < m = clip(last − i, 0, n); scale before term j is γ^j Π_{j'<j} d_{i+j'}
    offs = idx[:, None] + np.arange(n)[None, :]  # (T, n) rows i + j
    cols = np.minimum(offs, T - 1)
    m = np.minimum(np.maximum(last - idx[None, :], 0), n)  # (k, T) terms of each step
    disc = np.ones((k, T, n + 1), np.float32)
    disc[:, :, 1:] = np.float32(gamma) * discount[:, cols]  # (k, T, n) γ d_{i+j}
    scale_j = np.cumprod(disc, axis=2)  # (k, T, n + 1): scale before term j (j = n: after all)
    active = np.arange(n)[None, None, :] < m[:, :, None]  # (k, T, n)
    ret = (np.where(active, scale_j[:, :, :n] * reward[:, cols], np.float32(0))).sum(axis=2)  # (k, T)
    scale = scale_j[rows, idx[None, :], m]  # (k, T) γ^m Π d
    boot_idx = np.minimum(idx[None, :] + m, T - 1)  # (k, T) row s_{i+m}
    y = _rescale_np(ret + scale * boot[rows, boot_idx], eps)  # (k, T)
    q_sa = q[rows, idx[None, :], np.asarray(action, dtype=np.int64)]  # (k, T)
    td_abs = np.abs(y - q_sa)  # (k, T)
    mask = idx[None, :] < lengths[:, None]
    valid = np.zeros_like(mask)
    valid[:, :-1] = mask[:, 1:]  # row i+1 exists
    valid &= (idx >= burn_in)[None, :] | np.asarray(first, dtype=bool)[:, :1]
    td_abs = np.where(valid, td_abs, np.float32(0))
    count = np.maximum(valid.sum(axis=1), 1)
    return (eta * td_abs.max(axis=1) + (1.0 - eta) * td_abs.sum(axis=1, dtype=np.float32) / count).astype(np.float64)


def _rescale_np(x: np.ndarray, eps: float) -> np.ndarray:
    """:func:`value_rescale` in numpy (float32 in, float32 out)."""
    return np.sign(x) * (np.sqrt(np.abs(x) + np.float32(1)) - np.float32(1)) + np.float32(eps) * x


def _inverse_rescale_np(x: np.ndarray, eps: float) -> np.ndarray:
    """:func:`inverse_value_rescale` in numpy (float32 in, float32 out)."""
    e = np.float32(eps)
    root = (np.sqrt(np.float32(1) + np.float32(4) * e * (np.abs(x) + np.float32(1) + e)) - np.float32(1)) / (2 * e)
    return np.sign(x) * (root * root - np.float32(1))


# ----------------------------------------------------------------------------- agent


class Agent:
    """R2D2 with a causal transformer; see the module docstring."""

    def __init__(self, cfg: Config, spec: EnvSpec, settings: AgentSettings, device: torch.device):
        if spec.num_actions is None:
            raise ConfigError(
                f"agent.name=agents.r2d2_transformer needs a discrete action space, but env "
                f"{spec.env_id or '?'!r} has {spec.action_space}"
            )
        if cfg.torso not in ("auto", "linear", "cnn"):
            raise ConfigError(f"agent.torso={cfg.torso!r}: must be one of auto, linear, cnn")
        if torso_for(tuple(spec.obs_shape), cfg.torso) == "cnn" and len(spec.obs_shape) != 3:
            raise ConfigError(
                f"agent.torso=cnn needs image observations (C, H, W); env {spec.env_id or '?'!r} has "
                f"obs shape {tuple(spec.obs_shape)}"
            )
        if cfg.d_model % cfg.num_heads:
            raise ConfigError(f"agent.d_model={cfg.d_model} must be divisible by agent.num_heads={cfg.num_heads}")
        self.kind = settings.learns_from(Sequence, type(self).__module__)  # replay.sequence_length, _period, burn_in
        if cfg.context < 0:
            raise ConfigError(f"agent.context={cfg.context}: must be ≥ 0 (0: replay.sequence_length)")
        if cfg.context_hop < 0:
            raise ConfigError(f"agent.context_hop={cfg.context_hop}: must be ≥ 0 (0: half the context)")
        self.cfg = plain_config(cfg, Config)  # plain attributes: a read costs ns, not OmegaConf's µs
        self.spec, self.device = spec, torch.device(device)
        self.num_actions = int(spec.num_actions)
        self.gamma = settings.gamma
        self.n_step = settings.n_step
        self.rng = np.random.default_rng(settings.seed)
        self.bf16 = settings.bf16  # the learner's forward passes under bf16 autocast
        self.online: nn.Module | None = None
        # n, γ, ε of h, burn-in, η of actor_priorities (plain numbers: a config attribute costs µs)
        self._priority_args = (self.n_step, self.gamma, float(cfg.rescale_eps), int(self.kind.burn_in), float(cfg.eta))
        self._acting_held: tuple | None = None  # (network, slots, OneTokenStep, ContextEncode) for acting
        self.one_token_compiled = self.encode_compiled = False  # whether those are TorchScript's
        self.one_token_native = False  # whether the one-token step runs in C (NativeOneTokenStep)

    # ---- replay: one row per step, windows of rows
    def replay_columns(self) -> dict[str, str]:
        return {
            "obs": f"{np.dtype(self.spec.obs_dtype).name}[{','.join(map(str, self.spec.obs_shape))}]",
            "action": "int64",
            "reward": "float32",  # reward after action_t
            "discount": "float32",  # 0 if the transition t → t+1 terminated the episode
            "first": "bool",  # row t is the episode's step 0
            "version": "int64",  # weights version the actor acted with
        }

    def item_kind(self) -> Sequence:
        return self.kind

    def context_length(self) -> int:
        """Observations the actor keeps per env and passes to :meth:`act`."""
        return int(self.cfg.context) or self.kind.length

    # ---- acting
    def make_network(self) -> nn.Module:
        return TransformerQNetwork(tuple(self.spec.obs_shape), self.num_actions, self.cfg).to(self.device)

    def act(self, network, obs, epsilon, rng=None, lengths=None) -> ActOutput:
        """ε-greedy at the last step of each context: ``obs`` (k, C, obs_dim) left-aligned,
        ``lengths`` (k,) steps in each (padding after them is never attended to)."""
        rng = self.rng if rng is None else rng
        obs = torch.as_tensor(obs, device=self.device)
        if obs.dim() == 1 + len(self.spec.obs_shape):  # one step without context
            obs = obs[:, None]
        k, C = obs.shape[:2]
        last = torch.as_tensor(np.full(k, C) if lengths is None else lengths, device=self.device) - 1
        q = network(obs)  # (k, C, A)
        values = q[torch.arange(k, device=self.device), last].float().cpu().numpy()  # (k, A)
        return self._epsilon_greedy(values, epsilon, rng)

    def _epsilon_greedy(self, values: np.ndarray, epsilon, rng) -> ActOutput:
        k = len(values)
        actions = values.argmax(axis=1)
        explore = rng.random(k) < epsilon
        if explore.any():
            actions = np.where(explore, rng.integers(self.num_actions, size=k), actions)
        return ActOutput(actions=actions.astype(np.int64, copy=False), values=values)

    # ---- acting with a key/value cache (agents/kv_cache.py; the steps: agents/r2d2_accel.py; the
    # sequence actor calls these when make_kv_cache returns a cache)
    def make_kv_cache(self, num_envs: int) -> KVCache | None:
        """A cache of ``context_length()`` steps per env, or None when ``agent.kv_cache`` is false."""
        if not self.cfg.kv_cache:
            return None
        d, nh = self.cfg.d_model, self.cfg.num_heads
        return KVCache(num_envs, self.cfg.num_layers, nh, d // nh, self.context_length(), self.device)

    def context_hop(self) -> int:
        """Steps a full context drops at once when acting with a cache (``agent.context_hop``)."""
        return hop_length(self.context_length(), self.cfg.context_hop)

    def act_cached(self, network, cache: KVCache, ids, obs, n_new, epsilon, rng=None) -> ActOutput:
        """ε-greedy at each env's newest step, running the network on its new steps only.

        ``obs`` (k, Tn, *obs_shape): row r's first ``n_new[r]`` are env ``ids[r]``'s context steps
        after its ``cache.length`` cached ones (1 per env step; the whole context after
        ``cache.clear``); the rest is padding. Q-values equal :meth:`act` over the same context.

        Rows with one new step (almost every row of almost every recv) take the compiled
        :class:`OneTokenStep`; rows that re-encode their whole context into an empty cache (after
        new weights, context hops) take the compiled :class:`ContextEncode` in a second call over
        those rows only (:meth:`acting_modules`); anything else (several new steps after cached
        ones) and networks of another class take :meth:`TransformerQNetwork.extend`."""
        rng = self.rng if rng is None else rng
        ids, n_new = np.asarray(ids, dtype=np.int64), np.asarray(n_new, dtype=np.int64)
        one = n_new == 1
        if not isinstance(network, TransformerQNetwork):
            values = self._extend(network, cache, ids, obs, n_new)
        elif one.all():
            values = self._one_token(network, cache, ids, obs[:, :1])
        else:
            values = np.empty((len(ids), self.num_actions), dtype=np.float32)  # (k, A)
            fresh = ~one & (cache.length[ids] == 0)  # whole contexts into empty caches
            other = ~one & ~fresh  # several new steps after cached ones (not what the actors ask)
            if one.any():
                values[one] = self._one_token(network, cache, ids[one], obs[one, :1])
            for rows, many in ((fresh, self._encode), (other, self._extend)):
                if rows.any():
                    values[rows] = many(network, cache, ids[rows], obs[rows, : int(n_new[rows].max())], n_new[rows])
        return self._epsilon_greedy(values, epsilon, rng)

    def _extend(self, network, cache: KVCache, ids, obs, n_new) -> np.ndarray:
        """Q-values (k, A) of rows with any number of new steps, padded to ``obs.shape[1]``."""
        allowed, dist = cache.attention_bias(ids, n_new, obs.shape[1])
        q, kv_new = network.extend(torch.as_tensor(obs, device=self.device), cache.gather(ids), allowed, dist,
                                   n_new - 1)  # fmt: skip
        cache.append(ids, kv_new, n_new)
        return q.float().cpu().numpy()

    def _one_token(self, network, cache: KVCache, ids, obs) -> np.ndarray:
        """Q-values (k, A) of rows with exactly one new step each, ``obs`` (k, 1, *obs_shape)."""
        length = cache.length[ids]  # (k,) the new step's slot
        if (length >= cache.slots).any():
            r = int(np.argmax(length >= cache.slots))
            raise ValueError(f"env {int(ids[r])}: {int(length[r])} cached + 1 new tokens exceed the cache's "
                             f"{cache.slots} slots")  # fmt: skip
        step = self.acting_modules(network, cache.slots)[0]
        if isinstance(step, NativeOneTokenStep):
            values = step.values(obs, cache.host_view(), ids, length)
            cache.length[ids] = length + 1
            return values
        dev = self.device
        q = step(torch.as_tensor(obs, device=dev), cache.kv, torch.as_tensor(ids, device=dev),
                 torch.as_tensor(length, device=dev), int(length.max()) + 1)  # fmt: skip
        cache.length[ids] = length + 1
        return q.float().cpu().numpy()

    def _encode(self, network, cache: KVCache, ids, obs, n) -> np.ndarray:
        """Q-values (k, A) of rows whose caches are empty, ``obs`` (k, T, *obs_shape) their whole
        contexts (``n`` steps each, padded to T)."""
        if obs.shape[1] > cache.slots:
            r = int(np.argmax(n > cache.slots))
            raise ValueError(f"env {int(ids[r])}: 0 cached + {int(n[r])} new tokens exceed the cache's "
                             f"{cache.slots} slots")  # fmt: skip
        dev = self.device
        encode = self.acting_modules(network, cache.slots)[1]
        q = encode(torch.as_tensor(obs, device=dev), cache.kv, torch.as_tensor(ids, device=dev),
                   torch.as_tensor(n, device=dev))  # fmt: skip
        cache.length[ids] = n
        return q.float().cpu().numpy()

    def one_token_step(self, network: TransformerQNetwork, slots: int):
        """``network``'s :class:`OneTokenStep` over caches of ``slots`` slots (:meth:`acting_modules`)."""
        return self.acting_modules(network, slots)[0]

    def acting_modules(self, network: TransformerQNetwork, slots: int) -> tuple[nn.Module, nn.Module]:
        """``network``'s :class:`OneTokenStep` and :class:`ContextEncode` over caches of ``slots`` slots,
        each compiled with TorchScript where that gives the same results (:func:`compile_one_token_step`,
        :func:`compile_context_encode`); made on first use and kept for the next steps.
        ``one_token_compiled`` / ``encode_compiled`` say which are compiled."""
        held = self._acting_held
        if held is None or held[0] is not network or held[1] != slots:
            shape, dtype = self.spec.obs_shape, self.spec.obs_dtype
            step, self.one_token_compiled = compile_one_token_step(network, slots, shape, dtype)
            encode, self.encode_compiled = compile_context_encode(network, slots, shape, dtype)
            self.one_token_native, why = False, "agent.native_step is false"
            if self.cfg.native_step:
                native, why = native_one_token_step(network, slots, step, shape, dtype)
                if native is not None:
                    step, self.one_token_native = native, True
            if not self.one_token_native:
                log.info("acting with the TorchScript one-token step: %s", why)
            held = self._acting_held = (network, slots, step, encode)
        return held[2], held[3]

    def initial_priorities(self, values, action, reward, discount, first, lengths) -> np.ndarray:
        """Actor-side R2D2 priorities of windows (k,) from the Q-values acted with: ``values``
        (k, T, A); ``action``/``reward``/``discount``/``first`` (k, T); ``lengths`` (k,).

        :func:`actor_priorities`: the learner's :func:`sequence_td`, :func:`loss_mask` and
        :func:`priority_mix` in numpy (a few small arrays per call: ~4× cheaper than torch's
        per-op cost; tests/test_kv_cache_step.py holds the two equal)."""
        return actor_priorities(values, action, reward, discount, first, lengths, *self._priority_args)

    # ---- learning
    def setup_learner(self) -> None:
        self.online = self.make_network()
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        # fused Adam: a few kernels per step and no host read of the step counts (the for-loop Adam
        # reads each parameter's step back with .item(): ~290 a step at gato's size); not on meta
        fused = {"fused": True} if self.device.type in ("cpu", "cuda") else {}
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps, **fused)
        self.updates = 0

    def learner_network(self) -> nn.Module:
        if self.online is None:
            raise RuntimeError("call setup_learner() first")
        return self.online

    def loss(self, batch):
        """Weighted masked squared TD loss, TD errors (B, T), the loss mask (B, T) and Q (B, T, A):
        the forward passes under bf16 autocast with ``learner.bf16``, rescaling and TD errors in fp32."""
        d = {k: batch.data[k].to(self.device, non_blocking=True)
             for k in ("obs", "action", "reward", "discount", "first", "mask", "length")}  # fmt: skip
        weights = batch.weights.to(self.device, non_blocking=True)  # (B,) importance weights
        with bf16_forward(self.device, self.bf16):
            q = self.online(d["obs"]).float()  # (B, T, A)
            with torch.no_grad():
                q_target = self.target(d["obs"]).float()  # (B, T, A)
        td = sequence_td(q, q.detach(), q_target, d["action"], d["reward"], d["discount"], d["length"],
                         self.n_step, self.gamma, self.cfg.rescale_eps)  # fmt: skip
        valid = loss_mask(d["mask"], d["first"], self.kind.burn_in)  # (B, T)
        sq = torch.where(valid, td * td, torch.zeros_like(td))  # padding / burn-in / no transition: 0
        per_seq = 0.5 * sq.sum(dim=1) / valid.sum(dim=1).clamp(min=1)  # (B,)
        return (weights * per_seq).mean(), td, valid, q

    def learn(self, batch, update=None):
        """One update: metrics (0-dim tensors the learner reads once per metric row, never here)
        and the windows' new priorities (B,). ``update``: what runs :meth:`update` (``learner.graph``:
        its CUDA graph's replay, gearflow/learner/graph.py)."""
        metrics, priorities = (update or self.update)(batch)
        self.updated()
        metrics["learner/updates"] = float(self.updates)
        return metrics, priorities

    def update(self, batch):
        """The update's tensor work, with no host read and fixed shapes (``learner.graph`` captures
        it whole): loss, backward, clipping, the optimizer step. Returns the metrics as 0-dim
        tensors and the priorities η · max|δ| + (1 − η) · mean|δ| (B,)."""
        loss, td, valid, q = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.online.parameters(), self.cfg.max_grad_norm)  # no host read
        self.optimizer.step()
        td_abs = td.detach().abs()
        priorities = priority_mix(td_abs, valid, self.cfg.eta)  # (B,)
        steps = valid.sum().clamp(min=1)
        metrics = {
            "learner/loss": loss.detach(),
            "learner/q_max_mean": (q.detach().amax(2) * valid).sum() / steps,  # rescaled space
            "learner/td_abs_mean": (td_abs * valid).sum() / steps,
            "learner/grad_norm": grad_norm,
        }
        return metrics, priorities

    def updated(self) -> None:
        """After each update, on the host: the count, and the periodic target copy (in place)."""
        self.updates += 1
        if self.updates % self.cfg.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())

    def state_dict(self) -> dict:
        return learner_state(self, "online", "target", "optimizer")

    def load_state_dict(self, state: dict) -> None:
        load_learner_state(self, state, "online", "target", "optimizer")
