"""Hostile input against a shard service, over raw sockets on loopback.

* A hypothesis fuzz test sends well over 10,000 frames: truncated, oversized (lengths past
  every limit), wrong magic, wrong version, wrong kind, forbidden dtypes, bad shapes, bad
  JSON, random bytes — each connection first carries a run of well-formed requests the
  handlers refuse (the connection stays open, each gets an ERROR reply), then one broken
  frame (the connection is closed with a logged reason). Afterwards the service is up and
  answers valid requests, every refusal was logged and counted, the receive buffers never
  held more than the limits allow, and the table's bytes and priorities are unchanged.
* A wrong secret is refused; a recorded handshake replayed on a new connection is refused
  (fresh server nonce); a recorded server answer cannot convince a client (fresh client
  nonce).

The raw sockets send unsealed frames, so these services run with ``transport.integrity``
off: what is tested is the parser and the handlers behind it (what a peer that holds the
secret can send). With integrity on every such frame is also refused for its missing MAC:
tests/test_wire_security.py.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gearflow.kinds.transition import Transition
from gearflow.transport import auth
from gearflow.transport.client import Client
from gearflow.transport.framing import (
    AUTH,
    AUTH_OK,
    CHALLENGE,
    HEADER,
    MAGIC,
    REQUEST,
    VERSION,
    FrameLimits,
    encode,
)
from gearflow.transport.actor import RemoteWriter
from gearflow.transport.service import ServiceLimits
from gearflow.transport.server.shard import ShardService

TOKEN = "hostile-test-token-42"
APEX = {"obs": "float32[3]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}


@pytest.fixture(autouse=True)
def _no_frame_integrity():
    auth.set_default_integrity(False)
    yield
    auth.set_default_integrity(True)


def _auth_frame(token: str, server_nonce: str, cn: str, integrity: bool = False) -> bytes:
    """The AUTH frame of a learner-role client (protocol 2) answering ``server_nonce``."""
    script = auth.transcript(server_nonce, cn, "learner", "", integrity)
    meta = {"nonce": cn, "role": "learner", "name": "", "integrity": integrity, "mac": auth.client_mac(token.encode(), script)}
    return b"".join(bytes(p) for p in encode(AUTH, 0, "", meta))


LIMITS = ServiceLimits(frame=FrameLimits(max_frame_bytes=1 << 20, max_meta_bytes=4096, max_buffers=8, max_dims=4),
                       max_connections=8, max_in_flight=4, auth_timeout_s=5.0)  # fmt: skip


def recv_frame(sock) -> tuple[int, dict]:
    """(kind, meta) of the next frame on a blocking socket (test side: small frames only)."""
    head = _recv_exact(sock, HEADER.size)
    _, _, kind, _, meta_len, _, buf_bytes = HEADER.unpack(head)
    env = json.loads(_recv_exact(sock, meta_len))
    _recv_exact(sock, buf_bytes)
    return kind, env["meta"]


def _recv_exact(sock, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def raw_connect(port: int, token: str = TOKEN, record: list | None = None) -> socket.socket:
    """A raw socket through the handshake (``record`` gets the AUTH frame's bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    kind, meta = recv_frame(s)
    assert kind == CHALLENGE
    cn = auth.new_nonce()
    frame = _auth_frame(token, meta["nonce"], cn, meta["integrity"])
    if record is not None:
        record.append(frame)
    s.sendall(frame)
    kind, meta = recv_frame(s)
    assert kind == AUTH_OK, meta
    return s


def frame_bytes(op, meta, bufs=()) -> bytes:
    return b"".join(bytes(p) for p in encode(REQUEST, 1, op, meta, bufs))


def header(kind=REQUEST, magic=MAGIC, version=VERSION, meta_len=2, nbufs=0, buf_bytes=0) -> bytes:
    return struct.pack("<4sHHQIIQ", magic, version, kind, 1, meta_len, nbufs, buf_bytes)


# well-formed requests the handlers refuse: the connection stays open, each gets an ERROR reply
refused_ops = st.one_of(
    st.builds(lambda n: frame_bytes(f"no.such.{n}", {}), st.integers(0, 10**6)),
    st.builds(lambda b: frame_bytes("replay.sample", {"batch_size": b}), st.sampled_from([0, -1, "x", None, 1.5])),
    st.builds(lambda v: frame_bytes("params.get", {"min_version": v}), st.sampled_from(["1", None, 1.5])),
    st.just(frame_bytes("replay.write", {"session": 1, "ops": []})),  # no session on this connection
    st.builds(lambda k: frame_bytes("replay.update_priorities", {}, [np.arange(k, dtype=np.int64)]), st.integers(0, 5)),
    st.just(frame_bytes("replay.checkpoint", {"name": "../x"})),
    st.just(frame_bytes("replay.open_writer", {"num_streams": 99})),
)


def _envelope(op="x", meta=None, bufs=None) -> bytes:
    return json.dumps({"op": op, "meta": meta or {}, "bufs": bufs or []}).encode()


def _with_envelope(env: bytes, nbufs=0, buf_bytes=0, payload=b"") -> bytes:
    return header(meta_len=len(env), nbufs=nbufs, buf_bytes=buf_bytes) + env + payload


# broken frames: each closes its connection
broken = st.one_of(
    st.builds(lambda b: b + header()[len(b):], st.binary(min_size=4, max_size=4).filter(lambda b: b != MAGIC)),  # magic
    st.builds(lambda v: header(version=v) + b"{}", st.integers(0, 65535).filter(lambda v: v != VERSION)),
    st.builds(lambda k: header(kind=k) + b"{}", st.integers(0, 65535).filter(lambda k: k != REQUEST)),
    st.builds(lambda n: header(meta_len=n), st.integers(4097, 2**32 - 1)),  # envelope over the limit
    st.builds(lambda n: header(nbufs=n), st.integers(9, 2**32 - 1)),  # too many buffers
    st.builds(lambda n: header(meta_len=2, buf_bytes=n), st.integers(1 << 20, 2**64 - 1)),  # oversized frame
    st.builds(lambda d: _with_envelope(_envelope(bufs=[[d, [2]]]), 1, 16, bytes(16)),
              st.sampled_from(["object", "complex128", "<U4", "V8", "float128", "O", "", "datetime64"])),
    st.builds(lambda s: _with_envelope(_envelope(bufs=[["uint8", s]]), 1, 8, bytes(8)),
              st.sampled_from([[-1], [1, 2, 3, 4, 5], ["8"], [8.0], [2**70], [[8]]])),
    st.builds(lambda n: _with_envelope(_envelope(bufs=[["float64", [n]]]), 1, 8, bytes(8)), st.integers(2, 1000)),  # sizes disagree
    st.builds(lambda b: _with_envelope(b), st.binary(min_size=2, max_size=200)),  # not JSON / not an envelope
    st.builds(lambda e: _with_envelope(json.dumps(e).encode()),
              st.sampled_from([[], {"op": 1, "meta": {}, "bufs": []}, {"op": "x"}, {"op": "x", "meta": [], "bufs": []},
                               {"op": "x", "meta": {}, "bufs": [], "more": 1}])),
    st.builds(lambda raw: header(meta_len=len(raw)) + raw, st.just(b'{"op": "x", "meta": {"a": NaN}, "bufs": []}')),
    st.builds(lambda b: b if b[:4] != MAGIC else b"X" + b[1:], st.binary(min_size=32, max_size=512)),  # random bytes
)


def truncated(frame: bytes, cut: int) -> bytes:
    return frame[: max(1, cut % len(frame))]


@pytest.fixture
def shard(make_table):
    table = make_table(spec=APEX, P=2, S=64, selector="prioritized", kind=Transition())
    svc = ShardService(table, token=TOKEN, limits=LIMITS)
    port = svc.start()
    w = RemoteWriter(("127.0.0.1", port), num_streams=2, token=TOKEN, timeout_s=10)
    k = 20
    for s in range(2):
        w.extend({"obs": np.random.default_rng(s).standard_normal((k, 3)).astype(np.float32), "action": np.arange(k),
                  "ret": np.ones(k, np.float32), "disc": np.ones(k, np.float32), "version": np.zeros(k, np.int64)},
                 stream=s)  # fmt: skip
        w.create_items(np.arange(1, k + 1, dtype=np.float64), 1, streams=s, ends=np.arange(1, k + 1))
    w.close()
    table.scan()
    yield svc.service, port, table
    svc.stop()


def snapshot(table):
    st = table.storage
    return ({k: v.copy() for k, v in st.columns.items()}, st.counters[:, :3].copy(), st.item_start.copy(),
            st.item_priority.copy(), table.selector.tree.leaves.copy())  # fmt: skip


def test_fuzzed_frames_close_only_their_connection(shard, caplog):
    svc, port, table = shard
    before = snapshot(table)
    sent = {"broken": 0, "truncated": 0, "refused_ops": 0}
    caplog.set_level(logging.WARNING, logger="gearflow.transport.service")

    @settings(max_examples=410, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(ops=st.lists(refused_ops, min_size=5, max_size=15), bad=st.lists(broken, min_size=22, max_size=22),
           cuts=st.lists(st.integers(0, 10**6), min_size=3, max_size=3))  # fmt: skip
    def run(ops, bad, cuts):
        # 25 hostile frames, each on its own connection (a broken frame closes it): 16 before
        # the handshake, 6 after it (behind a run of refused requests on the first), 3 truncated
        for i, frame in enumerate(bad):
            if i < 16:  # garbage instead of the AUTH frame: refused before any handler runs
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                recv_frame(s)
            else:
                s = raw_connect(port)
                if i == 16:
                    s.sendall(b"".join(ops))  # well-formed, refused by the handlers: one ERROR reply each
                    for _ in ops:
                        kind, meta = recv_frame(s)
                        assert kind == 6 and meta["type"] in ("KeyError", "ValueError", "SessionLost", "IndexError"), meta
                    sent["refused_ops"] += len(ops)
            s.sendall(frame)
            sent["broken"] += 1
            _expect_closed(s)
            s.close()
        for cut in cuts:  # a valid frame cut short, then the connection closes
            s = raw_connect(port)
            s.sendall(truncated(frame_bytes("replay.stats", {}, [np.arange(10)]), cut))
            s.shutdown(socket.SHUT_WR)
            sent["truncated"] += 1
            _expect_closed(s)
            s.close()

    run()
    assert sent["broken"] + sent["truncated"] >= 10_000, sent
    # the service is up and answers valid requests
    with Client(("127.0.0.1", port), token=TOKEN, timeout_s=10) as c:
        meta, _ = c.call("replay.stats")
        assert meta["count"] == 40
        assert c.call("replay.sample", {"batch_size": 8})[0]["count"] == 40
    # every broken frame was refused and counted; the log says why, one line per interval
    # (transport.limits.refusal_log_interval_s) with the count of those it did not log
    refused = svc.counts["refused"] + svc.counts["auth_refused"]
    assert refused == sent["broken"]
    logged = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(logged) <= sent["broken"]
    assert any("bad magic" in r.getMessage() for r in logged)
    # memory: no receive block past the frame limit was ever made, and nothing is held now
    f = LIMITS.frame
    assert svc.peak_block_bytes <= LIMITS.max_connections * 2 * (LIMITS.max_in_flight + 1) * f.max_frame_bytes
    assert svc.peak_block_bytes < 4 * f.max_frame_bytes  # in fact: small frames only
    deadline = time.monotonic() + 10
    while svc.buffer_bytes() and time.monotonic() < deadline:  # the last connections finish closing
        time.sleep(0.01)
    assert svc.block_bytes == 0 and svc.buffer_bytes() == 0
    # the stored data and priorities are as they were (the sample above only counted samples)
    after = snapshot(table)
    for a, b in zip(before[1:], after[1:]):
        np.testing.assert_array_equal(a, b)
    for k in before[0]:
        np.testing.assert_array_equal(before[0][k], after[0][k])


def _expect_closed(s: socket.socket) -> None:
    """The service closes the connection (after at most one ERROR frame)."""
    s.settimeout(10)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return
        if not chunk:
            return
        data += chunk
        assert len(data) < 1 << 16, "the service kept answering a broken connection"


def test_wrong_secret_and_replayed_handshakes_are_refused(shard, caplog):
    svc, port, _ = shard
    caplog.set_level(logging.WARNING, logger="gearflow.transport.service")
    with Client(("127.0.0.1", port), token="not-the-token", timeout_s=5) as c:
        with pytest.raises(auth.AuthenticationError):
            c.call("replay.stats")
    assert any("authentication failed" in r.getMessage() for r in caplog.records)
    # a recorded AUTH frame replayed on a new connection: the server's nonce is new
    record: list = []
    raw_connect(port, record=record).close()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    recv_frame(s)
    s.sendall(record[0])
    kind, meta = recv_frame(s)
    assert kind == 6 and meta["type"] == "AuthenticationError"
    _expect_closed(s)
    s.close()
    assert svc.counts["auth_refused"] == 2

    # a recorded server answer replayed to a client by a fake service: the client's nonce is new
    real = socket.create_connection(("127.0.0.1", port), timeout=10)
    _, challenge = recv_frame(real)
    cn = auth.new_nonce()
    real.sendall(_auth_frame(TOKEN, challenge["nonce"], cn))
    _, ok = recv_frame(real)
    real.close()
    fake = socket.create_server(("127.0.0.1", 0))
    fake_port = fake.getsockname()[1]

    def serve():
        conn, _ = fake.accept()
        conn.sendall(b"".join(bytes(p) for p in encode(CHALLENGE, 0, "", {"nonce": challenge["nonce"], "version": 2,
                                                                          "integrity": False})))  # fmt: skip
        recv_frame(conn)
        conn.sendall(b"".join(bytes(p) for p in encode(AUTH_OK, 0, "", ok)))
        time.sleep(1)
        conn.close()

    th = threading.Thread(target=serve)
    th.start()
    with Client(("127.0.0.1", fake_port), token=TOKEN, timeout_s=5) as c:
        with pytest.raises(auth.AuthenticationError, match="did not prove it holds the secret"):
            c.call("replay.stats")
    th.join()
    fake.close()


def test_connection_and_in_flight_limits(shard):
    """Connections past max_connections are refused; a client that sends requests without
    reading replies is not read past max_in_flight (its socket backs up; memory stays put)."""
    svc, port, _ = shard
    socks = [raw_connect(port) for _ in range(LIMITS.max_connections)]
    # a socket past the limit gets its challenge (pre-auth sockets have their own pool), and is
    # refused once it has logged in
    extra = socket.create_connection(("127.0.0.1", port), timeout=10)
    kind, meta = recv_frame(extra)
    assert kind == CHALLENGE
    cn = auth.new_nonce()
    extra.sendall(_auth_frame(TOKEN, meta["nonce"], cn, meta["integrity"]))
    _, meta = recv_frame(extra)
    assert meta["type"] == "ServiceUnavailable" and "connection limit" in meta["message"]
    _expect_closed(extra)
    for s in socks[1:]:
        s.close()
    # one client floods sample requests (each reply ~1 KiB) and never reads
    s = socks[0]
    s.setblocking(False)
    req = frame_bytes("replay.sample", {"batch_size": 32})
    sent = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3:
        try:
            sent += s.send(req)
        except BlockingIOError:
            time.sleep(0.01)
    peak = svc.peak_block_bytes
    assert sent > 0
    assert peak <= 2 * (LIMITS.max_in_flight + 1) * LIMITS.frame.max_frame_bytes
    handled = svc.counts["requests"]
    assert handled < sent // len(req)  # the service stopped reading: it handled only part of it
    s.close()
    with Client(("127.0.0.1", port), token=TOKEN, timeout_s=10) as c:
        assert c.call("ping")[0]["pong"]


op_field = st.one_of(st.integers(-3, 40), st.just(2**62), st.text(max_size=3), st.none(), st.floats(allow_nan=False))
write_ops = st.lists(st.lists(op_field, max_size=7).flatmap(
    lambda rest: st.sampled_from(["a", "x", "i", "e", "f", "z"]).map(lambda code: [code, *rest])), max_size=6)


def test_fuzzed_writer_ops_touch_only_the_sessions_partition(shard):
    """An authenticated writer sending arbitrary op lists and buffers on its session (partition 1)
    gets errors or writes into partition 1; partition 0 and the service are untouched."""
    svc, port, table = shard
    st_ = table.storage
    before0 = ({k: v[: st_.steps_per_partition].copy() for k, v in st_.columns.items()}, st_.counters[0].copy(),
               st_.item_start[0].copy(), st_.item_priority[0].copy())  # fmt: skip
    c = Client(("127.0.0.1", port), token=TOKEN, timeout_s=10)
    session = c.call("replay.open_writer", {"num_streams": 1, "partitions": [1], "insert_timeout_s": 0.1})[0]["session"]
    outcomes = {"ok": 0, "refused": 0}
    cols = [np.zeros((4, 3), np.float32), np.zeros(4, np.int64), np.zeros(4, np.float32), np.zeros(4, np.float32),
            np.zeros(4, np.int64)]  # fmt: skip

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=write_ops, ints=st.lists(st.integers(-5, 70), max_size=12), n_cols=st.sampled_from([0, 5, 2]),
           floats=st.lists(st.floats(-1, 1e3, allow_nan=False), max_size=6))  # fmt: skip
    def run(ops, ints, n_cols, floats):
        bufs = [np.asarray(ints, np.int64), np.asarray(floats, np.float64), *cols[:n_cols]]
        try:
            c.call("replay.write", {"session": session, "ops": ops}, bufs)
            outcomes["ok"] += 1
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            assert str(exc)
            outcomes["refused"] += 1

    run()
    assert outcomes["refused"] > 50
    after0 = ({k: v[: st_.steps_per_partition] for k, v in st_.columns.items()}, st_.counters[0], st_.item_start[0],
              st_.item_priority[0])  # fmt: skip
    for k in before0[0]:
        np.testing.assert_array_equal(before0[0][k], after0[0][k])
    for a, b in zip(before0[1:], after0[1:]):
        np.testing.assert_array_equal(a, b)
    assert c.call("ping")[0]["pong"]
    c.close()
