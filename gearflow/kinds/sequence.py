"""The sequence item kind (R2D2): fixed-length windows, in one module.

* :class:`Sequence` — the item rule: windows of ``length`` steps (R2D2: length 80, period 40,
  burn-in 40). Batch: ``[B, T, *shape]`` plus ``mask`` ``[B, T]`` (False on padding, which is
  zero-filled), ``length`` ``[B]``. Its writer-side schedule (:meth:`Sequence.due_on_append`,
  :meth:`Sequence.due_at_end`): windows start every ``period`` steps of an episode, never cross
  its boundary, and the short tail windows of an episode are created at its end (padded by the
  gather, masked in the batch). ``gather_on_device`` is its GPU gather.
* :class:`WindowAdder` — writes steps and windows (``obs action reward discount first version``).
* :class:`SequenceActor` — acts over each env's recent context (below).
* :data:`KIND` — the registry's entry (:mod:`gearflow.kinds.registry`); the fewest steps per
  partition are a whole window plus the staged step (``WindowAdder.min_steps``).

**The actor** (R2D2) acts over each env's recent context. Per ``recv`` of a batch of ``b`` envs::

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

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from gearflow.actors.adders import Adder
from gearflow.actors.base import ActorBase
from gearflow.kinds.registry import KindDef
from gearflow.replay.items import TORCH_DTYPES, ItemKind, flat_index, gatherable
from gearflow.replay.layout import step_rows
from gearflow.replay.protocols import WriterLike

# C window rows; None where not built (numpy below is the reference)
from gearflow.replay.hotpath import C as _hotpath

__all__ = ["KIND", "Sequence", "SequenceActor", "WindowAdder"]


@dataclass(frozen=True)
class Sequence(ItemKind):
    """Fixed-length windows of ``length`` steps, one starting every ``period`` steps."""

    length: int = 80
    period: int = 40
    burn_in: int = 0
    name = "sequence"

    def __post_init__(self):
        if self.length < 1 or self.period < 1:
            raise ValueError(f"sequence length and period must be ≥ 1, got {self.length}, {self.period}")
        if not 0 <= self.burn_in < self.length:
            raise ValueError(f"burn_in must be in [0, length), got {self.burn_in}")

    @property
    def max_length(self) -> int:
        return self.length

    def layout(self, spec, batch_size):
        T = self.max_length
        shapes = {c.name: ((batch_size, T, *c.shape), TORCH_DTYPES[c.dtype]) for c in spec}
        shapes["mask"] = ((batch_size, T), torch.bool)
        shapes["length"] = ((batch_size,), torch.int64)
        return shapes

    def rows(self, parts, starts, lengths, S, stacks=None):
        rows = self._window_rows(parts, starts, lengths, S)
        if stacks is not None:  # (B, T, k): each step's stack (padding repeats the last step's)
            rel = np.minimum(self._arange(self.max_length), (lengths - 1)[:, None])  # (B, T)
            p = np.asarray(parts)[:, None]
            rows["stacks"] = stacks.rows(p, rows["window"][:, :1], starts[:, None] + rel, rel, S)
        return rows

    def _window_rows(self, parts, starts, lengths, S):
        T = self.max_length
        if _hotpath is not None:
            rows = np.empty((len(parts), T), dtype=np.int64)
            _hotpath.window_rows(
                np.ascontiguousarray(parts, dtype=np.int64), np.ascontiguousarray(starts, dtype=np.int64),
                np.ascontiguousarray(lengths, dtype=np.int64), S, T, rows,
            )  # fmt: skip
            return {"window": rows}
        first = starts % S  # (B,)
        if (lengths == T).all() and (first <= S - T).all():  # common case: full windows, no ring wrap
            return {"window": (parts * S + first)[:, None] + self._arange(T)}  # step_rows without a wrap
        offs = np.minimum(self._arange(T), (lengths - 1)[:, None])  # (B, T): padding repeats the last step
        return {"window": step_rows(parts[:, None], starts[:, None] + offs, S)}

    def wire_rows(self, columns, rows, lengths):
        stacked = rows.get("stacks") or {}
        window = rows["window"]  # (B, T): padding repeats the last step's row
        B, T = window.shape
        zero = None
        if lengths.min() < T:
            zero = (self._arange(T)[None, :] >= lengths[:, None]).reshape(-1)
        flat = window.reshape(-1)
        return {col: (col, flat, zero) for col in columns if col not in stacked}

    def _arange(self, T: int) -> np.ndarray:
        cached = self.__dict__.get("_arange_cache")
        if cached is None or cached.size != T:
            cached = np.arange(T)
            object.__setattr__(self, "_arange_cache", cached)  # frozen dataclass: a private cache
        return cached

    def gather(self, tensors, out, rows, lengths):
        idx = torch.from_numpy(rows["window"].reshape(-1))  # (B*T,)
        B, T = rows["window"].shape
        padded = bool(lengths.min() < T)
        if padded:
            lens = torch.from_numpy(lengths.astype(np.int64))
            torch.lt(torch.arange(T), lens[:, None], out=out["mask"])  # (B, T)
            out["length"].copy_(lens)
        else:  # full windows: no per-element work
            out["mask"].fill_(True)
            out["length"].fill_(T)
        stacks = rows.get("stacks") or {}
        for name, src, flat, dst in self._plan(tensors, out, B, T):
            # (B*T, *shape) view of dst; a stacked column: (B*T*k, *frame), each step's stack rows
            torch.index_select(src, 0, flat_index(stacks[name]) if name in stacks else idx, out=flat)
            if padded:
                dst.masked_fill_(~out["mask"].view(B, T, *([1] * (dst.dim() - 2))), 0)

    def _plan(self, tensors, out, B, T):
        """Per output buffer, once: (gatherable source, flat destination view, destination)."""
        plans = self.__dict__.get("_plans")
        if plans is None:
            plans = {}
            object.__setattr__(self, "_plans", plans)  # frozen dataclass: a private cache
        key = (id(tensors), id(out))
        plan = plans.get(key)
        if plan is None or plan[0] is not tensors or plan[1] is not out:
            steps = []
            for name, src in tensors.items():
                src, dst = gatherable(src), gatherable(out[name])
                steps.append((name, src, dst.view(-1, *src.shape[1:]), dst))
            plan = plans[key] = (tensors, out, steps)
        return plan[2]

    # writer-side schedule ------------------------------------------------
    def due_on_append(self, episode_length: int) -> list[int]:
        """Windows (as ``num_steps`` over the last steps) complete after this append."""
        L = episode_length
        return [self.length] if L >= self.length and (L - self.length) % self.period == 0 else []

    def due_at_end(self, episode_length: int) -> list[int]:
        """Tail windows created when the episode ends: each starts at a multiple of
        ``period``, runs to the episode's end and is shorter than ``length``. A tail
        window made only of burn-in is skipped, except the first window of an episode
        shorter than ``length`` (it has no earlier context to lose)."""
        L = episode_length
        out = []
        for start in range(0, L, self.period):
            n = L - start
            if n >= self.length:
                continue  # a full window, created on append
            if n > self.burn_in or start == 0:
                out.append(n)
        return out

    def to_dict(self):
        return {"kind": self.name, "length": self.length, "period": self.period, "burn_in": self.burn_in}

    def records_per_partition(self, steps_per_partition):
        """An episode of L steps creates ceil(L / period) windows, at most 2 per ``period`` steps
        when L ≥ period; episodes shorter than half a period can still lap the record ring first
        (their oldest windows are then evicted early, never served stale)."""
        return 2 * (int(steps_per_partition) // max(1, self.period)) + 2

    def max_steps(self, steps_per_partition):
        return self.max_length

    def gather_on_device(self, cols, draw, data):
        """The GPU gather (:class:`~gearflow.native.device_replay.DeviceColumns`): windows of
        ``max_length`` steps (B, T, *shape) padded with zeros, ``mask`` (B, T), ``length`` (B,);
        stacked-frame columns through ``gather_stacks``."""
        cp, T, mask = cols.cupy, self.max_length, data["mask"]
        parts, starts, lengths = draw.parts, draw.starts, draw.lengths
        for name, ptr, row_bytes in cols.columns:
            if name in cols.stacks:
                cols.stack(name, ptr, row_bytes, parts, starts, lengths, T, data[name])
            else:
                cols.windows(ptr, row_bytes, parts, starts, lengths, T, data[name], mask)
        if all(name in cols.stacks for name, _, _ in cols.columns):  # no windows kernel wrote the mask
            mask[...] = cp.arange(T)[None, :] < cp.clip(lengths, 0, T)[:, None]
        data["length"][...] = lengths


# ---------------------------------------------------------------------- the adder


class WindowAdder(Adder):
    """Sequence windows (R2D2), one row per step; an episode of L actions is L + 1 rows::

        row t:   obs_t  action_t  reward_t  discount_t  first_t  version_t
                 reward_t = r after action_t, discount_t = 0 if that transition terminated
        row L:   obs_L (the final observation)  0  0  0  False  version

    Row t is complete when the reward of action_t arrives with obs_{t+1}, so each
    env stages one step and appends its row one recv later (at the end of an
    episode, the staged row and the final-observation row together). Windows are
    created with the item kind's schedule (``Sequence.due_on_append`` after every
    appended row, ``due_at_end`` when the episode ends): windows start every
    ``period`` rows, never cross an episode, and the tail windows of an episode
    are shorter (padded and masked when sampled).

    Initial priorities: ``priority_fn(values, action, reward, discount, first, lengths)``
    (R2D2's, the agent's ``initial_priorities``) over the Q-values acted with, kept for an
    env's last ``T + 1`` rows in a small ring; without ``priority_fn`` (or Q-values) every
    new window gets priority 1.
    """

    COLUMNS = ("obs", "action", "reward", "discount", "first", "version")

    def __init__(self, writer: WriterLike, kind: Sequence, priority_fn: Optional[Callable] = None):
        super().__init__(writer)
        self.kind, self.priority_fn = kind, priority_fn
        self.num_envs = E = writer.num_streams
        obs_col = writer.spec["obs"]
        # The staged step of each env (its row waits for the reward of its action).
        self._staged = np.zeros(E, dtype=bool)
        self._s_obs = np.zeros((E, *obs_col.row_shape), dtype=obs_col.dtype)  # (E, *obs) or (E, *frame)
        self._s_action = np.zeros(E, dtype=np.int64)
        self._s_first = np.zeros(E, dtype=bool)
        self._s_version = np.zeros(E, dtype=np.int64)
        self._s_values: np.ndarray | None = None  # (E, A) once the first act reports values
        # Ring of the last W = T + 1 rows per env (by absolute row % W), for actor priorities.
        self._W = kind.max_length + 1
        self._r_values: np.ndarray | None = None  # (E, W, A)
        self._r_action = np.zeros((E, self._W), dtype=np.int64)
        self._r_reward = np.zeros((E, self._W), dtype=np.float32)
        self._r_discount = np.zeros((E, self._W), dtype=np.float32)
        self._r_first = np.zeros((E, self._W), dtype=bool)
        self._pending: list[tuple[int, int, int]] = []  # windows (stream, length, end) of this recv

    @classmethod
    def check_kind(cls, kind, agent_name: str) -> None:
        if not isinstance(kind, Sequence) or kind.name != Sequence.name:  # an Episode is a Sequence too
            raise TypeError(f"the sequence actor writes sequence windows; agent {agent_name} asks for {kind}")

    @classmethod
    def min_steps(cls, actor, kind) -> int:
        return kind.max_length + 1  # a whole window plus the staged step

    @classmethod
    def size_error(cls, actor, kind, steps: int) -> str:
        return (f"steps_per_partition={steps} is too small for windows of {kind.max_length} steps; "
                f"need at least {kind.max_length + 1}")  # fmt: skip

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version: int) -> None:
        reward, terminated = np.asarray(reward), np.asarray(terminated)
        obs = self._frames(obs)  # (b, *obs), or the newest frames (b, *frame): a view
        if values is not None and self._r_values is None:
            A = values.shape[1]
            self._s_values = np.zeros((self.num_envs, A), dtype=np.float32)
            self._r_values = np.zeros((self.num_envs, self._W, A), dtype=np.float32)
        done = terminated | np.asarray(truncated)
        # 1. the staged step of each env is complete: its row (reward of its action, discount)
        st = self._staged[ids]
        if st.any():
            e = ids[st]
            discount = np.where(terminated[st], 0.0, 1.0).astype(np.float32)
            self._append(e, {
                "obs": self._s_obs[e], "action": self._s_action[e], "reward": reward[st].astype(np.float32),
                "discount": discount, "first": self._s_first[e], "version": self._s_version[e],
            }, None if self._s_values is None else self._s_values[e])  # fmt: skip
            self._staged[e] = False
        # 2. episodes that ended: the final observation as its own row, then the tail windows
        if done.any():
            e = ids[done]
            D = e.size
            self._append(e, {
                "obs": np.ascontiguousarray(obs[done]), "action": np.zeros(D, np.int64),
                "reward": np.zeros(D, np.float32), "discount": np.zeros(D, np.float32),
                "first": np.zeros(D, bool), "version": np.full(D, version, np.int64),
            }, None if values is None else values[done])  # fmt: skip
            ends = self.writer.positions
            for stream, L in zip(e.tolist(), self.writer.episode_lengths(e).tolist()):
                self._pending += [(stream, n, int(ends[stream])) for n in self.kind.due_at_end(L)]
        self._create_windows()
        if done.any():
            e = ids[done]
            self.writer.end_episode(e)
            self._staged[e] = False
        # 3. stage the new steps of envs that continue
        live = ~done
        if live.any():
            e = ids[live]
            self._s_obs[e] = obs[live]
            self._s_action[e] = actions[live]
            self._s_first[e] = first[live]
            self._s_version[e] = version
            if values is not None:
                self._s_values[e] = values[live]
            self._staged[e] = True

    def _append(self, e, row, values) -> None:
        """Append one row per env ``e`` (streams), keep it in the priority ring, queue the
        windows now due."""
        pos = self.writer.append(row, streams=e)  # (k,) absolute row
        slot = pos % self._W
        self._r_action[e, slot] = row["action"]
        self._r_reward[e, slot] = row["reward"]
        self._r_discount[e, slot] = row["discount"]
        self._r_first[e, slot] = row["first"]
        if values is not None and self._r_values is not None:
            self._r_values[e, slot] = values
        lengths = self.writer.episode_lengths(e)  # rows in each episode so far
        k = self.kind
        if type(k) is Sequence:  # Sequence.due_on_append over the batch: one window or none per env
            due = (lengths >= k.length) & ((lengths - k.length) % k.period == 0)
            if due.any():
                m = int(np.count_nonzero(due))
                self._pending.extend(zip(e[due].tolist(), [k.length] * m, (pos[due] + 1).tolist()))
            return
        for stream, L, p in zip(e.tolist(), lengths.tolist(), pos.tolist()):  # any other kind: its own rule
            self._pending += [(stream, n, p + 1) for n in k.due_on_append(L)]

    def _create_windows(self) -> None:
        """Publish the windows queued in this recv with one ``create_items`` call."""
        if not self._pending:
            return
        win = np.asarray(self._pending, dtype=np.int64)  # (m, 3): stream, length, end
        self._pending = []
        streams, lengths, ends = win[:, 0], win[:, 1], win[:, 2]
        self.writer.create_items(self._priorities(streams, lengths, ends), lengths, streams, ends)
        self.items += streams.size

    def _priorities(self, streams, lengths, ends) -> np.ndarray:
        fn = self.priority_fn
        if fn is None or self._r_values is None:
            return np.ones(streams.size)
        T = self.kind.max_length
        offs = np.arange(T)
        rows = ends[:, None] - lengths[:, None] + np.minimum(offs, lengths[:, None] - 1)  # (m, T)
        slot = rows % self._W
        s = streams[:, None]
        pad = offs[None, :] >= lengths[:, None]  # (m, T)
        vals = self._r_values[s, slot]  # (m, T, A)
        vals[pad] = 0.0
        prio = fn(vals, np.where(pad, 0, self._r_action[s, slot]), np.where(pad, 0, self._r_reward[s, slot]),
                  np.where(pad, 0, self._r_discount[s, slot]), self._r_first[s, slot] & ~pad, lengths)  # fmt: skip
        return np.nan_to_num(np.asarray(prio, dtype=np.float64), nan=1.0, posinf=1.0)


# ---------------------------------------------------------------------- the actor


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


KIND = KindDef("sequence", item=Sequence, adder=WindowAdder, actor=SequenceActor,
               from_config=lambda r: Sequence(length=int(r.sequence_length), period=int(r.sequence_period),
                                              burn_in=int(r.burn_in)))  # fmt: skip
