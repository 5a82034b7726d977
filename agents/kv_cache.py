"""Per-env key/value caches for the causal transformer actors (R2D2, Decision Transformer).

An actor steps ``E`` envs; each keeps a context of recent tokens that its policy
attends over. Re-running the whole context every step costs ``O(context)`` per
env step; with a cache each step runs the network on the step's new tokens
only, attending to the keys and values cached for that env::

    cache = KVCache(E, num_layers=2, num_heads=4, head_dim=16, slots=40, device="cpu")
    kv_old = cache.gather(ids)                      # (k, L, 2, nh, S, hs) the envs of this recv
    allowed, dist = cache.attention_bias(ids, n_new, Tn)  # (k, Tn, S + Tn): mask, query − key position
    out, kv_new = network.extend(x_new, kv_old, allowed, dist)  # kv_new (k, L, 2, nh, Tn, hs)
    cache.append(ids, kv_new, n_new)                # slots length .. length + n_new − 1
    cache.clear(ids)                                # episode start, context hop, new weights

Slots are linear, not a ring: slot ``j`` holds the ``j``-th token of the env's
current context, so a cache and its context always describe the same tokens
and a token's position in the context is its slot. ``clear`` empties an env;
its next step re-encodes (prefills) the whole context in the same batched call
as the other envs' one-token steps (rows of one call may bring different
numbers of new tokens: ``n_new``, padded to ``Tn``).

Why the actors clear and re-encode instead of sliding a ring: in a transformer
of two or more layers the keys of a token in layer ``l ≥ 2`` depend on what that
token attended to, so once the oldest token leaves a context the cached keys of
the others are no longer what a recompute over the shortened context gives.
Exact equality with a recompute needs the re-encode; the actors do it when the
context *hops* (drops its oldest ``hop`` steps at once, :func:`hop_context`)
and when the weights change, so its cost is spread over ``hop`` steps.

The agents run their common cases (one env step after cached tokens; a whole
context into an empty cache) through small modules compiled with TorchScript
that write ``kv`` in place (``agents.r2d2_accel.OneTokenStep`` /
``ContextEncode``, ``agents.dt_accel.StepTokens``);
:func:`compile_checked` compiles one and keeps it only if it reads the network's
own parameters and matches the eager module, else the actor acts eagerly. On the CPU,
R2D2's one-token step runs in C (``agents._r2d2_decode``, ``agents.r2d2_accel.NativeOneTokenStep``:
the whole step in one call over :meth:`KVCache.host_view`), where it matches the compiled step.

This module is shared by both transformer agents, so it is neither's: each imports it, neither
reaches into the other (the framework's actors only call the agent's ``make_kv_cache``).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

__all__ = ["KVCache", "compile_checked", "hop_length"]

log = logging.getLogger(__name__)


def hop_length(context: int, hop: int = 0) -> int:
    """Steps a full context drops at once (``hop``; 0: half the context, at least 1).

    >>> hop_length(40), hop_length(1), hop_length(40, 30)
    (20, 1, 30)
    """
    h = int(hop) or int(context) // 2
    return max(1, min(h, int(context)))


class KVCache:
    """Keys and values of ``E`` envs' contexts: ``kv`` (E, L, 2, nh, S, hs) float32 on ``device``;
    ``length`` (E,) int64 numpy: tokens cached per env (slots 0 .. length−1 valid)."""

    def __init__(self, num_envs: int, num_layers: int, num_heads: int, head_dim: int, slots: int,
                 device="cpu", dtype=torch.float32):  # fmt: skip
        self.num_envs, self.slots = int(num_envs), int(slots)
        self.kv = torch.zeros(num_envs, num_layers, 2, num_heads, slots, head_dim, dtype=dtype, device=device)
        self.length = np.zeros(num_envs, dtype=np.int64)
        self.device = torch.device(device)
        self._host: np.ndarray | None = None

    def host_view(self) -> np.ndarray:
        """``kv`` as a numpy array sharing its memory (a CPU cache; made once)."""
        if self._host is None:
            self._host = self.kv.numpy()
        return self._host

    def clear(self, ids=None) -> None:
        """Empty the caches of envs ``ids`` (all when None); their slots are never read again
        before they are rewritten (the attention bias masks slots ≥ length)."""
        if ids is None:
            self.length[:] = 0
        else:
            self.length[ids] = 0

    def gather(self, ids: np.ndarray) -> torch.Tensor:
        """The caches of envs ``ids`` (k,): (k, L, 2, nh, S, hs), one ``index_select``."""
        return self.kv.index_select(0, torch.as_tensor(ids, device=self.device))

    def attention_bias(self, ids: np.ndarray, n_new: np.ndarray, Tn: int):
        """Which keys each new token may attend to, and how far back each is.

        Keys are the ``S`` cached slots followed by the ``Tn`` new tokens (the layout of
        ``torch.cat([kv_old, kv_new], dim=-2)``). Row ``r``'s new token ``i < n_new[r]``
        sees cached slots ``< length[r]`` and new tokens ``≤ i`` (causal); a padding query
        (``i ≥ n_new[r]``) sees the same plus itself, never an empty row, so its output (never
        read, never cached) stays finite. Returns
        ``(allowed, distance)``: (k, Tn, S + Tn) bool and float32 (query position − key
        position, for ALiBi-style biases; 0 where not allowed)."""
        S, length = self.slots, self.length[ids]  # (k,)
        n_new = np.asarray(n_new, dtype=np.int64)
        if (length + n_new > S).any():
            r = int(np.argmax(length + n_new > S))
            raise ValueError(f"env {int(ids[r])}: {int(length[r])} cached + {int(n_new[r])} new tokens "
                             f"exceed the cache's {S} slots")  # fmt: skip
        if Tn == 1:  # the one-token step: cached slots < length, then itself
            j = np.arange(S + 1)
            allowed = (j[None, :] < length[:, None]) | (j == S)[None, :]  # (k, S+1)
            dist = np.where(allowed, length[:, None] - np.minimum(j, length[:, None]), 0).astype(np.float32)
            return allowed[:, None], dist[:, None]  # (k, 1, S+1)
        i = np.arange(Tn)
        q_pos = length[:, None] + i[None, :]  # (k, Tn)
        k_pos = np.concatenate([np.broadcast_to(np.arange(S), (len(ids), S)), q_pos], axis=1)  # (k, S+Tn)
        cached = np.arange(S)[None, None, :] < length[:, None, None]  # (k, 1, S)
        new = (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] < n_new[:, None, None])  # (k, Tn, Tn)
        new |= np.eye(Tn, dtype=bool)[None]  # padding queries see themselves
        allowed = np.concatenate([np.broadcast_to(cached, (len(ids), Tn, S)), new], axis=2)  # (k, Tn, S+Tn)
        dist = np.where(allowed, q_pos[:, :, None] - k_pos[:, None, :], 0).astype(np.float32)
        return allowed, dist

    def append(self, ids: np.ndarray, kv_new: torch.Tensor, n_new: np.ndarray) -> None:
        """Write the first ``n_new[r]`` of each row's new tokens ``kv_new`` (k, L, 2, nh, Tn, hs)
        into env ``ids[r]``'s slots ``length .. length + n_new − 1``; advance ``length``."""
        n_new = np.asarray(n_new, dtype=np.int64)
        Tn, dev = kv_new.shape[4], self.device
        if Tn == 1:  # the one-token step: a view of the new keys, one index_put
            rows, src = np.arange(len(ids)), kv_new[:, :, :, :, 0]  # (k, L, 2, nh, hs)
            slot = self.length[ids]
        else:
            rows, cols = np.nonzero(np.arange(Tn)[None, :] < n_new[:, None])  # valid new tokens (N,)
            slot = self.length[ids][rows] + cols
            src = kv_new[torch.as_tensor(rows, device=dev), :, :, :, torch.as_tensor(cols, device=dev)]  # (N, L, 2, nh, hs)
        self.kv[torch.as_tensor(ids[rows], device=dev), :, :, :, torch.as_tensor(slot, device=dev)] = src
        self.length[ids] += n_new


def compile_checked(module: torch.nn.Module, network: torch.nn.Module, trials: list[tuple]):
    """An agent's cached acting module compiled with TorchScript: ``(torch.jit.script(module), True)``
    if the compiled module reads ``network``'s parameters (weight syncs copy into them in place) and
    gives ``module``'s outputs and cache writes on every trial within float rounding; else
    ``(module, False)`` (logged: the actor acts with the eager module, just as exactly).

    ``trials``: argument tuples ``(x, kv, ...)``, ``kv`` a cache tensor cloned for each of the two
    calls (the modules write into it in place)."""
    name = type(module).__name__
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(module)
        if not {p.data_ptr() for p in scripted.parameters()} <= {p.data_ptr() for p in network.parameters()}:
            log.info("acting with the eager %s: its TorchScript copy holds other parameters", name)
            return module, False
        with torch.inference_mode():
            for args in trials:
                kv_a, kv_b = args[1].clone(), args[1].clone()
                qa, qb = module(args[0], kv_a, *args[2:]), scripted(args[0], kv_b, *args[2:])
                if not (torch.allclose(qa, qb, rtol=1e-5, atol=1e-6) and torch.allclose(kv_a, kv_b, rtol=1e-5, atol=1e-6)):
                    log.info("acting with the eager %s: its TorchScript compilation differs", name)
                    return module, False
    except Exception as exc:  # noqa: BLE001 - any module TorchScript cannot compile (a custom torso): eager
        why = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        log.info("acting with the eager %s (TorchScript: %s)", name, why)
        return module, False
    return scripted, True
