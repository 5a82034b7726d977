"""No starved node across real hosts (issue 34 point 1, on emulated hosts: launch/hosts.py): two
``gearflow serve`` nodes on hosts 0 and 1 and a learner on host 2 over ``transport.shards``; every
process of node 1 is killed (its host's ``/dev/shm`` keeps the dead table's segments: the host's
own) and the node is started again on its port with a fresh table. The learner's global pacing
(:mod:`gearflow.replay.pacing`) lets it catch up. ``tests/test_node_pacing.py`` is the same run
on loopback. Marked ``hosts``: needs root and ``ip netns`` (skipped elsewhere)."""

from __future__ import annotations

import json
import os
import re
import signal

from tests.helpers_hosts import gearflow_on, hosts_tests, serve_on
from tests.test_node_pacing import MAX_STEPS, PACED, assert_caught_up

pytestmark = hosts_tests

PORT = 7000
COMMON = [*PACED, "run.log_every_s=0.5"]
STEPS = re.compile(r"shard \S+: (\d+) env steps")


def _latest_steps(node) -> int:
    """The node's env steps in its newest log line that counts them (0 before the first)."""
    found = STEPS.findall(node.log.read_text()) if node.log.exists() else []
    return int(found[-1]) if found else 0


def _kill_node(host, node) -> None:
    """Every process of the node dies at once (SIGKILL: no goodbye); the host stays up."""
    for pid in [p for p in host.pids() if p != host.holder]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.popen.wait(timeout=60)


def test_a_restarted_node_on_its_own_host_catches_up_and_no_actor_dies(make_hosts, tmp_path):
    """By the end neither node made less than half of the other's env steps over the run (node
    0's less its steps while node 1 was down: the learner sampled it alone), node 1 at least half
    of node 0's since the restart; no actor
    died of the rate limiter or paused on it; the learner reaches its step limit, rc 0."""
    hosts = make_hosts(3, subnet="10.231.4.0/24")
    nodes = [serve_on(hosts[i], tmp_path / f"n{i}", PORT, f"actor.ladder_offset={i}", *COMMON) for i in range(2)]
    learner = None
    try:
        addresses = [n.address() for n in nodes]
        learner = gearflow_on(hosts[2], "train", tmp_path / "learner.err", f"run.dir={tmp_path / 'learner'}", *COMMON,
                              "run.progress=log", f"run.max_env_steps={MAX_STEPS}",
                              f"transport.shards=[{','.join(addresses)}]")  # fmt: skip
        before = int(nodes[1].wait_for(r"shard \S+: ([2-9]\d{3}|\d{5,}) env steps").group(1))
        at_kill = _latest_steps(nodes[0])
        _kill_node(hosts[1], nodes[1])
        nodes[1] = serve_on(hosts[1], tmp_path / "n1b", PORT, "actor.ladder_offset=1", *COMMON)
        assert nodes[1].address() == addresses[1]
        at_restart = _latest_steps(nodes[0])
        rc, out = learner.finish(300)
        assert rc == 0, learner.tail()
        summary = json.loads(out.strip().splitlines()[-1])
        ends = []
        for i, n in enumerate(nodes):
            rc_i, out_i = n.finish(90)
            assert rc_i == 0, f"node {i}: rc {rc_i}\n{n.tail()}"
            ends.append(json.loads(out_i.strip().splitlines()[-1]))
    finally:
        for p in [learner, *nodes]:
            if p is not None:
                p.kill()
    assert_caught_up(tmp_path, summary, ends, before=before, at_kill=at_kill, at_restart=at_restart)
