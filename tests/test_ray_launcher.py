"""``launcher=ray`` on a local Ray instance (``ray.init`` on this machine): two shard nodes with an
actor group each, learners sampling both, an actor group killed mid-run and restarted by Ray."""

from __future__ import annotations

import threading
import time

import pytest

from gearflow.config import load_config
from tests.test_train import CONFIG, TINY

ray = pytest.importorskip("ray", reason="launcher=ray needs Ray (pip install 'gearflow[cluster]')")

def _cfg(tmp_path, *overrides: str):
    return load_config(CONFIG, [*TINY, "launcher=ray", "cluster.shards=2", "actor.num_actors=1",
                                "run.progress=log", f"run.dir={tmp_path / 'run'}", *overrides])  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # 12,000 env steps of 2 shards, 2 groups and 2 learners (20,000: 252-476 s at load 10-13)
def test_two_shards_two_learners_survive_a_killed_actor_group_and_shard(tmp_path, monkeypatch):
    """cartpole_apex with two shard nodes, two actor groups and two data-parallel learners: an
    actor group and then a shard killed mid-run are restarted by Ray (the shard on its port,
    with a fresh table its group moves to) and the run reaches its limit; both
    learners end with bit-identical parameters (they are identical after every step:
    tests/test_distributed.py)."""
    from gearflow.runner import train

    token = "ray-test-secret-0123"
    monkeypatch.setenv("GEARFLOW_TOKEN", token)
    killed = threading.Event()

    def kill_group_0_then_shard_1(handles):
        """Kill by progress (the nodes' env steps, read as a learner does), not by the clock: the
        group after 2,000 steps, the shard after 4,000; the run needs 12,000 (8,000 after the shard's
        kill: room for its restart, its group's move to the fresh table and that table's refill)."""
        from gearflow.transport.client import Client

        def env_steps(clients) -> int:
            total = 0
            for c in clients:
                try:
                    total += int(c.call("run.progress", {"cursor": 1 << 40}, timeout_s=5)[0]["env_steps"])
                except Exception:  # noqa: BLE001 - a node between instances
                    pass
            return total

        def wait_for(clients, steps: int) -> None:
            deadline = time.monotonic() + 600  # guards a lost run only: the kills wait on env steps
            while env_steps(clients) < steps and time.monotonic() < deadline:
                time.sleep(0.2)

        def later():
            infos = ray.get([s.info.remote() for s in handles["shards"]])
            clients = [Client(i["address"], token, timeout_s=10) for i in infos]
            try:
                wait_for(clients, 2000)
                ray.kill(handles["groups"][0], no_restart=False)  # Ray restarts it (cluster.max_restarts)
                wait_for(clients, 4000)
                ray.kill(handles["shards"][1], no_restart=False)  # same node, same port, a fresh table
                killed.set()
            finally:
                for c in clients:
                    c.close()

        threading.Thread(target=later, daemon=True).start()

    summary = train(_cfg(tmp_path, "run.max_env_steps=12000", "cluster.learners=2"),
                    on_started=kill_group_0_then_shard_1)  # fmt: skip
    assert killed.is_set()
    # rank 0 stops at its own limit, or in the same iteration as rank 1 when rank 1 saw it first
    assert summary["stop_reason"] in ("reached run.max_env_steps=12000", "stopped with the other learners")
    assert summary["actor/env_steps"] >= 12000
    assert summary["cluster/shards"] == 2 and summary["replay/shards"] == 2.0
    assert summary["cluster/group_restarts"] == 1 and summary["cluster/shard_restarts"] == 1
    # both nodes acted to the end: node 1's restarted table was refilled by its group's actors
    assert all(steps > 0 for steps in summary["cluster/node_env_steps"])
    assert summary["learner/updates"] > 100
    assert summary["cluster/learners"] == 2 and summary["learner/world_size"] == 2.0
    assert summary["cluster/parameters_identical"] is True
    assert (tmp_path / "run" / "learner-1" / "metrics.jsonl").exists()  # rank 1's own metrics
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*"))  # rank 0 checkpoints
    assert not (tmp_path / "run" / "learner-1" / "checkpoints").exists() or not list(
        (tmp_path / "run" / "learner-1" / "checkpoints").glob("ckpt-*"))
    assert not ray.is_initialized()  # the launcher started Ray, and shut it down


def test_the_run_summary_counts_the_learners_highest_env_steps():
    """Rank 0 stopped by rank 1's limit counted fewer steps (a killed shard took the steps since its
    last poll): the run's summary gives rank 1's count, and the rest from rank 0 and the nodes."""
    from gearflow.roles.ray_plan import run_summary

    ranks = [{"actor/env_steps": 19977, "learner/updates": 4271, "learner/parameters_fingerprint": "a",
              "stop_reason": "stopped with the other learners"},
             {"actor/env_steps": 20004, "learner/updates": 4271, "learner/parameters_fingerprint": "a",
              "stop_reason": "reached run.max_env_steps=20000"}]  # fmt: skip
    nodes = [{"actor/env_steps": 12000}, {"actor/env_steps": 2000}]
    s = run_summary(ranks, nodes, {"group-0": 1, "shard-1": 1, "shard-0": 0}, 2, 2)
    assert s["actor/env_steps"] == 20004 and s["stop_reason"] == "stopped with the other learners"
    assert s["cluster/group_restarts"] == 1 and s["cluster/shard_restarts"] == 1
    assert s["cluster/node_env_steps"] == [12000, 2000] and s["cluster/parameters_identical"] is True
    ranks[1]["learner/parameters_fingerprint"] = "b"
    assert run_summary(ranks, nodes, {}, 2, 2)["cluster/parameters_identical"] is False
    assert ranks[0]["actor/env_steps"] == 19977  # the learners' own summaries are left as they were


def test_missing_ray_is_one_line(monkeypatch):
    import builtins

    from gearflow.errors import MissingDependencyError
    from gearflow.roles.ray import require_ray

    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(MissingDependencyError, match=r"launcher=ray needs Ray: pip install 'gearflow\[cluster\]'"):
        require_ray()


@pytest.mark.parametrize("device,asked,cluster,want", [
    ("auto", 0.0, 0.0, 0.0),      # no GPU anywhere: CPU learners
    ("auto", 0.0, 4.0, 1.0),      # GPU nodes: one GPU per learner
    ("auto", 0.0, 1.0, 0.0),      # fewer GPUs than learners: CPU (auto)
    ("cpu", 0.0, 4.0, 0.0),       # asked for CPU
    ("auto", 0.5, 0.0, 0.5),      # cluster.learner_gpus wins
])
def test_learners_go_to_gpus_where_there_are_any(tmp_path, device, asked, cluster, want):
    from gearflow.roles.ray_plan import learner_gpus

    cfg = _cfg(tmp_path, f"learner.device={device}", f"cluster.learner_gpus={asked}", "cluster.learners=2")
    assert learner_gpus(cfg, cluster) == want


def test_cuda_learners_without_gpus_are_refused(tmp_path):
    from gearflow.errors import GearflowError
    from gearflow.roles.ray_plan import learner_gpus

    cfg = _cfg(tmp_path, "learner.device=cuda", "cluster.learners=2")
    with pytest.raises(GearflowError, match=r"learner.device=cuda but the Ray cluster has 1 GPU\(s\) for 2 learner"):
        learner_gpus(cfg, 1.0)


# ---------------------------------------------------------------------- a multi-node cluster


@pytest.fixture(scope="module")
def three_nodes():
    """A real three-node Ray cluster on this machine (a raylet per node): a 1-CPU head, a 1-CPU
    worker and a 3-CPU worker — the head first in no particular NodeID order."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        big = cluster.add_node(num_cpus=3)
        cluster.wait_for_nodes()
        yield cluster, big.node_id
    finally:
        cluster.shutdown()


def _gearflow(*args: str, timeout: float = 300, prefix: tuple = ()):
    import subprocess
    import sys

    from tests.test_train import ROOT

    cmd = [*prefix, sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, "launcher=ray", "run.progress=log", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(300)
def test_a_cluster_too_small_for_the_run_is_one_line(three_nodes, tmp_path):
    """Two shard nodes of 1 + 1 actor CPUs each: only the 3-CPU worker holds one. The driver says
    so in one line before starting any role (it was a raw ActorUnschedulableError traceback)."""
    cluster, _ = three_nodes
    proc = _gearflow(f"cluster.address={cluster.address}", "cluster.shards=2", "actor.num_actors=1",
                     f"run.dir={tmp_path / 'run'}")  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the Ray cluster cannot hold the run: no node left for shard node 1 of 2" in proc.stderr, proc.stderr[-3000:]
    assert "a shard node needs 2 CPU on one node" in proc.stderr


def test_placement_puts_a_shard_where_its_group_fits(three_nodes):
    """On the live cluster's own ``ray.nodes()``: a shard with 2 actors (3 CPUs) goes to the 3-CPU
    worker, never the 1-CPU head; two learners then fit in what is left, the worker's CPU first."""
    from gearflow.roles.ray_plan import place_roles

    cluster, big = three_nodes
    ray.init(address=cluster.address)
    try:
        nodes = ray.nodes()
    finally:
        ray.shutdown()
    head = next(n["NodeID"] for n in nodes if "node:__internal_head__" in n["Resources"])
    small = next(n["NodeID"] for n in nodes if n["NodeID"] not in (head, big))
    assert place_roles(nodes, 1, {"CPU": 3.0}, 2, {"CPU": 1.0}) == ([big], [small, head])
    from gearflow.errors import GearflowError

    with pytest.raises(GearflowError, match="no node left for learner rank 2 of 3"):
        place_roles(nodes, 1, {"CPU": 3.0}, 3, {"CPU": 1.0})


def test_an_empty_address_starts_ray_of_its_own_beside_a_running_cluster(three_nodes, tmp_path):
    """``cluster.address`` empty means a Ray instance of the run's own on this machine, even while
    another runs here (the fixture's cluster wrote /tmp/ray/ray_current_cluster, as `ray start`
    does): a bare ``ray.init(num_cpus=...)`` joined that one and failed with Ray's "num_cpus and
    num_gpus must not be provided" (seen when the suite's two workers ran it beside this fixture)."""
    from gearflow.roles.ray import init_kwargs

    cfg = _cfg(tmp_path)
    kwargs = init_kwargs(cfg)
    ray.init(**kwargs)
    try:
        assert len(ray.nodes()) == 1 and ray.cluster_resources()["CPU"] == kwargs["num_cpus"]
    finally:
        ray.shutdown()
    cluster, _ = three_nodes
    assert init_kwargs(_cfg(tmp_path, f"cluster.address={cluster.address}"))["address"] == cluster.address


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_learners_files_reach_the_drivers_run_dir(three_nodes, tmp_path):
    """The driver runs in a mount namespace with its own tmpfs over its run's parent folder, as if
    on another host: the learner (on a Ray worker) cannot see the driver's run.dir. Its metrics,
    train.log and checkpoints still reach it (on the old code they stayed on the worker's disk).
    The shard and its 2 actors (3 CPUs) are placed on the 3-CPU worker."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private mount for the driver needs root and unshare")
    cluster, _ = three_nodes
    driver = tmp_path / "driver"
    driver.mkdir()
    run = driver / "run"
    script = ('mount -t tmpfs tmpfs "$0" && "$@"; rc=$?; echo "FILES:"; '
              'cd "$0/run" && find . -type f | sort; exit $rc')  # fmt: skip
    proc = _gearflow(f"cluster.address={cluster.address}", "cluster.shards=1", "actor.num_actors=2",
                     "run.max_env_steps=1500", f"run.dir={run}", timeout=540,
                     prefix=("unshare", "-m", "--propagation", "private", "sh", "-c", script, str(driver)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = proc.stdout.split("FILES:", 1)[1].split()
    assert "./metrics.jsonl" in seen and "./train.log" in seen, seen
    assert any(f.startswith("./checkpoints/ckpt-") for f in seen), seen
    assert not list(run.glob("*")) or not (run / ".gearflow-driver").exists()  # outside the namespace: the worker's view
