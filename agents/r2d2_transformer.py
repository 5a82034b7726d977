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
(``gearflow.actors.SequenceActor``) and compute initial priorities with
:meth:`Agent.initial_priorities` from the Q-values they acted with (the learner's
functions with their one network as online and target, in numpy:
:func:`actor_priorities`).

Positions are encoded with ALiBi (Press et al. 2022: a per-head linear penalty
on attention distance), not absolute embeddings: a step's output depends only
on how far back each context step is, so a window that starts mid-episode
(learner) and a rolling actor context give the same step the same encoding.

Actors cache keys and values (``agent.kv_cache``, :meth:`Agent.act_cached`,
:mod:`gearflow.kv_cache`): each env step runs the network on that step only. A
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

A cached step with one new step per env (nearly every row of every recv) runs
:class:`OneTokenStep`, compiled with TorchScript: embed the step, then per block
write its keys and values into the env's next slot in place, attend over the
slots in use with the ALiBi bias read from a table, MLP; no per-step allocation
of caches, no Python per module or per env. On the CPU the same step runs in C
(:class:`NativeOneTokenStep`, ``gearflow/_decode.c``; ``agent.native_step``): one call per
recv instead of TorchScript's ~60 operator calls, checked against the compiled step before
it is used. Rows that re-encode take :class:`ContextEncode` (compiled) in their own call.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents.apex_dqn import NatureCNN
from gearflow.agent import ActOutput, EnvSpec
from gearflow.errors import ConfigError
from gearflow.kv_cache import KVCache, compile_checked, hop_length
from gearflow.precision import bf16_forward, fp32
from gearflow.replay.items import Sequence

log = logging.getLogger(__name__)

try:  # the C one-token step (setup.py builds it; optional)
    from gearflow import _decode
except ImportError:  # pragma: no cover - a build without a C compiler
    _decode = None


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
    """With ``kv_cache`` on the CPU: the one-token step in C (``gearflow._decode``, built with the
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

    def __init__(self, obs_shape: tuple[int, ...], d: int):
        super().__init__()
        self.cnn = NatureCNN(obs_shape)
        self.proj = nn.Linear(self.cnn.out_dim, d)

    def forward(self, obs):
        B, T = obs.shape[:2]
        return self.proj(self.cnn(obs.reshape(B * T, *obs.shape[2:]))).view(B, T, -1)  # (B, T, D)


class VectorEmbedding(nn.Module):
    """Vector observations (B, T, *shape) → tokens (B, T, D), one linear map."""

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
        H = cfg.num_heads  # the same slopes in numpy, for extend's bias (never a meta tensor)
        self._neg_slopes = -np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], np.float32)[None, :, None, None]
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
        """The cached step (:class:`gearflow.kv_cache.KVCache`): ``obs`` (k, Tn, *obs_shape) each
        row's new steps, ``kv_old`` (k, L, 2, nh, S, hs) its cached keys and values, ``allowed`` /
        ``dist`` (k, Tn, S + Tn) from ``KVCache.attention_bias``, ``last`` (k,) the new step to
        read. Returns Q-values (k, A) at ``last`` and the new keys/values (k, L, 2, nh, Tn, hs).
        ALiBi depends on distances only, so a step's bias is the same as in :meth:`forward`."""
        x = self.embed(obs)  # (k, Tn, D)
        bias = np.where(allowed[:, None], self._neg_slopes * dist[:, None], -np.inf).astype(np.float32)
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


class _FrameToken(nn.Module):
    """uint8 frames (k, T, C, H, W) → tokens (k, T, D): :class:`FrameEmbedding`'s own modules, in a
    form TorchScript compiles."""

    def __init__(self, embed: FrameEmbedding):
        super().__init__()
        self.cnn, self.proj = embed.cnn, embed.proj

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        B, T = obs.shape[0], obs.shape[1]
        return self.proj(self.cnn(obs.flatten(0, 1))).view(B, T, -1)


class _VectorToken(nn.Module):
    """Vector observations (k, T, *shape) → tokens (k, T, D): :class:`VectorEmbedding`'s map."""

    def __init__(self, embed: VectorEmbedding):
        super().__init__()
        self.linear = embed.linear

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs.float().flatten(2))


class _AnyToken(nn.Module):
    """Any other embedding (B, T, ...) → (B, T, D)."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.embed(obs)


def _token(embed: nn.Module) -> nn.Module:
    """The embedding as a token module TorchScript compiles."""
    return {FrameEmbedding: _FrameToken, VectorEmbedding: _VectorToken}.get(type(embed), _AnyToken)(embed)


class OneTokenStep(nn.Module):
    """The cached actor's step when every row brings exactly one new step: ``obs`` (k, 1, *obs_shape),
    ``kv`` the whole cache (E, L, 2, nh, S, hs) (:class:`gearflow.kv_cache.KVCache` ``.kv``),
    ``ids`` (k,) the rows' envs, ``length`` (k,) their cached steps (the new step's slot) and
    ``used = max(length) + 1``: only slots below it are read (a step costs what its contexts
    hold, not what the cache could). Writes each row's new keys and values into slot ``length`` of its env, in place, and returns
    Q-values (k, A): those of :meth:`TransformerQNetwork.extend` with ``Tn = 1``.

    Built to be compiled (``torch.jit.script``: one call, no per-module Python) and to run few
    ops: the ALiBi bias of a query at slot ``s`` over the ``S`` slots is row ``s`` of a table
    made once, the new token is written into the gathered caches before attending (slots
    ``≤ length`` are its context, itself included) and the gathered caches are written back
    with one ``index_copy_``. It holds the network's own submodules: the same parameter
    tensors, so weight syncs (copies in place) reach it."""

    def __init__(self, network: TransformerQNetwork, slots: int):
        super().__init__()
        self.token, self.blocks, self.ln, self.head = _token(network.embed), network.blocks, network.ln, network.head
        self.heads = int(network.blocks[0].heads)
        slopes = torch.as_tensor(-network._neg_slopes.reshape(-1))  # (nh,) from numpy: never a meta tensor
        pos = torch.arange(slots)
        dist = (pos[:, None] - pos[None, :]).float()  # (S, S) query slot − key slot
        table = -slopes[None, :, None] * dist[:, None, :]  # (S, nh, S): forward's bias at distance i − j
        table = table.masked_fill((dist < 0)[:, None, :], float("-inf")).to(network.head.weight.device)
        self.register_buffer("table", table, persistent=False)

    def forward(self, obs: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, length: torch.Tensor,
                used: int) -> torch.Tensor:
        x = self.token(obs).select(1, 0)  # (k, D)
        k, D = x.shape
        nh = self.heads
        bias = self.table.index_select(0, length).narrow(2, 0, used).unsqueeze(2)  # (k, nh, 1, used)
        # (narrow / select, not [:, ...]: TorchScript runs one op per sliced dimension)
        for layer, block in enumerate(self.blocks):
            qkv = block.qkv(block.ln1(x)).view(k, 3, nh, D // nh)  # q, k, v of the new token
            kv_l = kv.select(1, layer)  # (E, 2, nh, S, hs)
            kv_l[ids, :, :, length] = qkv.narrow(1, 1, 2)  # its keys/values into slot `length` of its env
            g = kv_l.narrow(3, 0, used).index_select(0, ids)  # (k, 2, nh, used, hs) this batch's (a copy)
            y = F.scaled_dot_product_attention(qkv.select(1, 0).unsqueeze(2), g.select(1, 0), g.select(1, 1),
                                               attn_mask=bias)  # fmt: skip
            x = x + block.proj(y.reshape(k, D))  # y (k, nh, 1, hs)
            x = x + block.mlp(block.ln2(x))
        return self.head(self.ln(x))  # (k, A)


class ContextEncode(nn.Module):
    """The cached actor's re-encode: rows whose caches are empty (an episode's first steps after new
    weights, a context that hopped) bring their whole context. ``obs`` (k, T, *obs_shape) left-aligned,
    ``n`` (k,) steps in each (padding after them), ``kv`` the whole cache (E, L, 2, nh, S, hs),
    ``ids`` (k,) the rows' envs, whose ``length`` is 0. Writes every layer's keys and values of the
    T steps into slots ``0 .. T − 1`` of each env (slots ≥ n hold padding, never read: they are
    past the length the caller sets) and returns Q-values (k, A) at step ``n − 1``: the learner's
    :meth:`TransformerQNetwork.forward` (the same causal ALiBi bias, from :class:`OneTokenStep`'s
    table) plus the cache writes, compiled like the one-token step."""

    def __init__(self, network: TransformerQNetwork, slots: int):
        super().__init__()
        one = OneTokenStep(network, slots)  # the same token module and bias table
        self.token, self.blocks, self.ln, self.head, self.heads = one.token, one.blocks, one.ln, one.head, one.heads
        self.register_buffer("table", one.table, persistent=False)  # (S, nh, S)

    def forward(self, obs: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        x = self.token(obs)  # (k, T, D)
        k, T, D = x.shape
        nh = self.heads
        bias = self.table.narrow(0, 0, T).narrow(2, 0, T).transpose(0, 1)  # (nh, T, T) causal ALiBi
        for layer, block in enumerate(self.blocks):
            qkv = block.qkv(block.ln1(x)).view(k, T, 3, nh, D // nh).permute(0, 2, 3, 1, 4)  # (k, 3, nh, T, hs)
            kv.select(1, layer).narrow(3, 0, T).index_copy_(0, ids, qkv.narrow(1, 1, 2))  # slots 0 .. T − 1
            y = F.scaled_dot_product_attention(qkv.select(1, 0), qkv.select(1, 1), qkv.select(1, 2),
                                               attn_mask=bias)  # (k, nh, T, hs)  # fmt: skip
            x = x + block.proj(y.transpose(1, 2).reshape(k, T, D))
            x = x + block.mlp(block.ln2(x))
        x = x[torch.arange(k, device=x.device), n - 1]  # (k, D) each row's last step
        return self.head(self.ln(x))  # (k, A)


class NativeOneTokenStep:
    """:class:`OneTokenStep` in C (``gearflow._decode.step``): one call per recv runs the blocks,
    the final norm and the head for every row, writing each row's keys and values into its env's
    slot ``length`` of the cache in place. It reads the network's parameters in place (buffer
    views of the same tensors: weight syncs reach it). A vector observation's linear embedding
    runs in C too; any other embedding (the Nature CNN) runs in torch first.

    ``NativeOneTokenStep(network, slots)`` raises ``ValueError`` naming what it cannot run (no C
    module, a device other than the CPU, parameters not float32, another block layout);
    :func:`native_one_token_step` builds it and checks it against the TorchScript step."""

    def __init__(self, network: TransformerQNetwork, slots: int):
        if _decode is None:
            raise ValueError("the C module gearflow._decode is not built (python setup.py build_ext --inplace)")
        params = list(network.parameters())
        if any(p.device.type != "cpu" for p in params):
            raise ValueError("the network is not on the CPU")
        if any(p.dtype != torch.float32 for p in params):
            raise ValueError("the network's parameters are not all float32")
        norms = [network.ln] + [m for b in network.blocks for m in (b.ln1, b.ln2)]
        if any(n.weight is None or n.bias is None for n in norms) or len({n.eps for n in norms}) != 1:
            raise ValueError("the layer norms are not affine with one eps")
        for b in network.blocks:
            mlp = list(b.mlp)
            if len(mlp) != 3 or not isinstance(mlp[0], nn.Linear) or not isinstance(mlp[2], nn.Linear) or \
                    type(mlp[1]) is not nn.GELU or mlp[1].approximate != "none":  # fmt: skip
                raise ValueError("a block's MLP is not Linear, GELU (exact), Linear")
        if not isinstance(network, TransformerQNetwork):
            raise ValueError(f"a {type(network).__name__} is not a TransformerQNetwork")  # noqa: TRY004 - what it cannot run
        self.vector = type(network.embed) is VectorEmbedding
        self.token = None if self.vector else _token(network.embed)  # torch: the CNN's token
        first = network.blocks[0]
        D, nh = first.proj.in_features, first.heads
        F, A = first.mlp[0].out_features, network.head.out_features

        def w(t: torch.Tensor) -> np.ndarray:
            return t.detach().numpy()  # a view: the parameter's own memory

        inw = (w(network.embed.linear.weight), w(network.embed.linear.bias)) if self.vector else (None, None)
        layers = [w(t) for b in network.blocks for t in (
            b.ln1.weight, b.ln1.bias, b.qkv.weight, b.qkv.bias, b.proj.weight, b.proj.bias,
            b.ln2.weight, b.ln2.bias, b.mlp[0].weight, b.mlp[0].bias, b.mlp[2].weight, b.mlp[2].bias)]  # fmt: skip
        self.slopes = np.ascontiguousarray(-network._neg_slopes.reshape(-1), dtype=np.float32)
        weights = (*inw, *layers, w(network.ln.weight), w(network.ln.bias), w(network.head.weight),
                   w(network.head.bias), self.slopes)  # fmt: skip
        self.in_dim = int(network.embed.linear.in_features) if self.vector else 0
        self.plan = _decode.plan(weights, len(network.blocks), D, nh, F, A, self.in_dim, float(network.ln.eps))
        self.num_actions, self.slots = A, int(slots)

    def __call__(self, obs: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, length: torch.Tensor,
                 used: int) -> torch.Tensor:
        """:class:`OneTokenStep`'s call (torch tensors in, Q-values (k, A) out; ``used`` is not
        needed: each row attends to its slots ``≤ length``)."""
        return torch.from_numpy(self.values(obs.cpu().numpy(), kv.numpy(), ids.numpy(), length.numpy()))

    def values(self, obs, cache_kv: np.ndarray, ids: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Q-values (k, A) float32: ``obs`` (k, 1, *obs_shape) one new step per row, ``cache_kv`` the
        cache as a numpy view (E, L, 2, nh, S, hs), ``ids`` / ``length`` (k,) int64: each row's env
        and the new step's slot (the actor's path: no torch call for a vector observation)."""
        k = len(ids)
        if self.vector:
            x = np.ascontiguousarray(np.asarray(obs).reshape(k, self.in_dim), dtype=np.float32)
        else:
            x = self.token(torch.as_tensor(obs)).select(1, 0).contiguous().numpy()
        out = np.empty((k, self.num_actions), dtype=np.float32)
        _decode.step(self.plan, x, cache_kv, np.ascontiguousarray(ids, dtype=np.int64),
                     np.ascontiguousarray(length, dtype=np.int64), out)  # fmt: skip
        return out


def native_one_token_step(network: TransformerQNetwork, slots: int, reference, obs_shape, obs_dtype):
    """``(NativeOneTokenStep(network, slots), "")`` where it runs and gives ``reference``'s (the
    TorchScript or eager :class:`OneTokenStep`) Q-values and cache writes within float rounding
    on random observations and caches (1 and 3 rows), else ``(None, why)``."""
    try:
        native = NativeOneTokenStep(network, slots)
    except ValueError as e:
        return None, str(e)
    obs, kv, _ = _random_inputs(network, slots, tuple(obs_shape), np.dtype(obs_dtype))
    with torch.inference_mode():
        for ids, length in _one_token_rows(slots):
            x = obs(len(ids), 1)
            kv_a, kv_b = kv.clone(), kv.clone()
            qa = reference(x, kv_a, torch.tensor(ids), torch.tensor(length), max(length) + 1).numpy()
            qb = native.values(x.numpy(), kv_b.numpy(), np.array(ids), np.array(length))
            if not (np.allclose(qa, qb, rtol=1e-4, atol=1e-5) and torch.allclose(kv_a, kv_b, rtol=1e-4, atol=1e-5)):
                err = float(np.abs(qa - qb).max())
                return None, f"its Q-values differ from the TorchScript step's by {err:.3g}"
    return native, ""


def compile_one_token_step(network: TransformerQNetwork, slots: int, obs_shape: tuple[int, ...], obs_dtype):
    """``OneTokenStep(network, slots)`` compiled with TorchScript, or the module itself (eager) where
    TorchScript cannot compile it, its parameters are not the network's, or it does not give the
    eager step's Q-values and cache writes (within float rounding) on random observations
    ``(k, 1, *obs_shape)`` of ``obs_dtype`` and random caches, for 1 and 3 rows. Returns
    ``(step, compiled)``."""
    obs, kv, dev = _random_inputs(network, slots, tuple(obs_shape), np.dtype(obs_dtype))
    trials = []
    for ids, length in _one_token_rows(slots):
        trials.append((obs(len(ids), 1), kv, torch.tensor(ids, device=dev), torch.tensor(length, device=dev),
                       max(length) + 1))  # fmt: skip
    return compile_checked(OneTokenStep(network, slots), network, trials)


def compile_context_encode(network: TransformerQNetwork, slots: int, obs_shape: tuple[int, ...], obs_dtype):
    """``ContextEncode(network, slots)`` compiled with TorchScript where that gives the eager module's
    Q-values and cache writes (contexts of 1 row × 3 steps and 2 rows × ``slots`` steps), else the
    module itself. Returns ``(encode, compiled)``."""
    obs, kv, dev = _random_inputs(network, slots, tuple(obs_shape), np.dtype(obs_dtype))
    trials = [(obs(1, 3), kv, torch.tensor([1], device=dev), torch.tensor([3], device=dev)),
              (obs(2, slots), kv, torch.tensor([3, 0], device=dev), torch.tensor([slots, 2], device=dev))]  # fmt: skip
    return compile_checked(ContextEncode(network, slots), network, trials)


def _one_token_rows(slots: int) -> tuple:
    """The rows the one-token steps are checked on: (envs, their slots) of 1 and 3 rows, the
    first and last slot included (:func:`compile_one_token_step`, :func:`native_one_token_step`)."""
    return ([2], [0]), ([3, 0, 1], [slots - 1, 0, slots // 2])


def _random_inputs(network, slots: int, obs_shape: tuple[int, ...], obs_dtype: np.dtype):
    """(obs(k, T) → random observations, a random cache of 4 envs, the device) for the checks."""
    device = network.head.weight.device
    first = network.blocks[0]
    L, nh = len(network.blocks), first.heads
    rng = np.random.default_rng(0)
    kv = torch.as_tensor(rng.standard_normal((4, L, 2, nh, slots, first.proj.in_features // nh), np.float32))

    def obs(k: int, T: int) -> torch.Tensor:
        if obs_dtype.kind in "ui":
            x = rng.integers(0, 256 if obs_dtype.itemsize == 1 else 100, (k, T, *obs_shape))
        else:
            x = rng.standard_normal((k, T, *obs_shape))
        return torch.as_tensor(x.astype(obs_dtype), device=device)

    return obs, kv.to(device), device


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

    def __init__(self, cfg: Config, spec: EnvSpec, full_cfg, device: torch.device):
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
        r = full_cfg.replay
        self.kind = Sequence(length=int(r.sequence_length), period=int(r.sequence_period), burn_in=int(r.burn_in))
        if cfg.context < 0:
            raise ConfigError(f"agent.context={cfg.context}: must be ≥ 0 (0: replay.sequence_length)")
        if cfg.context_hop < 0:
            raise ConfigError(f"agent.context_hop={cfg.context_hop}: must be ≥ 0 (0: half the context)")
        self.cfg, self.spec, self.device = cfg, spec, torch.device(device)
        self.num_actions = int(spec.num_actions)
        self.gamma = float(full_cfg.actor.gamma)
        self.n_step = int(full_cfg.actor.n_step)
        self.rng = np.random.default_rng(int(full_cfg.run.seed))
        self.bf16 = bool(full_cfg.learner.bf16)  # the learner's forward passes under bf16 autocast
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

    # ---- acting with a key/value cache (gearflow.kv_cache; the sequence actor calls these when
    # make_kv_cache returns a cache)
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
        self.optimizer = torch.optim.Adam(self.online.parameters(), lr=self.cfg.lr, eps=self.cfg.adam_eps)
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

    def learn(self, batch):
        loss, td, valid, q = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(self.online.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.cfg.target_update_period == 0:
            self.target.load_state_dict(self.online.state_dict())

        td_abs = td.detach().abs()
        priorities = priority_mix(td_abs, valid, self.cfg.eta)  # (B,)
        steps = valid.sum().clamp(min=1)
        stats = torch.stack([loss.detach(), (q.detach().amax(2) * valid).sum() / steps,
                             (td_abs * valid).sum() / steps, grad_norm.detach()])  # fmt: skip
        loss_v, q_mean, td_mean, gnorm = stats.float().cpu().tolist()  # one device sync
        metrics = {
            "learner/loss": loss_v,
            "learner/q_max_mean": q_mean,  # rescaled space
            "learner/td_abs_mean": td_mean,
            "learner/grad_norm": gnorm,
            "learner/updates": float(self.updates),
        }
        return metrics, priorities

    def state_dict(self) -> dict:
        return {
            "online": self.online.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.online is None:
            self.setup_learner()
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
