"""Rate limiting with Reverb's semantics (``MinSize``, ``SampleToInsertRatio``).

Let ``diff = inserts * samples_per_insert - samples``. With an error buffer
``e`` and ``min_size_to_sample = m``::

    min_diff = m * spi - e        max_diff = m * spi + e
    an insert of k items may go  iff  size + k <= m                    (stage 1)
                                 or   (inserts + k) * spi - samples <= max_diff
    a sample of b items may go   iff  size >= m  and  diff - b >= min_diff

Stage 1 is Reverb's too (``UnblocksInsertsIfDeletedItemsBringsSizeBelowMinSize``): when
eviction takes the table below ``m`` while the writers are held at their limit, inserts
go on until samples can, instead of both waiting for each other. The sums are Reverb's
own expressions in float64 (``(inserts + k) * spi``, not a division), so the limit
matches Reverb's at every float boundary.

``samples_per_insert = 0`` keeps only the minimum size (Reverb's ``MinSize``).
The limiter itself is pure arithmetic; the table applies it to samples and
publishes ``insert_limit(samples)`` in shared memory, where writer processes
read it before they publish items (no lock, no round trip).

    limiter = RateLimiter(min_size_to_sample=1000, samples_per_insert=8, error_buffer=800)
    limiter.can_sample(size=1000, inserts=1000, samples=0, n=256)   # True
    limiter.insert_limit(samples=0)                                  # 1100 items may be inserted
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gearflow.errors import GearflowError

NO_LIMIT = 2**63 - 1  # no limit on inserts (also the value published in the segment header)
MAX_BACKOFF_S = 0.001  # a blocked sampler/writer re-checks at least every millisecond


class RateLimiterTimeout(GearflowError, TimeoutError):
    """An insert or a sample stayed blocked by the rate limiter for longer than its timeout."""


@dataclass(frozen=True)
class RateLimiter:
    min_size_to_sample: int = 1
    samples_per_insert: float = 0.0
    error_buffer: float = 0.0

    def __post_init__(self) -> None:
        if self.min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample must be ≥ 1, got {self.min_size_to_sample}")
        if self.samples_per_insert < 0 or not math.isfinite(self.samples_per_insert):
            raise ValueError(f"samples_per_insert must be ≥ 0, got {self.samples_per_insert}")
        if self.samples_per_insert > 0 and self.error_buffer < max(1.0, self.samples_per_insert):
            raise ValueError(
                f"error_buffer ({self.error_buffer}) must be ≥ max(1, samples_per_insert="
                f"{self.samples_per_insert}), or inserts and samples can block each other forever"
            )

    @property
    def min_diff(self) -> float:
        return self.min_size_to_sample * self.samples_per_insert - self.error_buffer

    @property
    def max_diff(self) -> float:
        return self.min_size_to_sample * self.samples_per_insert + self.error_buffer

    def can_sample(self, size: int, inserts: int, samples: int, n: int) -> bool:
        if size < self.min_size_to_sample:
            return False
        if self.samples_per_insert == 0:
            return True
        return inserts * self.samples_per_insert - samples - n >= self.min_diff

    def can_insert(self, inserts: int, samples: int, n: int, deletes: int = 0) -> bool:
        """Reverb's ``CanInsert``: ``inserts - deletes + n <= min_size_to_sample`` (stage 1),
        else ``(inserts + n) * spi - samples <= max_diff``."""
        return inserts + n <= self.insert_limit(samples, deletes)

    def insert_limit(self, samples: int, deletes: int = 0) -> int:
        """Total items that may have been inserted once ``samples`` items were sampled and
        ``deletes`` removed (evicted): the largest ``k`` with ``k * spi - samples <= max_diff``
        (Reverb's product, evaluated in float64), or ``deletes + min_size_to_sample`` when
        that is larger (stage 1: the table is below its minimum size)."""
        if self.samples_per_insert == 0:
            return NO_LIMIT
        spi, top = self.samples_per_insert, self.max_diff
        k = int(math.floor((top + samples) / spi))  # within one of the answer; the product decides
        while k * spi - samples > top:
            k -= 1
        while (k + 1) * spi - samples <= top:
            k += 1
        return max(k, deletes + self.min_size_to_sample)

    def why_blocked(self, size: int, inserts: int, samples: int, n: int) -> str:
        if size < self.min_size_to_sample:
            return f"the table holds {size} items, min_size_to_sample={self.min_size_to_sample}"
        return (
            f"samples_per_insert={self.samples_per_insert}: {samples} items sampled after "
            f"{inserts} inserted; sampling {n} more would exceed the error buffer "
            f"{self.error_buffer} (are the actors running?)"
        )
