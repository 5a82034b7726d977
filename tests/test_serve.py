"""Shard nodes (``gearflow serve``) and a learner sampling them (``transport.shards``): the real
commands on loopback, and the node's control messages (params.push, run.progress, run.stop)
against a real node in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow.config import load_config
from gearflow.transport.client import Client
from tests.test_train import CONFIG, ROOT, TINY

TOKEN = "serve-test-secret-0123"


def _env() -> dict:
    return {**os.environ, "GEARFLOW_TOKEN": TOKEN, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _serve(tmp_path: Path, name: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    address = tmp_path / f"{name}.address"
    proc = subprocess.Popen([sys.executable, "-m", "gearflow", "serve", CONFIG, *TINY, "actor.num_actors=1",
                             f"run.dir={tmp_path / name}", *overrides, "--address-file", str(address)],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / f"{name}.err", "w"), text=True, cwd=ROOT,
                            env=_env())  # fmt: skip
    return proc, address


def _address(proc: subprocess.Popen, path: Path, log: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"gearflow serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return path.read_text()


@pytest.mark.slow
def test_learner_trains_from_two_shard_nodes(tmp_path):
    """Two nodes with one actor each (their slices of one ε ladder), a learner sampling both:
    the run reaches its step limit from both nodes' steps, both nodes' actors act with the
    learner's pushed weights, and the learner's end of the run stops both nodes (exit 0)."""
    nodes = [_serve(tmp_path, f"n{i}", f"actor.ladder_offset={i}", "actor.ladder_total=2") for i in range(2)]
    try:
        addresses = [_address(p, a, tmp_path / f"n{i}.err") for i, (p, a) in enumerate(nodes)]
        learner = subprocess.run([sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, "run.max_env_steps=6000",
                                  f"run.dir={tmp_path / 'learner'}", "run.progress=log",
                                  f"transport.shards=[{','.join(addresses)}]"],
                                 capture_output=True, text=True, timeout=240, cwd=ROOT, env=_env())  # fmt: skip
        assert learner.returncode == 0, learner.stderr[-3000:]
        summary = json.loads(learner.stdout.strip().splitlines()[-1])
        outs = []
        for p, _ in nodes:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p, _ in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert summary["actor/env_steps"] >= 6000
    assert summary["replay/shards"] == 2.0
    assert summary["learner/updates"] > 0
    # the learner's env steps are the nodes' (read at its last poll, before the nodes' last steps)
    assert summary["actor/env_steps"] <= sum(o["actor/env_steps"] for o in outs)
    assert all(o["actor/env_steps"] > 0 and o["actor/episodes"] > 0 for o in outs)
    # both nodes hold the learner's last pushed weights, and the actors acted with pushed ones
    assert [o["weights_version"] for o in outs] == [summary["learner/weights_version"]] * 2
    assert summary["actor/weights_version_min"] > 1
    assert all(o["stop_reason"].startswith("run.stop from 127.0.0.1") for o in outs)
    # episodes of the run's greediest actor (index 1: node 1's) reached the learner
    assert np.isfinite(summary["actor/return_last100_greediest"])
    assert "checkpoints hold the learner only" in learner.stderr
    assert list((tmp_path / "learner" / "checkpoints").glob("ckpt-*"))


def test_unreachable_shard_is_one_line(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={tmp_path / 'run'}",
                           f"transport.shards=[127.0.0.1:{port}]", "replay.timeout_s=1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("gearflow train: error: transport.shards: cannot reach the shard node 127.0.0.1:")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A real shard node in this process, its service listening, its actors not started."""
    from gearflow.topology.shard_node import ShardNode

    monkeypatch.setenv("GEARFLOW_TOKEN", TOKEN)
    cfg = load_config(CONFIG, [*TINY, "actor.num_actors=1", "actor.ladder_offset=3", "actor.ladder_total=4",
                               f"run.dir={tmp_path / 'node'}"])  # fmt: skip
    n = ShardNode(cfg)
    n.shard.start()
    client = Client(("127.0.0.1", n.shard.port), TOKEN, timeout_s=10)
    yield n, client
    client.close()
    n.close()


def test_params_push_checks_and_publishes(node):
    n, client = node
    _, state = n.params.read()
    names = list(state)
    bufs = [(state[k] + 1).numpy() for k in names]
    meta, _ = client.call("params.push", {"version": 5, "names": names}, bufs)
    assert meta == {"version": 5, "applied": True}
    version, now = n.params.read()
    assert version == 5 and all(torch.equal(now[k], state[k] + 1) for k in names)
    meta, _ = client.call("params.push", {"version": 4, "names": names}, bufs)  # stale: not applied
    assert meta == {"version": 5, "applied": False}
    with pytest.raises(ValueError, match="must name exactly the"):
        client.call("params.push", {"version": 6, "names": names[:-1]}, bufs[:-1])
    wrong = [b if i else np.zeros((3, 3), b.dtype) for i, b in enumerate(bufs)]
    with pytest.raises(ValueError, match=f"params.push: '{names[0]}' is torch.float32\\[3, 3\\], the node's network holds"):
        client.call("params.push", {"version": 6, "names": names}, wrong)
    with pytest.raises(ValueError, match="version must be an int ≥ 1"):
        client.call("params.push", {"version": "7", "names": names}, bufs)
    assert n.params.latest_version() == 5  # nothing refused was stored


def test_progress_numbers_reports_in_the_runs_actor_indices(node):
    n, client = node
    n.relay.add_episode(0, 12.5)
    n.relay.actor_counters[0] = {"type": "counters", "actor": 0, "actor/env_steps": 40, "blob": [1, 2]}
    meta, _ = client.call("run.progress", {"cursor": 0})
    assert meta["cursor"] == 2 and meta["lost"] == 0 and meta["ladder_offset"] == 3 and meta["actors"] == 1
    ep, counters = meta["messages"]
    assert ep == {"type": "episode", "actor": 3, "actor/episode_return": 12.5}  # offset 3 + local 0
    assert counters["actor"] == 3 and counters["actor/env_steps"] == 40 and "blob" not in counters
    meta, _ = client.call("run.progress", {"cursor": 2})
    assert meta["messages"] == [] and meta["cursor"] == 2 and meta["stopping"] is False
    with pytest.raises(ValueError, match="cursor must be an int ≥ 0"):
        client.call("run.progress", {"cursor": -1})


def test_run_stop_ends_serve_forever(node):
    n, client = node
    client.call("run.stop", {"reason": "done here"})
    assert n.stop_event.is_set()
    assert n.serve_forever(poll_s=0.01).endswith(": done here")


def test_a_learner_for_another_env_is_refused_with_one_line(node, tmp_path):
    """A learner whose agent does not fit the node's replay (another env: other observation
    shapes) is refused before it pushes or samples anything, naming both layouts."""
    from gearflow.agent import make_agent
    from gearflow.envs import make_vec_env
    from gearflow.errors import ConfigError
    from gearflow.transport.learner.shards import RemoteShards

    n, _ = node
    cfg = load_config(CONFIG, [*TINY, "env.id=Acrobot-v1", f"transport.shards=[127.0.0.1:{n.shard.port}]",
                               f"run.dir={tmp_path / 'learner'}"])  # fmt: skip
    probe = make_vec_env(cfg.env.copy() | {"num_envs": 1, "batch_size": 1}, seed=0)
    spec = probe.env_spec
    probe.close()
    agent = make_agent(cfg, spec, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"transport.shards: the nodes' replay columns are .*float32\[4\].*"
                                          r"the agent learns from .*float32\[6\]"):
        RemoteShards(cfg, agent)
    assert n.params.latest_version() == 1  # nothing was pushed
