"""``launcher=ray`` across emulated hosts (launch/hosts.py): ``ray start --head`` on one host,
``ray start --address`` on two workers, the driver on the head; two shard nodes (one per worker,
placed by resources) and two data-parallel learners on two different hosts. Each host resolves
its hostname to nothing useful, so gloo would fall back to loopback: the learners meet on their
own interfaces and end bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers_hosts import env, gearflow_on, hosts_tests

pytest.importorskip("ray", reason="launcher=ray needs Ray (pip install 'gearflow[cluster]')")
pytestmark = hosts_tests

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Ray 2.60's `ray start --head` turns token auth on while `--address` and drivers default to off;
# the emulated cluster runs without it (what Ray does and does not protect: docs/security.md)
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def _ray_start(hosts, *args: str) -> None:
    """``ray start ARGS`` on every host of ``hosts`` at once (the workers join the head together);
    each must exit 0."""
    procs = [h.popen([*RAY, "start", f"--node-ip-address={h.address}", "--disable-usage-stats", *args],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env(), **RAY_ENV})
             for h in hosts]  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:] + out[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_across_a_head_and_two_workers_with_two_learners_on_two_hosts(make_hosts, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the driver too (env() reads os.environ)
    hosts = make_hosts(3, subnet="10.231.4.0/24")
    head = f"{hosts[0].address}:6379"
    _ray_start(hosts[:1], "--head", "--port=6379", "--num-cpus=1", "--include-dashboard=false")
    _ray_start(hosts[1:], f"--address={head}", "--num-cpus=3")
    driver = gearflow_on(hosts[0], "train", tmp_path / "driver.err", "launcher=ray", f"cluster.address={head}",
                         "cluster.shards=2", "cluster.learners=2", "actor.num_actors=1", "run.progress=log",
                         "run.max_env_steps=3000", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    rc, out = driver.finish(timeout=600)
    assert rc == 0, driver.tail()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["cluster/parameters_identical"] is True, driver.tail()
    learners = summary["cluster/learner_nodes"]
    assert len(set(learners)) == 2, learners  # two hosts
    assert all(steps > 0 for steps in summary["cluster/node_env_steps"])
    assert summary["learner/updates"] > 10 and summary["actor/env_steps"] >= 3000
    stops = [h.popen([*RAY, "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     env={**env(), **RAY_ENV}) for h in hosts]  # fmt: skip
    for proc in stops:  # the three hosts' raylets stop together
        proc.wait(timeout=120)
    left = [n for h in hosts for n in h.shm() if n.startswith("gearflow")]
    assert not left, left  # the run's segments are gone from every host
