"""One client cannot stall the service or make it hold unbounded memory (issue #32, points 3-5).

Attacks through real sockets against a :class:`ShardService` / :class:`Service` (the memory
attack against a service in its own process, so that its RSS is measured alone):

* a ``replay.sample`` asking for 10⁹ items, or a wait of ``1e999`` (infinity) / nan → refused
  at once; one that waits on the rate limiter does not hold the table (others' ``stats`` and
  ``total`` are answered within their timeouts) and ends when its connection closes;
* a client that never reads its sample replies stalls only itself;
* two connections with large frames queued behind a stalled request keep the service
  within ``2 × (max_queued_bytes + max_frame_bytes)`` of receive buffers (RSS checked);
* 64 idle sockets that never log in do not keep a legitimate client out (a ``ping`` client,
  and real ``gearflow actor --connect`` EnvPool actors joining a ``gearflow train`` run), and
  the refusals are logged one line per interval with a count.

Every wait is on progress (a counter, a log line, a stats field), with a guard far above a
loaded box's latency; nothing sleeps for a fixed time.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from gearflow.kinds.transition import Transition
from gearflow.replay.rate_limiter import RateLimiter
from gearflow.transport.actor import RemoteWriter
from gearflow.transport.client import Client, RequestTimeout, ServiceUnavailable
from gearflow.transport.framing import FrameLimits
from gearflow.transport.server.shard import ShardService
from gearflow.transport.service import Service, ServiceLimits

TOKEN = "limits-test-token-42"
GUARD_S = 240  # a hang guard, never reached when the code is right


def _until(cond, what: str, guard_s: float = GUARD_S):
    """Poll ``cond()`` until it is true (progress, not a clock); fail after the guard."""
    deadline = time.monotonic() + guard_s
    delay = 0.005
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"no progress in {guard_s} s: {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _fill(port: int, k: int, obs_shape=(3,)) -> None:
    w = RemoteWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=60)
    for s in range(2):
        w.extend({"obs": np.full((k, *obs_shape), s, np.uint8), "action": np.arange(k),
                  "ret": np.ones(k, np.float32), "disc": np.ones(k, np.float32), "version": np.zeros(k, np.int64)},
                 stream=s)  # fmt: skip
        w.create_items(np.arange(1, k + 1, dtype=np.float64), 1, streams=s, ends=np.arange(1, k + 1))
    w.close()


def _spec(obs: str) -> dict:
    return {"obs": obs, "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}


# ----------------------------------------------------------------------------- the stall


def test_huge_or_endless_samples_are_refused_up_front(make_table):
    table = make_table(spec=_spec("uint8[3]"), P=2, S=64, selector="prioritized", kind=Transition())
    limits = ServiceLimits(max_batch=4096, max_reply_bytes=64 << 10)
    with ShardService(table, token=TOKEN, limits=limits) as shard:
        _fill(shard.port, 20)
        with Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=60) as c:
            with pytest.raises(ValueError, match="max_batch=4096"):
                c.call("replay.sample", {"batch_size": 10**9, "timeout_s": 1e300})
            # 10**400 is valid JSON that no float holds; the others are not numbers or negative
            for bad in (10**400, -1.0, "10", True, [1]):
                with pytest.raises(ValueError, match="timeout_s must be a finite number"):
                    c.call("replay.sample", {"batch_size": 8, "timeout_s": bad})
            # a reply over max_reply_bytes is refused before anything is drawn or allocated
            with pytest.raises(ValueError, match="max_reply_bytes"):
                c.call("replay.sample", {"batch_size": 4096})
            assert table.samples == 0
            assert c.call("replay.sample", {"batch_size": 8, "timeout_s": 1e300})[0]["count"] == 40


def test_infinite_or_nan_waits_are_refused():
    """``1e999`` written into the JSON by a hostile client (our encoder refuses it) parses as infinity."""
    limits = ServiceLimits(max_wait_s=30.0)
    import json

    for text in ("1e999", "-1e999", "NaN"):
        value = json.loads(text)
        with pytest.raises(ValueError, match="timeout_s must be a finite number"):
            limits.wait_s(value, 5.0)
    assert limits.wait_s(1e300, 5.0) == 30.0  # capped
    assert limits.wait_s(None, 5.0) == 5.0
    with pytest.raises(ValueError, match="max_wait_s"):
        ServiceLimits(max_wait_s=float("inf"))


def test_a_waiting_sample_holds_neither_the_table_nor_outlives_its_connection(make_table):
    """A sample that waits on the rate limiter (an empty table, the longest wait allowed) leaves
    ``replay.stats`` / ``replay.total`` / ``replay.update_priorities`` of other clients answered
    at once, and its wait ends when its connection closes (not at its timeout)."""
    table = make_table(spec=_spec("uint8[3]"), P=2, S=64, selector="prioritized", kind=Transition(),
                       limiter=RateLimiter(min_size_to_sample=10))  # fmt: skip
    limits = ServiceLimits(max_wait_s=3600.0)
    with ShardService(table, token=TOKEN, limits=limits) as shard:
        svc = shard.service
        staller = Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=3600)
        fut = staller.submit("replay.sample", {"batch_size": 8, "timeout_s": 3000.0})
        # the staller's request is being handled (it waits on the rate limiter) ...
        _until(lambda: svc.stats()["transport/in_flight"] == 1, "the stalled sample was never received")
        with Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=20) as other:
            for _ in range(3):  # ... and the others are answered well within their 20 s
                assert other.call("replay.stats")[0]["count"] == 0
                assert other.call("replay.total")[0]["count"] == 0
                other.call("replay.update_priorities", {}, [np.zeros(0, np.int64), np.zeros(0, np.float64)])
        errors = svc.counts["errors"]
        staller.close()  # the wait ends with the connection
        _until(lambda: svc.counts["errors"] > errors,
               "the closed connection's sample still waits (it would wait its 3000 s)")
        assert fut.done()


def _stop_reading(client: Client) -> None:
    """Make ``client`` a peer that never reads: a tiny receive buffer, reading paused."""
    proto = client._ensure(time.monotonic() + 60)
    proto.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    done = threading.Event()
    client._loop.call_soon_threadsafe(lambda: (proto.transport.pause_reading(), done.set()))
    assert done.wait(60)


def test_unread_replies_stall_only_their_client(make_table):
    """A client that sends samples and never reads their replies (2 MiB each, far past the
    sockets' buffers) holds its own buffer sets only: another learner keeps sampling."""
    table = make_table(spec=_spec("uint8[512]"), P=2, S=64, kind=Transition(), num_buffers=3)
    with ShardService(table, token=TOKEN, wire_min_row_bytes=None) as shard:  # every column from the buffer sets
        _fill(shard.port, 40, (512,))
        svc = shard.service
        lazy = Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=3600)
        _stop_reading(lazy)
        futs = [lazy.submit("replay.sample", {"batch_size": 4096}) for _ in range(6)]
        # more of its replies are stuck in the service than the table has buffer sets
        _until(lambda: svc.stats()["transport/replies_unsent"] >= table.num_buffers,
               "the lazy client's replies drained: the test's premise (a backed-up socket) does not hold")
        with Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=30) as learner:
            for _ in range(3 * table.num_buffers):
                meta, bufs = learner.call("replay.sample", {"batch_size": 256, "timeout_s": 20.0})
                assert meta["count"] == 80 and bufs[0].shape == (256,)
        assert not any(f.done() for f in futs)
        lazy.close()


# ----------------------------------------------------------------------------- memory

_SERVER = textwrap.dedent("""
    import sys, threading
    from gearflow.transport.framing import FrameLimits
    from gearflow.transport.service import Service, ServiceLimits
    go = threading.Event()
    limits = ServiceLimits(frame=FrameLimits(max_frame_bytes=FRAME), max_queued_bytes=QUEUED) if FRAME else ServiceLimits()
    svc = Service(limits=limits)
    def stall(meta, bufs):
        go.wait(3600)
        return {}, []
    svc.register("stall", stall)
    svc.register("sink", lambda meta, bufs: ({"n": int(bufs[0].nbytes)}, []), inline=True)
    svc.register("go", lambda meta, bufs: (go.set(), ({}, []))[1], inline=True)
    svc.register("stats", lambda meta, bufs: (svc.stats(), []), inline=True)
    print(svc.start(), flush=True)
    sys.stdin.read()
    svc.stop()
""")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("limits, payload_mib", [((64 << 20, 32 << 20), 48), (None, 128)], ids=["small-limits", "default-limits"])
def test_two_connections_with_big_frames_behind_a_stall_stay_bounded(limits, payload_mib):
    """Two clients each queue a stalled request then frames of ``payload_mib``: each connection
    holds at most ``max_queued_bytes + max_frame_bytes`` of receive buffers (the bound), so the
    service's RSS grows by at most twice that (plus 48 MiB of slack for allocator and loop).
    ``default-limits`` is issue #32's scenario (128 MiB frames; the code before the limits went
    from 435 to 1,950 MiB): at the defaults (256 MiB frames, 64 MiB queued) the bound is
    2 × 320 + 48 = 688 MiB; each connection stops being read after its first 128 MiB frame,
    so the growth measured is about 2 × 128 MiB (printed)."""
    mib = 1 << 20
    if limits is None:
        frame, queued = FrameLimits().max_frame_bytes, ServiceLimits().max_queued_bytes
        code = _SERVER.replace("FRAME", "None").replace("QUEUED", "None")
    else:
        frame, queued = limits
        code = _SERVER.replace("FRAME", str(frame)).replace("QUEUED", str(queued))
    env = {**os.environ, "GEARFLOW_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    clients, threads = [], []
    try:
        port = int(proc.stdout.readline())
        ctl = Client(("127.0.0.1", port), token=TOKEN, timeout_s=GUARD_S, limits=FrameLimits(max_frame_bytes=frame))
        ctl.call("stats")
        base = _rss(proc.pid)
        payload = np.ones(payload_mib * mib, np.uint8)
        futs = []

        def flood(c: Client) -> None:
            futs.append(c.submit("stall", timeout_s=3600))
            for _ in range(c.max_in_flight - 1):  # blocks once the service stops reading this connection
                try:
                    futs.append(c.submit("sink", {}, [payload], timeout_s=3600))
                except (ServiceUnavailable, RequestTimeout):
                    return

        for _ in range(2):
            c = Client(("127.0.0.1", port), token=TOKEN, timeout_s=3600, limits=FrameLimits(max_frame_bytes=frame))
            clients.append(c)
            threads.append(threading.Thread(target=flood, args=(c,), daemon=True))
            threads[-1].start()
        # both connections are held back by their limits (the service reads neither any further)
        bound = 2 * (queued + frame)

        def held_back() -> bool:  # both paused by their limits, or past the bound (then the assert fails)
            st = ctl.call("stats")[0]
            return st["transport/paused"] == 2 or st["transport/buffer_bytes"] > bound + 2 * (1 << 20)

        _until(held_back, "the flooding connections were never paused")
        stats = ctl.call("stats")[0]
        assert stats["transport/buffer_bytes"] <= bound + 2 * (1 << 20), stats
        grown = _rss(proc.pid) - base
        print(f"service RSS {base / mib:.0f} -> {(base + grown) / mib:.0f} MiB: grew {grown / mib:.0f} MiB with two "
              f"connections of {payload_mib} MiB frames (bound {bound / mib:.0f} + 48 MiB)")  # fmt: skip
        assert grown <= bound + 48 * mib, f"service RSS grew {grown / mib:.0f} MiB (bound {bound / mib:.0f} + 48 MiB)"
        ctl.call("go")  # the stalls end: everything queued is served
        for t in threads:
            t.join(GUARD_S)
        for f in futs:
            f.result(GUARD_S)
        ctl.close()
    finally:
        for c in clients:
            c.close()
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_a_huge_sample_is_refused_without_allocating(make_table):
    table = make_table(spec=_spec("uint8[512]"), P=2, S=64, kind=Transition())
    with ShardService(table, token=TOKEN) as shard:
        _fill(shard.port, 20, (512,))
        with Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=60) as c:
            with pytest.raises(ValueError, match="max_batch"):
                c.call("replay.sample", {"batch_size": 10**7})
            # under max_batch but over max_reply_bytes (65536 × ~550 B = 34 MiB is fine; the
            # reply bound is checked before the lane's buffers exist)
            limits = shard.service.limits
            big = limits.max_batch
            assert shard._reply_bytes(big) < limits.max_reply_bytes
        assert shard.service.peak_block_bytes < 1 << 20


# ----------------------------------------------------------------------------- pre-auth


def test_idle_unauthenticated_sockets_do_not_keep_a_client_out(caplog):
    """64 sockets that take their challenge and never log in (as many as the connection
    limit): a legitimate client still connects and is served; the idle ones are dropped
    oldest first, and the refusals are logged one line per interval with a count."""
    limits = ServiceLimits(refusal_log_interval_s=0.2, auth_timeout_s=3600.0)  # idle sockets never time out here
    svc = Service(token=TOKEN, limits=limits)
    port = svc.start()
    idle = []
    try:
        with caplog.at_level(logging.WARNING, logger="gearflow.transport.service"):
            for _ in range(limits.max_connections):
                s = socket.create_connection(("127.0.0.1", port), timeout=60)
                s.recv(1)  # its challenge came: the service has taken it in
                idle.append(s)
            with Client(("127.0.0.1", port), token=TOKEN, timeout_s=60, connect_timeout_s=30) as c:
                assert c.call("ping")[0]["pong"]
                assert svc.stats()["transport/connections_open"] == 1
            dropped = limits.max_connections - limits.max_preauth
            _until(lambda: svc.counts["auth_refused"] >= dropped, "the oldest idle sockets were not dropped")
            _until(lambda: any("more" in r.getMessage() for r in caplog.records if "refused" in r.getMessage()),
                   "the rate-limited refusals never logged their count")
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) < dropped / 4, lines  # not one line per refusal
    finally:
        for s in idle:
            s.close()
        svc.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_idle_unauthenticated_sockets_do_not_keep_a_real_actor_out(tmp_path):
    """The same 64 idle sockets against ``gearflow train`` with ``actor.remote_actors=2``, held
    open for the whole run (``auth_timeout_s=3600``: no timeout frees a slot, only the pre-auth
    pool can): two real ``gearflow actor --connect`` EnvPool actors still join and write every
    step of the run (no local actor: the learner's env steps are theirs)."""
    from tests.test_remote_actors import _finish, _gearflow, _learner, _wait_for

    learner, learner_log, address = _learner(tmp_path, "actor.remote_actors=2", "run.max_env_steps=3000",
                                             "transport.limits.auth_timeout_s=3600")  # fmt: skip
    host, port = address.rsplit(":", 1)
    idle, actors = [], None
    try:
        for _ in range(64):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.recv(1)  # its challenge came: the service has taken it in
            idle.append(s)
        actors_log = tmp_path / "actors.err"
        actors = _gearflow("actor", "--connect", address, "--actors", "2", log=actors_log)
        _wait_for(learner_log, r"remote actor 1 joined", learner, timeout=GUARD_S)
        _wait_for(learner_log, r"remote actor 0 joined", learner, timeout=GUARD_S)
        code, out = _finish(learner, timeout=600)
        assert code == 0, learner_log.read_text()[-3000:]
        import json

        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["actor/env_steps"] >= 3000 and summary["learner/updates"] > 0, summary
        assert actors.wait(timeout=GUARD_S) == 0, actors_log.read_text()[-3000:]
        assert sum(1 for s in idle if s.fileno() >= 0) == 64  # the test held its sockets throughout
    finally:
        for s in idle:
            s.close()
        for proc in (learner, actors):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)


# ----------------------------------------------------------------------------- config


def test_limits_are_config_keys_validated_like_the_others():
    from gearflow.config import load_config
    from gearflow.errors import ConfigError
    from gearflow.transport.service import service_limits

    cfg = load_config("configs/cartpole_apex.yaml", ["transport.limits.max_batch=1024", "transport.limits.max_preauth=4",
                                                     "transport.limits.max_frame_bytes=1e7"])  # fmt: skip
    limits = service_limits(cfg.transport.limits)
    assert (limits.max_batch, limits.max_preauth, limits.frame.max_frame_bytes) == (1024, 4, 10**7)
    assert service_limits(load_config("configs/cartpole_apex.yaml").transport.limits) == ServiceLimits()
    for bad, key in (("transport.limits.max_batch=0", "transport.limits.max_batch"),
                     ("transport.limits.max_wait_s=inf", "transport.limits.max_wait_s"),
                     ("transport.limits.auth_timeout_s=-1", "transport.limits.auth_timeout_s"),
                     ("transport.limits.max_prauth=3", "max_preauth")):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            load_config("configs/cartpole_apex.yaml", [bad])


# ----------------------------------------------------------------------------- reports, names, frames


class _Conn:
    def __init__(self, actor: int):
        self.state, self.peer, self.closed = {"actor": actor}, "127.0.0.1:1", False

    def on_close(self, cb) -> None:
        pass


def test_reports_are_checked_and_bounded_by_what_the_actor_wrote(caplog):
    import queue

    from gearflow.learner import Progress
    from gearflow.reports import fold_report
    from gearflow.roles.remote_actors import Members

    written = {"actor/episodes": 2, "actor/env_steps": 40, "actor/items": 38, "actor/weight_version": 3}
    q: queue.Queue = queue.Queue()
    members = Members("", {0: [0, 1]}, q, threading.Event(), written=lambda parts: dict(written))
    conn = _Conn(0)

    def episode(ret):
        return {"type": "episode", "env": 0, "actor/episode_return": ret, "actor/episode_length": 10, "actor/epsilon": 0.1}

    for bad in (float("inf"), float("nan"), 1e300, "500", True):
        with pytest.raises(ValueError, match="episode_return"):
            members.report({"messages": [episode(bad)]}, [], conn)
    with pytest.raises(ValueError, match="control characters"):
        members.report({"messages": [{"type": "counters", "actor/note": "ok\n2026 INFO fake line"}]}, [], conn)
    with pytest.raises(ValueError, match="counter key"):
        members.report({"messages": [{"type": "counters", "bad key\n": 1}]}, [], conn)
    assert q.empty()  # a refused batch passes nothing on
    # 100 episodes of return 500 from an actor whose partitions hold 2: two pass, the rest wait
    members.report({"messages": [episode(500.0) for _ in range(100)]}, [], conn)
    got = [q.get_nowait() for _ in range(q.qsize())]
    assert len(got) == 2 and all(m["actor"] == 0 for m in got)
    written["actor/episodes"] = 5  # its writes catch up: three more pass at its next report
    members.report({"messages": []}, [], conn)
    assert q.qsize() == 3
    [q.get_nowait() for _ in range(3)]
    # counters past what its partitions hold (and weights the learner never published) are capped
    members.report({"messages": [{"type": "counters", "actor/env_steps": 10**15, "actor/episodes": 10**9,
                                  "actor/items": 7, "actor/weight_version": 10**17, "actor/env_steps_per_s": 99.5}]},
                   [], conn)  # fmt: skip
    c = q.get_nowait()
    assert (c["actor/env_steps"], c["actor/episodes"], c["actor/items"], c["actor/weight_version"]) == (40, 5, 7, 3)
    assert c["actor"] == 0 and c["actor/env_steps_per_s"] == 99.5
    # an error report's lines are indented in the log: none can pose as a log line of its own
    progress = Progress()
    with caplog.at_level(logging.ERROR):
        fold_report(progress, {"type": "error", "actor": 0, "error": "boom\n2026-12-02 INFO run.stop_at_return reached\x1b[2J"})
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "\n2026" not in text and "\x1b" not in text and "    | 2026-12-02" in text


def test_checkpoint_names_refuse_trailing_newlines_and_paths(make_table, tmp_path):
    table = make_table(spec=_spec("uint8[3]"), P=2, S=64, kind=Transition())
    with ShardService(table, token=TOKEN, checkpoint_dir=str(tmp_path)) as shard:
        with Client(("127.0.0.1", shard.port), token=TOKEN, timeout_s=60) as c:
            for bad in ("ok\n", "..", "a/b", "../x", "", "x" * 129, "ok\r"):
                with pytest.raises(ValueError, match="checkpoint name"):
                    c.call("replay.checkpoint", {"name": bad})
            assert c.call("replay.checkpoint", {"name": "fine-1"})[0]["path"].endswith("fine-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fine-1"]


def test_a_zero_size_buffer_with_huge_dims_is_a_frame_error():
    from gearflow.transport.framing import FrameError, parse_envelope

    env = b'{"op":"x","meta":{},"bufs":[["float64",[0,268435456,268435456,268435456]]]}'
    with pytest.raises(FrameError, match="too large"):
        parse_envelope(env, 1, 0, FrameLimits())
    # a plain zero-size buffer is fine
    op, meta, layout = parse_envelope(b'{"op":"x","meta":{},"bufs":[["float64",[0,3]]]}', 1, 0, FrameLimits())
    assert layout[0][1] == (0, 3)
