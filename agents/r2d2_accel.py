"""The R2D2 transformer's acting accelerators (agents/r2d2_transformer.py acts with them; the
learner never does): the cached actor's steps, compiled or in C, each checked against the eager
step before it is used.

A cached step with one new step per env (nearly every row of every recv) runs
:class:`OneTokenStep`, compiled with TorchScript: embed the step, then per block
write its keys and values into the env's next slot in place, attend over the
slots in use with the ALiBi bias read from a table, MLP; no per-step allocation
of caches, no Python per module or per env. On the CPU the same step runs in C
(:class:`NativeOneTokenStep`, ``agents/_r2d2_decode.c``; ``agent.native_step``): one call per
recv instead of TorchScript's ~60 operator calls, checked against the compiled step before
it is used. Rows that re-encode take :class:`ContextEncode` (compiled) in their own call.

The network is :class:`agents.r2d2_transformer.TransformerQNetwork`; this module reads its
parts (``embed``, ``blocks``, ``ln``, ``head``, ``neg_slopes``) and does not import it (the
agent imports this module). The embeddings say which TorchScript form they take with a class
attribute, ``acting_token``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents.kv_cache import compile_checked

if TYPE_CHECKING:
    from agents.r2d2_transformer import TransformerQNetwork

try:  # the C one-token step (setup.py builds it; optional)
    from agents import _r2d2_decode as _decode
except ImportError:  # pragma: no cover - a build without a C compiler
    _decode = None

__all__ = ["ContextEncode", "NativeOneTokenStep", "OneTokenStep", "compile_context_encode",
           "compile_one_token_step", "native_one_token_step"]  # fmt: skip


class _FrameToken(nn.Module):
    """uint8 frames (k, T, C, H, W) → tokens (k, T, D): ``FrameEmbedding``'s own modules, in a
    form TorchScript compiles."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.cnn, self.proj = embed.cnn, embed.proj

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        B, T = obs.shape[0], obs.shape[1]
        return self.proj(self.cnn(obs.flatten(0, 1))).view(B, T, -1)


class _VectorToken(nn.Module):
    """Vector observations (k, T, *shape) → tokens (k, T, D): ``VectorEmbedding``'s map."""

    def __init__(self, embed: nn.Module):
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


def _token_kind(embed: nn.Module) -> str:
    """``"frame"`` / ``"vector"``: the ``acting_token`` the embedding's own class declares
    (``FrameEmbedding`` / ``VectorEmbedding``; not inherited: a subclass may embed otherwise),
    else ``""``."""
    return type(embed).__dict__.get("acting_token", "")


def _token(embed: nn.Module) -> nn.Module:
    """The embedding as a token module TorchScript compiles."""
    return {"frame": _FrameToken, "vector": _VectorToken}.get(_token_kind(embed), _AnyToken)(embed)


class OneTokenStep(nn.Module):
    """The cached actor's step when every row brings exactly one new step: ``obs`` (k, 1, *obs_shape),
    ``kv`` the whole cache (E, L, 2, nh, S, hs) (:class:`agents.kv_cache.KVCache` ``.kv``),
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
        slopes = torch.as_tensor(-network.neg_slopes.reshape(-1))  # (nh,) from numpy: never a meta tensor
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
    """:class:`OneTokenStep` in C (``agents._r2d2_decode.step``): one call per recv runs the blocks,
    the final norm and the head for every row, writing each row's keys and values into its env's
    slot ``length`` of the cache in place. It reads the network's parameters in place (buffer
    views of the same tensors: weight syncs reach it). A vector observation's linear embedding
    runs in C too; any other embedding (the Nature CNN) runs in torch first.

    ``NativeOneTokenStep(network, slots)`` raises ``ValueError`` naming what it cannot run (no C
    module, a device other than the CPU, parameters not float32, another block layout);
    :func:`native_one_token_step` builds it and checks it against the TorchScript step."""

    def __init__(self, network: TransformerQNetwork, slots: int):
        if _decode is None:
            raise ValueError("the C module agents._r2d2_decode is not built (python setup.py build_ext --inplace)")
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
        if not hasattr(network, "neg_slopes"):  # TransformerQNetwork's ALiBi slopes
            raise ValueError(f"a {type(network).__name__} is not a TransformerQNetwork")
        self.vector = _token_kind(network.embed) == "vector"
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
        self.slopes = np.ascontiguousarray(-network.neg_slopes.reshape(-1), dtype=np.float32)
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
