"""Global pacing (:mod:`gearflow.replay.pacing`): one rate limiter over several shards.

* The rule: the union never passes the configured limiter's insert limit, the room goes first
  to the node furthest behind, and every node keeps a share of it (a stalled node holds no
  one); a restarted node's earlier counters stay in the union's.
* A model of a run — a learner drawing by priority mass (∝ items held), two nodes whose actors
  insert in chunks — with one node started late: under today's rule (each node's own limiter)
  the late node stays starved; under the global pacing it catches up, the union's
  samples-per-insert stays within its error buffer, and a stalled node stalls no one.
* On the wire: a RemoteSampler over two shard services sends each its insert limit (``pace``)
  with every request; a one-shard learner's draws put the shard back on its own limiter.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from gearflow.kinds.transition import Transition
from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, make_selector
from gearflow.replay.pacing import GlobalPacing
from gearflow.replay.rate_limiter import NO_LIMIT, RateLimiterTimeout
from gearflow.replay.storage import H_INSERT_LIMIT, SHM_DIR
from gearflow.transport.learner import RemoteSampler
from gearflow.transport.server.shard import ShardService
from tests.test_global_sampling import fill

LIMITER = RateLimiter(min_size_to_sample=100, samples_per_insert=8.0, error_buffer=1000.0)
CHUNK = 33  # items an actor publishes at once
B = 32


def test_room_goes_to_the_node_behind_first_and_never_past_the_unions_limit():
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(2, 6))
        w = rng.integers(1, 9, n)
        p = GlobalPacing(LIMITER, w)
        inserts = rng.integers(0, 20_000, n)
        samples = int(rng.integers(0, 8 * inserts.sum() + 1))
        for i in range(n):
            p.note(i, inserts=int(inserts[i]), samples=samples // n, deletes=0, size=int(min(inserts[i], 5000)))
        limits = p.insert_limits()
        union = LIMITER.insert_limit(p.total_samples())
        room = union - int(inserts.sum())
        assert (limits >= inserts).all()
        if room <= 0:
            assert (limits == inserts).all()
            continue
        assert limits.sum() <= union  # the union stays within the configured ratio
        assert limits.sum() >= union - n  # and all of the room is handed out (floors aside)
        got = limits - inserts
        assert (got >= np.floor(0.5 * room * w / w.sum())).all()  # each keeps its share by weight
        behind = int(np.argmin(inserts / w))
        assert got[behind] / w[behind] == pytest.approx((got / w).max(), abs=1.0)  # the most behind gets the most


def test_a_restarted_node_keeps_its_earlier_counters_in_the_unions():
    p = GlobalPacing(LIMITER, [4, 4])
    p.note(0, inserts=5000, samples=40_000, deletes=0, size=5000)
    p.note(1, inserts=4000, samples=31_880, deletes=0, size=4000)
    assert (p.total_inserts(), p.total_samples()) == (9000, 71_880)
    p.note(1, inserts=0, samples=0, deletes=0, size=0)  # restarted: a fresh table
    assert p.restarts == 1
    assert (p.total_inserts(), p.total_samples()) == (9000, 71_880)  # the union's ratio does not jump
    p.note(1, inserts=10, samples=0, deletes=0, size=10)
    assert p.total_inserts() == 9010
    limits = p.insert_limits()
    # room 9210 - 9010 = 200: 50 each by weight, 100 more to node 1 (4010 in all, behind node 0's 5000),
    # whose credit is capped at its half of the buffer (2·1000/8/2 = 125): the 25 over it to node 0
    assert (limits - [5000, 10]).tolist() == [75, 125]
    # without a ratio: no limit, and samples wait only for the union's minimum size
    q = GlobalPacing(RateLimiter(min_size_to_sample=100), [1, 1])
    q.note(0, inserts=60, samples=0, deletes=0, size=60)
    q.note(1, inserts=50, samples=0, deletes=0, size=50)
    assert (q.insert_limits() == NO_LIMIT).all()
    assert q.can_sample(B)  # 110 items in the union, though neither node holds 100


def _model(rule: str, start: tuple[int, int], period: tuple[int, int], ticks: int = 4000):
    """A run: each tick the learner draws ``B`` (split by items held, as priority mass) if the
    rate limiter lets it; each started node's actor publishes a chunk every ``period`` ticks if
    its insert limit takes it (a period of 1 is ~8× the learner's pace). ``rule``: "per-node" (each node's own limiter, today's) or
    "global" (GlobalPacing). Returns the nodes' inserts and the union's lowest/highest
    ``inserts·spi - samples`` seen, and the longest wait (ticks) between two of node 0's
    chunks once both nodes act."""
    rng = np.random.default_rng(1)
    ins, smp = np.zeros(2, np.int64), np.zeros(2, np.int64)
    pacing = GlobalPacing(LIMITER, [1, 1])
    diffs, last, gap = [], 0, 0
    for t in range(ticks):
        for i in range(2):
            pacing.note(i, inserts=int(ins[i]), samples=int(smp[i]), deletes=0, size=int(ins[i]))
        if rule == "global":
            go = pacing.can_sample(B)
            limits = pacing.insert_limits()
        else:
            split = rng.multinomial(B, ins / ins.sum()) if ins.sum() else (B, B)
            go = all(LIMITER.can_sample(int(ins[i]), int(ins[i]), int(smp[i]), int(b)) for i, b in enumerate(split) if b)
            limits = np.array([LIMITER.insert_limit(int(s)) for s in smp])
        if go and ins.sum() >= LIMITER.min_size_to_sample:
            smp += rng.multinomial(B, ins / ins.sum())
        for i in range(2):  # an actor publishes a chunk every period[i] ticks, if the limit takes it
            if t >= start[i] and t % period[i] == 0 and ins[i] + CHUNK <= limits[i]:
                ins[i] += CHUNK
                if i == 0:
                    gap = max(gap, t - last) if t > max(start) else gap
                    last = t
        diffs.append(int(ins.sum()) * LIMITER.samples_per_insert - int(smp.sum()))
    return ins, min(diffs[ticks // 10:]), max(diffs), gap


def test_a_late_node_catches_up_under_the_global_pacing_and_stays_starved_under_its_own():
    own, *_ = _model("per-node", (0, 800), (1, 1))
    paced, lo, hi, gap = _model("global", (0, 800), (1, 1))
    assert own[0] > 10 * own[1]  # today's rule: the late node never recovers its share
    assert max(paced) <= 1.1 * min(paced)  # paced: it catches up
    # and the node ahead is not held while it does: its share of each call's room (~1 item)
    # gathers into a chunk (33) — a chunk about every 33 / (4 items a tick / 4) ticks
    assert gap <= 3 * CHUNK
    # the union's samples-per-insert stays within the configured error buffer (a draw's worth)
    assert hi <= LIMITER.max_diff and lo >= LIMITER.min_diff - B


def test_a_slow_node_gets_what_it_can_use_and_a_stalled_one_stalls_no_one():
    ins, lo, hi, _ = _model("global", (0, 0), (1, 20))  # node 1 acts at ~0.4 of the learner's pace
    assert ins[1] >= 0.9 * 4000 / 20 * CHUNK  # never held
    assert ins.sum() * LIMITER.samples_per_insert >= 0.9 * 4000 * B  # node 0 makes up the rest
    assert hi <= LIMITER.max_diff and lo >= LIMITER.min_diff - B
    ins, lo, *_ = _model("global", (0, 10**9), (1, 1))  # node 1 never acts
    assert ins[1] == 0 and ins[0] * LIMITER.samples_per_insert >= 0.9 * 4000 * B  # node 0 goes on at the learner's pace
    assert lo >= LIMITER.min_diff - B


# ----------------------------------------------------------------------------- on the wire
TOKEN = "test-token-pacing"
WIRE = RateLimiter(min_size_to_sample=100, samples_per_insert=2.0, error_buffer=1000.0)


@pytest.fixture
def shards():
    """Two shard services on loopback over tables with ``WIRE``; shard 0 holds 400 items."""
    made, services = [], []
    for i, k in enumerate((400, 0)):
        st = SharedStorage.create(TableSpec.parse({"obs": "float32[2]", "action": "int64"}), 1, 512)
        t = Table(st, Transition(), make_selector("prioritized", st.items_per_partition, seed=i), WIRE,
                  sample_timeout_s=5.0)  # fmt: skip
        made.append(t)
        if k:
            fill(t, np.arange(k), np.ones(k))
        s = ShardService(t, token=TOKEN)
        services.append((t, s.start()))
        made.append(s)
    yield services
    for x in reversed(made):
        with contextlib.suppress(Exception):
            x.stop() if isinstance(x, ShardService) else x.close()
        if isinstance(x, Table):
            (SHM_DIR / x.storage.name).unlink(missing_ok=True)


def test_a_sampler_over_two_shards_paces_both_and_a_one_shard_sampler_unpaces(shards):
    (t0, p0), (t1, p1) = shards
    assert t1.storage.header[H_INSERT_LIMIT] == WIRE.insert_limit(0, 0) == 600  # its own: (100·2 + 1000) / 2
    sampler = RemoteSampler([("127.0.0.1", p0), ("127.0.0.1", p1)], token=TOKEN, timeout_s=10, prefetch=0, seed=0)
    try:
        for _ in range(20):
            sampler.sample(B)
        pacing = sampler._pacing
        assert pacing is not None and pacing.total_samples() == 20 * B == t0.samples
        assert t0.paced and t1.paced
        # the 20th request carried the limits of the counters the 19th left: the union may hold
        # (1200 + 19·32) / 2 = 904 inserts; of the room left after 400, half by weight (126 each),
        # half to the node furthest behind (252 more to shard 1)
        assert WIRE.insert_limit(19 * B) == 904
        assert [int(t.storage.header[H_INSERT_LIMIT]) for t in (t0, t1)] == [400 + 126, 126 + 252]
        # once 400·2 - samples - 32 < min_diff = -800 the union waits for inserts, and says so
        with pytest.raises(RateLimiterTimeout, match="over every shard node: samples_per_insert=2.0"):
            for _ in range(40):
                sampler.sample(B, timeout_s=0.05)
        assert t0.samples == 1600  # the last draw went at 1568 sampled: 800 - 1568 - 32 = -800
    finally:
        sampler.close()
    one = RemoteSampler([("127.0.0.1", p0)], token=TOKEN, timeout_s=10, prefetch=0)
    try:
        with pytest.raises(RateLimiterTimeout, match="samples_per_insert=2.0"):  # its own limiter again, which holds it
            one.sample(B, timeout_s=0.05)
        assert not t0.paced
    finally:
        one.close()
