"""The Decision Transformer's network and its policy head (:mod:`agents.decision_transformer`
trains and acts with them; :mod:`agents.dt_accel` compiles the cached actor's step from the
network's own submodules).

    cfg = agents.decision_transformer.Config()
    net = DecisionTransformer(obs_dim=4, act_dim=2, discrete=True, max_timestep=500, cfg=cfg)
    out = net(rtg / cfg.rtg_scale, obs, action, timestep)   # (B, K) (B, K, 4) (B, K) (B, K) → (B, K, 2)

Continuous actions: the head gives (mean, log_std) per action dimension, the policy is
:func:`tanh_normal` over [-1, 1]^A (ODT's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gearflow.precision import fp32

if TYPE_CHECKING:
    from agents.decision_transformer import Config

__all__ = ["Block", "DecisionTransformer", "tanh_normal", "tanh_normal_mode"]


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention + MLP, with dropout."""

    def __init__(self, d: int, heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_ratio * d), nn.GELU(), nn.Linear(mlp_ratio * d, d),
                                 nn.Dropout(dropout))  # fmt: skip
        self.drop = nn.Dropout(dropout)

    def forward(self, x, kv_old=None, allowed=None):
        """``x`` (B, N, D), causal. With ``kv_old`` (B, 2, nh, S, hs) cached keys and values, the N
        tokens attend to them and each other as ``allowed`` (B, 1, N, S + N) bool says, and this
        block's keys and values of the N tokens (B, 2, nh, N, hs) are returned as well."""
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)  # 3 × (B, N, D)
        q, k, v = (z.view(B, N, self.heads, D // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, N, hs)
        p = self.dropout if self.training else 0.0
        if kv_old is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, nh, N, hs)
        else:
            kv = torch.stack([k, v], dim=1)  # (B, 2, nh, N, hs)
            k, v = torch.cat([kv_old, kv], dim=3).unbind(1)  # (B, nh, S+N, hs)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)  # (B, nh, N, hs)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, N, D)))
        x = x + self.mlp(self.ln2(x))  # (B, N, D)
        return x if kv_old is None else (x, kv)


class DecisionTransformer(nn.Module):
    """(R̂, s, a, timestep) of K steps → action-head features (B, K, D) read at the s_t tokens.

    Tokens are interleaved R̂_1, s_1, a_1, ..., R̂_K, s_K, a_K (3K); each step's three
    tokens share its timestep embedding. The output at s_t sees R̂_≤t, s_≤t, a_<t only.
    """

    def __init__(self, obs_dim: int, act_dim: int, discrete: bool, max_timestep: int, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.discrete = discrete
        self.max_timestep = max_timestep
        self.embed_rtg = nn.Linear(1, d)
        self.embed_obs = nn.Linear(obs_dim, d)
        self.embed_action = nn.Embedding(act_dim, d) if discrete else nn.Linear(act_dim, d)
        self.embed_time = nn.Embedding(max_timestep, d)
        self.ln_in = nn.LayerNorm(d)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(d, cfg.num_heads, cfg.mlp_ratio, cfg.dropout) for _ in range(cfg.num_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, act_dim if discrete else 2 * act_dim)  # logits, or (mean, log_std)

    def forward(self, rtg, obs, action, timestep):
        """``rtg`` (B, K) already scaled; ``obs`` (B, K, obs_dim); ``action`` (B, K) int or
        (B, K, act_dim) in [-1, 1]; ``timestep`` (B, K). Returns the head's output (B, K, H)."""
        B, K = rtg.shape
        time = self.embed_time(timestep.long().clamp(0, self.max_timestep - 1))  # (B, K, D)
        a = self.embed_action(action.long()) if self.discrete else self.embed_action(action.float())
        tokens = torch.stack([self.embed_rtg(rtg.float()[..., None]) + time,
                              self.embed_obs(obs.float().flatten(2)) + time, a + time], dim=2)  # (B, K, 3, D)
        x = self.drop(self.ln_in(tokens.reshape(B, 3 * K, -1)))  # (B, 3K, D)
        for block in self.blocks:
            x = block(x)
        with fp32(x):  # the final norm and head in fp32 under bf16 autocast (gearflow/precision.py)
            x = self.ln(x.float()).view(B, K, 3, -1)[:, :, 1]  # (B, K, D): outputs at the s_t tokens
            return self.head(x)  # (B, K, H) float32

    def extend(self, rtg, obs, action, timestep, first_token, kv_old, allowed, n_new):
        """The cached step (:class:`agents.kv_cache.KVCache`). ``rtg``/``obs``/``action``/
        ``timestep`` (k, Ts, ...): context steps from step ``first_token // 3`` on (inputs as in
        :meth:`forward`); the new tokens of row r are its tokens ``first_token[r]`` ..
        ``first_token[r] + n_new[r] − 1`` of the context's sequence R̂_0, s_0, a_0, R̂_1, ...,
        (its cached tokens come before them), the last one an s_t. ``kv_old`` (k, L, 2, nh, S,
        hs), ``allowed`` (k, Tn, S + Tn) from ``KVCache.attention_bias``. Returns the head's
        output at each row's last new token (k, H) and the new keys/values (k, L, 2, nh, Tn, hs)."""
        B, Ts = rtg.shape
        time = self.embed_time(timestep.long().clamp(0, self.max_timestep - 1))  # (k, Ts, D)
        a = self.embed_action(action.long()) if self.discrete else self.embed_action(action.float())
        tokens = torch.stack([self.embed_rtg(rtg.float()[..., None]) + time,
                              self.embed_obs(obs.float().flatten(2)) + time, a + time], dim=2)  # (k, Ts, 3, D)
        x = self.ln_in(tokens.reshape(B, 3 * Ts, -1))  # (k, 3Ts, D)
        Tn = allowed.shape[1]
        local = np.minimum((first_token % 3)[:, None] + np.arange(Tn)[None, :], 3 * Ts - 1)  # (k, Tn)
        x = x[torch.arange(B)[:, None], torch.from_numpy(local)].to(x.device)  # (k, Tn, D) the new tokens
        mask = torch.from_numpy(np.ascontiguousarray(allowed[:, None])).to(x.device)  # (k, 1, Tn, S+Tn)
        kv_new = []
        for layer, block in enumerate(self.blocks):
            x, kv = block(x, kv_old[:, layer], mask)
            kv_new.append(kv)
        x = x[torch.arange(B, device=x.device), torch.as_tensor(n_new - 1, device=x.device)]  # (k, D)
        return self.head(self.ln(x)), torch.stack(kv_new, dim=1)


# ----------------------------------------------------------------------------- the policy head (continuous actions)


def tanh_normal(out: torch.Tensor) -> torch.distributions.Distribution:
    """Squashed diagonal Gaussian over [-1, 1]^A from head outputs (..., 2A) (ODT's policy)."""
    mean, log_std = out.chunk(2, dim=-1)
    std = log_std.clamp(-5.0, 2.0).exp()
    base = torch.distributions.Normal(mean, std)
    dist = torch.distributions.TransformedDistribution(base, [torch.distributions.TanhTransform(cache_size=1)])
    return torch.distributions.Independent(dist, 1)


def tanh_normal_mode(out: torch.Tensor) -> torch.Tensor:
    return torch.tanh(out.chunk(2, dim=-1)[0])
