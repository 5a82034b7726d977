"""Adders: what an actor writes into replay, over the writer interface (Acme's adders).

An actor calls its adder once per ``recv`` with the batch it just acted on; the
adder stages steps, appends rows, creates items and closes episodes through a
:class:`~gearflow.replay.protocols.WriterLike` (a local
:class:`~gearflow.replay.Writer`, or later a remote one)::

    adder = TransitionAdder(writer, n=3, gamma=0.99)
    adder.add(ids, obs, reward, terminated, truncated, first, actions, values, version)
    ...
    adder.finish(block=True)        # publish what is queued
    adder.items                     # items published so far

One adder per item kind, registered in :data:`ADDERS` by ``ItemKind.name``:

* :class:`TransitionAdder` — Ape-X n-step transitions (``obs action ret disc version``),
* :class:`WindowAdder` — R2D2 sequence windows (``obs action reward discount first version``),
* :class:`EpisodeAdder` — Decision Transformer episodes (``obs action reward timestep``).

Every argument of ``add`` is per env of the batch: ``ids`` (b,) int64 env indices
(= writer streams), ``obs`` (b, *obs) (with a stacked-frame ``obs`` column, ``stack=k``,
the env's stacks ``(b, k, *frame)``, of which only the newest frame is written), ``reward``/``terminated``/``truncated`` (b,),
``first`` (b,) bool (``obs`` is an episode's step 0), ``actions`` (b, ...) the
actions just sent (int (b,), or float (b, *action_shape) for continuous actions), ``values``
(b, A) the Q-values acted with or ``None`` (:class:`TransitionAdder` also takes the pair
``(q_action, q_bootstrap)`` (b,), (b,) of an agent whose actions cannot index Q-values),
``version`` the weights version acted with.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from gearflow.replay.items import Episode, ItemKind, Sequence, Transition
from gearflow.replay.protocols import WriterLike
from gearflow.replay.rate_limiter import RateLimiterTimeout
from gearflow.replay.writer import OFFSET_MAX, Writer

try:  # the C adders (setup.py builds it); the numpy code below is the reference
    from gearflow.replay import _hotpath
except ImportError:  # pragma: no cover - depends on the build
    _hotpath = None

log = logging.getLogger(__name__)

__all__ = ["ADDERS", "Adder", "EpisodeAdder", "TransitionAdder", "WindowAdder", "adder_class_for"]


class Adder:
    """What every adder offers (constructor arguments differ per kind: see :func:`make_adder`)."""

    COLUMNS: tuple[str, ...] = ()
    WHAT = "items"
    USES_FIRST = True  # whether ``add`` reads ``first`` (else the actor passes None)

    def __init__(self, writer: WriterLike):
        self.writer = writer
        self.items = 0  # items published
        self._dt = {c.name: c.dtype for c in writer.spec}
        # a stacked-frame obs column (``stack=k``) stores one frame per step: the adder stages
        # and writes only the newest frame of each stacked observation (a view, obs[:, -1])
        self._obs_frames = "obs" in writer.spec and writer.spec["obs"].stack > 1

    def _frames(self, obs: np.ndarray) -> np.ndarray:
        """What the ``obs`` column stores of a batch of observations ``(b, *obs)``: the whole
        observation, or with stacked frames its newest frame ``(b, *frame)``, a view."""
        return obs[:, -1] if self._obs_frames else obs

    @classmethod
    def check_kind(cls, kind: ItemKind, agent_name: str) -> None:
        """Refuse an item kind this adder cannot write (before an env exists)."""
        raise NotImplementedError

    @classmethod
    def min_steps(cls, cfg, kind: ItemKind) -> int:
        """The fewest steps per stream this adder can write ``kind`` items into."""
        raise NotImplementedError

    @classmethod
    def size_error(cls, cfg, kind: ItemKind, steps: int) -> str:
        raise NotImplementedError

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version: int) -> None:
        raise NotImplementedError

    def finish(self, block: bool = True) -> None:
        """Publish what is queued; ``block=False`` (shutdown): without waiting on the rate limiter."""


# ---------------------------------------------------------------------- Ape-X transitions


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
        self._native = None  # the C context (_hotpath.nstep_*), or None: the numpy reference below
        why_not = self._native_unsupported(writer)
        if native and why_not:
            raise ValueError(f"TransitionAdder(native=True): {why_not}")
        if native is not False and not why_not:
            self._make_native(capacity=n * E * (2 * n + 1))

    @classmethod
    def check_kind(cls, kind, agent_name: str) -> None:
        if not isinstance(kind, Transition) or "obs" not in kind.next_columns:
            raise ValueError(
                f"the Ape-X actor writes n-step transition items with next_obs; agent {agent_name} asks for {kind}"
            )

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        return 2 * (int(cfg.actor.n_step) + 1)  # n staged steps, then the item's n + 1 rows

    @classmethod
    def size_error(cls, cfg, kind, steps: int) -> str:
        return (f"steps_per_partition={steps} is too small for n_step={int(cfg.actor.n_step)}; "
                f"need at least {cls.min_steps(cfg, kind)}")  # fmt: skip

    # ------------------------------------------------------------------ the C path
    def _native_unsupported(self, writer) -> str:
        """Why the C path cannot serve ``writer`` ('' when it can)."""
        if _hotpath is None or not hasattr(_hotpath, "nstep_add"):
            return "the C module gearflow.replay._hotpath is not built (python setup.py build_ext --inplace)"
        if not isinstance(writer, Writer):
            return f"the C path writes into a local Writer's table, not a {type(writer).__name__}"
        dt = self._dt
        for col, kinds in (("action", ("int64", "int32")), ("version", ("int64", "int32")),
                           ("ret", ("float32", "float64")), ("disc", ("float32", "float64"))):  # fmt: skip
            if dt[col].name not in kinds:
                return f"column {col!r} is {dt[col].name}; the C path takes {' or '.join(kinds)}"
        if writer.spec["action"].shape != ():
            return f"column 'action' is {writer.spec['action'].describe()}; the C path takes one action per step"
        return ""

    def _make_native(self, capacity: int) -> None:
        """(Re)build the C context over the staging arrays, a pending-item list of
        ``capacity`` items (keeping the items already queued) and the writer's arrays."""
        old = getattr(self, "_p", None)
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
        w = self.writer.native_arrays()
        cols = w.pop("columns")
        arrays = {
            "s_obs": self._obs, "s_action": self._action, "s_version": self._version, "acc": self._acc,
            "qsa": self._qsa, "item_prio": self._item_prio, "t": self._t, "episode_row": self._episode_row,
            "end_pending": self._end_pending, **self._p, **w,
            "c_obs": cols["obs"], "c_action": cols["action"], "c_ret": cols["ret"], "c_disc": cols["disc"],
            "c_version": cols["version"],
        }  # fmt: skip
        self._native = _hotpath.nstep_context(arrays, self.writer.num_streams, self.n, self.writer.steps_per_stream,
                                              self.writer.storage.items_per_partition, self.gamma, OFFSET_MAX)  # fmt: skip

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
        try:
            r = _hotpath.nstep_add(self._native, ids, obs, reward, terminated, truncated, actions, values, version)
        except (TypeError, ValueError, BufferError):  # not the exact arrays: convert, then its real errors
            ids, reward, terminated, truncated, actions = (
                np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(reward, np.float64),
                np.ascontiguousarray(terminated, bool), np.ascontiguousarray(truncated, bool),
                np.ascontiguousarray(actions, np.int64),
            )  # fmt: skip
            values = None if values is None else np.ascontiguousarray(values, np.float64)
            r = _hotpath.nstep_add(self._native, ids, obs, reward, terminated, truncated, actions, values, version)
        while r < 0:  # nothing was changed: make room, then the same batch again
            if r == -1:  # an env ends while its last episode end waits for the flush
                self.flush_items()
            else:  # -2: the pending list could overflow
                self._make_native(capacity=2 * self._p["p_prio"].size + ids.size * (2 * self.n + 1))
            r = _hotpath.nstep_add(self._native, ids, obs, reward, terminated, truncated, actions, values, version)
        self._recvs_since_flush += 1
        if self._recvs_since_flush >= self.flush_every:
            self.flush_items()

    def _flush_native(self, block: bool) -> int:
        m = int(self._p_count[0])
        try:
            published = _hotpath.nstep_publish(self._native, 0)
            if published < 0:  # the rate limiter holds them
                if block:
                    self.writer.wait_for_insert(m)
                    published = _hotpath.nstep_publish(self._native, 1)
                else:
                    log.debug("dropped %d items at shutdown (rate limiter)", m)
                    published = _hotpath.nstep_publish(self._native, 2)
        except BaseException:
            self._p_count[0] = 0  # as the reference: the items of a failed flush are gone
            raise
        self.items += published
        return published

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
            return self._flush_native(block)
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


# ---------------------------------------------------------------------- R2D2 windows


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
        if not isinstance(kind, Sequence) or isinstance(kind, Episode):
            raise TypeError(f"the sequence actor writes sequence windows; agent {agent_name} asks for {kind}")

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        return kind.max_length + 1  # a whole window plus the staged step

    @classmethod
    def size_error(cls, cfg, kind, steps: int) -> str:
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


# ---------------------------------------------------------------------- Decision Transformer episodes


class EpisodeAdder(Adder):
    """Whole episodes (Decision Transformer), one row per step; an episode of L actions is L rows::

        row t:  obs_t  action_t  reward_t (r after action_t)  timestep t

    Row t is complete when the reward of action_t arrives with obs_{t+1}, so each env
    stages one step and appends its row one recv later; the final observation is not
    stored (a DT does not bootstrap). When an episode ends, one item is created over
    its last ``min(L, T)`` rows (``T = kind.max_length``; earlier rows of a longer
    episode are stored but never sampled), with priority ``priority_fn(return of those
    rows, their number)`` (the agent's ``episode_priority``: the learner recomputes the
    same value, so priorities never drift).
    """

    COLUMNS = ("obs", "action", "reward", "timestep")

    def __init__(self, writer: WriterLike, kind: Episode, priority_fn: Callable):
        super().__init__(writer)
        self.kind, self.priority_fn = kind, priority_fn
        E, obs_col, act_col = writer.num_streams, writer.spec["obs"], writer.spec["action"]
        self._t = np.zeros(E, dtype=np.int64)  # timestep of each env's next obs
        # The staged step of each env (its row waits for the reward of its action).
        self._staged = np.zeros(E, dtype=bool)
        self._s_obs = np.zeros((E, *obs_col.row_shape), dtype=obs_col.dtype)  # (E, *obs) or (E, *frame)
        self._s_action = np.zeros((E, *act_col.shape), dtype=act_col.dtype)
        self._s_t = np.zeros(E, dtype=np.int64)
        # Rewards of each env's last T rows (by timestep % T): the item's return at the end.
        self._T = int(kind.max_length)
        self._rewards = np.zeros((E, self._T), dtype=np.float64)
        self.long_episodes = 0  # episodes longer than T (only their last T rows are sampled)

    @classmethod
    def check_kind(cls, kind, agent_name: str) -> None:
        if not isinstance(kind, Episode):
            raise ValueError(f"the episode actor writes episode items; agent {agent_name} asks for {kind}")

    @classmethod
    def min_steps(cls, cfg, kind) -> int:
        return kind.max_length  # the longest episode item

    @classmethod
    def size_error(cls, cfg, kind, steps: int) -> str:
        return (f"steps_per_partition={steps} is too small for episode items of {kind.max_length} steps "
                f"(replay.max_episode_length); need at least {kind.max_length}")  # fmt: skip

    def add(self, ids, obs, reward, terminated, truncated, first, actions, values, version: int) -> None:
        reward = np.asarray(reward, dtype=np.float64)
        obs = self._frames(obs)  # (b, *obs), or the newest frames (b, *frame): a view
        done = np.asarray(terminated) | np.asarray(truncated)
        w = self.writer
        self._t[ids[first]] = 0
        # 1. the staged step of each env is complete: its row
        staged = self._staged[ids]
        if staged.any():
            e = ids[staged]
            r = reward[staged]
            w.append({"obs": self._s_obs[e], "action": self._s_action[e],
                      "reward": r.astype(np.float32), "timestep": self._s_t[e]}, streams=e)  # fmt: skip
            self._rewards[e, self._s_t[e] % self._T] = r
            self._staged[e] = False
        # 2. episodes that ended: one item over the last min(L, T) rows
        if done.any():
            e = ids[done]
            L = w.episode_lengths(e)
            has = L > 0
            if has.any():
                ei, Li = e[has], L[has]
                n = np.minimum(Li, self._T)
                self.long_episodes += int((Li > self._T).sum())
                window = (Li[:, None] - 1 - np.arange(self._T)[None, :]) % self._T  # slots of the last T rows
                keep = np.arange(self._T)[None, :] < n[:, None]
                ret = np.where(keep, self._rewards[ei[:, None], window], 0.0).sum(axis=1)
                prio = np.asarray(self.priority_fn(ret, n), dtype=np.float64)
                w.create_items(prio, n, ei, w.positions[ei])
                self.items += ei.size
            w.end_episode(e)
            self._rewards[e] = 0.0
        # 3. stage the new steps of envs that continue
        live = ~done
        if live.any():
            e = ids[live]
            self._s_obs[e] = obs[live]
            self._s_action[e] = actions[live]
            self._s_t[e] = self._t[e]
            self._t[e] += 1
            self._staged[e] = True


ADDERS: dict[str, type[Adder]] = {"transition": TransitionAdder, "sequence": WindowAdder, "episode": EpisodeAdder}


def adder_class_for(kind: ItemKind) -> type[Adder]:
    """The adder that writes ``kind`` (by ``kind.name``)."""
    try:
        return ADDERS[kind.name]
    except KeyError:
        raise ValueError(f"no adder writes {kind.name!r} items (known: {', '.join(sorted(ADDERS))})") from None
