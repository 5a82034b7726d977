"""Shard node health (gearflow/transport/learner/health.py): heartbeats mark a silent node down
once, within one node timeout, whatever the learner's calls wait for; a call to a node marked
down fails at once instead of reconnecting to a silent host; the probe re-admits it."""

from __future__ import annotations

import threading
import time

import pytest

from gearflow.transport.client import ServiceUnavailable
from gearflow.transport.learner.health import NodeHealth
from gearflow.transport.service import Service
from tests.helpers_relay import LoopbackRelay

TOKEN = "health-test-secret-0123"


class BlackHole(LoopbackRelay):
    """A TCP relay to ``port`` that can go silent: while :attr:`silent` is set, every byte either
    way is read and dropped and new connections are accepted into the same silence (a host whose
    link is down: no RST, no reply); cleared, it forwards again (for new connections)."""

    def __init__(self, port: int):
        self.silent = threading.Event()
        super().__init__(port)

    def connected(self) -> bool:
        return self.silent.is_set()  # a connection made in the silence stays silent

    def pump(self, src, dst, direction: str, born_silent: bool) -> None:
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            if born_silent or self.silent.is_set():
                continue  # dropped: nothing gets through, nothing is answered
            try:
                dst.sendall(chunk)
            except OSError:
                return


@pytest.fixture
def node():
    svc = Service(token=TOKEN, name="node")
    svc.register("replay.total", lambda meta, bufs: ({"total": 1.0, "count": 1}, []))
    svc.start()
    hole = BlackHole(svc.port)
    yield svc, hole
    hole.close()
    svc.stop()


def _until(what: str, check, timeout: float = 60.0) -> None:
    """Wait for ``check()`` (progress, not the clock: ``timeout`` only bounds a broken test)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.01)


def test_heartbeats_mark_a_silent_node_down_once_within_one_timeout_and_the_probe_re_admits_it(node):
    _, hole = node
    timeout_s = 2.0
    health = NodeHealth([hole.address], TOKEN, timeout_s=timeout_s, probe_every_s=0.2)
    events: list[tuple[bool, float]] = []
    health.on_change(lambda i, up: events.append((up, time.monotonic())))
    try:
        health.start_heartbeats()
        _until("heartbeat replies", lambda: health.beats[0] >= 2)
        hole.silent.set()
        silent_at = time.monotonic()
        _until("down mark", lambda: events)
        up, at = events[0]
        assert not up and health.is_down(0) and health.downs == [1]
        assert "no heartbeat reply" in health.lost()[hole.address]
        # within one node timeout of the silence (the last reply came at most a heartbeat before it);
        # a loaded machine may add its scheduling delay, never a second timeout
        assert at - silent_at <= timeout_s + 1.0, at - silent_at
        with pytest.raises(ServiceUnavailable, match="is marked down"):
            health.check_up(0)  # a call to it fails now
        beats = health.beats[0]
        hole.silent.clear()
        _until("re-admission", lambda: len(events) > 1)
        assert events[1][0] and health.live() == [0] and health.downs == [1]
        _until("heartbeats again", lambda: health.beats[0] > beats)
        health.check_up(0)
    finally:
        health.close()
    assert health.rtt_max_s[0] > 0


def _filled(make_table, seed: int):
    """A prioritized table of one stream with 30 transitions."""
    import numpy as np

    from gearflow.replay import Writer

    table = make_table(spec={"obs": "float32[3]"}, P=1, S=64, selector="prioritized", selector_kwargs={"alpha": 0.6})
    w = Writer(table.storage, np.arange(1), prefault=False)
    for t in range(30):
        w.append({"obs": np.full((1, 3), seed * 100 + t, np.float32)})
        w.create_items(np.ones(1), np.ones(1, np.int64), streams=np.zeros(1, np.int64))
    w.flush()
    return table


def test_a_node_marked_down_by_an_update_timeout_is_not_asked_in_the_same_round(make_table, shard_of):
    """Node 1 goes silent with a priority update in flight: the next round waits for that reply
    (its totals must be in the split), the wait times out and marks node 1 down, and the round is
    drawn from node 0 alone, at once, not sent to node 1 to reconnect through a silent link for a
    second timeout (before issue 47: the round was split over the node list read before the wait)."""
    import numpy as np

    from gearflow.transport.learner import RemoteSampler
    from tests.conftest import SHARD_TOKEN

    shards = [shard_of(_filled(make_table, k))[0] for k in range(2)]
    hole = BlackHole(shards[1].port)
    timeout_s = 2.0
    health = NodeHealth([f"127.0.0.1:{shards[0].port}", hole.address], SHARD_TOKEN, timeout_s=timeout_s,
                        probe_every_s=60.0)  # heartbeats off: the calls alone notice  # fmt: skip
    sampler = RemoteSampler([f"127.0.0.1:{shards[0].port}", hole.address], token=SHARD_TOKEN, prefetch=0,
                            timeout_s=timeout_s, health=health)  # fmt: skip
    try:
        batch = sampler.sample(16)
        assert set(np.unique(batch.keys.numpy() >> 56).tolist()) == {0, 1}
        hole.silent.set()
        sampler.update_priorities(batch.keys, np.full(16, 2.0))  # returns once sent
        t0 = time.monotonic()
        batch = sampler.sample(16)  # waits for node 1's update reply: one timeout, then node 0 alone
        took = time.monotonic() - t0
        assert health.is_down(1) and "update_priorities" in health.lost()[hole.address]
        assert set(np.unique(batch.keys.numpy() >> 56).tolist()) == {0}
        assert took < 2 * timeout_s, took  # one timeout (and a loaded machine's delay), not two
    finally:
        sampler.close()
        health.close()
        hole.close()
