"""The C n-step adder (``_hotpath.nstep_*``) against its numpy reference (``native=False``).

Both adders get the same recvs (random batches of envs, rewards, terminations and
truncations, Q-values, episodes as short as one step, rings that wrap) and write into
two tables of the same layout; after every recv the two tables must hold the same bytes:
every column, every item record, every counter but the heartbeat, the step offsets of a
stacked-frame column. tests/test_actor.py checks the items themselves by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers_envs import Recvs

from gearflow.kinds.transition import TransitionAdder
from gearflow.replay.rate_limiter import NO_LIMIT
from gearflow.replay.storage import (
    COMMIT,
    EPISODES,
    H_INSERT_LIMIT,
    PUBLISHED,
    REC_RESERVE,
    RESERVE,
)
from gearflow.replay.writer import Writer

_hotpath = pytest.importorskip("gearflow.replay._hotpath", reason="the C module is not built")

APEX = {"obs": "float32[3]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}
WIDE = {"obs": "uint8[2,3]", "action": "int32", "ret": "float64", "disc": "float64", "version": "int32"}
FRAMES = {"obs": "uint8[4,5,5] stack=4", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}
COUNTER_FIELDS = [RESERVE, COMMIT, PUBLISHED, EPISODES, REC_RESERVE]


def pair(storage_factory, spec, E, S, n, gamma=0.9, R=None):
    """Two tables of one layout: the numpy reference adder on one, the C adder on the other."""
    out = []
    for native in (False, True):
        st = storage_factory(spec, P=E, S=S, R=R)
        adder = TransitionAdder(Writer(st, np.arange(E), prefault=False), n, gamma, native=native)
        assert adder.native is native
        out.append((st, adder))
    return out


def assert_same_tables(a, b, where=""):
    for name in a.columns:
        np.testing.assert_array_equal(a.columns[name].view(np.uint8), b.columns[name].view(np.uint8),
                                      err_msg=f"column {name} {where}")  # fmt: skip
    np.testing.assert_array_equal(a.counters[:, COUNTER_FIELDS], b.counters[:, COUNTER_FIELDS], err_msg=f"counters {where}")
    np.testing.assert_array_equal(a.item_start, b.item_start, err_msg=f"item starts {where}")
    np.testing.assert_array_equal(a.item_length, b.item_length, err_msg=f"item lengths {where}")
    np.testing.assert_array_equal(a.item_priority.view(np.int64), b.item_priority.view(np.int64),
                                  err_msg=f"item priorities {where}")  # fmt: skip
    if a.step_offset is not None:
        np.testing.assert_array_equal(a.step_offset, b.step_offset, err_msg=f"step offsets {where}")


@pytest.mark.parametrize(
    "spec,E,b,n,S,flush_every,p_end,with_values",
    [
        (APEX, 8, 4, 3, 8, None, 0.08, True),  # S = min_steps: the ring wraps every few steps
        (APEX, 6, 6, 1, 64, None, 0.2, True),  # one-step transitions, whole batches
        (APEX, 5, 3, 5, 32, None, 0.3, False),  # no Q-values: priorities |ret|; episodes shorter than n
        (APEX, 4, 2, 3, 64, 1, 0.15, True),  # a flush every recv; the C list starts with one entry and grows
        (WIDE, 4, 3, 2, 16, None, 0.1, True),  # int32 actions and versions, float64 returns
        (FRAMES, 4, 2, 3, 16, None, 0.1, True),  # stacked frames: the newest frame and its offset
    ],
)
def test_native_adder_writes_what_the_reference_writes(storage_factory, spec, E, b, n, S, flush_every, p_end, with_values):
    (sa, ref), (sb, nat) = pair(storage_factory, spec, E, S, n)
    if flush_every is not None:
        ref.flush_every = nat.flush_every = flush_every
        nat._native.rebuild(capacity=1)  # the C path (NativeNStep): a one-entry list
    col = sa.spec["obs"]
    recvs = Recvs(E, b, 4, seed=E * 100 + n, p_end=p_end, obs=(col.shape, col.dtype), with_values=with_values)
    for step in range(400):
        batch = recvs(version=step // 7)
        ref.add(*batch)
        nat.add(*batch)
        assert_same_tables(sa, sb, f"after recv {step}")
        assert nat.items == ref.items
        np.testing.assert_array_equal(nat.writer.positions, ref.writer.positions)
        np.testing.assert_array_equal(nat.writer.episode_starts(), ref.writer.episode_starts())
    ref.finish()
    nat.finish()
    assert_same_tables(sa, sb, "after finish")
    assert nat.items == ref.items > 0
    assert int(sb.counters[:, EPISODES].sum()) > 10


def test_native_adder_refuses_nan_priorities_like_the_reference(storage_factory):
    (sa, ref), (sb, nat) = pair(storage_factory, APEX, 2, 32, 1)
    recvs = Recvs(2, 2, 3, seed=1, p_end=0.0)
    errors = []
    for adder in (ref, nat):
        recvs.rng = np.random.default_rng(1)
        adder.flush_every = 10**9
        for step in range(4):
            ids, obs, reward, term, trunc, first, actions, values, v = recvs(step)
            if step == 1:
                values[:, :] = np.nan
            adder.add(ids, obs, reward, term, trunc, first, actions, values, v)
        with pytest.raises(ValueError, match=r"priority must be finite and ≥ 0, got nan at index") as info:
            adder.flush_items()
        errors.append(str(info.value))
        assert adder.flush_items() == 0  # the failed flush's items are gone, as in the reference
    assert errors[0] == errors[1]
    assert_same_tables(sa, sb)


def test_native_adder_drops_items_held_by_the_rate_limiter_at_shutdown(storage_factory):
    """finish(block=False) with the limiter closed: no item published, the ended episodes
    still closed; once the limiter opens, items flow again."""
    (sa, ref), (sb, nat) = pair(storage_factory, APEX, 4, 64, 3)
    recvs = Recvs(4, 4, 2, seed=3, p_end=0.0)
    for st in (sa, sb):
        st.header[H_INSERT_LIMIT] = 0
    for adder in (ref, nat):
        adder.flush_every = 10**9  # one flush: at shutdown (no env ends twice before it)
        adder.writer.insert_timeout_s = 0.05
    for step in range(8):
        ids, obs, reward, term, trunc, first, actions, values, v = recvs(step)
        if step == 6:  # every env's episode ends: 6 steps, 2n items each
            term[:] = True
            recvs.reset[:] = True
        ref.add(ids, obs, reward, term, trunc, first, actions, values, v)
        nat.add(ids, obs, reward, term, trunc, first, actions, values, v)
    assert nat._native.pending > 0  # items queued in the C path (NativeNStep)
    ref.finish(block=False)
    nat.finish(block=False)
    assert_same_tables(sa, sb)
    assert int(sb.counters[:, PUBLISHED].sum()) == 0 and int(sb.counters[:, EPISODES].sum()) == 4
    for st in (sa, sb):
        st.header[H_INSERT_LIMIT] = NO_LIMIT
    recvs.p_end = 0.1
    for adder in (ref, nat):
        adder.flush_every = adder.n
    for step in range(8, 60):
        batch = recvs(step)
        ref.add(*batch)
        nat.add(*batch)
    ref.finish()
    nat.finish()
    assert_same_tables(sa, sb)
    assert nat.items == ref.items > 0


def test_native_adder_checks_its_batch_before_writing(storage_factory):
    (sa, ref), (sb, nat) = pair(storage_factory, APEX, 2, 32, 2)
    obs = np.zeros((2, 3), np.float32)
    zeros, no = np.zeros(2, np.float32), np.zeros(2, bool)
    with pytest.raises(ValueError, match=r"streams \[5\] out of range \[0, 2\)"):
        nat.add(np.array([0, 5]), obs, zeros, no, no, no, np.zeros(2, np.int64), None, 0)
    with pytest.raises(IndexError, match="index 7 is out of bounds for axis 1 with size 3"):
        nat.add(np.array([0, 1]), obs, zeros, no, no, no, np.array([0, 7]), np.zeros((2, 3), np.float32), 0)
    with pytest.raises(ValueError, match="column 'obs': expected dtype float32, got float64"):
        nat.add(np.array([0, 1]), obs.astype(np.float64), zeros, no, no, no, np.zeros(2, np.int64), None, 0)
    assert (nat._t == 0).all() and int(sb.counters[:, COMMIT].sum()) == 0
    # lists and other dtypes are converted, as the reference takes them
    nat.add([0, 1], obs, [0.5, 1.0], [False, False], [False, False], [True, True], [1, 0], None, 0)
    ref.add(np.array([0, 1]), obs, np.array([0.5, 1.0]), no, no, ~no, np.array([1, 0]), None, 0)
    assert_same_tables(sa, sb)
    with pytest.raises(ValueError, match="native=True"):
        TransitionAdder(ListWriter(ref.writer), 2, 0.9, native=True)


class ListWriter:
    """A WriterLike that is not a local Writer (a stand-in for a remote one): the C path refuses it."""

    def __init__(self, w):
        self._w = w

    def __getattr__(self, name):
        return getattr(self._w, name)


# --------------------------------------------------------------------------- R2D2 windows

WINDOWS = {"obs": "float32[3]", "action": "int64", "reward": "float32", "discount": "float32", "first": "bool",
           "version": "int64"}  # fmt: skip


@pytest.mark.parametrize("length,period,burn_in", [(5, 2, 1), (4, 4, 0), (6, 1, 2)])
def test_window_adder_batch_rule_creates_the_windows_of_the_kinds_own_rule(storage_factory, length, period, burn_in):
    """WindowAdder finds the windows due after an append over the whole batch for a Sequence;
    a Sequence subclass goes through its own due_on_append per env (the reference). Both
    tables must end up the same, item for item."""
    from dataclasses import dataclass

    from gearflow.kinds.sequence import Sequence, WindowAdder

    @dataclass(frozen=True)
    class OwnRule(Sequence):  # the same windows, through the per-env path
        pass

    E, b, S = 5, 3, 64
    tables = []
    for kind in (OwnRule(length, period, burn_in), Sequence(length, period, burn_in)):
        st = storage_factory(WINDOWS, P=E, S=S)
        tables.append((st, WindowAdder(Writer(st, np.arange(E), prefault=False), kind)))
    recvs = Recvs(E, b, 2, seed=length * 10 + period, p_end=0.1)
    for step in range(300):
        batch = recvs(step // 5)
        for _, adder in tables:
            adder.add(*batch)
        assert_same_tables(tables[0][0], tables[1][0], f"after recv {step}")
    assert tables[0][1].items == tables[1][1].items > 50
