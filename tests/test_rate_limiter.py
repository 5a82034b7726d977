"""gearflow.replay.rate_limiter against Reverb's RateLimiter arithmetic.

Reference (reverb/cc/rate_limiter.cc; ``size = inserts - deletes``)::

    CanInsert(n): if inserts - deletes + n <= min_size: true
                  else (inserts + n) * spi - samples <= max_diff
    CanSample(n): if size < min_size: false
                  else inserts * spi - samples - n >= min_diff

``SampleToInsertRatio(spi, min_size, error_buffer)``: ``min_diff = min_size * spi - e``,
``max_diff = min_size * spi + e``; ``MinSize(m)``: no bound on the difference.
"""

from __future__ import annotations

import itertools
import math

import pytest

from gearflow.replay.rate_limiter import NO_LIMIT, RateLimiter, RateLimiterTimeout


class ReverbRef:
    def __init__(self, min_size, spi, e):
        self.m = min_size
        self.spi = spi
        if spi == 0:  # MinSize
            self.spi, self.min_diff, self.max_diff = 1.0, -math.inf, math.inf
        else:
            self.min_diff = min_size * spi - e
            self.max_diff = min_size * spi + e

    def can_insert(self, inserts, samples, n, deletes=0):
        if inserts - deletes + n <= self.m:
            return True
        return (inserts + n) * self.spi - samples <= self.max_diff

    def can_sample(self, size, inserts, samples, n):
        if size < self.m:
            return False
        return inserts * self.spi - samples - n >= self.min_diff


PARAMS = [
    (1, 0.0, 0.0),  # MinSize(1)
    (7, 0.0, 0.0),  # MinSize(7)
    (1, 1.0, 1.0),
    (3, 1.0, 4.0),
    (5, 2.0, 2.0),
    (4, 8.0, 10.0),
    (2, 0.5, 1.0),
    (3, 2.5, 3.0),
    (6, 0.25, 1.5),
    # ratios that are not binary fractions: Reverb's product decides at the float boundaries
    (1, 0.01, 1.0),
    (2, 0.1, 1.0),
    (3, 0.3, 1.0),
    (1, 0.7, 1.3),
    (4, 1 / 3, 1.0),
]


@pytest.mark.parametrize("m, spi, e", PARAMS)
def test_matches_reverb(m, spi, e):
    lim = RateLimiter(min_size_to_sample=m, samples_per_insert=spi, error_buffer=e)
    ref = ReverbRef(m, spi, e)
    if spi:
        assert lim.min_diff == m * spi - e and lim.max_diff == m * spi + e
    for inserts, samples, n in itertools.product(range(30), range(0, 60, 3), (1, 2, 5)):
        assert lim.can_insert(inserts, samples, n) == ref.can_insert(inserts, samples, n), (
            inserts,
            samples,
            n,
        )
        size = inserts
        assert lim.can_sample(size, inserts, samples, n) == ref.can_sample(size, inserts, samples, n), (
            inserts, samples, n,
        )  # fmt: skip
    for samples in range(60):
        limit = lim.insert_limit(samples)
        if spi == 0:
            assert limit == NO_LIMIT
            continue
        # the largest total that may have been inserted: CanInsert(limit - inserts) holds, one more does not
        assert ref.can_insert(0, samples, limit) and not ref.can_insert(0, samples, limit + 1), (
            samples
        )
    # stage 1: deletes (evictions) take the size below min_size, and inserts go on
    for inserts, samples, n, deletes in itertools.product(range(0, 40, 3), range(0, 60, 7), (1, 2, 5), range(0, 40, 4)):
        if deletes > inserts:
            continue
        assert lim.can_insert(inserts, samples, n, deletes) == ref.can_insert(inserts, samples, n, deletes), (
            inserts, samples, n, deletes,
        )  # fmt: skip


def test_insert_limit_is_reverbs_product_at_float_boundaries():
    """Reverb's CanInsert computes ``(inserts + n) * spi - samples <= max_diff``; a division
    (``floor((max_diff + samples) / spi)``) allowed 301 at 2 samples and 400 at 3."""
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=0.01, error_buffer=1.0)
    assert [lim.insert_limit(s) for s in (2, 3)] == [300, 401]
    assert lim.can_insert(299, 2, 1) and not lim.can_insert(300, 2, 1)
    assert lim.can_insert(400, 3, 1) and not lim.can_insert(401, 3, 1)


def test_insert_limit_examples():
    lim = RateLimiter(min_size_to_sample=1000, samples_per_insert=8, error_buffer=800)
    assert lim.insert_limit(0) == 1100
    assert (
        lim.insert_limit(8) == 1101
        and lim.insert_limit(15) == 1101
        and lim.insert_limit(16) == 1102
    )
    assert lim.can_sample(size=1000, inserts=1000, samples=0, n=256)
    assert not lim.can_sample(size=999, inserts=1000, samples=0, n=1)
    assert lim.can_insert(inserts=1099, samples=0, n=1) and not lim.can_insert(
        inserts=1100, samples=0, n=1
    )
    # spi = 1/3 (non-representable ratio): floor must not lose an insert to rounding
    lim = RateLimiter(min_size_to_sample=3, samples_per_insert=1 / 3, error_buffer=1.0)
    ref = ReverbRef(3, 1 / 3, 1.0)
    for samples in range(30):
        limit = lim.insert_limit(samples)
        assert ref.can_insert(0, samples, limit) and not ref.can_insert(0, samples, limit + 1), (
            samples
        )


def test_min_size_only_never_limits_inserts():
    lim = RateLimiter(min_size_to_sample=10)
    assert lim.insert_limit(0) == NO_LIMIT == 2**63 - 1
    assert lim.can_insert(10**12, 0, 10**6)
    assert not lim.can_sample(9, 10**6, 0, 1) and lim.can_sample(10, 10, 10**9, 10**6)


def test_validation():
    with pytest.raises(ValueError, match="min_size_to_sample must be ≥ 1, got 0"):
        RateLimiter(min_size_to_sample=0)
    with pytest.raises(ValueError, match="samples_per_insert must be ≥ 0, got -1"):
        RateLimiter(samples_per_insert=-1)
    with pytest.raises(ValueError, match="samples_per_insert must be ≥ 0, got nan"):
        RateLimiter(samples_per_insert=float("nan"))
    for spi, e in [(4.0, 3.9), (0.5, 0.5), (1.0, 0.0), (8.0, 0.0)]:
        with pytest.raises(ValueError) as info:
            RateLimiter(samples_per_insert=spi, error_buffer=e)
        assert f"error_buffer ({e}) must be ≥ max(1, samples_per_insert={spi})" in str(info.value)
    RateLimiter(samples_per_insert=4.0, error_buffer=4.0)
    RateLimiter(samples_per_insert=0.5, error_buffer=1.0)


def test_why_blocked_messages():
    lim = RateLimiter(min_size_to_sample=5, samples_per_insert=2.0, error_buffer=2.0)
    assert lim.why_blocked(3, 3, 0, 1) == "the table holds 3 items, min_size_to_sample=5"
    msg = lim.why_blocked(5, 5, 4, 8)
    assert (
        "samples_per_insert=2.0: 4 items sampled after 5 inserted" in msg
        and "error buffer 2.0" in msg
    )


def test_timeout_is_a_timeout_error():
    assert issubclass(RateLimiterTimeout, TimeoutError)
