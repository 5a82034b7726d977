"""Tests for gearflow.replay.selectors: distributions, bookkeeping, state and errors."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from gearflow.replay import selectors
from gearflow.replay.selectors import (
    SELECTORS,
    Selection,
    SumTree,
    make_selector,
)

ALL_NAMES = sorted(SELECTORS)
CHI2_P_VALUE = 1e-3


def chi2_critical(df: int) -> float:
    """Upper ``1 - CHI2_P_VALUE`` quantile of chi-square(df); Wilson-Hilferty without scipy."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = 3.090232306167813  # standard normal quantile at 1 - 1e-3
        return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return float(chi2.ppf(1 - CHI2_P_VALUE, df))


def assert_matches_distribution(counts: np.ndarray, probabilities: np.ndarray) -> None:
    """Chi-square goodness of fit; slots with probability 0 must never appear."""
    counts = np.asarray(counts, dtype=np.float64)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    possible = probabilities > 0
    assert counts[~possible].sum() == 0, "a slot with probability 0 was sampled"
    expected = counts.sum() * probabilities[possible]
    statistic = float(((counts[possible] - expected) ** 2 / expected).sum())
    df = int(possible.sum()) - 1
    assert statistic < chi2_critical(df), f"chi-square {statistic:.1f} with df={df}"


def sample_counts(selector, capacity: int, batches: int = 200, batch_size: int = 256):
    slots = np.concatenate([selector.sample(batch_size).slots for _ in range(batches)])
    return np.bincount(slots, minlength=capacity)


def fill(selector, slots, priorities, first_order: int = 0) -> None:
    slots = np.asarray(slots, dtype=np.int64)
    order = np.arange(first_order, first_order + len(slots))
    selector.insert(slots, np.asarray(priorities, dtype=np.float64), order)


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, b[key], err_msg=key)
            assert value.dtype == b[key].dtype, key
        else:
            assert value == b[key], key


def assert_selections_equal(a: Selection, b: Selection) -> None:
    np.testing.assert_array_equal(a.slots, b.slots)
    np.testing.assert_array_equal(a.probabilities, b.probabilities)
    np.testing.assert_array_equal(a.weights, b.weights)


def test_module_docstring_example_runs():
    failures, _ = doctest.testmod(selectors)
    assert failures == 0


# -- factory and construction -----------------------------------------------


def test_make_selector_builds_every_kind():
    for name in ALL_NAMES:
        selector = make_selector(name, 10, seed=0)
        assert selector.name == name
        assert isinstance(selector, SELECTORS[name])
        assert len(selector) == 0


def test_make_selector_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="'reservoir'") as info:
        make_selector("reservoir", 10)
    for name in ALL_NAMES:
        assert name in str(info.value)


def test_make_selector_passes_kind_specific_kwargs():
    selector = make_selector("prioritized", 10, alpha=0.7, beta=0.2, fanout=4)
    assert (selector.alpha, selector.beta, selector.tree.fanout) == (0.7, 0.2, 4)
    assert make_selector("top_k", 10, k=3).k == 3
    with pytest.raises(TypeError):
        make_selector("uniform", 10, alpha=0.5)


@pytest.mark.parametrize(
    ("name", "kwargs", "word"),
    [
        ("uniform", {"capacity": 0}, "capacity"),
        ("prioritized", {"capacity": 4, "alpha": -0.1}, "alpha"),
        ("prioritized", {"capacity": 4, "beta": float("nan")}, "beta"),
        ("prioritized", {"capacity": 4, "fanout": 1}, "fanout"),
        ("top_k", {"capacity": 4, "k": 0}, "k"),
    ],
)
def test_constructor_rejects_bad_arguments(name, kwargs, word):
    with pytest.raises(ValueError, match=word):
        make_selector(name, **kwargs)


# -- common bookkeeping -------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_len_counts_live_slots(name):
    selector = make_selector(name, 20, seed=0)
    fill(selector, [3, 5, 7], [1.0, 2.0, 3.0])
    assert len(selector) == 3
    fill(selector, [5, 9], [4.0, 1.0], first_order=3)  # 5 is replaced, 9 is new
    assert len(selector) == 4
    selector.remove(np.array([3, 3, 11]))  # repeated and dead slots are fine
    assert len(selector) == 3
    selector.remove(np.array([3]))  # already dead: no-op
    assert len(selector) == 3
    selector.remove(np.array([], dtype=np.int64))
    assert len(selector) == 3
    batch = selector.sample(64)
    assert set(batch.slots.tolist()) <= {5, 7, 9}


@pytest.mark.parametrize("name", ALL_NAMES)
def test_selection_shapes_and_dtypes(name):
    selector = make_selector(name, 10, seed=0)
    fill(selector, [1, 2, 3], [1.0, 2.0, 3.0])
    batch = selector.sample(5)
    assert batch.slots.shape == batch.probabilities.shape == batch.weights.shape == (5,)
    assert batch.slots.dtype == np.int64
    assert batch.probabilities.dtype == np.float64
    assert batch.weights.dtype == np.float32
    assert np.all((batch.probabilities > 0) & (batch.probabilities <= 1))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_removed_slot_is_never_sampled_and_reinsert_works(name):
    capacity = 12
    kwargs = {"k": capacity} if name == "top_k" else {}
    selector = make_selector(name, capacity, seed=1, **kwargs)
    fill(selector, np.arange(capacity), np.linspace(1.0, 2.0, capacity))
    favourite = int(selector.sample(1).slots[0])
    selector.remove(np.array([favourite]))
    for _ in range(50):
        assert favourite not in selector.sample(32).slots
    fill(selector, [favourite], [1.5], first_order=capacity)
    seen = np.concatenate([selector.sample(capacity).slots for _ in range(50)])
    assert favourite in seen
    assert len(selector) == capacity


@pytest.mark.parametrize(
    ("name", "kwargs", "batch_size", "expected"),
    [
        ("max_heap", {}, 2, [6, 4]),
        ("min_heap", {}, 2, [4, 6]),
        ("prioritized", {}, 64, [6] * 64),  # slot 4 ends with zero priority
        ("top_k", {"k": 1}, 64, [6] * 64),
    ],
)
def test_insert_repeated_slot_last_wins(name, kwargs, batch_size, expected):
    selector = make_selector(name, 10, seed=0, **kwargs)
    fill(selector, [4, 6, 4], [100.0, 5.0, 0.0])
    assert len(selector) == 2
    assert selector.sample(batch_size).slots.tolist() == expected


# -- uniform ------------------------------------------------------------------


def test_uniform_distribution_over_live_slots():
    capacity = 60
    selector = make_selector("uniform", capacity, seed=0)
    fill(selector, np.arange(0, capacity, 2), np.ones(30))
    selector.remove(np.arange(0, 20, 4))  # 5 of them die
    live = np.setdiff1d(np.arange(0, capacity, 2), np.arange(0, 20, 4))
    expected = np.zeros(capacity)
    expected[live] = 1 / len(live)
    assert_matches_distribution(sample_counts(selector, capacity), expected)
    batch = selector.sample(16)
    np.testing.assert_array_equal(batch.probabilities, np.full(16, 1 / 25))
    np.testing.assert_array_equal(batch.weights, np.ones(16, dtype=np.float32))


# -- prioritized --------------------------------------------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_prioritized_distribution_is_p_to_alpha(alpha):
    capacity = 40
    priorities = np.array([0.5, 1.0, 2.0, 4.0, 0.0, 8.0, 3.0, 0.25, 6.0, 1.5])
    slots = np.array([0, 3, 5, 8, 13, 21, 22, 30, 33, 39])
    selector = make_selector("prioritized", capacity, seed=2, alpha=alpha, fanout=4)
    fill(selector, slots, priorities)
    expected = np.zeros(capacity)
    expected[slots] = priorities**alpha
    expected /= expected.sum()
    assert_matches_distribution(sample_counts(selector, capacity), expected)
    batch = selector.sample(256)
    np.testing.assert_allclose(batch.probabilities, expected[batch.slots], rtol=1e-12)


def test_prioritized_counts_fail_for_the_wrong_alpha():
    """The distribution test has power: alpha=1 samples do not fit p**0.5."""
    capacity = 10
    priorities = np.arange(1.0, 11.0)
    selector = make_selector("prioritized", capacity, seed=3, alpha=1.0)
    fill(selector, np.arange(capacity), priorities)
    wrong = priorities**0.5 / (priorities**0.5).sum()
    with pytest.raises(AssertionError, match="chi-square"):
        assert_matches_distribution(sample_counts(selector, capacity), wrong)


def test_prioritized_sampling_is_stratified():
    selector = make_selector("prioritized", 64, seed=4, alpha=1.0)
    fill(selector, np.arange(64), np.ones(64))
    # Equal masses and one stratum per item: every item exactly once.
    np.testing.assert_array_equal(np.sort(selector.sample(64).slots), np.arange(64))


def test_prioritized_importance_weights_match_formula():
    priorities = np.array([0.1, 1.0, 2.0, 5.0, 0.0, 3.0])
    selector = make_selector("prioritized", 8, seed=5, alpha=0.6, beta=0.4)
    fill(selector, np.arange(6), priorities)
    masses = priorities**0.6
    probabilities = masses / masses.sum()
    n_live = 6  # the zero-priority item counts
    for beta in (0.4, 1.0, 0.0):
        selector.beta = beta
        batch = selector.sample(32)
        raw = (n_live * probabilities[batch.slots]) ** -beta
        np.testing.assert_allclose(batch.weights, raw / raw.max(), rtol=1e-6)
        assert batch.weights.max() == np.float32(1.0)
    assert np.all(batch.weights == 1.0)  # beta = 0: no correction


def test_prioritized_beta_setter_validates():
    selector = make_selector("prioritized", 8)
    with pytest.raises(ValueError, match="beta"):
        selector.beta = -1.0
    assert selector.beta == 0.4


def test_prioritized_update_changes_distribution():
    capacity = 10
    selector = make_selector("prioritized", capacity, seed=6, alpha=1.0)
    fill(selector, np.arange(capacity), np.ones(capacity))
    selector.update(np.array([3]), np.array([991.0]))
    counts = sample_counts(selector, capacity, batches=20)
    assert counts[3] / counts.sum() == pytest.approx(0.991, abs=0.01)
    selector.update(np.array([3]), np.array([0.0]))
    assert 3 not in np.concatenate([selector.sample(256).slots for _ in range(20)])


def test_prioritized_update_repeated_slot_last_wins():
    selector = make_selector("prioritized", 10, seed=7, alpha=1.0)
    fill(selector, np.arange(4), np.ones(4))
    selector.update(np.array([1, 2, 1, 1]), np.array([50.0, 3.0, 0.0, 2.0]))
    np.testing.assert_array_equal(selector.tree.leaves[:4], [1.0, 2.0, 3.0, 1.0])
    assert selector.tree.total == 7.0
    batch = selector.sample(70)
    np.testing.assert_allclose(batch.probabilities[batch.slots == 1], 2 / 7)


def test_prioritized_zero_priority_is_never_sampled():
    selector = make_selector("prioritized", 100, seed=8, alpha=0.0)  # 0 ** 0 must stay 0
    fill(selector, np.arange(100), np.where(np.arange(100) % 3 == 0, 0.0, 1.0))
    seen = np.concatenate([selector.sample(256).slots for _ in range(50)])
    assert not np.any(seen % 3 == 0)
    assert len(np.unique(seen)) == 66


@pytest.fixture(params=["c", "numpy"])
def tree_impl(request, monkeypatch):
    """Run a sum-tree test on the C descent/update and on the numpy reference."""
    import gearflow.replay.selectors as selectors

    if request.param == "numpy":
        monkeypatch.setattr(selectors, "_hotpath", None)
    elif selectors._hotpath is None:
        pytest.skip("the C sum tree was not built (no compiler at install time)")
    return request.param


def test_all_zero_priorities_results_in_uniform_sampling(tree_impl):
    """Reverb's item_selectors_test: with every priority 0 the prioritized selector samples
    uniformly (P = 1/N, weights 1) instead of raising; one positive priority ends it."""
    selector = make_selector("prioritized", 10, seed=0, alpha=0.6, beta=0.4)
    fill(selector, [1, 2, 7], [0.0, 0.0, 0.0])
    seen = np.concatenate([selector.sample(64).slots for _ in range(60)])
    counts = np.bincount(seen, minlength=10)
    assert counts.sum() == 3840 and set(np.flatnonzero(counts)) == {1, 2, 7}
    assert counts[[1, 2, 7]].min() > 1100  # 1280 expected each (binomial sd ~29)
    batch = selector.sample(5)
    np.testing.assert_array_equal(batch.probabilities, np.full(5, 1 / 3))
    np.testing.assert_array_equal(batch.weights, np.ones(5, np.float32))
    assert batch.total is None and selector.reweigh(np.zeros(5)) is None
    selector.update(np.array([2]), np.array([1.0]))  # a positive one: proportional again
    assert set(selector.sample(32).slots.tolist()) == {2}


def test_c_sum_tree_is_built_where_a_compiler_exists():
    import shutil

    import gearflow.replay.selectors as selectors

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the numpy path is used")
    assert selectors._hotpath is not None, "pip install did not build gearflow.replay._hotpath"
    assert SumTree(10, 4).native


@pytest.mark.parametrize("capacity", [1, 7, 1000, 100_003])
@pytest.mark.parametrize("fanout", [2, 16])
def test_sum_tree_invariants_after_random_operations(capacity, fanout, tree_impl):
    rng = np.random.default_rng(capacity + fanout)
    alpha = 0.7
    selector = make_selector("prioritized", capacity, seed=0, alpha=alpha, fanout=fanout)
    masses = np.zeros(capacity)  # independent model of what the leaves must hold
    live = np.zeros(capacity, dtype=bool)
    for step in range(30):
        slots = rng.integers(capacity, size=rng.integers(1, 300))
        priorities = rng.exponential(size=len(slots)) * (rng.random(len(slots)) > 0.1)
        kind = step % 3
        if kind == 0:
            selector.insert(slots, priorities, np.arange(len(slots)) + 1000 * step)
            live[slots] = True
        elif kind == 1 and live.any():
            slots = rng.choice(np.flatnonzero(live), size=len(slots))
            selector.update(slots, priorities)
        else:
            selector.remove(slots)
            live[slots] = False
            masses[slots] = 0.0
            continue
        # the last occurrence of a repeated slot wins
        _, last = np.unique(slots[::-1], return_index=True)
        last = len(slots) - 1 - last
        masses[slots[last]] = np.where(priorities[last] > 0, priorities[last] ** alpha, 0.0)

        tree = selector.tree
        assert len(selector) == live.sum()
        np.testing.assert_allclose(tree.leaves[:capacity], masses, rtol=1e-14, atol=0)
        assert not tree.leaves[capacity:].any()
        assert tree.total == pytest.approx(masses.sum(), rel=1e-9, abs=1e-300)
        for parent, children in zip(tree.levels[:-1], tree.levels[1:], strict=True):
            sums = children.reshape(-1, fanout).sum(axis=1)
            np.testing.assert_allclose(parent[: len(sums)], sums, rtol=1e-12, atol=0)
            assert not parent[len(sums) :].any()


@pytest.mark.parametrize("size", [1, 7, 1000, 100_003])
@pytest.mark.parametrize("fanout", [2, 3, 16, 32])
def test_sum_tree_find_matches_searchsorted(size, fanout, tree_impl):
    rng = np.random.default_rng(size * fanout)
    tree = SumTree(size, fanout)
    values = rng.random(size) * (rng.random(size) > 0.3)
    if not values.any():
        values[-1] = 1.0
    tree.set(np.arange(size), values)
    targets = np.sort(rng.random(500)) * tree.total
    expected = np.searchsorted(np.cumsum(values), targets, side="right")
    np.testing.assert_array_equal(tree.find(targets), expected)
    assert np.all(values[tree.find(targets)] > 0)


@pytest.mark.parametrize("fanout", [2, 4, 16])
def test_sum_tree_find_clamps_targets_at_or_past_total(fanout, tree_impl):
    tree = SumTree(7, fanout)
    tree.set(np.arange(7), np.array([0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0]))
    total = tree.total
    targets = np.array([0.0, 0.5, 1.0, 2.5, total, np.nextafter(total, np.inf), 2 * total])
    np.testing.assert_array_equal(tree.find(targets), [1, 1, 3, 3, 3, 3, 3])


def test_sum_tree_layout():
    tree = SumTree(10**5, 16)
    assert [len(level) for level in tree.levels] == [1, 16, 32, 400, 6256, 100_000]
    assert len(SumTree(10**7, 16).levels) == 7  # six levels below the root
    assert [len(level) for level in SumTree(1, 16).levels] == [1, 16]


# -- deterministic selectors ---------------------------------------------------


def test_fifo_and_lifo_return_oldest_and_newest():
    fifo = make_selector("fifo", 20)
    lifo = make_selector("lifo", 20)
    for selector in (fifo, lifo):
        selector.insert(np.array([7, 3, 9, 1]), np.ones(4), np.array([10, 11, 12, 13]))
    assert fifo.sample(2).slots.tolist() == [7, 3]
    assert lifo.sample(2).slots.tolist() == [1, 9]
    assert fifo.sample(6).slots.tolist() == [7, 3, 9, 1, 7, 3]  # fewer live than B: cycle
    assert lifo.sample(5).slots.tolist() == [1, 9, 3, 7, 1]
    np.testing.assert_array_equal(fifo.sample(3).probabilities, np.ones(3))
    for selector in (fifo, lifo):
        selector.insert(np.array([7]), np.ones(1), np.array([14]))  # 7 becomes the newest
        selector.remove(np.array([9]))
    assert fifo.sample(3).slots.tolist() == [3, 1, 7]
    assert lifo.sample(3).slots.tolist() == [7, 1, 3]


def test_heaps_return_extreme_priorities_with_ties_broken_by_order():
    priorities = np.array([5.0, 1.0, 5.0, 3.0, 1.0, 0.0])
    order = np.array([4, 3, 2, 1, 0, 5])
    max_heap = make_selector("max_heap", 10)
    min_heap = make_selector("min_heap", 10)
    for selector in (max_heap, min_heap):
        selector.insert(np.arange(6), priorities, order)
    assert max_heap.sample(3).slots.tolist() == [2, 0, 3]
    assert max_heap.sample(1).slots.tolist() == [2]
    assert min_heap.sample(3).slots.tolist() == [5, 4, 1]
    assert min_heap.sample(2).slots.tolist() == [5, 4]
    assert max_heap.sample(8).slots.tolist() == [2, 0, 3, 4, 1, 5, 2, 0]
    max_heap.update(np.array([3]), np.array([9.0]))
    assert max_heap.sample(2).slots.tolist() == [3, 2]


@pytest.mark.parametrize("name", ["fifo", "lifo", "max_heap", "min_heap"])
def test_ranked_selectors_match_a_full_sort(name):
    rng = np.random.default_rng(9)
    capacity = 500
    selector = make_selector(name, capacity)
    slots = rng.permutation(capacity)[:300]
    priorities = rng.integers(0, 5, size=300).astype(np.float64)  # many ties
    order = rng.permutation(10_000)[:300]
    selector.insert(slots, priorities, order)
    key = {"fifo": order, "lifo": -order, "max_heap": -priorities, "min_heap": priorities}[name]
    reference = slots[np.lexsort((order, key))]
    for batch_size in (1, 2, 17, 60, 299, 300, 301, 700):
        expected = np.resize(reference, batch_size)
        np.testing.assert_array_equal(selector.sample(batch_size).slots, expected)


# -- top_k ----------------------------------------------------------------------


def test_top_k_samples_uniformly_among_the_k_best():
    capacity = 30
    rng = np.random.default_rng(10)
    priorities = rng.permutation(capacity).astype(np.float64)
    selector = make_selector("top_k", capacity, seed=11, k=5)
    fill(selector, np.arange(capacity), priorities)
    expected = np.where(priorities >= capacity - 5, 1 / 5, 0.0)
    assert_matches_distribution(sample_counts(selector, capacity, batches=40), expected)
    np.testing.assert_array_equal(selector.sample(8).probabilities, np.full(8, 1 / 5))


def test_top_k_ties_at_cutoff_prefer_older_and_k_above_len():
    selector = make_selector("top_k", 10, seed=12, k=2)
    selector.insert(np.arange(4), np.array([2.0, 1.0, 1.0, 1.0]), np.array([0, 3, 1, 2]))
    assert set(selector.sample(200).slots.tolist()) == {0, 2}
    selector.k = 10
    batch = selector.sample(200)
    assert set(batch.slots.tolist()) == {0, 1, 2, 3}
    np.testing.assert_array_equal(batch.probabilities, np.full(200, 1 / 4))


# -- state_dict -------------------------------------------------------------------


def random_workload(selector, capacity: int, rng: np.random.Generator, steps: int, start: int):
    """Apply the same random inserts/updates/removes given the same rng."""
    for step in range(start, start + steps):
        slots = rng.integers(capacity, size=8)
        selector.insert(slots, rng.random(8) * 3, np.arange(8) + 8 * step)
        selector.remove(rng.integers(capacity, size=2))
        live = selector.state_dict()["slots"]
        targets = rng.choice(live, size=4)
        selector.update(targets, rng.random(4))


@pytest.mark.parametrize("name", ALL_NAMES)
def test_state_dict_round_trip_reproduces_future_samples(name):
    capacity = 300
    kwargs = {"k": 20} if name == "top_k" else {}
    original = make_selector(name, capacity, seed=13, **kwargs)
    random_workload(original, capacity, np.random.default_rng(0), steps=40, start=0)
    original.sample(10)  # advance the RNG
    state = original.state_dict()
    for key, value in state.items():
        assert isinstance(value, (np.ndarray, int, float)), key

    restored = make_selector(name, capacity, seed=999)  # other seed and defaults
    restored.load_state_dict(state)
    for value in state.values():  # the restored selector holds copies
        if isinstance(value, np.ndarray):
            value[...] = 0
    assert len(restored) == len(original)
    assert_states_equal(restored.state_dict(), original.state_dict())
    for round_ in range(5):
        assert_selections_equal(restored.sample(64), original.sample(64))
        for selector in (original, restored):
            random_workload(selector, capacity, np.random.default_rng(round_ + 1), 3, 100)
    assert_states_equal(restored.state_dict(), original.state_dict())


@pytest.mark.parametrize("name", ALL_NAMES)
def test_state_dict_survives_npz(name, tmp_path):
    original = make_selector(name, 50, seed=15)
    fill(original, np.arange(0, 50, 3), np.linspace(0.5, 2.0, 17))
    np.savez(tmp_path / "selector.npz", **original.state_dict())
    with np.load(tmp_path / "selector.npz") as stored:  # 0-d arrays come back for scalars
        state = {key: stored[key] for key in stored.files}
    restored = make_selector(name, 50)
    restored.load_state_dict(state)
    assert_selections_equal(restored.sample(32), original.sample(32))


def test_prioritized_state_restores_hyperparameters_and_tree():
    original = make_selector("prioritized", 100, seed=14, alpha=0.9, beta=0.7, fanout=4)
    fill(original, np.arange(50), np.linspace(0.0, 2.0, 50))
    restored = make_selector("prioritized", 100, fanout=32)
    restored.load_state_dict(original.state_dict())
    assert (restored.alpha, restored.beta, restored.tree.fanout) == (0.9, 0.7, 4)
    for a, b in zip(restored.tree.levels, original.tree.levels, strict=True):
        np.testing.assert_array_equal(a, b)


def test_load_state_dict_rejects_other_capacity_without_changes():
    source = make_selector("uniform", 10, seed=0)
    fill(source, [1, 2], [1.0, 1.0])
    target = make_selector("uniform", 20, seed=0)
    fill(target, [5], [1.0])
    before = target.state_dict()
    with pytest.raises(ValueError, match="capacity"):
        target.load_state_dict(source.state_dict())
    assert_states_equal(target.state_dict(), before)


# -- errors leave the state untouched ----------------------------------------------

NAN, INF = float("nan"), float("inf")
BAD_CALLS = [
    ("insert", (np.array([1]), np.array([NAN]), np.array([9])), r"priority must be finite and ≥ 0, got nan"),
    ("insert", (np.array([1, 2]), np.array([1.0, INF]), np.array([9, 10])), r"priority must be finite and ≥ 0, got inf"),
    ("insert", (np.array([1]), np.array([-1.5]), np.array([9])), r"priority must be finite and ≥ 0, got -1\.5"),
    ("insert", (np.array([1, 2, 3]), np.array([1.0, 2.0]), np.arange(3)), "shape"),
    ("insert", (np.array([1, 2]), np.array([1.0, 2.0]), np.arange(3)), "order"),
    ("insert", (np.array([1, 20]), np.ones(2), np.arange(2)), "slot 20 out of range"),
    ("insert", (np.array([-1]), np.ones(1), np.arange(1)), "slot -1 out of range"),
    ("insert", (np.array([[1]]), np.ones(1), np.arange(1)), "1-D"),
    ("insert", (np.array([1.0]), np.ones(1), np.arange(1)), "integers"),
    ("update", (np.array([2]), np.array([NAN])), r"priority must be finite and ≥ 0, got nan"),
    ("update", (np.array([2, 3]), np.array([-INF, 1.0])), r"priority must be finite and ≥ 0, got -inf"),
    ("update", (np.array([2, 3]), np.array([1.0])), "shape"),
    ("update", (np.array([2, 10]), np.ones(2)), "slot 10 out of range"),
    ("update", (np.array([2, 7]), np.ones(2)), "slot 7: it is not live"),
    ("remove", (np.array([3, 10]),), "slot 10 out of range"),
    ("sample", (0,), "batch_size"),
]


@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize(("method", "args", "message"), BAD_CALLS)
def test_bad_calls_raise_and_change_nothing(name, method, args, message):
    selector = make_selector(name, 10, seed=0)
    fill(selector, [2, 3, 4], [1.0, 2.0, 3.0])
    before = selector.state_dict()
    with pytest.raises(ValueError, match=message):
        getattr(selector, method)(*args)
    assert_states_equal(selector.state_dict(), before)
    assert len(selector) == 3


@pytest.mark.parametrize("name", ALL_NAMES)
def test_sampling_an_empty_selector_says_it_is_empty(name):
    selector = make_selector(name, 10, seed=0)
    with pytest.raises(ValueError, match="empty"):
        selector.sample(1)
    fill(selector, [4], [1.0])
    selector.remove(np.array([4]))
    before = selector.state_dict()
    with pytest.raises(ValueError, match="empty"):
        selector.sample(8)
    assert_states_equal(selector.state_dict(), before)


def test_c_and_numpy_prioritized_draws_are_identical(monkeypatch):
    import gearflow.replay.selectors as selectors

    if selectors._hotpath is None:
        pytest.skip("the C hot path was not built (no compiler at install time)")
    rng = np.random.default_rng(3)
    prios = rng.exponential(size=5000) * (rng.random(5000) > 0.2)
    draws = {}
    for impl in ("c", "numpy"):
        if impl == "numpy":
            monkeypatch.setattr(selectors, "_hotpath", None)
        sel = make_selector("prioritized", 5000, seed=11, alpha=0.7, beta=0.5)
        sel.insert(np.arange(5000), prios, np.arange(5000))
        draws[impl] = [sel.sample(256) for _ in range(3)]
    for a, b in zip(draws["c"], draws["numpy"], strict=True):
        np.testing.assert_array_equal(a.slots, b.slots)
        np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=1e-12)
        np.testing.assert_allclose(a.weights, b.weights, rtol=1e-6)


def test_incremental_updates_are_resummed_exactly_every_four_times_the_size(tree_impl):
    """Leaf changes carried up by adding drift by rounding; the tree re-sums exactly once
    4 × size of them have accumulated, so parents equal their children's sums again."""
    tree = SumTree(16, 4)
    rng = np.random.default_rng(0)
    for _ in range(70):  # 70 × 4 = 280 leaf changes > 4 × 16
        slots = rng.integers(16, size=4)
        tree.set_priorities(slots, rng.exponential(size=4) * 1e3 ** rng.random(4), alpha=0.7)
    assert tree._incremental < 4 * 16 or not tree.native
    if tree.native:  # the last re-sum was at most 4 × size changes ago; re-sum now and compare
        before = [level.copy() for level in tree.levels]
        tree.rebuild()
        for a, b in zip(before, tree.levels, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12)
    for parent, children in zip(tree.levels[:-1], tree.levels[1:], strict=True):
        sums = children.reshape(-1, 4).sum(axis=1)
        np.testing.assert_allclose(parent[: len(sums)], sums, rtol=1e-12)
