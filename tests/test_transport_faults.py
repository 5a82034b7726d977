"""Faults over the TCP transport: a shard service that stops mid-run and comes back, a remote
writer process killed mid-run.

* Stop the service while a remote writer streams (and while a create_items waits on the
  rate limiter): the writer raises a named error within its timeout, never hangs; when the
  service is back on the same port it reconnects, re-opens its session on its partitions
  and its steps land in the table again. A sampler does the same.
* A remote writer process killed with SIGKILL: the shard frees its partitions, the learner
  keeps sampling, a new writer takes the partitions over and continues after the dead
  writer's last step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from gearflow.replay import RateLimiter
from gearflow.replay.storage import COMMIT, HEARTBEAT_NS, PUBLISHED
from gearflow.transport.client import RequestTimeout, ServiceUnavailable
from gearflow.transport.actor import RemoteWriter
from gearflow.transport.learner import RemoteSampler
from gearflow.transport.server.shard import ShardService

TOKEN = "faults-test-token-99"
APEX = {"obs": "float32[3]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}


def rows(k, v=0):
    return {"obs": np.full((k, 3), v, np.float32), "action": np.full(k, v, np.int64), "ret": np.zeros(k, np.float32),
            "disc": np.zeros(k, np.float32), "version": np.zeros(k, np.int64)}  # fmt: skip


def write_step(w, i):
    w.append(rows(w.num_streams, i))
    w.create_items(np.ones(w.num_streams), 1)


def test_stopped_service_raises_a_named_error_then_reconnects(make_table):
    table = make_table(spec=APEX, P=2, S=256)
    shard = ShardService(table, token=TOKEN)
    port = shard.start()
    w = RemoteWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=2.0, max_in_flight=2)
    try:
        for i in range(50):
            write_step(w, i)
        w.flush()
        assert table.storage.counters[:2, PUBLISHED].sum() == 100
        shard.stop()
        t0 = time.monotonic()
        with pytest.raises((ServiceUnavailable, RequestTimeout)):
            for i in range(10_000):  # the loss surfaces at a later call, within the timeout
                write_step(w, i)
                if i % 10 == 0:
                    w.flush()
        assert time.monotonic() - t0 < 2.0 + 2.0 + 1.0  # a connect timeout + a reply timeout, and slack
        # while it is down, every call fails fast with a named error
        with pytest.raises(ServiceUnavailable):
            write_step(w, 0)
        assert shard.start() == port  # back on the same port
        before = table.storage.counters[:2, COMMIT].copy()
        for i in range(20):  # reconnects (with backoff) and re-opens its session on the same partitions
            write_step(w, 1000 + i)
        w.flush()
        assert w.partitions.tolist() == [0, 1]
        after = table.storage.counters[:2, COMMIT]
        np.testing.assert_array_equal(after - before, [20, 20])
        np.testing.assert_array_equal(w.positions, after)
        # the rows written after the reconnect are there
        S = table.storage.steps_per_partition
        last = table.storage.columns["action"][(after[0] - 1) % S]
        assert last == 1019
    finally:
        w.close()
        shard.stop()


def test_insert_held_by_the_rate_limiter_fails_when_the_service_stops(make_table):
    lim = RateLimiter(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=2.0)
    table = make_table(spec=APEX, P=1, S=64, limiter=lim)
    shard = ShardService(table, token=TOKEN)
    port = shard.start()
    w = RemoteWriter(("127.0.0.1", port), num_streams=1, token=TOKEN, timeout_s=2.0, insert_timeout_s=60.0,
                     max_in_flight=1, max_delay_s=0.0)  # every create_items is sent at once  # fmt: skip
    try:
        for i in range(3):
            write_step(w, i)
        write_step(w, 3)  # sent: held by the shard's rate limiter (limit 3 items)
        time.sleep(0.2)
        shard.stop()  # the held insert is abandoned on the shard, the connection closes
        t0 = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            w.flush()
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert table.storage.counters[0, PUBLISHED] == 3
    finally:
        w.close()
        shard.stop()


def test_sampler_raises_then_recovers(make_table):
    table = make_table(spec=APEX, P=1, S=64)
    shard = ShardService(table, token=TOKEN)
    port = shard.start()
    w = RemoteWriter(("127.0.0.1", port), num_streams=1, token=TOKEN, timeout_s=2.0)
    for i in range(10):
        write_step(w, i)
    w.close()
    s = RemoteSampler(("127.0.0.1", port), token=TOKEN, timeout_s=2.0, prefetch=1)
    try:
        assert len(s.sample(4).keys) == 4
        shard.stop()
        t0 = time.monotonic()
        with pytest.raises((ServiceUnavailable, RequestTimeout)):
            s.sample(4)
            s.sample(4)
        assert time.monotonic() - t0 < 2.0 * 2 + 1.0
        shard.start()
        assert len(s.sample(4).keys) == 4
    finally:
        s.close()
        shard.stop()


def _writer_process(port: int, ready) -> None:
    w = RemoteWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=10.0)
    i = 0
    while True:
        write_step(w, i)
        i += 1
        if i == 50:
            w.flush()
            ready.set()


def test_killed_remote_writer_process_leaves_the_learner_training(make_table):
    table = make_table(spec=APEX, P=2, S=128)
    shard = ShardService(table, token=TOKEN)
    port = shard.start()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_writer_process, args=(port, ready), daemon=True)
    proc.start()
    s = RemoteSampler(("127.0.0.1", port), token=TOKEN, timeout_s=10.0)
    try:
        assert ready.wait(60), "the writer process did not start writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        for _ in range(20):  # the learner keeps sampling
            assert len(s.sample(8).keys) == 8
        # the shard freed the dead writer's partitions: a new writer gets them and continues after
        # the dead one's last committed step
        deadline = time.monotonic() + 10
        while True:
            try:
                w = RemoteWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=5.0, partitions=[0, 1])
                break
            except Exception:  # PartitionOwned until the shard has seen the connection drop
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        c = table.storage.counters[:2, COMMIT].copy()
        np.testing.assert_array_equal(w.positions, c)
        write_step(w, 7)
        w.flush()
        np.testing.assert_array_equal(table.storage.counters[:2, COMMIT], c + 1)
        assert len(s.sample(8).keys) == 8
        w.close()
    finally:
        if proc.is_alive():
            proc.kill()
        s.close()
        shard.stop()


def test_shipping_writer_raises_a_named_error_and_a_new_one_continues(make_table):
    from gearflow.kinds.transition import TransitionAdder
    from gearflow.transport.actor import ShippingWriter

    table = make_table(spec=APEX, P=2, S=256)
    shard = ShardService(table, token=TOKEN)
    port = shard.start()
    w = ShippingWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=2.0, partitions=[0, 1])
    rng = np.random.default_rng(0)

    def recv(t):
        ids = np.arange(2)
        return (ids, rng.standard_normal((2, 3)).astype(np.float32), np.ones(2, np.float32), np.zeros(2, bool),
                np.zeros(2, bool), np.zeros(2, bool), np.zeros(2, np.int64), rng.standard_normal((2, 2)).astype(np.float32), t)  # fmt: skip

    try:
        adder = TransitionAdder(w, 3, 0.9)
        for t in range(60):
            adder.add(*recv(t))
        w.flush()
        shipped = table.storage.counters[:2, COMMIT].copy()
        np.testing.assert_array_equal(shipped, w.positions)
        assert (table.storage.counters[:2, HEARTBEAT_NS] > 0).all()  # flush stamps the shard's heartbeat
        assert table.storage.counters[:2, PUBLISHED].sum() == adder.items > 0
        shard.stop()
        t0 = time.monotonic()
        with pytest.raises((ServiceUnavailable, RequestTimeout)):
            for t in range(60, 10_000):
                adder.add(*recv(t))
                if t % 20 == 0:
                    w.flush()
        assert time.monotonic() - t0 < 2.0 + 2.0 + 1.0
        w.close()  # a gone shard: close drops what it could not ship
        shard.start()
        w2 = ShippingWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=5.0, partitions=[0, 1])
        np.testing.assert_array_equal(w2.positions, table.storage.counters[:2, COMMIT])
        adder2 = TransitionAdder(w2, 3, 0.9)
        for t in range(30):
            adder2.add(*recv(t))
        w2.flush()
        assert (table.storage.counters[:2, COMMIT] > shipped).all()
        np.testing.assert_array_equal(table.storage.counters[:2, COMMIT], w2.positions)
        w2.close()
    finally:
        shard.stop()
