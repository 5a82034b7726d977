"""Replies within the limits the client accepts (issue 47): the client announces its frame limits
at the handshake (authenticated), the service keeps every reply within them — a reply that
would break them is an error reply naming the limit, the connection stays — and ``run.progress``,
a reply that grows with a node's backlog, is paged to fit."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from gearflow.config import load_config
from gearflow.transport.client import Client
from gearflow.transport.framing import FrameError, FrameLimits
from gearflow.transport.service import ANY_ROLE, Service
from tests.test_train import CONFIG, ROOT, TINY

TOKEN = "replies-test-secret-0123"


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A real shard node (``gearflow serve``'s ShardNode) in this process, its actors not started."""
    from gearflow.topology.shard_node import ShardNode

    monkeypatch.setenv("GEARFLOW_TOKEN", TOKEN)
    n = ShardNode(load_config(CONFIG, [*TINY, "actor.num_actors=1", f"run.dir={tmp_path / 'node'}"]))
    n.shard.start()
    yield n
    n.close()


def _read_all(client: Client, limit: int) -> tuple[list[dict], int]:
    """Every report from cursor 0, page by page as a learner reads them; (reports, pages)."""
    got, cursor, pages = [], 0, 0
    while True:
        meta, _ = client.call("run.progress", {"cursor": cursor})
        pages += 1
        size = len(json.dumps({"op": "run.progress", "meta": meta, "bufs": []}, separators=(",", ":")))
        assert size <= limit, size  # the page fits what the client accepts
        assert meta["lost"] == 0 and meta["cursor"] == cursor + len(meta["messages"])
        got += meta["messages"]
        cursor = meta["cursor"]
        if not meta["more"]:
            return got, pages


def test_run_progress_pages_a_backlog_to_fit_the_clients_envelope(node):
    """10,000 reports (a node whose actors ran unthrottled before any learner polled: ~440 KB of
    JSON, where one reply of 4,096 of them was 231 KB against the client's 64 KiB envelope limit):
    read whole, in order, in pages that fit; a client announcing a 16 KiB envelope gets smaller
    pages; a report too big for a page alone is cut, and the cursor moves on."""
    for k in range(10_000):
        node.relay.add({"type": "episode", "actor": k % 2, "actor/episode_return": float(k), "actor/episode_length": k})
    with Client(("127.0.0.1", node.shard.port), TOKEN, timeout_s=10) as c:
        got, pages = _read_all(c, 64 << 10)
    assert [m["actor/episode_return"] for m in got] == [float(k) for k in range(10_000)]
    small = FrameLimits(max_meta_bytes=16 << 10)
    with Client(("127.0.0.1", node.shard.port), TOKEN, timeout_s=10, limits=small) as c:
        got_small, pages_small = _read_all(c, 16 << 10)
    assert got_small == got and pages_small > 3 * pages >= 3 * 7
    node.relay.add({"type": "error", "actor": 0, "error": "é" * 100_000})  # 600 KB of JSON escapes
    node.relay.add({"type": "episode", "actor": 1, "actor/episode_return": -1.0})
    with Client(("127.0.0.1", node.shard.port), TOKEN, timeout_s=10) as c:
        meta, _ = c.call("run.progress", {"cursor": 10_000})
        assert meta["more"] and meta["cursor"] == 10_001 and "[cut: 100000 characters]" in meta["messages"][0]["error"]
        meta, _ = c.call("run.progress", {"cursor": meta["cursor"]})
        assert not meta["more"] and meta["messages"] == [{"type": "episode", "actor": 1, "actor/episode_return": -1.0}]


def test_a_reply_over_the_clients_limits_is_an_error_reply_and_the_connection_stays():
    svc = Service(token=TOKEN)
    svc.register("big.meta", lambda meta, bufs: ({"blob": "x" * (100 << 10)}, []), roles=ANY_ROLE)
    svc.register("big.buf", lambda meta, bufs: ({}, [np.zeros(2 << 20, np.uint8)]), roles=ANY_ROLE)
    svc.start()
    try:
        with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=10, limits=FrameLimits(max_frame_bytes=1 << 20)) as c:
            with pytest.raises(FrameError, match=r"the reply to big.meta breaks the limits this client accepts "
                                                 r"\(envelope of \d+ bytes exceeds max_meta_bytes=65536\)"):
                c.call("big.meta")
            with pytest.raises(FrameError, match=r"the reply to big.buf .* exceeds max_frame_bytes=1048576"):
                c.call("big.buf")
            assert c.call("ping")[0]["pong"] and c.generation == 1  # the same connection
        assert svc.stats()["transport/replies_oversized"] == 2
    finally:
        svc.stop()


@pytest.mark.slow
def test_a_learner_started_late_against_a_node_whose_actors_ran_unthrottled_trains(tmp_path):
    """The issue's case: ``gearflow serve`` with ``replay.samples_per_insert=0`` and no learner
    until its report log holds more than one reply's worth (4,096 reports: 231 KB of JSON then);
    a learner started then reads the backlog in pages and trains to its update limit (before:
    its first poll's reply broke its 64 KiB envelope limit, the connection dropped, the node was
    marked down and the learner never sampled)."""
    import time

    from tests.test_serve import TOKEN as SERVE_TOKEN
    from tests.test_serve import _address, _env, _serve

    proc, addr_file = _serve(tmp_path, "n0", "replay.samples_per_insert=0")
    try:
        address = _address(proc, addr_file, tmp_path / "n0.err")
        with Client(address, SERVE_TOKEN, timeout_s=30) as c:  # the node's reports so far (a cursor past them: no page)
            while c.call("run.progress", {"cursor": 1 << 40})[0]["cursor"] <= 6000:
                assert proc.poll() is None, (tmp_path / "n0.err").read_text()[-3000:]
                time.sleep(0.2)
        learner = subprocess.run([sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, "run.max_updates=50",
                                  "run.max_env_steps=100000000", f"run.dir={tmp_path / 'learner'}", "run.progress=log",
                                  f"transport.shards=[{address}]"],
                                 check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())  # fmt: skip
        assert learner.returncode == 0, learner.stderr[-3000:]
        summary = json.loads(learner.stdout.strip().splitlines()[-1])
        assert summary["stop_reason"] == "reached run.max_updates=50"
        assert summary["actor/episodes"] > 4096  # the backlog's episodes reached the learner
        assert "malformed frame" not in learner.stderr and "is down" not in learner.stderr
    finally:
        proc.kill()
        proc.wait()
