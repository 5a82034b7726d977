"""Sequence actors (R2D2): act over each env's recent context; the
:class:`~gearflow.actors.adders.WindowAdder` writes steps and sequence windows.

Per ``recv`` of a batch of ``b`` envs::

    obs, reward, terminated, truncated, ids = env.recv()
    context[ids] ← obs            # each env's last C observations, left-aligned, reset at episode start
    out = agent.act(policy, context[ids], epsilon[ids], rng, lengths=context_len[ids])
    env.send(out.actions, ids)
    adder.add(...)                # rows, windows, R2D2 priorities from out.values

``C = agent.context_length()`` (:class:`~gearflow.agent.SequenceAgent`).

**Key/value cache.** An agent may offer ``make_kv_cache(E)`` (a
:class:`~agents.kv_cache.KVCache`, or None when switched off), ``context_hop()``
and ``act_cached(network, cache, ids, obs_new, n_new, ε, rng)``
(``agents.r2d2_transformer`` does, ``agent.kv_cache``). Then each recv runs the
network on each env's *new* steps only, attending to its cached keys::

    context[ids] ← obs           # full (C steps): drop the oldest H = agent.context_hop() first
    n_new = len(context) − len(cache)    # 1; the whole context after an episode start,
                                         # a hop or new weights (the cache was cleared)
    out = agent.act_cached(policy, cache, ids, context[ids][len(cache):], n_new, ...)

so a step costs one token per env, plus a re-encode of ``C − H + 1`` steps every
``H`` steps and once per env after each weight update. (``agents.r2d2_transformer``
runs both as TorchScript-compiled modules over the batch, ``OneTokenStep`` and
``ContextEncode``, writing the cache in place: ~0.1–0.2 ms per recv of 4 envs at
d = 64, two layers, whatever the context length.) The context is then
``C − H + 1`` to ``C`` steps (not always the last C): over the same steps the
cached Q-values equal a full recompute, up to float rounding. (A sliding cache
that drops one step at a time cannot be exact: from the second layer on, the
cached keys of a step depend on the steps it attended to when it was new.) With
``C = replay.sequence_length``, ``H = replay.sequence_period`` and
``burn_in = C − H`` (R2D2's 80/40/40, cartpole_masked_r2d2's 40/20/20) the actor's
context of step t is exactly the one the learner's window gives step t where t
gets its loss.
"""

from __future__ import annotations

import numpy as np
import torch

from gearflow.actors.adders import WindowAdder
from gearflow.actors.base import ActorBase, register_actor


@register_actor("sequence")
class SequenceActor(ActorBase):
    """Steps one vectorised env with a sequence agent's policy and writes sequence windows
    (constructor arguments: :class:`~gearflow.actors.base.ActorBase`)."""

    NAME = "the sequence actor"

    def _make_adder(self, writer) -> WindowAdder:
        return WindowAdder(writer, self.kind, self.agent.initial_priorities)

    def _setup_state(self) -> None:
        E, obs_shape, obs_dtype = self.num_envs, tuple(self.env.obs_shape), np.dtype(self.env.obs_dtype)
        # Context per env: the last C observations of its episode, left-aligned.
        C = self.context = int(self.agent.context_length())
        self._ctx = np.zeros((E, C, *obs_shape), dtype=obs_dtype)  # (E, C, *obs)
        self._ctx_len = np.zeros(E, dtype=np.int64)
        make_cache = getattr(self.agent, "make_kv_cache", None)
        self.cache = make_cache(E) if make_cache is not None else None  # KVCache | None
        self.hop = int(self.agent.context_hop()) if self.cache is not None else 1  # steps a full context drops
        self._cache_version = -1  # weights version of the cached keys

    def step(self) -> int:
        """One recv → context → act → send → rows and windows. Returns the env steps done."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        self._push_context(ids, obs, self._new_episode[ids])
        with torch.inference_mode():  # cheaper per op than no_grad; the cache is updated in place
            if self.cache is None:
                out = self.agent.act(self.network, self._ctx[ids], self.epsilon[ids], self.rng,
                                     lengths=self._ctx_len[ids])  # fmt: skip
            else:
                out = self._act_cached(ids, obs)
        self.env.send(out.actions, env_ids)  # the envs step while we write replay
        self._observe(ids, obs, reward, terminated, truncated, out.actions, out.values)
        return self._count_steps(ids.size)

    def _act_cached(self, ids, obs):
        """Act on each env's steps that are not in its cache yet (one, or the whole context)."""
        if self._cache_version != self.version:  # new weights: every cached key is stale
            self.cache.clear()
            self._cache_version = self.version
        cached, n = self.cache.length[ids], self._ctx_len[ids]
        n_new = n - cached  # (k,)
        Tn = int(n_new.max())
        if Tn == 1:
            obs_new = obs[:, None]  # (k, 1, *obs): the step just pushed
        else:
            idx = np.minimum(cached[:, None] + np.arange(Tn)[None, :], (n - 1)[:, None])  # (k, Tn) padded
            obs_new = self._ctx[ids[:, None], idx]  # (k, Tn, *obs)
        return self.agent.act_cached(self.network, self.cache, ids, obs_new, n_new, self.epsilon[ids], self.rng)

    def _push_context(self, ids, obs, first) -> None:
        """Append obs to each env's context (emptied at an episode's first step; when full, the
        oldest ``hop`` steps are dropped: 1 without a cache, ``agent.context_hop()`` with one,
        whose entries for the env are then cleared)."""
        C, H = self.context, self.hop
        self._ctx_len[ids[first]] = 0
        full = self._ctx_len[ids] >= C
        if full.any():
            f = ids[full]
            self._ctx[f, : C - H] = self._ctx[f, H:]
            self._ctx_len[f] = C - H
        if self.cache is not None:
            self.cache.clear(ids[first | full])
        self._ctx[ids, self._ctx_len[ids]] = obs
        self._ctx_len[ids] += 1


__all__ = ["SequenceActor"]
