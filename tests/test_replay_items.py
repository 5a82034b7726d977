"""gearflow.replay.items: rows and gathers of each kind, sequence/episode schedules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gearflow.replay import Writer
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.kinds.registry import kind_from_dict

from helpers_replay import SPEC, step_values  # noqa: E402


@pytest.fixture
def filled(storage_factory):
    """P=2, S=10; partition p holds steps 5..14 (the ring wrapped once)."""
    st = storage_factory(SPEC, P=2, S=10)
    w = Writer(st, [0, 1])
    for t in range(15):
        w.append(step_values([0, 1], [t, t]))
    return st


def _out(kind, B):
    return {
        name: torch.full(shape, 7, dtype=dtype)
        for name, (shape, dtype) in kind.layout(SPEC, B).items()
    }


def test_transition_rows_and_gather(filled):
    kind = Transition(next_columns=("obs", "frame"))
    parts = np.array([0, 1, 1])
    starts = np.array([5, 8, 12])
    lengths = np.array([3, 1, 3])
    rows = kind.rows(parts, starts, lengths, 10)
    assert rows["first"].tolist() == [5, 18, 12]
    assert rows["last"].tolist() == [7, 18, 14]  # step 14 of partition 1 wraps to row 10 + 4
    out = _out(kind, 3)
    assert set(out) == {"obs", "frame", "action", "done", "next_obs", "next_frame"}
    kind.gather(filled.tensors, out, rows, lengths)
    first = step_values(parts, starts)
    last = step_values(parts, starts + lengths - 1)
    for k in SPEC.names:
        np.testing.assert_array_equal(out[k].numpy(), first[k], err_msg=k)
    np.testing.assert_array_equal(out["next_obs"].numpy(), last["obs"])
    np.testing.assert_array_equal(out["next_frame"].numpy(), last["frame"])
    assert out["action"].dtype == torch.int64 and out["done"].dtype == torch.bool
    with pytest.raises(ValueError, match=r"next column 'reward' is not in the table spec"):
        Transition(next_columns=("reward",)).layout(SPEC, 1)


def test_sequence_gather_pads_with_zeros_and_masks(filled):
    kind = Sequence(length=4, period=2)
    parts = np.array([1, 0, 1])
    starts = np.array([9, 11, 14])
    lengths = np.array([4, 2, 1])
    rows = kind.rows(parts, starts, lengths, 10)["window"]
    assert rows.shape == (3, 4)
    assert rows[0].tolist() == [19, 10, 11, 12]  # wraps around partition 1's ring
    out = _out(kind, 3)
    kind.gather(filled.tensors, out, {"window": rows}, lengths)
    assert out["length"].tolist() == [4, 2, 1] and out["length"].dtype == torch.int64
    mask = np.arange(4)[None] < lengths[:, None]
    np.testing.assert_array_equal(out["mask"].numpy(), mask)
    for b in range(3):
        n = lengths[b]
        want = step_values(np.full(n, parts[b]), starts[b] + np.arange(n))
        for k in SPEC.names:
            got = out[k][b].numpy()
            np.testing.assert_array_equal(got[:n], want[k], err_msg=f"{k} row {b}")
            assert not got[n:].any(), f"{k} row {b}: padding is not zero"
    assert out["obs"].shape == (3, 4, 3) and out["frame"].shape == (3, 4, 2, 4)


def test_sequence_full_batch_leaves_no_stale_padding(filled):
    kind = Sequence(length=3, period=1)
    out = _out(kind, 2)
    lengths = np.array([1, 3])
    rows = kind.rows(np.array([0, 1]), np.array([6, 7]), lengths, 10)
    kind.gather(filled.tensors, out, rows, lengths)
    assert not out["obs"][0, 1:].any()
    # reuse the buffer with full-length items: every position overwritten, all valid
    lengths = np.array([3, 3])
    rows = kind.rows(np.array([0, 1]), np.array([6, 7]), lengths, 10)
    kind.gather(filled.tensors, out, rows, lengths)
    assert out["mask"].all()
    np.testing.assert_array_equal(
        out["obs"][0].numpy(), step_values(np.zeros(3, int), np.arange(6, 9))["obs"]
    )


def test_sequence_validation():
    with pytest.raises(ValueError, match="sequence length and period must be ≥ 1, got 0, 1"):
        Sequence(length=0, period=1)
    with pytest.raises(ValueError, match="sequence length and period must be ≥ 1, got 4, 0"):
        Sequence(length=4, period=0)
    with pytest.raises(ValueError, match=r"burn_in must be in \[0, length\), got 4"):
        Sequence(length=4, period=2, burn_in=4)
    with pytest.raises(ValueError, match="max_episode_length must be ≥ 1, got 0"):
        Episode(max_episode_length=0)


def _windows(kind, L):
    """(start, length) of every window the schedule creates over an episode of ``L`` steps."""
    out = []
    for n in range(1, L + 1):  # after each append; episode length n
        out += [(n - k, k) for k in kind.due_on_append(n)]
    out += [(L - k, k) for k in kind.due_at_end(L)]
    return out


@pytest.mark.parametrize(
    "L, expected",
    [
        (30, [(0, 30)]),  # shorter than a window: one padded window
        (80, [(0, 80)]),  # the tail at 40 would be burn-in only
        (100, [(0, 80), (40, 60)]),  # tail of 20 at 80 is burn-in only: skipped
        (120, [(0, 80), (40, 80)]),
        (200, [(0, 80), (40, 80), (80, 80), (120, 80)]),
        (41, [(0, 41)]),  # tail at 40 is 1 step of burn-in: skipped
        (1, [(0, 1)]),
    ],
)
def test_r2d2_sequence_schedule(L, expected):
    kind = Sequence(length=80, period=40, burn_in=40)
    wins = _windows(kind, L)
    assert sorted(wins) == expected
    for start, n in wins:
        assert 0 <= start and start + n <= L  # never crosses the episode boundary
        assert start % 40 == 0 and 1 <= n <= 80


def test_sequence_schedule_without_burn_in_covers_every_step():
    kind = Sequence(length=8, period=4)
    for L in range(1, 40):
        wins = _windows(kind, L)
        covered = set()
        for start, n in wins:
            assert start % 4 == 0 and start + n <= L and n <= 8
            covered.update(range(start, start + n))
        assert covered == set(range(L)), L
        # windows start at every multiple of the period
        assert sorted(s for s, _ in wins) == list(range(0, L, 4)), L
        # full windows come from appends, partial ones only at the end
        assert all(n == 8 for s, n in wins if s + 8 <= L)


@pytest.mark.parametrize(
    "L, expected",
    [
        (3, [(0, 3)]),
        (5, [(0, 5)]),
        (6, [(0, 5), (5, 1)]),
        (10, [(0, 5), (5, 5)]),
        (12, [(0, 5), (5, 5), (10, 2)]),
    ],
)
def test_episode_chunking(L, expected):
    kind = Episode(max_episode_length=5)
    assert kind.max_length == 5
    assert sorted(_windows(kind, L)) == expected


def test_episode_gather_pads(filled):
    kind = Episode(max_episode_length=6)
    out = _out(kind, 2)
    assert out["obs"].shape == (2, 6, 3) and out["mask"].shape == (2, 6)
    lengths = np.array([2, 6])
    rows = kind.rows(np.array([1, 0]), np.array([12, 8]), lengths, 10)
    kind.gather(filled.tensors, out, rows, lengths)
    assert out["mask"].sum(1).tolist() == [2, 6]
    np.testing.assert_array_equal(out["action"][0, :2].numpy(), [121, 131])
    assert not out["action"][0, 2:].any() and not out["frame"][0, 2:].any()
    np.testing.assert_array_equal(out["action"][1].numpy(), [80, 90, 100, 110, 120, 130])


@pytest.mark.parametrize(
    "kind",
    [
        Transition(next_columns=("obs", "frame")),
        Sequence(length=8, period=2, burn_in=3),
        Episode(max_episode_length=9),
    ],
)
def test_kind_dict_round_trip(kind):
    assert kind_from_dict(kind.to_dict()) == kind
    with pytest.raises(ValueError, match="unknown item kind 'bogus'"):
        kind_from_dict({"kind": "bogus"})


def test_c_window_rows_match_the_numpy_reference(monkeypatch):
    import gearflow.kinds.sequence as items

    if items._hotpath is None:
        pytest.skip("the C hot path was not built (no compiler at install time)")
    rng = np.random.default_rng(5)
    kind = items.Sequence(length=8, period=4)
    S = 50
    parts = rng.integers(0, 3, 200)
    starts = rng.integers(0, 10_000, 200)  # absolute steps: many windows wrap the ring
    lengths = rng.integers(1, 9, 200)
    fast = kind.rows(parts, starts, lengths, S)["window"]
    monkeypatch.setattr(items, "_hotpath", None)
    ref = kind.rows(parts, starts, lengths, S)["window"]
    np.testing.assert_array_equal(fast, ref)


def test_records_per_partition():
    from gearflow.replay.items import records_per_partition
    from gearflow.kinds.episode import Episode
    from gearflow.kinds.sequence import Sequence
    from gearflow.kinds.transition import Transition

    assert records_per_partition(Transition(next_columns=("obs",)), 1000) == 1000  # one item per step
    assert records_per_partition(Episode(max_episode_length=500), 1000) == 1002  # at most one per step
    # windows every 20 steps: an episode of L ≥ 20 steps makes ceil(L/20) ≤ 2·L/20 of them
    kind = Sequence(length=40, period=20, burn_in=20)
    R = records_per_partition(kind, 1000)
    assert R == 102
    for L in range(20, 200):
        windows = len(range(0, L, kind.period))
        assert windows * (1000 // L) <= R, L  # the step ring laps before the record ring
