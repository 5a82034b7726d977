"""Exact global sampling over several shards (issue #15): a RemoteSampler over three shard
services on loopback (real sockets, real shared-memory tables, deliberately imbalanced
priority totals) draws as ONE table holding every item with the same priorities.

* Frequencies: per-item draw counts follow ``m_i / Σm`` (``m = p^α``) by a chi-square bound
  ~6σ above its mean (never flakes: the seeds are fixed and the draws deterministic), and the
  same bound rejects GEAR's naive scheme (each shard supplies B/3 of the batch).
* Probabilities and IS weights of the keys a batch returns are the one table's for the same
  items (its selector's own normalisation, checked against a batch the table itself draws):
  probabilities to 1e-12 relative, float32 weights to the last bit (≤ 1 ulp), with and
  without prefetch, across priority updates (prefetch=1: each round is drawn before the
  update of the batch returned just before it, as a local table sampled one batch ahead).
* Priority updates reach the owning shard (read back by key there) and the next split follows
  the new totals (a shard whose items all went to priority 0 supplies nothing, and comes back).
* A split made before a shard grew reports the probabilities of the draw it made (the
  shard's share times its own draw's probability), and says how far off it was.
* Uniform shards draw uniformly over the union; ranked selectors over several shards are refused.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from gearflow.kinds.transition import Transition
from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, Writer, make_selector
from gearflow.replay.storage import SHM_DIR
from gearflow.replay.layout import SHARD_SHIFT
from gearflow.transport.learner import RemoteSampler
from gearflow.transport.server.shard import ShardService

TOKEN = "test-token-global-sampling"
SPEC = {"obs": "float32[2]", "action": "int64"}
SIZES = (8, 16, 24)  # items per shard
SCALE = (1.0, 40.0, 0.05)  # priority scale per shard: totals ~ 1 : 18 : 0.5 at alpha 0.6
ALPHA, BETA = 0.6, 0.5
LOCAL = (1 << SHARD_SHIFT) - 1


def priorities() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [s * (0.2 + rng.random(k)) for k, s in zip(SIZES, SCALE)]


@pytest.fixture
def tables():
    """``tables(selector, seed, **selector_kwargs) -> Table`` of one 64-step partition; closed at teardown."""
    made = []

    def make(selector: str, seed: int, **kw) -> Table:
        st = SharedStorage.create(TableSpec.parse(SPEC), 1, 64)
        try:
            t = Table(st, Transition(), make_selector(selector, st.items_per_partition, seed=seed, **kw), RateLimiter(1),
                      sample_timeout_s=5.0)  # fmt: skip
        except BaseException:
            st.close()
            st.unlink()
            raise
        made.append(t)
        return t

    yield make
    for t in made:
        name = t.storage.name
        with contextlib.suppress(Exception):
            t.close()
        (SHM_DIR / name).unlink(missing_ok=True)


def fill(table: Table, ids: np.ndarray, prios: np.ndarray) -> None:
    """Item ``j`` of ``table`` is one step whose obs[0] is ``ids[j]``, with priority ``prios[j]``
    (key ``j``: partition 0, sequence ``j``; slot ``j``)."""
    k = ids.size
    w = Writer(table.storage, np.arange(1), prefault=False)
    obs = np.zeros((k, 2), np.float32)
    obs[:, 0] = ids
    w.extend({"obs": obs, "action": np.arange(k)}, stream=0)
    w.create_items(prios, 1, streams=0, ends=np.arange(1, k + 1))


@pytest.fixture
def world(tables):
    """Three shards on loopback, and the one reference table holding all their items."""
    services = []

    def make(selector: str = "prioritized", **kw):
        prios = priorities()
        ids = np.split(np.arange(sum(SIZES)), np.cumsum(SIZES)[:-1])  # global item ids, shard by shard
        shards = []
        for i, (p, g) in enumerate(zip(prios, ids)):
            t = tables(selector, seed=10 + i, **kw)
            fill(t, g, p)
            s = ShardService(t, token=TOKEN)
            services.append(s)
            shards.append((t, s.start()))
        one = tables(selector, seed=99, **kw)
        fill(one, np.arange(sum(SIZES)), np.concatenate(prios))
        one.scan()
        return shards, one, np.concatenate(prios)

    make.services = services  # the shards' ShardServices, in order
    yield make
    for s in services:
        s.stop()


def sampler_of(shards, **kw) -> RemoteSampler:
    return RemoteSampler([("127.0.0.1", port) for _, port in shards], token=TOKEN, timeout_s=10, **kw)


def item_ids(batch) -> np.ndarray:
    return batch.data["obs"][:, 0].numpy().astype(np.int64)


def one_table_view(one: Table, ids: np.ndarray):
    """The one table's probabilities and IS weights for items ``ids`` drawn in one batch (its
    selector's normalisation: P = m / total, w = (N P)^-β / max over the batch, float32)."""
    masses = one.selector.tree.leaves[ids]  # item j is in slot j
    return one.selector.reweigh(masses)


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    e = p * counts.sum()
    return float(((counts - e) ** 2 / e).sum())


def test_frequencies_are_the_one_tables_and_an_even_split_is_rejected(world):
    shards, one, prios = world("prioritized", alpha=ALPHA, beta=BETA)
    m = prios**ALPHA
    expect = m / m.sum()
    totals = [float((p**ALPHA).sum()) for p in np.split(prios, np.cumsum(SIZES)[:-1])]
    assert max(totals) / min(totals) > 10  # deliberately imbalanced
    dof = expect.size - 1
    bound = dof + 6 * np.sqrt(2 * dof)  # ~6σ above the chi-square mean
    B, rounds = 60, 250

    sampler = sampler_of(shards, prefetch=1, seed=1)
    counts = np.zeros(expect.size)
    for _ in range(rounds):
        np.add.at(counts, item_ids(sampler.sample(B)), 1)
    assert counts.sum() == B * rounds
    assert chi2(counts, expect) < bound, chi2(counts, expect)

    # the reference itself: the one table's own draws pass the same bound
    ref = np.zeros(expect.size)
    for _ in range(rounds):
        np.add.at(ref, item_ids(one.sample(B)), 1)
    assert chi2(ref, expect) < bound

    # GEAR's naive scheme: each shard supplies B/3 of every batch (its own proportional draw)
    naive = [sampler_of([s], prefetch=0, seed=2) for s in shards]
    biased = np.zeros(expect.size)
    for _ in range(rounds):
        for s in naive:
            np.add.at(biased, item_ids(s.sample(B // 3)), 1)
    assert biased.sum() == B * rounds
    assert chi2(biased, expect) > 10 * bound, chi2(biased, expect)  # rejected, by far
    for s in (sampler, *naive):
        s.close()


@pytest.mark.parametrize("prefetch", [0, 1])
def test_probabilities_and_weights_are_the_one_tables_across_updates(world, prefetch):
    shards, one, _ = world("prioritized", alpha=ALPHA, beta=0.4)
    # the rule checked below is the one table's own: a batch it draws carries reweigh's values
    own = one.sample(32)
    p_own, w_own = one_table_view(one, item_ids(own))
    np.testing.assert_array_equal(own.probabilities.numpy(), p_own)
    np.testing.assert_array_equal(own.weights.numpy(), w_own)

    sampler = sampler_of(shards, prefetch=prefetch, seed=3)
    sampler.selector.beta = one.selector.beta = BETA
    rng = np.random.default_rng(5)
    pending = []  # the updates the one table has not applied yet: (ids, priorities)
    B = 48
    for step in range(30):
        while len(pending) > prefetch:  # the draw of this batch saw every update but the last `prefetch`
            ids_u, p_u = pending.pop(0)
            one.update_priorities(torch.from_numpy(ids_u), torch.from_numpy(p_u))  # key j is item j
        batch = sampler.sample(B)
        ids = item_ids(batch)
        want_p, want_w = one_table_view(one, ids)
        np.testing.assert_allclose(batch.probabilities.numpy(), want_p, rtol=1e-12, atol=0, err_msg=f"step {step}")
        assert batch.weights.dtype == torch.float32
        np.testing.assert_array_max_ulp(batch.weights.numpy(), want_w, maxulp=1)
        assert sampler.split_drift < 1e-12  # the split was by the totals at the draws
        # a learner's update: new priorities for the batch's keys, through the sampler
        new = rng.random(B) * 3 + 0.05
        keys = batch.keys.clone()
        assert sampler.update_priorities(keys, torch.from_numpy(new)) == B
        pending.append((ids, new))
    sampler.close()


def test_updates_reach_the_owning_shard_and_steer_the_next_split(world):
    shards, _, _ = world("prioritized", alpha=1.0, beta=BETA)
    sampler = sampler_of(shards, prefetch=1, seed=4)
    batch = sampler.sample(64)
    keys = batch.keys.numpy()
    shard_of = keys >> SHARD_SHIFT
    assert {0, 1} <= set(shard_of.tolist())  # shard 2 holds ~2% of the mass
    new = np.arange(1, 65, dtype=np.float64) / 8
    assert sampler.update_priorities(batch.keys, torch.from_numpy(new), wait=True) == 64  # applied
    for i, (t, _) in enumerate(shards):  # read back by key on the owning shard (key j: slot j)
        mine = shard_of == i
        local = keys[mine] & LOCAL
        last = {int(k): p for k, p in zip(local, new[mine])}  # a repeated key keeps its last priority
        np.testing.assert_array_equal(t.selector.tree.leaves[list(last)], list(last.values()))
    # every item of shard 2 to priority 0: once the prefetched round is out, shard 2 supplies nothing
    k2 = np.arange(SIZES[2], dtype=np.int64) | (2 << SHARD_SHIFT)
    sampler.update_priorities(k2, np.zeros(SIZES[2]), wait=True)
    assert shards[2][0].selector.tree.total == 0.0
    sampler.sample(64)  # drawn before the update (prefetch=1), as a local table one batch ahead
    for _ in range(10):
        b = sampler.sample(64)
        assert not ((b.keys.numpy() >> SHARD_SHIFT) == 2).any()
        assert sampler.split_drift == 0.0
    # shard 1 to a tiny total: its share of the draws follows (binomial bound)
    k1 = np.arange(SIZES[1], dtype=np.int64) | (1 << SHARD_SHIFT)
    sampler.update_priorities(k1, np.full(SIZES[1], 1e-3))
    sampler.sample(64)
    t0, t1 = shards[0][0].selector.tree.total, shards[1][0].selector.tree.total
    share = t1 / (t0 + t1)
    n1 = sum(int(((sampler.sample(64).keys.numpy() >> SHARD_SHIFT) == 1).sum()) for _ in range(20))
    assert abs(n1 - share * 1280) < 6 * np.sqrt(1280 * share * (1 - share)) + 1, (n1, share)
    # shard 2 back: it is drawn again (its total kept coming with every round (replay.total))
    sampler.update_priorities(k2, np.full(SIZES[2], 100.0))
    sampler.sample(64)
    assert ((sampler.sample(64).keys.numpy() >> SHARD_SHIFT) == 2).mean() > 0.8
    sampler.close()


def test_an_update_returns_before_its_reply_and_the_next_round_is_split_after_it(world):
    """Ape-X's learner does not wait for its priority writes: ``update_priorities`` returns while
    shard 1 cannot apply it nor answer (its table lock held here; the old sampler waited for every
    reply: RequestTimeout). The next round is split only once the reply is in: by the totals the
    update left, the one table's probabilities to 1e-12."""
    shards, one, _ = world("prioritized", alpha=ALPHA, beta=BETA)
    sampler = sampler_of(shards, prefetch=0, seed=6)
    sampler.selector.beta = one.selector.beta = BETA
    batch = sampler.sample(48)
    assert ((batch.keys.numpy() >> SHARD_SHIFT) == 1).any()  # shard 1 holds ~90% of the mass
    new = np.linspace(0.1, 5.0, 48)
    with world.services[1].lock:  # every handler of shard 1's table takes this lock
        assert sampler.update_priorities(batch.keys.clone(), torch.from_numpy(new)) == 48  # sent
    one.update_priorities(torch.from_numpy(item_ids(batch)), torch.from_numpy(new))  # key j is item j
    for _ in range(3):
        b = sampler.sample(48)
        want_p, _ = one_table_view(one, item_ids(b))
        np.testing.assert_allclose(b.probabilities.numpy(), want_p, rtol=1e-12, atol=0)
        assert sampler.split_drift < 1e-12
    assert sampler.update_priorities(b.keys, torch.ones(48), wait=True) == 48  # applied, read now
    sampler.close()


def test_a_split_made_before_a_shard_grew_reports_the_draws_own_probabilities(world):
    shards, _, _ = world("prioritized", alpha=1.0, beta=BETA)
    sampler = sampler_of(shards, prefetch=0, seed=6)
    sampler.sample(16)
    before = np.array([t.selector.tree.total for t, _ in shards])
    q = before / before.sum()  # the split the next round will use
    # a writer adds items to shard 0 that the sampler has not heard of
    t0 = shards[0][0]
    w = Writer(t0.storage, np.arange(1), prefault=False)
    w.extend({"obs": np.full((4, 2), 1000, np.float32), "action": np.arange(4)}, stream=0)
    w.create_items(np.full(4, 50.0), 1, streams=0, ends=np.arange(SIZES[0] + 1, SIZES[0] + 5))
    batch = sampler.sample(256)
    after = np.array([t.selector.tree.total for t, _ in shards])
    assert after[0] > before[0]
    keys = batch.keys.numpy()
    shard, local = keys >> SHARD_SHIFT, keys & LOCAL
    masses = np.array([shards[i][0].selector.tree.leaves[k] for i, k in zip(shard, local)])
    # P = (the split's share) x (the shard's own draw probability m / T_i at the draw)
    np.testing.assert_allclose(batch.probabilities.numpy(), q[shard] * masses / after[shard], rtol=1e-12)
    assert (item_ids(batch) == 1000).any()  # the new items were drawn, at the shard's share
    assert sampler.split_drift == pytest.approx(float(np.abs(q - after / after.sum()).max()), rel=1e-9)
    assert sampler.split_drift > 0.05
    assert sampler.stats()["replay/split_drift"] == sampler.split_drift
    sampler.sample(16)  # quiescent again: the next split is by the totals at the draws
    assert sampler.split_drift == 0.0
    sampler.close()


def test_uniform_shards_draw_uniformly_over_the_union(world):
    shards, one, _ = world("uniform")
    n = sum(SIZES)
    sampler = sampler_of(shards, prefetch=1, seed=8)
    assert sampler.selector.name == "uniform" and not sampler.selector.importance_sampled
    counts = np.zeros(n)
    for _ in range(200):
        b = sampler.sample(60)
        np.testing.assert_allclose(b.probabilities.numpy(), 1.0 / n, rtol=1e-12)  # the one table's 1/N
        np.testing.assert_array_equal(b.weights.numpy(), one.sample(60).weights.numpy())  # ones
        np.add.at(counts, item_ids(b), 1)
    dof = n - 1
    assert chi2(counts, np.full(n, 1.0 / n)) < dof + 6 * np.sqrt(2 * dof)
    sampler.close()


@pytest.mark.parametrize("selector", ["fifo", "top_k", "max_heap"])
def test_ranked_selectors_over_several_shards_are_refused(world, selector):
    shards, _, _ = world(selector)
    with pytest.raises(ValueError, match=f"'{selector}' selector ranks the items of one table: there is no global order"):
        sampler_of(shards)
    one = sampler_of(shards[:1], prefetch=0)  # one shard: its own ranking, passed through
    assert len(one.sample(4).keys) == 4
    one.close()


def test_shards_with_different_selectors_are_refused(tables):
    ports, services = [], []
    try:
        for kw in ({"alpha": 0.6}, {"alpha": 0.7}):
            t = tables("prioritized", seed=0, **kw)
            fill(t, np.arange(4), np.ones(4))
            services.append(ShardService(t, token=TOKEN))
            ports.append(services[-1].start())
        with pytest.raises(ValueError, match=r"shard 1 .* selects with prioritized \(alpha 0.7\), shard 0 with "
                                             r"prioritized \(alpha 0.6\)"):  # fmt: skip
            RemoteSampler([("127.0.0.1", p) for p in ports], token=TOKEN, timeout_s=10)
    finally:
        for s in services:
            s.stop()


def test_a_shard_empty_at_the_start_joins_the_split_once_it_has_items(tables):
    """A shard with no items when the sampler starts gets no draw, but still reports its total
    every round (replay.total), so the first items it publishes enter the split; a batch drawn
    wholly from one of several shards still carries the global probabilities."""
    services = []
    try:
        ts = [tables("prioritized", seed=20 + i, alpha=1.0, beta=BETA) for i in range(2)]
        fill(ts[0], np.arange(8), np.arange(1, 9, dtype=np.float64))
        for t in ts:
            services.append(ShardService(t, token=TOKEN))
        sampler = RemoteSampler([("127.0.0.1", s.start()) for s in services], token=TOKEN, timeout_s=10, prefetch=1, seed=9)
        for _ in range(3):
            b = sampler.sample(32)
            assert not (b.keys.numpy() >> SHARD_SHIFT).any()  # shard 1 is empty: never asked to draw
            np.testing.assert_allclose(b.probabilities.numpy(), (item_ids(b) + 1) / 36.0, rtol=1e-12)
        fill(ts[1], np.arange(100, 104), np.full(4, 1e-7))  # a tiny mass: most batches wholly from shard 0
        for _ in range(3):  # rounds split before a reply reported it: requested ahead, or by an older reply
            sampler.sample(32)
        assert sampler.split_drift == 0.0  # the split has caught up
        seen, whole = set(), 0
        for _ in range(40):
            b = sampler.sample(32)
            ids = item_ids(b)
            shard = b.keys.numpy() >> SHARD_SHIFT
            seen |= set(shard.tolist())
            whole += int(not shard.any())
            m = np.where(ids >= 100, 1e-7, ids + 1.0)
            np.testing.assert_allclose(b.probabilities.numpy(), m / (36.0 + 4e-7), rtol=1e-12)  # never m / T_0
        assert seen == {0} and whole == 40  # 4e-7 of the mass: no draw in 1280, and the split knew it
        sampler.update_priorities(np.arange(4, dtype=np.int64) | (1 << SHARD_SHIFT), np.full(4, 9.0))
        sampler.sample(32)  # the prefetched round (before the update)
        assert (sampler.sample(32).keys.numpy() >> SHARD_SHIFT).any()
        sampler.close()
    finally:
        for s in services:
            s.stop()


def test_one_shard_weighs_its_draws_with_the_learners_beta(world):
    """Over one shard the batch is the shard's own draw: its IS weights follow the ``beta`` the
    learner set on ``sampler.selector`` (sent with every request, so with no round requested
    ahead the next batch has it), not the shard's own."""
    shards, _, _ = world("prioritized", alpha=ALPHA, beta=0.4)
    sampler = sampler_of(shards[:1], prefetch=0)
    try:
        for beta in (0.0, 1.0, 0.5):
            sampler.selector.beta = beta
            batch = sampler.sample(64)
            p = batch.probabilities.numpy().astype(np.float64)
            assert np.ptp(p) > 0  # unequal priorities: beta shows in the weights
            want = (p.min() / p) ** beta  # (N P)^-beta over its max in the batch
            np.testing.assert_allclose(batch.weights.numpy(), want, rtol=1e-5)
    finally:
        sampler.close()
