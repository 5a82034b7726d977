"""``launcher=ray`` across emulated hosts (launch/hosts.py): ``ray start --head`` on one host,
``ray start --address`` on two workers, the driver on the head; two shard nodes (one per worker,
placed by resources) and two data-parallel learners on two different hosts. Each host resolves
its hostname to nothing useful, so gloo would fall back to loopback: the learners meet on their
own interfaces and end bit-identical."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers_hosts import env, gearflow_on, hosts_tests

pytest.importorskip("ray", reason="launcher=ray needs Ray (pip install 'gearflow[cluster]')")
pytestmark = hosts_tests

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Ray 2.60's `ray start --head` turns token auth on while `--address` and drivers default to off;
# the emulated cluster runs without it (what Ray does and does not protect: docs/security.md)
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def _ray_start(host, *args: str) -> None:
    proc = host.run([*RAY, "start", f"--node-ip-address={host.address}", "--disable-usage-stats", *args],
                    capture_output=True, text=True, env={**env(), **RAY_ENV}, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_across_a_head_and_two_workers_with_two_learners_on_two_hosts(make_hosts, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the driver too (env() reads os.environ)
    hosts = make_hosts(3, subnet="10.231.4.0/24")
    head = f"{hosts[0].address}:6379"
    _ray_start(hosts[0], "--head", "--port=6379", "--num-cpus=1", "--include-dashboard=false")
    for h in hosts[1:]:
        _ray_start(h, f"--address={head}", "--num-cpus=3")
    driver = gearflow_on(hosts[0], "train", tmp_path / "driver.err", "launcher=ray", f"cluster.address={head}",
                         "cluster.shards=2", "cluster.learners=2", "actor.num_actors=1", "run.progress=log",
                         "run.max_env_steps=4000", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    rc, out = driver.finish(timeout=600)
    assert rc == 0, driver.tail()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["cluster/parameters_identical"] is True, driver.tail()
    learners = summary["cluster/learner_nodes"]
    assert len(set(learners)) == 2, learners  # two hosts
    assert all(steps > 0 for steps in summary["cluster/node_env_steps"])
    assert summary["learner/updates"] > 10 and summary["actor/env_steps"] >= 4000
    for h in hosts:
        h.run([*RAY, "stop", "--force"], env={**env(), **RAY_ENV}, timeout=120)
    left = [n for h in hosts for n in h.shm() if n.startswith("gearflow")]
    assert not left, left  # the run's segments are gone from every host
