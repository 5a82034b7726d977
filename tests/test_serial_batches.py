"""run.serial=true's loop (gearflow.learner.SerialBatches) against the rate limiter: with one
batch allowing fewer inserts than one actor step writes, stepping first deadlocked (the insert
blocks and the one thread is the only sampler); the loop samples whatever the limiter allows first."""

from __future__ import annotations

import pytest

from gearflow.learner import Progress, SerialBatches
from gearflow.replay.rate_limiter import RateLimiter


class Blocked(Exception):
    """An insert the limiter refuses: in a real run the writer waits, forever in serial mode."""


class LimitedTable:
    """The table's counters and rate limiter, nothing stored."""

    def __init__(self, limiter: RateLimiter):
        self.limiter, self.inserts, self.samples = limiter, 0, 0

    def scan(self):
        pass

    def insert(self, k: int):
        if not self.limiter.can_insert(self.inserts, self.samples, k):
            raise Blocked(f"insert of {k}: {self.inserts} inserted, {self.samples} sampled")
        self.inserts += k

    def can_sample(self, n: int) -> bool:
        return self.limiter.can_sample(self.inserts, self.inserts, self.samples, n)

    def sample(self, n: int):
        assert self.can_sample(n)
        self.samples += n
        return n


class Actor:
    def __init__(self, table: LimitedTable, items_per_step: int):
        self.table, self.k = table, items_per_step

    def step(self):
        self.table.insert(self.k)


@pytest.mark.parametrize("batch_size, items_per_step", [(64, 8), (64, 24), (256, 8), (16, 24)])
def test_serial_loop_never_blocks_an_insert_and_keeps_the_ratio(batch_size, items_per_step):
    # pendulum_dpg's limiter: 1000 items before sampling, 16 samples per insert, error buffer 4000;
    # (64, 24): a batch allows 4 inserts, one recv of 16 envs writes 24 (the reproduction below)
    table = LimitedTable(RateLimiter(min_size_to_sample=1000, samples_per_insert=16, error_buffer=4000))
    loop = SerialBatches(Actor(table, items_per_step), table, batch_size, Progress())
    batches = sum(loop.next_batch() is not None for _ in range(20_000))
    assert batches > 0
    # the limiter's ratio: samples follow inserts × 16 within the error buffer
    assert abs(table.inserts * 16 - table.samples - 1000 * 16) <= 4000 + batch_size + items_per_step * 16


def test_unpaced_serial_loop_steps_the_actor_every_call():
    # replay.samples_per_insert=0: sampling never frees inserts, so sampling first (as the paced
    # loop does) would learn forever on the first min_size_to_sample items; the actor must step
    # every call, a batch following once the table holds enough
    table = LimitedTable(RateLimiter(min_size_to_sample=16))
    loop = SerialBatches(Actor(table, 8), table, 8, Progress(), paced=False)
    batches = sum(loop.next_batch() is not None for _ in range(100))
    assert table.inserts == 100 * 8
    assert batches == 99  # every call from the second on (16 items after two steps)
