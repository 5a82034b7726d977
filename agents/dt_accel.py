"""The Decision Transformer's acting accelerator (:meth:`agents.decision_transformer.Agent.act_cached`
runs it; the learner never does): the cached actor's one-env-step call, compiled with
TorchScript and checked against the eager module before it is used.

A row that brings one env step after cached ones (nearly every row of every recv) runs
:class:`StepTokens`: its three new tokens a_{t−1}, R̂_t, s_t are embedded, written per block
into the env's next three cache slots in place and attend to the slots before them, with no
per-module Python; rows that re-encode take :meth:`DecisionTransformer.extend
<agents.dt_model.DecisionTransformer.extend>`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents.kv_cache import compile_checked

if TYPE_CHECKING:
    from agents.dt_model import DecisionTransformer

__all__ = ["StepTokens", "compile_step_tokens"]


class StepTokens(nn.Module):
    """The cached actor's step when each row brings one env step after cached ones: its three new
    tokens a_{t−1}, R̂_t, s_t go into the env's slots ``length .. length + 2`` (in place) and attend
    to the slots before them and to each other, causally; returns the head's output at s_t (k, H),
    that of :meth:`DecisionTransformer.extend` for these rows. Inputs: ``obs`` (k, obs_dim) s_t,
    ``kv`` the whole cache (E, L, 2, nh, S, hs), ``ids`` (k,) the envs, ``length`` (k,) their cached
    tokens, ``used = max(length) + 3`` (slots read), ``rtg`` (k,) R̂_t scaled, ``prev_action`` (k,)
    int or (k, A) in [-1, 1], ``t_prev`` / ``t`` (k,) the timesteps of steps t − 1 and t.

    Built to be compiled (``torch.jit.script``), for a network in eval mode (dropout is not applied);
    it holds the network's own submodules, so weight syncs reach it."""

    def __init__(self, network: DecisionTransformer):
        super().__init__()
        n = network
        self.embed_rtg, self.embed_obs, self.embed_action, self.embed_time = (n.embed_rtg, n.embed_obs,
                                                                              n.embed_action, n.embed_time)  # fmt: skip
        self.ln_in, self.blocks, self.ln, self.head = n.ln_in, n.blocks, n.ln, n.head
        self.discrete, self.max_timestep, self.heads = bool(n.discrete), int(n.max_timestep), int(n.blocks[0].heads)

    def forward(self, obs: torch.Tensor, kv: torch.Tensor, ids: torch.Tensor, length: torch.Tensor, used: int,
                rtg: torch.Tensor, prev_action: torch.Tensor, t_prev: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # fmt: skip
        time = self.embed_time(t.long().clamp(0, self.max_timestep - 1))  # (k, D)
        time_prev = self.embed_time(t_prev.long().clamp(0, self.max_timestep - 1))
        if self.discrete:
            a = self.embed_action(prev_action.long())
        else:
            a = self.embed_action(prev_action.float())
        tokens = torch.stack([a + time_prev, self.embed_rtg(rtg.float().unsqueeze(1)) + time,
                              self.embed_obs(obs.float().flatten(1)) + time], dim=1)  # (k, 3, D)  # fmt: skip
        x = self.ln_in(tokens)
        k, _, D = x.shape
        nh = self.heads
        slots = length.unsqueeze(1) + torch.arange(3, device=x.device).unsqueeze(0)  # (k, 3) the new tokens'
        allowed = torch.arange(used, device=x.device).view(1, 1, used) <= slots.unsqueeze(2)  # (k, 3, used)
        mask = allowed.unsqueeze(1)  # (k, 1, 3, used): cached slots, then causal among the new three
        rows = ids.unsqueeze(1)  # (k, 1)
        for layer, block in enumerate(self.blocks):
            qkv = block.qkv(block.ln1(x)).view(k, 3, 3, nh, D // nh)  # (k, token, q/k/v, nh, hs)
            kv_l = kv.select(1, layer)  # (E, 2, nh, S, hs)
            kv_l[rows, :, :, slots] = qkv.narrow(2, 1, 2)  # (k, 3, 2, nh, hs) into slots length .. length + 2
            g = kv_l.narrow(3, 0, used).index_select(0, ids)  # (k, 2, nh, used, hs)
            y = F.scaled_dot_product_attention(qkv.select(2, 0).transpose(1, 2), g.select(1, 0), g.select(1, 1),
                                               attn_mask=mask)  # (k, nh, 3, hs)  # fmt: skip
            x = x + block.proj(y.transpose(1, 2).reshape(k, 3, D))
            x = x + block.mlp(block.ln2(x))
        return self.head(self.ln(x.select(1, 2)))  # (k, H) at s_t


def compile_step_tokens(network: DecisionTransformer, slots: int, obs_dim: int, act_shape: tuple[int, ...]):
    """:class:`StepTokens` compiled with TorchScript where that gives the eager module's outputs and
    cache writes on random inputs (1 and 3 rows), else the module itself (:func:`compile_checked`).
    Returns ``(step, compiled)``."""
    dev = network.head.weight.device
    first = network.blocks[0]
    L, nh = len(network.blocks), first.heads
    rng = np.random.default_rng(0)
    kv = torch.as_tensor(rng.standard_normal((4, L, 2, nh, slots, first.proj.in_features // nh), np.float32)).to(dev)
    trials = []
    for ids, length in (([2], [2]), ([3, 0, 1], [slots - 3, 2, 5 if slots > 8 else 2])):
        k = len(ids)
        if network.discrete:
            prev = torch.as_tensor(rng.integers(0, network.embed_action.num_embeddings, k), device=dev)
        else:
            prev = torch.as_tensor(rng.uniform(-1, 1, (k, *act_shape)).astype(np.float32), device=dev)
        t = torch.as_tensor(rng.integers(1, 50, k), device=dev)
        trials.append((torch.as_tensor(rng.standard_normal((k, obs_dim)).astype(np.float32), device=dev), kv,
                       torch.tensor(ids, device=dev), torch.tensor(length, device=dev), max(length) + 3,
                       torch.as_tensor(rng.standard_normal(k).astype(np.float32), device=dev), prev, t - 1, t))  # fmt: skip
    return compile_checked(StepTokens(network), network, trials)
