"""The transition item kind (Ape-X): n-step transitions, in one module.

* :class:`Transition` — the item rule: every column at the first step, and ``next_<c>`` for
  the ``next_columns`` at the last step (the bootstrap step ``t + n``, or the final step of an
  episode that ended sooner). The frame at ``t + n`` is stored once, as its own step. Batch:
  ``[B, *shape]``. One record per step; ``gather_on_device`` is its GPU gather.
* :class:`TransitionAdder` — writes them (``obs action ret disc version``, Ape-X priorities).
* :class:`Actor` — the Ape-X actor: ε-greedy over the ε ladder on each env's current observation.
* :func:`apex_min_steps` — the fewest steps per partition: ``2 (n + 1)``.
* :data:`KIND` — the registry's entry (:mod:`gearflow.kinds.registry`).

The actor, per recv::

    out = agent.act(policy, obs, epsilon[ids], rng)     # actions (b,), Q-values (b, A)

The Q-values acted with give the items' initial priorities (Ape-X, no max-priority); an agent
of continuous actions (``agents.apex_dpg``: actions (b, A) float32) gives ``out.q_action``
(Q(s, a) of what it sent) and ``out.q_bootstrap`` (Q(s, μ(s))) instead, and reads its ε as the
scale of its exploration noise. ``policy`` is the network's forward traced with TorchScript
(:func:`~gearflow.actors.policy.traced_policy`), or the network itself where tracing would
change what it computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from gearflow.actors.adders import Adder
from gearflow.actors.base import ActorBase
from gearflow.actors.policy import TracedPolicy, traced_policy
from gearflow.kinds.registry import KindDef
from gearflow.replay.items import TORCH_DTYPES, ItemKind, flat_index, gatherable
from gearflow.replay.layout import step_rows
from gearflow.replay.protocols import WriterLike
from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.writer import OFFSET_MAX, Writer

# the C adders; None where not built (TransitionAdder's numpy is the reference)
from gearflow.replay.hotpath import C as _hotpath

log = logging.getLogger(__name__)

__all__ = ["KIND", "Actor", "NativeNStep", "Transition", "TransitionAdder", "apex_min_steps"]


def apex_min_steps(actor) -> int:
    """The fewest steps per partition Ape-X transitions need: ``2 (n + 1)`` (n staged steps, then
    the item's n + 1 rows), ``n = actor.n_step`` (``actor``: the run's actor group). The config's
    check and the adder's read this."""
    return 2 * (int(actor.n_step) + 1)


@dataclass(frozen=True)
class Transition(ItemKind):
    """n-step transitions; ``next_columns`` are also gathered at the item's last step."""

    next_columns: tuple[str, ...] = ("obs",)
    name = "transition"

    def layout(self, spec, batch_size):
        shapes = {c.name: ((batch_size, *c.shape), TORCH_DTYPES[c.dtype]) for c in spec}
        for name in self.next_columns:
            if name not in spec:
                raise ValueError(f"next column {name!r} is not in the table spec {spec.names}")
            shapes["next_" + name] = shapes[name]
        return shapes

    def rows(self, parts, starts, lengths, S, stacks=None):
        rows = {"first": step_rows(parts, starts, S), "last": step_rows(parts, starts + lengths - 1, S)}
        if stacks is not None:  # (2, B, k): the first step's stack, the last step's stack
            rel = np.stack([np.zeros_like(lengths), lengths - 1])  # (2, B) steps after the first
            rows["stacks"] = stacks.rows(parts, rows["first"][None, :], starts + rel, rel, S)
        return rows

    def gather(self, tensors, out, rows, lengths):
        first = torch.from_numpy(rows["first"])
        last = torch.from_numpy(rows["last"])
        stacks = rows.get("stacks") or {}
        for name, src in tensors.items():
            src, dst = gatherable(src), gatherable(out[name])
            if name in stacks:  # (B, k, *frame) as (B*k, *frame)
                torch.index_select(src, 0, flat_index(stacks[name][0]), out=dst.view(-1, *src.shape[1:]))
            else:
                torch.index_select(src, 0, first, out=dst)  # (B, *shape)
        for name in self.next_columns:
            if name not in tensors:
                continue  # left to wire_rows
            src, dst = gatherable(tensors[name]), gatherable(out["next_" + name])
            if name in stacks:
                torch.index_select(src, 0, flat_index(stacks[name][1]), out=dst.view(-1, *src.shape[1:]))
            else:
                torch.index_select(src, 0, last, out=dst)

    def wire_rows(self, columns, rows, lengths):
        stacked = rows.get("stacks") or {}
        out = {}
        for col in columns:
            if col in stacked:
                continue
            out[col] = (col, rows["first"], None)
            if col in self.next_columns:
                out["next_" + col] = (col, rows["last"], None)
        return out

    def to_dict(self):
        return {"kind": self.name, "next_columns": list(self.next_columns)}

    @classmethod
    def from_dict(cls, d):
        return cls(next_columns=tuple(d.get("next_columns", ("obs",))))

    def records_per_partition(self, steps_per_partition):
        return int(steps_per_partition)  # one item per step

    def gather_on_device(self, cols, draw, data):
        """The GPU gather (:class:`~gearflow.native.device_replay.DeviceColumns`): every column at the
        item's first step (B, *shape), ``next_<c>`` at its last; a stacked-frame column's stack as
        a window of one step at the first / last step."""
        cp, parts, starts = cols.cupy, draw.parts, draw.starts
        lengths = draw.lengths.astype(cp.int64)
        first, last = cols.first_last_rows(parts, starts, lengths)
        if cols.stacks:  # one-step windows at the first / last step
            one, at_last = cp.ones(parts.shape[0], dtype=cp.int32), starts + lengths - 1
        columns = [(n, p, rb, n) for n, p, rb in cols.columns]
        columns += [(n, p, rb, "next_" + n) for n, p, rb in cols.columns if n in self.next_columns]
        for name, ptr, row_bytes, dst in columns:
            nxt = dst != name
            if name in cols.stacks:
                cols.stack(name, ptr, row_bytes, parts, at_last if nxt else starts, one, 1, data[dst])
            else:
                cols.rows(ptr, row_bytes, last if nxt else first, data[dst])


# ---------------------------------------------------------------------- the adder


class TransitionAdder(Adder):
    """Ape-X n-step transitions, one row per step, no frame stored twice::

        row t:  obs_t  action_t  ret_t  disc_t  version_t
        item t: rows t .. t+n   (obs = obs_t, next_obs = obs_{t+n})
                ret_t  = r_{t+1} + γ r_{t+2} + ... + γ^{n-1} r_{t+n},  disc_t = γ^n

    The writer is append-only, and ``ret_t`` / ``disc_t`` are known only when
    ``obs_{t+n}`` arrives, so an env's rows are appended *late*: step t is staged
    here (obs, action, version, running return and discount) and its row is
    appended at time t+n; the item for t (rows t..t+n) is created once row t+n is
    in, at time t+2n. At an episode's end (final observation obs_L) every staged
    step is appended, then obs_L as its own row (action 0, ret 0, disc 0: the
    bootstrap row, never the first row of an item), and all the episode's
    outstanding items are created; the last n-1 have shorter windows ending at
    row L, ret truncated there, and disc = 0 if the episode terminated else γ^(L-t).

    Items are queued and published with one ``create_items`` call every ``n``
    recvs (its fixed cost is the largest on the insert path), and before a
    stream's episode is closed in the writer.

    Initial priorities (Ape-X, no max-priority): |ret + disc · max_a Q(s_last, a) − Q(s_t, a_t)|
    from the Q-values computed when acting; with ``values`` the pair ``(q_action, q_bootstrap)``
    (continuous actions, ``agents.apex_dpg``): |ret + disc · q_bootstrap(s_last) − q_action(s_t)|.
    The ``action`` column may have a shape (``float32[6]``): staged and written per row as is.

    With the C module built and a local :class:`~gearflow.replay.Writer`, ``add`` is one
    ``_hotpath.nstep_add`` call per recv (staging, returns, rows written into the table,
    items queued; ~1 µs plus ~0.1 µs per env) and ``flush_items`` one ``nstep_publish``; the
    numpy code below (``native=False``, or any other writer) is the reference it is tested
    against, row for row and item for item (tests/test_adders_native.py).
    """

    COLUMNS = ("obs", "action", "ret", "disc", "version")
    USES_FIRST = False

    def __init__(self, writer: WriterLike, n: int, gamma: float, *, native: Optional[bool] = None):
        super().__init__(writer)
        self.n, self.gamma = n, gamma = int(n), float(gamma)
        E, obs_col = writer.num_streams, writer.spec["obs"]
        dt = self._dt
        # Staged steps: step t of env e sits in slot t % n until its row is appended.
        self._obs = np.zeros((E, n, *obs_col.row_shape), dtype=obs_col.dtype)  # (E, n, *obs) or (E, n, *frame)
        self._action = np.zeros((E, n, *writer.spec["action"].shape), dtype=dt["action"])  # (E, n[, A])
        self._version = np.zeros((E, n), dtype=dt["version"])
        # running n-step return and γ^(rewards so far) of each staged step; disc 0 = empty slot
        self._acc = np.zeros((E, n, 2), dtype=np.float64)  # (E, n, [ret, disc])
        self._qsa = np.zeros((E, n), dtype=np.float64)  # Q(s_t, a_t) when acting
        # Appended rows whose item waits for row t+n: priority of item t in slot t % n.
        self._item_prio = np.zeros((E, n), dtype=np.float64)
        # Per env: step index in the episode of the next obs, first row of the episode.
        self._t = np.zeros(E, dtype=np.int64)
        self._episode_row = writer.positions  # absolute row of the episode's step 0
        self._arange = np.arange(max(E, 2 * n))
        # Items are queued and published with one create_items every `flush_every` recvs (its
        # fixed cost dominates the insert path). Closing an episode in the writer waits for the
        # flush too; that is safe because a stream appends no row of its next episode before
        # its (n+1)-th recv after the end, and flush_every <= n.
        self.flush_every = n
        self._pending_items: list[tuple] = []
        self._end_pending = np.zeros(E, dtype=bool)
        self._recvs_since_flush = 0
        self._adds = 0  # add calls so far
        self._native: NativeNStep | None = None  # the C path, or None: the numpy reference below
        why_not = NativeNStep.unsupported(writer, dt)
        if native and why_not:
            raise ValueError(f"TransitionAdder(native=True): {why_not}")
        if native is not False and not why_not:
            self._native = NativeNStep(self, capacity=n * E * (2 * n + 1))

    @classmethod
    def check_kind(cls, kind, agent_name: str) -> None:
        if not isinstance(kind, Transition) or "obs" not in kind.next_columns:
            raise ValueError(
                f"the Ape-X actor writes n-step transition items with next_obs; agent {agent_name} asks for {kind}"
            )

    @classmethod
    def min_steps(cls, actor, kind) -> int:
        return apex_min_steps(actor)

    @classmethod
    def size_error(cls, actor, kind, steps: int) -> str:
        return (f"steps_per_partition={steps} is too small for n_step={int(actor.n_step)}; "
                f"need at least {cls.min_steps(actor, kind)}")  # fmt: skip

    @property
    def native(self) -> bool:
        """Whether ``add`` runs in C (``_hotpath.nstep_add``)."""
        return self._native is not None

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version: int) -> None:
        """Replay bookkeeping for one recv: one C call (or the numpy reference: a fixed number
        of numpy calls for the batch, plus one ``extend`` per env whose episode ended); items
        are queued for :meth:`flush_items`, every ``flush_every`` recvs."""
        if self._native is not None and isinstance(values, tuple):  # (q_action, q_bootstrap): numpy only
            if self._adds:
                raise ValueError("TransitionAdder: values became a (q_action, q_bootstrap) pair after the C path "
                                 "had started; an agent gives one or the other from its first act")
            log.info("n-step adder: priorities from (q_action, q_bootstrap); the numpy path writes")
            self._native = None
        self._adds += 1
        if self._native is None:
            return self._add_reference(ids, obs, reward, terminated, truncated, actions, values, version)
        obs = self._frames(obs)  # (b, *obs), or the newest frames (b, *frame): a view
        if obs.dtype != self._dt["obs"]:
            raise ValueError(f"column 'obs': expected dtype {self._dt['obs'].name}, got {obs.dtype.name}")
        self._native.add(ids, obs, reward, terminated, truncated, actions, values, version)
        self._recvs_since_flush += 1
        if self._recvs_since_flush >= self.flush_every:
            self.flush_items()

    # ------------------------------------------------------------------ the numpy reference
    def _add_reference(self, ids, obs, reward, terminated, truncated, actions, values, version: int) -> None:
        n = self.n
        b = ids.size
        obs = self._frames(obs)  # (b, *obs), or the newest frames (b, *frame): a view
        if values is None:  # an agent without Q-values: priorities fall back to |ret|
            qsa = max_q = np.zeros(b)
        elif isinstance(values, tuple):  # continuous actions: Q(s_t, a_t) and V(s_t) as given
            qsa, max_q = (np.asarray(v, dtype=np.float64).reshape(b) for v in values)
        else:
            qsa = values[self._arange[:b], actions]  # Q(s_t, a_t) (b,)
            max_q = values.max(axis=1)  # max_a Q(s_t, a) (b,)
        t = self._t[ids]  # (b,) step index of obs in its episode
        slot = t % n
        done = terminated | truncated
        if done.any() and self._end_pending[ids[done]].any():  # a stream ends twice between two flushes
            self.flush_items()  # (before this recv's items, as the C path does)

        # 1. the reward that came with obs_t belongs to every staged step of its env
        acc = self._acc[ids]  # (b, n, 2)
        acc[..., 0] += acc[..., 1] * reward[:, None]  # ret += γ^k r
        acc[..., 1] *= self.gamma
        self._acc[ids] = acc

        if not done.any():
            self._queue_items(self._steady(ids, slot, t, obs, actions, qsa, max_q, version))
        else:
            live = ~done
            self._queue_items(self._steady(ids[live], slot[live], t[live], obs[live], actions[live],
                                           qsa[live], max_q[live], version))  # fmt: skip
            ended = ids[done]
            self._queue_items(self._flush_ended(ended, obs[done], terminated[done], max_q[done], version))
            self._close_episodes(ended)
        self._recvs_since_flush += 1
        if self._recvs_since_flush >= self.flush_every:
            self.flush_items()

    def _queue_items(self, items) -> None:
        if items is not None and items[0].size:
            self._pending_items.append(items)

    def flush_items(self, block: bool = True) -> int:
        """Publish the queued items (one ``create_items`` call), then close the episodes that
        ended since the last flush. Returns the items published.

        ``block=False`` (shutdown) drops the items instead of waiting on the rate limiter."""
        self._recvs_since_flush = 0
        if self._native is not None:
            published = self._native.publish(block)
            self.items += published
            return published
        w = self.writer
        pending, self._pending_items = self._pending_items, []
        published = 0
        if pending:
            prio, lengths, streams, ends = (np.concatenate(c) if len(pending) > 1 else c[0] for c in zip(*pending))
            saved = w.insert_timeout_s
            if not block:
                w.insert_timeout_s = 0.0
            try:
                # items the ring overtook since they were queued are dropped and counted, as the
                # C path does (a RemoteWriter's are dropped on the shard, counted there)
                before = getattr(w, "expired_items", 0)
                w.create_items(prio, lengths, streams, ends, expired="drop")
                published = prio.size - (getattr(w, "expired_items", 0) - before)
            except RateLimiterTimeout:
                if block:
                    raise
                log.debug("dropped %d items at shutdown (rate limiter)", prio.size)
            finally:
                w.insert_timeout_s = saved
        ended = np.flatnonzero(self._end_pending)
        if ended.size:
            w.end_episode(ended)
            self._end_pending[ended] = False
        self.items += published
        return published

    def _steady(self, e, s, t, obs, actions, qsa, max_q, version):
        """Envs ``e`` whose obs_t continues an episode: append row t-n, stage step t.

        Returns the items now complete, (priorities, lengths, streams, ends), or None."""
        n = self.n
        items = None
        # step t-n is complete: append its row; item t-2n now has its last row (t-n)
        ready = t >= n
        num_ready = np.count_nonzero(ready)
        if num_ready:
            full = num_ready == e.size
            er, sr, tr, mq = (e, s, t, max_q) if full else (e[ready], s[ready], t[ready], max_q[ready])
            acc = self._acc[er, sr]  # (k, 2)
            ret, disc = acc[:, 0], acc[:, 1]
            prio = np.abs(ret + disc * mq - self._qsa[er, sr])
            self.writer.append({
                "obs": self._obs[er, sr], "action": self._action[er, sr],
                "ret": ret.astype(self._dt["ret"]), "disc": disc.astype(self._dt["disc"]),
                "version": self._version[er, sr],
            }, streams=er)  # fmt: skip
            has_item = tr >= 2 * n
            num_items = np.count_nonzero(has_item)
            if num_items:
                full = num_items == er.size
                ei, si, ti = (er, sr, tr) if full else (er[has_item], sr[has_item], tr[has_item])
                ends = self._episode_row[ei] + ti - n + 1  # exclusive: just after row t-n
                items = (self._item_prio[ei, si], np.full(ei.size, n + 1), ei, ends)
            self._item_prio[er, sr] = prio  # item t-n waits for row t
        # stage step t: obs_t, the action taken, the weights' version, Q(s_t, a_t)
        self._obs[e, s] = obs
        self._action[e, s] = actions
        self._version[e, s] = version
        self._qsa[e, s] = qsa
        self._acc[e, s] = (0.0, 1.0)
        self._t[e] = t + 1
        return items

    def _flush_ended(self, e, final_obs, terminated, max_q_last, version):
        """Envs ``e`` returned their final obs_L: append steps max(0, L-n)..L-1 and row L,
        and return the episode's outstanding items (steps max(0, L-2n)..L-1)."""
        n, w = self.n, self.writer
        L = self._t[e]  # (D,)
        # a (D, 2n) grid of steps L-2n .. L-1: the first n have rows and wait for their item,
        # the last n are staged (ret/disc final now; truncated at L, disc 0 if terminated)
        grid = L[:, None] - 2 * n + self._arange[None, : 2 * n]  # (D, 2n)
        slots = grid % n
        E = e[:, None]
        old = self._arange[None, : 2 * n] < n
        acc = self._acc[E, slots[:, n:]]  # (D, n, 2)
        ret_s = acc[..., 0]
        disc_s = np.where(terminated[:, None], 0.0, acc[..., 1])
        prio_s = np.abs(ret_s + disc_s * max_q_last[:, None] - self._qsa[E, slots[:, n:]])
        prio = np.concatenate([self._item_prio[E, slots[:, :n]], prio_s], axis=1)  # (D, 2n)
        ends = np.where(old, grid + n + 1, L[:, None] + 1)  # exclusive, in episode steps
        valid = grid >= 0
        starts = grid[valid]
        D = e.size
        items = (
            prio[valid],
            ends[valid] - starts,
            np.repeat(e, valid.sum(axis=1)),
            self._episode_row[e].repeat(valid.sum(axis=1)) + ends[valid],
        )
        # rows: the staged steps (the last min(L, n) of the grid's staged half) then obs_L
        dt = self._dt
        sl = slots[:, n:]
        rows = {
            "obs": np.concatenate([self._obs[E, sl], final_obs[:, None]], axis=1),  # (D, n+1, ...)
            "action": np.concatenate([self._action[E, sl], np.zeros((D, 1, *self._action.shape[2:]), dt["action"])],
                                     axis=1),
            "ret": np.concatenate([ret_s, np.zeros((D, 1))], axis=1).astype(dt["ret"]),
            "disc": np.concatenate([disc_s, np.zeros((D, 1))], axis=1).astype(dt["disc"]),
            "version": np.concatenate([self._version[E, sl], np.full((D, 1), version, dt["version"])], axis=1),
        }
        first = n - np.minimum(L, n)  # first staged column holding a step of this episode
        for d in range(D):  # rare: only the envs whose episode ended
            f = int(first[d])
            w.extend({k: v[d, f:] for k, v in rows.items()}, stream=int(e[d]))
        return items

    def _close_episodes(self, e) -> None:
        self._end_pending[e] = True  # writer.end_episode at the next flush, after the items
        self._episode_row[e] += self._t[e] + 1
        self._t[e] = 0
        self._acc[e] = 0.0  # empty slots: the reset step's reward reaches nothing

    def finish(self, block: bool = True) -> None:
        self.flush_items(block=block)


class NativeNStep:
    """The C path of a :class:`TransitionAdder` (``_hotpath.nstep_*``): the adder's staging arrays
    (``(E, n, ...)``), a pending-item list and the writer's arrays (``Writer.native_arrays``)
    handed to one C context; :meth:`add` is one ``nstep_add`` per recv (staging, returns, rows
    written into the table, items queued), :meth:`publish` one ``nstep_publish`` per flush. It
    changes exactly what the adder's numpy reference changes (tests/test_adders_native.py)."""

    def __init__(self, adder: TransitionAdder, capacity: int):
        self.adder = adder
        self._p: dict[str, np.ndarray] | None = None
        self.rebuild(capacity)

    @staticmethod
    def unsupported(writer, dt: dict) -> str:
        """Why the C path cannot serve ``writer`` with column dtypes ``dt`` ('' when it can)."""
        if _hotpath is None or not hasattr(_hotpath, "nstep_add"):
            return "the C module gearflow.replay._hotpath is not built (python setup.py build_ext --inplace)"
        if not isinstance(writer, Writer):
            return f"the C path writes into a local Writer's table, not a {type(writer).__name__}"
        for col, kinds in (("action", ("int64", "int32")), ("version", ("int64", "int32")),
                           ("ret", ("float32", "float64")), ("disc", ("float32", "float64"))):  # fmt: skip
            if dt[col].name not in kinds:
                return f"column {col!r} is {dt[col].name}; the C path takes {' or '.join(kinds)}"
        if writer.spec["action"].shape != ():
            return f"column 'action' is {writer.spec['action'].describe()}; the C path takes one action per step"
        return ""

    def rebuild(self, capacity: int) -> None:
        """(Re)build the C context over the staging arrays, a pending-item list of
        ``capacity`` items (keeping the items already queued) and the writer's arrays."""
        a, old = self.adder, self._p
        self._p = {  # the items queued for the next flush: nstep_add fills them, nstep_publish empties them
            "p_prio": np.zeros(capacity, np.float64), "p_len": np.zeros(capacity, np.int64),
            "p_stream": np.zeros(capacity, np.int64), "p_end": np.zeros(capacity, np.int64),
            "p_count": np.zeros(1, np.int64),
        }  # fmt: skip
        if old is not None:
            k = int(old["p_count"][0])
            for name in ("p_prio", "p_len", "p_stream", "p_end"):
                self._p[name][:k] = old[name][:k]
            self._p["p_count"][0] = k
        self._p_count = self._p["p_count"]
        w = a.writer.native_arrays()
        cols = w.pop("columns")
        arrays = {
            "s_obs": a._obs, "s_action": a._action, "s_version": a._version, "acc": a._acc,
            "qsa": a._qsa, "item_prio": a._item_prio, "t": a._t, "episode_row": a._episode_row,
            "end_pending": a._end_pending, **self._p, **w,
            "c_obs": cols["obs"], "c_action": cols["action"], "c_ret": cols["ret"], "c_disc": cols["disc"],
            "c_version": cols["version"],
        }  # fmt: skip
        self.context = _hotpath.nstep_context(arrays, a.writer.num_streams, a.n, a.writer.steps_per_stream,
                                              a.writer.storage.items_per_partition, a.gamma, OFFSET_MAX)  # fmt: skip

    @property
    def pending(self) -> int:
        """Items queued for the next :meth:`publish`."""
        return int(self._p_count[0])

    def add(self, ids, obs, reward, terminated, truncated, actions, values, version: int) -> None:
        """One recv (``obs``: the frames the adder stages, of the obs column's dtype)."""
        ctx = self.context
        try:
            r = _hotpath.nstep_add(ctx, ids, obs, reward, terminated, truncated, actions, values, version)
        except (TypeError, ValueError, BufferError):  # not the exact arrays: convert, then its real errors
            ids, reward, terminated, truncated, actions = (
                np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(reward, np.float64),
                np.ascontiguousarray(terminated, bool), np.ascontiguousarray(truncated, bool),
                np.ascontiguousarray(actions, np.int64),
            )  # fmt: skip
            values = None if values is None else np.ascontiguousarray(values, np.float64)
            r = _hotpath.nstep_add(ctx, ids, obs, reward, terminated, truncated, actions, values, version)
        while r < 0:  # nothing was changed: make room, then the same batch again
            if r == -1:  # an env ends while its last episode end waits for the flush
                self.adder.flush_items()
            else:  # -2: the pending list could overflow
                self.rebuild(capacity=2 * self._p["p_prio"].size + ids.size * (2 * self.adder.n + 1))
            r = _hotpath.nstep_add(self.context, ids, obs, reward, terminated, truncated, actions, values, version)

    def publish(self, block: bool) -> int:
        """Publish the queued items (``block=False``: drop them if the rate limiter holds them).
        Returns the items published."""
        m = int(self._p_count[0])
        try:
            published = _hotpath.nstep_publish(self.context, 0)
            if published < 0:  # the rate limiter holds them
                if block:
                    self.adder.writer.wait_for_insert(m)
                    published = _hotpath.nstep_publish(self.context, 1)
                else:
                    log.debug("dropped %d items at shutdown (rate limiter)", m)
                    published = _hotpath.nstep_publish(self.context, 2)
        except BaseException:
            self._p_count[0] = 0  # as the reference: the items of a failed flush are gone
            raise
        return published


# ---------------------------------------------------------------------- the actor


class Actor(ActorBase):
    """Steps one vectorised env with an agent's policy and writes n-step transitions
    (constructor arguments: :class:`~gearflow.actors.base.ActorBase`)."""

    NAME = "the actor"

    def _make_adder(self, writer) -> TransitionAdder:
        return TransitionAdder(writer, int(self.cfg.n_step), float(self.cfg.gamma))

    def _setup_state(self) -> None:
        self.policy = traced_policy(self.network, self.env.obs_shape, self.env.obs_dtype, self.env.batch_size)
        self._no_grad = torch.no_grad()  # one context object for every step (0.5 µs less per recv)

    def sync_weights(self) -> bool:
        loaded = super().sync_weights()
        if loaded and isinstance(self.policy, TracedPolicy) and not self.policy.shares_parameters():
            log.warning("actor %d: the weight sync replaced parameter tensors; acting with the eager network",
                        self.actor_index)  # fmt: skip
            self.policy = self.network
        return loaded

    def step(self) -> int:
        """One recv → act → send → replay writes. Returns the env steps done (the batch size)."""
        obs, reward, terminated, truncated, env_ids, ids = self._recv()
        with self._no_grad:
            out = self.agent.act(self.policy, obs, self.epsilon[ids], self.rng)
        self.env.send(out.actions, env_ids)  # the envs step while we write replay
        values = out.values if out.q_action is None else out.priority_values()  # (b, A), or the pair (b,), (b,)
        self._observe(ids, obs, reward, terminated, truncated, out.actions, values)
        return self._count_steps(ids.size)


KIND = KindDef("transition", item=Transition, adder=TransitionAdder, actor=Actor, config_min_steps=lambda cfg: apex_min_steps(cfg.actor))
