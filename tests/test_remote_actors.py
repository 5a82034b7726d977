"""Remote actors (``actor.remote_actors`` + ``gearflow actor --connect``) through the real
commands on loopback: a run fed only by remote actors, a remote actor killed mid-run, bad
secrets and configs, and an actor writing over TCP exactly what it writes into shared memory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gearflow.kinds.transition import Actor
from gearflow.config import load_config
from gearflow.envs import make_vec_env
from gearflow.replay import Table, make_selector
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED, SharedStorage
from gearflow.replay.spec import TableSpec
from gearflow.replay.writer import Writer
from tests.test_train import CONFIG, ROOT, TINY

# every test starts `gearflow` commands (torch + EnvPool each); the waits inside are on log lines and
# exits, their limits only catch a hung test, far above a loaded 2-core box's start-up
pytestmark = pytest.mark.timeout(900)

TOKEN = "remote-actors-test-secret"
TESTS = str(Path(__file__).parent)


def _gearflow(*args: str, log: Path, token: str = TOKEN) -> subprocess.Popen:
    env = {**os.environ, "GEARFLOW_TOKEN": token, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-m", "gearflow", *args], stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, cwd=ROOT, env=env)  # fmt: skip


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout: float = 300.0, until=None) -> re.Match:
    """The first match of ``pattern`` in ``log`` (or, with ``until``, the first time ``until(text)``
    holds); fails when ``proc`` exits first or after ``timeout`` (a hung-test guard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        m = re.search(pattern, text)
        if m and (until is None or until(text)):
            return m
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {log}:\n{log.read_text()[-3000:]}")


def _learner(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path, str]:
    log = tmp_path / "train.err"
    proc = _gearflow("train", CONFIG, *TINY, "run.progress=log", f"run.dir={tmp_path / 'run'}", *overrides, log=log)
    m = _wait_for(log, r"on (127\.0\.0\.1:\d+): run gearflow actor --connect", proc)
    return proc, log, m.group(1)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.mark.slow
def test_a_run_fed_only_by_remote_actors(tmp_path):
    """Both actors of the run connect with ``gearflow actor --connect``: the learner trains from
    what they write, counts their episodes, and both sides exit 0 when the run ends. The actor
    machine holds only an actor credential (``gearflow secret actor``), not the learner's secret."""
    from gearflow.transport.auth import actor_credential

    learner, learner_log, address = _learner(tmp_path, "actor.remote_actors=2", "run.max_env_steps=2000")
    actors_log = tmp_path / "actors.err"
    actors = _gearflow("actor", "--connect", address, CONFIG, *TINY, "--actors", "2", log=actors_log,
                       token=actor_credential(TOKEN, "box-1"))  # fmt: skip
    code, out = _finish(learner)
    assert code == 0, learner_log.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["actor/env_steps"] >= 2000 and summary["learner/updates"] > 0
    assert summary["actor/episodes"] > 0  # episodes reached the learner over run.report
    text = learner_log.read_text()
    assert "remote actor 0 joined" in text and "remote actor 1 joined" in text
    assert actors.wait(timeout=240) == 0, actors_log.read_text()[-3000:]
    assert "Traceback" not in actors_log.read_text()


@pytest.mark.slow
def test_a_killed_remote_actor_does_not_stop_the_learner(tmp_path):
    """One local and one remote actor; the remote one is SIGKILLed mid-run: the learner logs it
    and trains on the local actor's data, until it is stopped (SIGTERM: 143, its summary printed).
    No step budget: with one, the local actor alone reached it before the remote one had joined
    (a CI run at load, 3,500 steps in 5 s); every wait is on a log line."""
    learner, learner_log, address = _learner(tmp_path, "actor.remote_actors=1", "run.max_env_steps=0",
                                             "run.max_seconds=900")  # fmt: skip
    actors_log = tmp_path / "actors.err"
    actors = _gearflow("actor", "--connect", address, "--actors", "1", log=actors_log)
    try:
        _wait_for(learner_log, r"remote actor 1 joined", learner)
        _wait_for(learner_log, r"progress: steps [1-9]", learner)
        # kill the whole remote side at once (parent and its actor process): no goodbye is sent. Not
        # Python's resource tracker: it unlinks the dead side's named semaphores (else left in /dev/shm)
        remote = _spawned_children(actors.pid)
        assert len(remote) == 1, "the remote side's actor process was not found"
        for pid in remote + [actors.pid]:
            os.kill(pid, signal.SIGKILL)
        left = _wait_for(learner_log, r"remote actor 1 \(.*\) left; its place waits for it", learner)
        # training goes on from the local actor: 1,000 more env steps and more updates after the leave
        steps0, updates0 = (_progress(learner_log.read_text()[: left.end()]) or [(0, 0)])[-1]
        _wait_for(learner_log, "", learner,
                  until=lambda text: any(s >= steps0 + 1000 and u > updates0 for s, u in _progress(text)))  # fmt: skip
    finally:
        learner.send_signal(signal.SIGTERM)
        if actors.poll() is None:  # a failure before the kill
            actors.kill()
    code, out = _finish(learner)
    assert code == 143, learner_log.read_text()[-3000:]  # stopped by SIGTERM, not by an error
    assert json.loads(out.strip().splitlines()[-1])["actor/env_steps"] >= steps0 + 1000


def _progress(text: str) -> list[tuple[int, int]]:
    """(env steps, updates) of every progress line in a learner's log, in order."""
    return [(int(s), int(u)) for s, u in re.findall(r"progress: steps (\d+) \([^)]*\) updates (\d+)", text)]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_wrong_secret_and_mismatched_config_are_one_line_errors(tmp_path):
    # the learner waits for its remote actor until SIGTERM (max_seconds only guards a lost test): with
    # run.max_seconds=60 it ended on a loaded box before the second actor connected
    learner, learner_log, address = _learner(tmp_path, "actor.remote_actors=1", "run.max_env_steps=0",
                                             "run.max_seconds=900")  # fmt: skip
    try:
        # the three refused actors at once (none of them gets a place: each is refused at its handshake
        # or before it joins), each checked for its own one line
        def refused_actor(*args: str, **env: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "gearflow", "actor", "--connect", address, *args, "--wait", "2"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env={**os.environ, **env})  # fmt: skip

        def ended(proc: subprocess.Popen) -> subprocess.CompletedProcess:
            out, err = proc.communicate(timeout=240)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

        procs = [refused_actor(GEARFLOW_TOKEN="not-the-secret"),
                 refused_actor(CONFIG, *TINY, "env.id=Acrobot-v1", GEARFLOW_TOKEN=TOKEN),
                 refused_actor(GEARFLOW_TOKEN=TOKEN, GEARFLOW_INTEGRITY="0")]  # fmt: skip
        bad, other, plain = (ended(proc) for proc in procs)
        assert bad.returncode == 2, bad.stderr
        assert "Traceback" not in bad.stderr and re.search(r"remote actor: .*(secret|authenticat)", bad.stderr, re.I)
        assert other.returncode == 2, other.stderr
        assert "env.id is 'Acrobot-v1' here, 'CartPole-v1' in the learner's config" in other.stderr
        assert "Traceback" not in other.stderr
        assert plain.returncode == 2, plain.stderr  # frame integrity off here, on at the learner: one line
        assert "Traceback" not in plain.stderr
        assert "transport.integrity differs: the service at" in plain.stderr and "has true, this client false" in plain.stderr
        assert "refused" in learner_log.read_text()  # the wrong secret was logged by the service
    finally:
        learner.send_signal(signal.SIGTERM)
        learner.communicate(timeout=240)


def test_cli_errors_before_connecting(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GEARFLOW_TOKEN"}
    commands = [["actor", "--connect", "127.0.0.1:1"], ["actor", "--connect", "nohost", "--token", TOKEN],
                ["train", CONFIG, "actor.remote_actors=1"]]  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-m", "gearflow", *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env) for c in commands]  # three independent commands at once
    (e1, r1), (e2, r2), (e3, r3) = ((p.communicate(timeout=240)[1], p.returncode) for p in procs)
    assert r1 == 2 and "needs a shared secret" in e1 and "GEARFLOW_TOKEN" in e1
    assert r2 == 2 and "--connect nohost" in e2
    assert r3 == 2 and "actor.remote_actors=1" in e3 and "shared secret" in e3


# ---------------------------------------------------------------------- same data as shared memory


def _counting_cfg():
    return load_config(None, [
        "env.factory=helpers_envs:make", "env.num_envs=4", "env.batch_size=0", "actor.num_actors=1",
        "actor.n_step=3", "actor.gamma=0.9", "actor.epsilon=1.0", "agent.hidden_sizes=[]", "agent.dueling=false",
        "replay.capacity=4096", "run.seed=5",
        "actor.weight_sync_period=100000",  # no flush at a weight sync: only the writer's own hook ships
    ])  # fmt: skip


def _act_into(cfg, writer, steps: int) -> None:
    from gearflow.agent import make_agent

    import torch

    env = make_vec_env(cfg.env, seed=0)
    torch.manual_seed(3)  # the same network (its Q-values give the items' priorities)
    agent = make_agent(cfg, env.env_spec, "cpu")
    with Actor(env, agent, writer, None, np.ones(4), cfg=cfg.actor, env_cfg=cfg.env, actor_index=0, seed=11) as actor:
        actor.run(max_steps=steps)


@pytest.mark.parametrize("kind", ["RemoteWriter", "ShippingWriter"])
def test_an_actor_over_tcp_writes_exactly_what_it_writes_into_shared_memory(monkeypatch, kind):
    """The same actor (same seed, random policy, CountingEnv) once through a local Writer and once
    through a RemoteWriter (or the ShippingWriter remote actors use) into a ShardService: every
    column, every item record, every counter equal — over 150 steps per stream, so each 128-step
    ring wraps (a shipment split at the wrap)."""
    from gearflow.agent import make_agent
    from gearflow.kinds.transition import Transition
    from gearflow.transport import actor as remote
    from gearflow.transport.server.shard import ShardService

    monkeypatch.syspath_prepend(TESTS)
    cfg = _counting_cfg()
    probe = make_vec_env(cfg.env, seed=0)
    spec = TableSpec.parse(make_agent(cfg, probe.env_spec, "cpu").replay_columns())
    probe.close()
    stores = [SharedStorage.create(spec, 4, 128) for _ in range(2)]
    try:
        _act_into(cfg, Writer(stores[0], np.arange(4)), 600)
        table = Table(stores[1], Transition(next_columns=("obs",)), make_selector("uniform", 4 * stores[1].items_per_partition))
        with ShardService(table, token=TOKEN) as shard:
            writer = getattr(remote, kind)(("127.0.0.1", shard.port), 4, TOKEN, partitions=[0, 1, 2, 3])
            _act_into(cfg, writer, 600)
            writer.close()
        a, b = stores
        for c in (COMMIT, PUBLISHED, EPISODES):
            np.testing.assert_array_equal(a.counters[:, c], b.counters[:, c])
        assert int(a.counters[:, PUBLISHED].sum()) > 400
        assert int(a.counters[:, COMMIT].min()) > 128  # every ring wrapped
        for name in spec.names:
            np.testing.assert_array_equal(a.columns[name], b.columns[name], err_msg=name)
        for rec in ("item_start", "item_length", "item_priority"):
            np.testing.assert_array_equal(getattr(a, rec), getattr(b, rec), err_msg=rec)
    finally:
        for st in stores:
            st.close()
            st.unlink()


def test_the_remote_writer_is_the_first_of_the_transports_table_that_fits(monkeypatch):
    """``transport.actor.WRITERS`` chooses a remote actor's writer: ShippingWriter (the C adder's
    ring) unless the run stacks frames (RemoteWriter); an entry put first is what it writes through."""
    from omegaconf import OmegaConf

    from gearflow.kinds.transition import Transition
    from gearflow.transport import actor as remote
    from gearflow.transport.server.shard import ShardService

    spec = TableSpec.parse({"obs": "float32[4]", "action": "int64", "ret": "float32", "disc": "float32",
                            "version": "int64"})  # fmt: skip
    store = SharedStorage.create(spec, 2, 64)
    try:
        table = Table(store, Transition(next_columns=("obs",)), make_selector("uniform", 2 * store.items_per_partition))
        with ShardService(table, token=TOKEN) as shard:
            def made(frame_stack: bool):
                w = remote.remote_writer(OmegaConf.create({"replay": {"frame_stack": frame_stack}}),
                                         ("127.0.0.1", shard.port), [0, 1], TOKEN)  # fmt: skip
                w.close()
                return type(w)

            assert made(False) is remote.ShippingWriter and made(True) is remote.RemoteWriter
            monkeypatch.setattr(remote, "WRITERS", [("staged", "gearflow.transport.actor.writer:RemoteWriter",
                                                     lambda cfg: True), *remote.WRITERS])  # fmt: skip
            assert made(False) is remote.RemoteWriter
    finally:
        store.close()
        store.unlink()


def _spawned_children(pid: int) -> list[int]:
    """A gearflow process's spawned children (multiprocessing's spawn_main; not its resource tracker)."""
    out = []
    for child in _children(pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd:
            out.append(child)
    return out


@pytest.mark.slow
def test_a_killed_shard_process_is_restarted_and_the_actors_rejoin(tmp_path):
    """SIGKILL the learner's shard process mid-run (every actor is remote, so it is the learner's
    only spawned child): the learner restarts it on the same port, the remote actors reconnect,
    rejoin their places and the run reaches its step limit; both sides exit 0. (The limit leaves
    a rejoin several seconds: a learner at ~500 updates/s paces 5,000 steps in ~3 s after the
    restart, before the second actor's retry, issue 45.)"""
    learner, learner_log, address = _learner(tmp_path, "actor.remote_actors=2", "run.max_env_steps=20000")
    actors_log = tmp_path / "actors.err"
    actors = _gearflow("actor", "--connect", address, "--actors", "2", log=actors_log)
    _wait_for(learner_log, r"progress: steps [1-9]", learner)
    (shard,) = _spawned_children(learner.pid)
    os.kill(shard, signal.SIGKILL)
    _wait_for(learner_log, r"shard process died \(exit code -9\); restarting it on port", learner)
    code, out = _finish(learner)
    assert code == 0, learner_log.read_text()[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["actor/env_steps"] >= 20000
    assert learner_log.read_text().count("remote actor 0 joined") >= 2  # rejoined after the restart
    assert actors.wait(timeout=240) == 0, actors_log.read_text()[-3000:]


@pytest.mark.slow
def test_remote_actors_held_past_the_rate_limiters_timeout_rejoin(tmp_path):
    """The learner is paused (SIGSTOP) longer than replay.timeout_s: its shard's rate limiter
    holds the remote actors' inserts until they time out. The actors rejoin and wait again
    rather than exit (nothing would restart them); once the learner goes on, the run reaches
    its step limit on their data alone and both sides exit 0."""
    learner, learner_log, address = _learner(tmp_path, "actor.remote_actors=2", "run.max_env_steps=5000",
                                             "replay.timeout_s=2")  # fmt: skip
    actors_log = tmp_path / "actors.err"
    actors = _gearflow("actor", "--connect", address, "--actors", "2", log=actors_log)
    _wait_for(learner_log, r"progress: steps [1-9]", learner)
    os.kill(learner.pid, signal.SIGSTOP)
    try:
        _wait_for(actors_log, r"rejoining the run", actors, timeout=300)
    finally:
        os.kill(learner.pid, signal.SIGCONT)
    code, out = _finish(learner)
    assert code == 0, learner_log.read_text()[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["actor/env_steps"] >= 5000
    assert actors.wait(timeout=240) == 0, actors_log.read_text()[-3000:]
    assert "died" not in actors_log.read_text()  # rejoined, not restarted


def test_places_one_per_connection_and_a_rejoin_keeps_its_place():
    """``run.join`` over real connections: a connection gets a free place (or the one it asks
    for); joining again on the same connection (an actor whose writer was reset) keeps that
    place; another connection cannot take a held place; a closed connection frees it."""
    import multiprocessing as mp
    import queue

    from gearflow.roles.remote_actors import Members
    from gearflow.transport.client import Client
    from gearflow.transport.service import Service

    reports = queue.Queue()
    members = Members("cfg: 1", {0: [0, 1], 1: [2, 3]}, reports, mp.Event())
    with Service(token=TOKEN) as service:
        service.register("run.join", members.join, with_connection=True)
        a, b, c = (Client(("127.0.0.1", service.port), TOKEN, timeout_s=10) for _ in range(3))
        try:
            assert a.call("run.join", {"actor": None})[0]["actor"] == 0
            assert a.call("run.join", {"actor": None})[0]["partitions"] == [0, 1]  # the same place again
            assert a.call("run.join", {"actor": 0})[0]["actor"] == 0
            with pytest.raises(ValueError, match="this connection holds remote actor 0's place; it cannot join as actor 1"):
                a.call("run.join", {"actor": 1})
            with pytest.raises(ValueError, match="remote actor 0 is already joined"):
                b.call("run.join", {"actor": 0})
            assert b.call("run.join", {"actor": None})[0]["actor"] == 1
            with pytest.raises(ValueError, match="all 2 remote actor places are taken"):
                c.call("run.join", {"actor": None})
            a.close()
            deadline = time.monotonic() + 10
            while 0 in members.joined and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.call("run.join", {"actor": None})[0]["actor"] == 0  # freed by the closed connection
        finally:
            for client in (a, b, c):
                client.close()
    seen = []
    while not reports.empty():
        m = reports.get_nowait()
        seen.append((m["type"], m["actor"]))
    assert seen[:6] == [("joined", 0)] * 3 + [("joined", 1), ("left", 0), ("joined", 0)]  # then b and c leave
