"""A sharded run across emulated hosts (launch/hosts.py): network + mount + UTS namespaces on a
bridge, each with a private /dev/shm. The harness itself (private, reachable, closed, torn down),
two ``gearflow serve`` nodes and a learner on three hosts, and a node killed and restarted on its
port. Marked ``hosts``: needs root and ``ip netns`` (skipped elsewhere)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from launch.hosts import HOST_DIR
from tests.helpers_hosts import gearflow_on, hosts_tests, serve_on

pytestmark = hosts_tests

PORT = 7000  # every host has its own network stack: the same port on each
_PROBE = """
import socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        print(target, "open")
    except OSError as exc:
        print(target, type(exc).__name__, exc.errno)
"""


def _probe(host, *targets: str) -> dict[str, str]:
    out = host.run([sys.executable, "-c", _PROBE, *targets], check=True, timeout=60).stdout
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines()}


def _alive(pid: int) -> bool:
    """Running (not gone, nor a zombie waiting for whoever adopted it to reap it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


def test_hosts_are_private_reach_each_other_and_nothing_else(make_hosts):
    hosts = make_hosts(2, subnet="10.231.1.0/24")
    a, b = hosts
    assert a.run(["hostname"]).stdout.strip() == a.name
    # a private, empty /dev/shm: what one host writes there no other host (nor this machine) sees
    assert a.shm() == [] and b.shm() == []
    a.run(["sh", "-c", f"echo x > /dev/shm/{a.name}-only"], check=True)
    assert a.shm() == [f"{a.name}-only"] and b.shm() == []
    assert not Path(f"/dev/shm/{a.name}-only").exists()
    assert b.run(["ls", "-A", "/tmp/ray"]).stdout == ""
    # HOST_DIR: the same path, each host's own folder (a local disk): a's file is in a.dir only
    a.run(["sh", "-c", f"echo a > {HOST_DIR}/mine"], check=True)
    assert (a.dir / "mine").read_text() == "a\n" and not (b.dir / "mine").exists()
    assert b.run(["ls", "-A", HOST_DIR]).stdout == "" and not Path(HOST_DIR, "mine").exists()
    # b listens; a reaches it; nothing outside the subnet answers (no route), not even this machine
    serve = "import socket, time; s = socket.create_server(('0.0.0.0', 7001)); print('up', flush=True); s.accept()"
    listener = b.popen([sys.executable, "-c", serve + "; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert listener.stdout.readline().strip() == "up"
    outside = socket.create_server(("127.0.0.1", 0))  # this machine's loopback: not the hosts'
    here = f"127.0.0.1:{outside.getsockname()[1]}"
    probes = _probe(a, f"{b.address}:7001", "10.231.250.1:80", "8.8.8.8:53", here)
    outside.close()
    assert probes[f"{b.address}:7001"] == "open"
    assert probes["10.231.250.1:80"] == probes["8.8.8.8:53"] == "OSError 101"  # ENETUNREACH
    assert probes[here] == "ConnectionRefusedError 111"
    assert a.run(["ip", "route"]).stdout.split()[0] == str(hosts.net)  # one route: the subnet's
    a.run(["sh", "-c", "setsid sleep 300 > /dev/null 2>&1 &"], check=True)  # an orphan: not a Popen of ours
    pids = a.pids() + b.pids()
    assert len(pids) >= 4  # the holders, the listener, the orphan
    hosts.down()
    assert not [pid for pid in pids if _alive(pid)]
    assert listener.poll() is not None
    netns = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    assert a.name not in netns and b.name not in netns


def test_shaped_link_and_relay_latency(make_hosts):
    """tbf shapes the rate; the relay adds its delay to the round trip (both measured)."""
    from launch.hosts import rtt

    hosts = make_hosts(2, subnet="10.231.1.0/24", rate_mbit=100)
    qdisc = hosts[0].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in qdisc and "100Mbit" in qdisc
    plain = rtt(hosts, 0, 1, rounds=50)
    delayed = rtt(hosts, 0, 1, delay_ms=4.0, rounds=50)
    assert plain["rtt_ms_median"] < 2.0
    assert delayed["rtt_ms_min"] >= 4.0 > plain["rtt_ms_min"]


def _nodes(hosts, tmp_path: Path, count: int = 2) -> list:
    return [serve_on(hosts[i], tmp_path / f"n{i}", PORT, f"actor.ladder_offset={i}", f"actor.ladder_total={count}")
            for i in range(count)]  # fmt: skip


def _learner(host, tmp_path: Path, addresses: list[str], *args: str):
    return gearflow_on(host, "train", tmp_path / "learner.err", f"run.dir={tmp_path / 'learner'}", "run.progress=log",
                       f"transport.shards=[{','.join(addresses)}]", *args)  # fmt: skip


def _end(procs, timeout: float = 120.0, rc: int = 0) -> list[dict]:
    """Each command's last stdout line (its JSON summary), once it exited with ``rc``."""
    ends = []
    for p in procs:
        code, out = p.finish(timeout)
        assert code == rc, f"exited {code}:\n{p.tail()}"
        ends.append(json.loads(out.strip().splitlines()[-1]))
    return ends


def test_two_serve_nodes_and_a_learner_on_three_hosts(make_hosts, tmp_path):
    """Each node on its own host (its own /dev/shm, the same port), the learner on a third: the
    run reaches its step limit from both nodes' steps, the learner's run.stop (from its host's
    address) ends both nodes with rc 0, and each host's /dev/shm is empty after."""
    hosts = make_hosts(3, subnet="10.231.1.0/24")
    nodes = _nodes(hosts, tmp_path)
    try:
        addresses = [n.address() for n in nodes]
        assert addresses == [f"{hosts[0].address}:{PORT}", f"{hosts[1].address}:{PORT}"]
        assert hosts[0].shm() and hosts[1].shm() and hosts[2].shm() == []  # each node's segments: its own host's
        learner = _learner(hosts[2], tmp_path, addresses, "run.max_env_steps=3000")
        (summary,) = _end([learner], timeout=240)
        outs = _end(nodes)
    finally:
        for p in nodes:
            p.kill()
    assert summary["stop_reason"] == "reached run.max_env_steps=3000"
    assert summary["replay/shards"] == 2.0 and summary["learner/updates"] > 0
    assert all(o["actor/env_steps"] > 0 for o in outs)
    assert summary["actor/env_steps"] <= sum(o["actor/env_steps"] for o in outs)
    assert all(o["stop_reason"].startswith(f"run.stop from {hosts[2].address}:") for o in outs)
    assert [o["weights_version"] for o in outs] == [summary["learner/weights_version"]] * 2
    assert [h.shm() for h in hosts] == [[], [], []]


def test_a_node_killed_and_restarted_on_its_port_is_ridden_out(make_hosts, tmp_path):
    """Node 0's process is killed mid-run (SIGKILL: its segments stay in its host's /dev/shm) and
    a fresh node is started on the same host and port: the learner trains on node 1 meanwhile
    (node 0 marked down), re-admits node 0, reads it as restarted (a fresh table), pushes it
    weights and samples it. Stopped then by SIGTERM, the learner ends with its
    summary (143) and leaves both nodes serving (for --resume); SIGTERM ends them (143) clean."""
    hosts = make_hosts(3, subnet="10.231.1.0/24")
    nodes = _nodes(hosts, tmp_path)
    try:
        addresses = [n.address() for n in nodes]
        learner = _learner(hosts[2], tmp_path, addresses, "run.max_env_steps=100000000")  # stopped below
        learner.wait_for(r"progress: steps ([2-9]\d{3}|[1-9]\d{4,}) ")  # ≥ 2000 steps: both nodes feed it
        killed = set(hosts[0].shm())
        nodes[0].kill()
        nodes[0] = serve_on(hosts[0], tmp_path / "n0-again", PORT, "actor.ladder_offset=0", "actor.ladder_total=2")
        assert nodes[0].address() == addresses[0]
        learner.wait_for(rf"shard node {addresses[0]} was restarted")
        # the new node acts with weights the learner pushed it (its own start is version 1)
        nodes[0].wait_for(r": [1-9]\d* env steps, .* weights version ([2-9]|\d{2,})$")
        learner.popen.terminate()
        (summary,) = _end([learner], timeout=240, rc=143)
        assert all(n.popen.poll() is None for n in nodes)  # a signal: the nodes wait for a --resume
        for n in nodes:
            n.popen.terminate()
        outs = _end(nodes, rc=143)
    finally:
        for p in nodes:
            p.kill()
    assert summary["stop_reason"] == "stopped by signal"
    assert summary["actor/env_steps"] > 2000 and summary["learner/updates"] > 0
    # re-admitted after the learner trained on node 1 alone: back in the split, not lost
    assert summary["replay/shards"] == 2.0 and "transport/nodes_lost" not in summary
    assert all(o["actor/env_steps"] > 0 and o["stop_signal"] == "SIGTERM" for o in outs)
    assert hosts[1].shm() == [] and set(hosts[0].shm()) <= killed  # only the killed node's segments are left
