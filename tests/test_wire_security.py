"""The wire under attack (issue #32): frame integrity after the handshake, and roles.

* An on-path relay that does not hold the token sits between a real client and a real service
  (a :class:`Service` with counting handlers, and a real shard node — ``ShardNode``, what
  ``gearflow serve`` runs — in this process). It injects a frame, alters one byte of a reply
  (the weights of ``params.get``), replays, reorders or drops a frame: each time the receiver
  closes the connection with a logged reason before acting on the frame, and nothing is
  applied. With ``transport.integrity`` off the same relay's attacks go through (the control
  that shows the relay works).
* The two ends' ``transport.integrity`` must agree: a mismatch is refused at the handshake, and a
  relay that rewrites the challenge's flag cannot switch it off.
* An actor credential (``gfa1.<name>.…``, derived from the learner's secret) connects as the actor
  role: it may join, write, report and read weights, and every learner handler of a real shard
  node refuses it (``AuthorizationError``) without applying anything.
"""

from __future__ import annotations

import ctypes
import json
import logging
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

from gearflow.config import load_config
from gearflow.transport import auth, integrity
from gearflow.transport.actor import RemoteParams
from gearflow.transport.auth import AuthorizationError, IntegrityMismatch
from gearflow.transport.client import Client, ServiceUnavailable
from gearflow.transport.framing import HEADER, VERSION, FramedProtocol
from gearflow.transport.service import ANY_ROLE, Service
from tests.helpers_relay import LoopbackRelay
from tests.test_train import CONFIG, TINY

TOKEN = "wire-security-secret-0123"
TRAILER = integrity.TRAILER.size


# ----------------------------------------------------------------- the relay
def _recv_exact(sock, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except OSError:
            return None
        if not chunk:
            return None
        out += chunk
    return bytes(out)


class Relay(LoopbackRelay):
    """A TCP relay on loopback that does not know the secret: it forwards whole frames, and
    ``tamper(direction, index, frame) -> [frames]`` may drop, duplicate, reorder, rewrite or add
    some. ``direction`` is ``"c2s"`` or ``"s2c"``; ``index`` counts that direction's frames (c2s 0
    is AUTH; s2c 0 and 1 are CHALLENGE and AUTH_OK). After the handshake each frame ends with
    the integrity trailer when the ends use integrity (``trailer``)."""

    HANDSHAKE = {"c2s": 1, "s2c": 2}  # each direction's frames before the first with a trailer

    def __init__(self, port: int, tamper=None, trailer: bool = True):
        self.tamper, self.trailer = tamper or (lambda d, i, f: [f]), trailer
        self.frames = {"c2s": [], "s2c": []}  # what the relay saw, for tests that replay it later
        super().__init__(port)

    def pump(self, src, dst, direction: str, state=None) -> None:
        i, handshake = 0, self.HANDSHAKE[direction]
        while True:
            head = _recv_exact(src, HEADER.size)
            if head is None:
                break
            _, _, _, _, meta_len, _, buf_bytes = HEADER.unpack(head)
            rest = _recv_exact(src, meta_len + buf_bytes + (TRAILER if self.trailer and i >= handshake else 0))
            if rest is None:
                break
            self.frames[direction].append(head + rest)
            try:
                for f in self.tamper(direction, i, head + rest):
                    dst.sendall(f)
            except OSError:
                break
            i += 1
        self.shut(src, dst)


def _frame(op: str, meta: dict, kind: int = 4, rid: int = 99, trailer: bytes = b"") -> bytes:
    """A well-formed frame made by someone without the keys (a guessed or zero trailer)."""
    env = json.dumps({"op": op, "meta": meta, "bufs": []}).encode()
    return HEADER.pack(b"GFLW", VERSION, kind, rid, len(env), 0, 0) + env + trailer


def _flip_last_buffer_byte(frame: bytes) -> bytes:
    """``frame`` with one byte of its buffer block changed (the trailer left as it was)."""
    b = bytearray(frame)
    b[-TRAILER - 8] ^= 0x01
    return bytes(b)


# ----------------------------------------------------------------- a service with counting handlers
@pytest.fixture
def service():
    applied = {"stop": 0, "add": 0}

    def stop(meta, bufs):
        applied["stop"] += 1
        return {"stopped": True}, []

    def add(meta, bufs):
        applied["add"] += 1
        return {"n": applied["add"]}, []

    svc = Service(token=TOKEN, name="target")
    svc.register("run.stop", stop)
    svc.register("counter.add", add, roles=ANY_ROLE)
    svc.register("weights.get", lambda meta, bufs: ({}, [np.ones(4096, np.float32)]), roles=ANY_ROLE)
    svc.start()
    yield svc, applied
    svc.stop()


def _refused(caplog, what: str) -> bool:
    return any(what in r.getMessage() for r in caplog.records)


def test_injected_frame_is_refused_and_not_applied(service, caplog):
    """The relay slips a ``run.stop`` in after the client's first request (with a guessed
    trailer: the right sequence number, a zero tag)."""
    svc, applied = service
    caplog.set_level(logging.WARNING)

    def inject(direction, i, frame):  # before the client's second request (its first was answered)
        if direction == "c2s" and i == 2:
            return [_frame("run.stop", {}, trailer=struct.pack("<Q16s", 1, bytes(16))), frame]
        return [frame]

    relay = Relay(svc.port, inject)
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10) as c:
        assert c.call("counter.add")[0] == {"n": 1}
        with pytest.raises(ServiceUnavailable):  # the connection was closed on the injected frame
            c.call("counter.add", timeout_s=10)
    assert applied == {"stop": 0, "add": 1}
    assert _refused(caplog, "frame integrity check failed: frame 1 failed its MAC check")
    relay.close()


def test_injected_frame_goes_through_without_integrity(caplog):
    """The control: with transport.integrity off on both ends the same relay stops the service."""
    applied = []
    svc = Service(token=TOKEN, integrity=False)
    svc.register("run.stop", lambda meta, bufs: applied.append(1))
    svc.register("counter.add", lambda meta, bufs: None, roles=ANY_ROLE)
    svc.start()
    relay = Relay(svc.port, lambda d, i, f: [_frame("run.stop", {}), f] if d == "c2s" and i == 2 else [f],
                  trailer=False)  # fmt: skip
    try:
        with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10, integrity=False) as c:
            c.call("counter.add")
            try:  # the injected frame is handled before this one (in order); its reply, of an id
                c.call("counter.add")  # this client never used, may end the connection first
            except ServiceUnavailable:
                pass
        assert applied == [1]
    finally:
        relay.close()
        svc.stop()


def test_altered_reply_byte_is_refused(service, caplog):
    svc, _ = service
    caplog.set_level(logging.WARNING)
    relay = Relay(svc.port, lambda d, i, f: [_flip_last_buffer_byte(f)] if d == "s2c" and i == 3 else [f])
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10) as c:
        _, (w,) = c.call("weights.get")  # reply 0 (s2c frame 2): as sent
        assert float(w.sum()) == 4096.0
        with pytest.raises(ServiceUnavailable, match="integrity check failed"):
            c.call("weights.get")  # reply 1: one byte changed
    assert _refused(caplog, "failed its MAC check: altered or injected on the way")
    relay.close()


@pytest.mark.parametrize("attack", ["replay", "reorder", "drop"])
def test_replayed_reordered_dropped_requests_are_refused(service, caplog, attack):
    """Three ``counter.add`` requests pipelined; the relay plays the second one twice, swaps the
    second and third, or drops the second. The service applies those before the attack only."""
    svc, applied = service
    caplog.set_level(logging.WARNING)
    held = []
    seen = []
    svc._handlers["counter.add"].fn = lambda meta, bufs: (seen.append(meta["i"]), ({"n": len(seen)}, []))[1]

    def tamper(direction, i, frame):
        if direction != "c2s" or i < 2:
            return [frame]
        if attack == "replay" and i == 2:
            return [frame, frame]
        if attack == "reorder":
            if i == 2:
                held.append(frame)
                return []
            if i == 3:
                return [frame, held[0]]
        if attack == "drop" and i == 2:
            return []
        return [frame]

    relay = Relay(svc.port, tamper)
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10) as c:
        futs = [c.submit("counter.add", {"i": i}) for i in range(3)]
        assert c.result(futs[0], "counter.add", 10)[0] == {"n": 1}
        with pytest.raises(ServiceUnavailable):
            c.result(futs[2], "counter.add", 10)
    # the replayed second request is never applied twice (its original may or may not have run
    # before the connection closed); reordered or after a gap: none after the first
    assert seen in ([0], [0, 1]) if attack == "replay" else seen == [0]
    expected = {"replay": "frame sequence number 1, expected 2", "reorder": "frame sequence number 2, expected 1",
                "drop": "frame sequence number 2, expected 1"}[attack]  # fmt: skip
    assert _refused(caplog, expected)
    relay.close()


def test_replayed_reply_and_a_recorded_session_are_refused(service, caplog):
    """A reply played twice to the client; a whole recorded session played to the service on a new
    connection (the handshake is fresh, the recorded frames are under another connection's keys)."""
    svc, applied = service
    caplog.set_level(logging.WARNING)
    closed = threading.Event()
    relay = Relay(svc.port, lambda d, i, f: [f, f] if d == "s2c" and i == 2 else [f])
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=10) as c:
        c.call("counter.add")  # its reply arrives twice: the second copy closes the connection
        proto = c._proto
        c._loop.call_soon_threadsafe(lambda: proto.closed and closed.set())
        lost = proto.connection_lost
        proto.connection_lost = lambda exc: (lost(exc), closed.set())
        c._loop.call_soon_threadsafe(lambda: proto.closed and closed.set())
        assert closed.wait(30), "the client kept a connection that replayed a reply"
    assert any("frame sequence number 0, expected 1" in r.getMessage() for r in caplog.records)
    recorded = relay.frames["c2s"]
    relay.close()
    before = applied["add"]
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=10)
    head = _recv_exact(s, HEADER.size)
    _recv_exact(s, HEADER.unpack(head)[4])  # a new challenge
    for f in recorded:
        s.sendall(f)
    while _recv_exact(s, 1) is not None:  # an ERROR, then closed
        pass
    s.close()
    assert applied["add"] == before


# ----------------------------------------------------------------- big frames: MACed in MAC threads
def _flip_at(frame: bytes, at: int) -> bytes:
    b = bytearray(frame)
    b[at] ^= 0x01
    return bytes(b)


@pytest.fixture
def big_service():
    """A service whose replies and requests are big enough (2 MiB) for the MAC threads: the
    service MACs a reply while it writes it, the client MACs a request while it sends it, and
    each receiver MACs the block as it lands (integrity.BlockMac). Small replies come from an
    inline handler: sent while the big reply before them is still being MACed."""
    applied = []
    big = np.arange(1 << 19, dtype=np.float32)  # 2 MiB
    assert big.nbytes >= integrity.MAC_THREAD_BYTES
    svc = Service(token=TOKEN, name="big")
    svc.register("big.get", lambda meta, bufs: ({"i": meta.get("i")}, [big]), roles=ANY_ROLE)
    svc.register("small.get", lambda meta, bufs: ({"i": meta.get("i")}, [np.arange(8)]), roles=ANY_ROLE,
                 inline=True)  # on the loop: sent at once, while the big reply before it is being MACed
    svc.register("big.put", lambda meta, bufs: (applied.append(float(bufs[0].sum())), ({}, []))[1], roles=ANY_ROLE)
    svc.start()
    yield svc, big, applied
    svc.stop()


@pytest.mark.parametrize("wire_threads", [True, False], ids=["wire-threads", "loop"])
def test_big_frames_are_maced_beside_the_socket_and_still_checked(big_service, caplog, monkeypatch, wire_threads):
    """Big and small frames pipelined on one connection arrive whole and in order (a small reply
    sent while a big one's MAC runs goes after its trailer); one changed byte in the middle of a
    big reply, or of a big request, closes the connection and the request is not applied — with
    the client reading big blocks in its wire thread (MACed as they land), and through the loop
    with a MAC thread following (TLS's way, and a build without ``_mac.c``)."""
    svc, big, applied = big_service
    monkeypatch.setattr(FramedProtocol, "wire_threads", wire_threads)
    caplog.set_level(logging.WARNING)
    with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=20) as c:
        ops = ["big.get", "small.get", "small.get", "big.get", "big.get", "small.get"]
        futs = [c.submit(op, {"i": i}) for i, op in enumerate(ops)]
        for i, (op, f) in enumerate(zip(ops, futs)):
            meta, (arr,) = c.result(f, op, 20)
            assert meta == {"i": i} and np.array_equal(arr, big if op == "big.get" else np.arange(8)), op
        if wire_threads:  # the big replies' blocks were read (and MACed) by the client's wire thread
            assert c._proto._wire.received == 3 and c._proto.reader.opener._block_mac is None
        else:  # through a MAC thread beside the loop
            assert not c._proto._wire and c._proto.reader.opener._block_mac is not None
        c.call("big.put", {}, [big])
        assert applied == [float(big.sum())]
    middle = HEADER.size + 200 + big.nbytes // 2  # inside the block, past the first MAC thread's piece
    relay = Relay(svc.port, lambda d, i, f: [_flip_at(f, middle)] if d == "s2c" and i == 3 else [f])
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=20) as c:
        assert np.array_equal(c.call("big.get")[1][0], big)  # reply 0 (s2c frame 2): as sent
        with pytest.raises(ServiceUnavailable, match="integrity check failed"):
            c.call("big.get")  # reply 1: one byte changed half-way through
    relay.close()
    assert _refused(caplog, "failed its MAC check: altered or injected on the way")
    caplog.clear()
    relay = Relay(svc.port, lambda d, i, f: [_flip_at(f, middle)] if d == "c2s" and i == 2 else [f])
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=20) as c:
        c.call("big.put", {}, [big])  # request 0 (c2s frame 1): as sent
        with pytest.raises(ServiceUnavailable):
            c.call("big.put", {}, [big])  # request 1: one byte changed
    relay.close()
    assert applied == [float(big.sum())] * 2  # the altered request was not applied
    assert _refused(caplog, "frame integrity check failed: frame 1 failed its MAC check")


def test_every_frame_through_the_mac_threads_round_trips(monkeypatch):
    """With the MAC threads' threshold at 0 every frame after the handshake, empty ones too, is
    MACed in a MAC thread on both sides: pipelined calls of mixed sizes all verify, in order."""
    monkeypatch.setattr(integrity, "MAC_THREAD_BYTES", 0)
    svc = Service(token=TOKEN)
    svc.register("echo", lambda meta, bufs: (meta, bufs), roles=ANY_ROLE)
    svc.start()
    try:
        with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=20) as c:
            sizes = [0, 5, 1 << 16, 3, 1 << 20, 0, 7]
            futs = [c.submit("echo", {"i": i}, [np.full(n, i, np.uint8)] if n else []) for i, n in enumerate(sizes)]
            for i, (n, f) in enumerate(zip(sizes, futs)):
                meta, bufs = c.result(f, "echo", 20)
                assert meta == {"i": i} and (bufs == [] if not n else np.array_equal(bufs[0], np.full(n, i, np.uint8)))
            assert c._proto.sealer.thread_bytes == 0 and c._proto.reader.opener._block_mac is not None
    finally:
        svc.stop()


# ----------------------------------------------------------------- integrity settings must agree
def test_integrity_mismatch_is_refused_at_the_handshake(caplog):
    caplog.set_level(logging.WARNING)
    for server_on in (True, False):
        svc = Service(token=TOKEN, integrity=server_on)
        svc.start()
        try:
            with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=5, integrity=not server_on) as c:
                with pytest.raises(IntegrityMismatch, match="transport.integrity differs: the service at .* has "
                                   + ("true" if server_on else "false")):  # fmt: skip
                    c.call("ping")
            with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=5, integrity=server_on) as c:
                assert c.call("ping")[0]["pong"]
        finally:
            svc.stop()


def test_a_relay_cannot_switch_integrity_off(service, caplog):
    """Both ends have integrity on; the relay rewrites the challenge to say off (so that its later
    frames need no MAC), or the client's AUTH: refused either way, and no request is served."""
    svc, applied = service
    caplog.set_level(logging.WARNING)

    def rewrite(flag_of):
        def tamper(direction, i, frame):
            if (direction, i) == flag_of:  # a well-formed frame: the header's envelope length fixed
                magic, version, kind, rid, meta_len, nbufs, buf_bytes = HEADER.unpack(frame[:HEADER.size])
                env = json.loads(frame[HEADER.size:HEADER.size + meta_len])
                assert env["meta"]["integrity"] is True
                env["meta"]["integrity"] = False
                env = json.dumps(env).encode()
                return [HEADER.pack(magic, version, kind, rid, len(env), nbufs, buf_bytes) + env]
            return [frame]

        return tamper

    relay = Relay(svc.port, rewrite(("s2c", 0)))
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=5) as c:
        with pytest.raises(IntegrityMismatch, match="has false, this client true"):
            c.call("counter.add")
    relay.close()
    relay = Relay(svc.port, rewrite(("c2s", 0)))
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=5) as c:
        with pytest.raises(auth.AuthenticationError):
            c.call("counter.add")
    relay.close()
    assert applied["add"] == 0
    assert _refused(caplog, "authentication failed")


@pytest.mark.parametrize("change", ["smaller", "removed"])
def test_a_relay_cannot_change_the_frame_limits_a_client_announces(service, caplog, change):
    """The client's frame limits (what the service keeps its replies within) are in the
    handshake's transcript: rewritten (a smaller envelope: replies it would page needlessly) or
    removed, the login fails and nothing is served."""
    svc, applied = service
    caplog.set_level(logging.WARNING)

    def tamper(direction, i, frame):
        if (direction, i) != ("c2s", 0):
            return [frame]
        magic, version, kind, rid, meta_len, nbufs, buf_bytes = HEADER.unpack(frame[:HEADER.size])
        env = json.loads(frame[HEADER.size:HEADER.size + meta_len])
        assert env["meta"]["limits"] == [256 << 20, 64 << 10, 64, 8]
        if change == "smaller":
            env["meta"]["limits"][1] = 16 << 10
        else:
            del env["meta"]["limits"]
        env = json.dumps(env).encode()
        return [HEADER.pack(magic, version, kind, rid, len(env), nbufs, buf_bytes) + env]

    relay = Relay(svc.port, tamper)
    with Client(("127.0.0.1", relay.port), TOKEN, timeout_s=5) as c:
        with pytest.raises(auth.AuthenticationError):
            c.call("counter.add")
    relay.close()
    assert applied["add"] == 0 and _refused(caplog, "authentication failed")


# ----------------------------------------------------------------- a real shard node
@pytest.fixture
def node(tmp_path, monkeypatch):
    """A real shard node in this process (``gearflow serve``'s ShardNode), actors not started."""
    from gearflow.topology.shard_node import ShardNode

    monkeypatch.setenv("GEARFLOW_TOKEN", TOKEN)
    cfg = load_config(CONFIG, [*TINY, "actor.num_actors=1", f"run.dir={tmp_path / 'node'}"])
    n = ShardNode(cfg)
    n.shard.start()
    yield n
    n.close()


def test_altered_weights_in_params_get_never_reach_the_actor(node, caplog):
    """The issue's attack: the relay zeroed the weights of a params.get reply; now a changed byte
    closes the connection and the actor's network keeps what it had."""
    caplog.set_level(logging.WARNING)
    _, state = node.params.read()
    node.params.publish({k: v + 1 for k, v in state.items()}, version=2)
    relay = Relay(node.shard.port, lambda d, i, f: [_flip_last_buffer_byte(f)] if d == "s2c" and i == 2 else [f])
    params = RemoteParams(("127.0.0.1", relay.port), auth.actor_credential(TOKEN, "a0"), timeout_s=10)
    net = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(ServiceUnavailable, match="integrity check failed"):
        params.load_into(net)
    assert all(float(v.abs().sum()) == 0.0 for v in net.values())  # nothing copied
    params.close()
    relay.close()
    good = RemoteParams(("127.0.0.1", node.shard.port), auth.actor_credential(TOKEN, "a0"), timeout_s=10)
    assert good.load_into(net) == 2 and all(torch.equal(net[k], state[k] + 1) for k in state)
    good.close()


def test_an_actor_credential_cannot_call_learner_handlers(node, tmp_path, caplog):
    """Every handler of a real shard node not tagged for actors refuses an actor-role connection;
    nothing is applied (no stop, no push, no sample drawn, no checkpoint written)."""
    caplog.set_level(logging.WARNING)
    svc = node.shard.service
    learner_only = sorted(n for n, h in svc._handlers.items() if auth.ACTOR not in h.roles)
    assert {"params.push", "run.stop", "replay.sample", "replay.update_priorities", "replay.checkpoint",
            "replay.total", "replay.info"} <= set(learner_only)  # fmt: skip
    _, state = node.params.read()
    names = list(state)
    calls = {"params.push": ({"version": 2**62, "names": names}, [v.numpy() * 0 for v in state.values()]),
             "run.stop": ({"reason": "x"}, []), "replay.sample": ({"batch_size": 4}, []),
             "replay.update_priorities": ({}, [np.zeros(1, np.int64), np.full(1, 1e300)]),
             "replay.checkpoint": ({"name": "mine"}, [])}  # fmt: skip
    version, samples = node.params.latest_version(), node.table.samples
    with Client(("127.0.0.1", node.shard.port), auth.actor_credential(TOKEN, "actor-7"), timeout_s=10) as c:
        assert c.role == "actor"
        for op in learner_only:
            meta, bufs = calls.get(op, ({}, []))
            with pytest.raises(AuthorizationError, match=f"{op} needs the learner role; this connection proved the actor"):
                c.call(op, meta, bufs)
        assert c.call("params.get", {"min_version": 0})[0]["version"] == version  # what an actor may do
        assert "messages" in c.call("run.progress", {"cursor": 0})[0]
    assert not node.stop_event.is_set()
    assert node.params.latest_version() == version
    assert node.table.samples == samples
    assert not any(p.name.startswith("mine") for p in tmp_path.rglob("*"))
    assert svc.counts["forbidden"] == len(learner_only)
    with Client(("127.0.0.1", node.shard.port), TOKEN, timeout_s=10) as c:  # the learner's secret may
        assert c.role == "learner"
        c.call("run.stop", {"reason": "the learner"})
    assert node.stop_event.is_set()


def test_actor_credentials_are_per_name_and_cannot_serve(node):
    """A credential is bound to its name (another name's secret, a forged one, or a learner secret
    posing as one fail); a service refuses to run on an actor credential; one actor credential
    cannot convince another actor's client (a fake service that holds actor a0's secret)."""
    a0 = auth.actor_credential(TOKEN, "a0")
    forged = "gfa1.a1." + a0.split(".")[2]  # a0's key under a1's name
    with Client(("127.0.0.1", node.shard.port), forged, timeout_s=5) as c:
        with pytest.raises(auth.AuthenticationError):
            c.call("params.get", {"min_version": 0})
    with pytest.raises(ValueError, match="actor credential"):
        Service(token=a0)
    with pytest.raises(ValueError, match="cannot derive another"):
        auth.actor_credential(a0, "a2")
    # a fake service run by actor a0's machine: it knows a0's secret only, not the learner's
    fake = Service(token="not-the-learners-secret")
    fake._secret = b"unused"
    real_role_secret = auth.role_secret
    fake_key = auth.credential(a0.encode()).secret
    try:
        auth.role_secret = lambda learner, role, name: fake_key if role == auth.ACTOR and name == "a0" else None
        fake.start()
        with Client(("127.0.0.1", fake.port), a0, timeout_s=5) as c:  # the one it can fool: a0 itself
            assert c.call("ping")[0]["pong"]
        with Client(("127.0.0.1", fake.port), auth.actor_credential(TOKEN, "a1"), timeout_s=5) as c:
            with pytest.raises(auth.AuthenticationError):
                c.call("ping")
        with Client(("127.0.0.1", fake.port), TOKEN, timeout_s=5) as c:
            with pytest.raises(auth.AuthenticationError):
                c.call("ping")
    finally:
        auth.role_secret = real_role_secret
        fake.stop()


# ----------------------------------------------------------------- mutual TLS
@pytest.fixture(scope="module")
def tls_dirs(tmp_path_factory):
    """A run's CA with the service's node certificate and a client machine's, and another CA's."""
    import shutil
    import subprocess
    import sys

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make certificates")
    from tests.test_train import ROOT

    root = tmp_path_factory.mktemp("tls")
    for args in (["run"], ["run", "--name", "box-b"], ["other"]):  # through the real command
        r = subprocess.run([sys.executable, "-m", "gearflow", "tls", "init", str(root / args[0]), *args[1:]],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr
    assert (root / "run" / "ca.key").stat().st_mode & 0o077 == 0 and (root / "run" / "node.key").stat().st_mode & 0o077 == 0
    (root / "mixed").mkdir()  # trusts the run's CA, but its own certificate is another CA's
    shutil.copyfile(root / "run" / "ca.pem", root / "mixed" / "ca.pem")
    for n in ("node.pem", "node.key"):
        shutil.copyfile(root / "other" / n, root / "mixed" / n)
    return root


@pytest.mark.parametrize("records", ["gearflow", "tls"])
def test_tls_round_trip_and_refusals(tls_dirs, tmp_path, records, monkeypatch):
    from gearflow.transport.tls import TlsError

    monkeypatch.setenv(auth.TLS_RECORDS_ENV, records)  # both ends' transport.tls_records
    svc = Service(token=TOKEN, tls=str(tls_dirs / "run"))
    svc.register("echo", lambda meta, bufs: (meta, bufs), roles=ANY_ROLE)
    svc.start()
    try:
        data = np.arange(1 << 18, dtype=np.float32)
        with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=10, tls=str(tls_dirs / "run" / "box-b")) as c:
            for i in range(3):
                meta, (back,) = c.call("echo", {"i": i}, [data])
                assert meta == {"i": i} and np.array_equal(back, data)
            if records == "tls":  # TLS decrypts in the loop: no wire thread reads the raw socket
                assert c._proto._wire is False and c._proto.send_cipher is None
            else:  # gearflow's records: the wire thread reads (and decrypts) the plain socket
                assert c._proto._wire and c._proto.send_cipher is not None and c._proto.reader.head_tags
        # an on-path listener sees neither the frames nor what they carry
        seen = bytearray()
        listener = socket.create_server(("127.0.0.1", 0))

        def sniff():
            down, _ = listener.accept()
            up = socket.create_connection(("127.0.0.1", svc.port))

            def pump(a, b):
                while chunk := a.recv(1 << 16):
                    seen.extend(chunk)
                    b.sendall(chunk)
                b.shutdown(socket.SHUT_WR)

            t = threading.Thread(target=pump, args=(up, down), daemon=True)
            t.start()
            pump(down, up)
            t.join(10)

        th = threading.Thread(target=sniff, daemon=True)
        th.start()
        with Client(("127.0.0.1", listener.getsockname()[1]), TOKEN, timeout_s=10, tls=str(tls_dirs / "run" / "box-b")) as c:
            assert c.call("echo", {"note": "plaintext-marker-4711"})[0] == {"note": "plaintext-marker-4711"}
        th.join(10)
        listener.close()
        assert len(seen) > 1000 and b"plaintext-marker-4711" not in seen and b"GFLW" not in seen
        # a client with a certificate of another CA, and one without TLS: no request is served
        for tls in (str(tls_dirs / "mixed"), str(tls_dirs / "other"), ""):
            with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=3, connect_timeout_s=3, tls=tls) as c:
                with pytest.raises((ServiceUnavailable, auth.AuthenticationError)):
                    c.call("echo", {"i": -1})
        assert svc.counts["requests"] == 4
    finally:
        svc.stop()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "ca.pem").write_text("x")
    with pytest.raises(TlsError, match=r"node.pem, node.key missing there \(make them with `gearflow tls init"):
        Client(("127.0.0.1", 1), TOKEN, tls=str(tmp_path / "half"))


def test_tls_init_takes_a_relative_directory(tmp_path, monkeypatch):
    """``gearflow tls init runs/tls`` (as the docs write it) from the directory above: openssl runs
    inside it, so the paths handed to it must not be relative to the caller's directory."""
    import shutil
    from pathlib import Path

    from gearflow.transport.tls import client_context, init

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make certificates")
    monkeypatch.chdir(tmp_path)
    made = init("runs/tls") + init("runs/tls", name="box-b")
    assert {Path(p).name for p in made} == {"ca.pem", "ca.key", "node.pem", "node.key"}
    assert (tmp_path / "runs/tls/node.pem").is_file() and (tmp_path / "runs/tls/box-b/node.key").is_file()
    client_context("runs/tls/box-b")  # a usable pair


def test_tls_pieces_regroups_parts_without_copying():
    from gearflow.transport.tls import pieces

    a = np.arange(10, dtype=np.uint8)
    b = np.arange(12, dtype=np.float32).reshape(3, 4)  # 48 bytes, 2-D
    parts = [b"head", a, b"", b, b"t"]
    groups = list(pieces(parts, 16))
    flat = b"".join(bytes(p) for p in parts)
    assert b"".join(bytes(v) for g in groups for v in g) == flat  # every byte, in order
    assert [sum(len(v) for v in g) for g in groups] == [16, 16, 16, 15]
    a[3] = 99  # views of the parts, not copies
    assert bytes(groups[0][1])[3] == 99
    assert all(type(v) is memoryview and any(v.obj is p for p in parts) for g in groups for v in g)
    big = bytes(range(256)) * 64  # a bytes part sliced into pieces: views of it, not copies of the rest
    assert [v.obj is big for g in pieces([big], 4096) for v in g] == [True] * 4
    assert list(pieces([], 16)) == [] and list(pieces([b""], 16)) == []
    assert [[bytes(v) for v in g] for g in pieces([b"x" * 32], 16)] == [[b"x" * 16], [b"x" * 16]]


def test_tls_big_frames_reach_the_transport_in_pieces(tls_dirs, monkeypatch):
    """A big frame goes to a TLS transport a piece at a time (tls.PIECE bytes), both ways: written
    whole, the transport grew OpenSSL's memory BIO to the frame's size before sending any of it."""
    from gearflow.transport import framing
    from gearflow.transport.tls import PIECE

    writes: list[int] = []
    made = framing.FramedProtocol.connection_made

    def recording(self, transport):
        made(self, transport)
        inner = transport.writelines

        def writelines(parts):
            writes.append(sum(memoryview(p).nbytes for p in parts))
            inner(parts)

        transport.writelines = writelines

    monkeypatch.setattr(framing.FramedProtocol, "connection_made", recording)
    monkeypatch.setenv(auth.TLS_RECORDS_ENV, "tls")  # TLS's own records: the transport encrypts
    svc = Service(token=TOKEN, tls=str(tls_dirs / "run"), loop="asyncio")
    svc.register("echo", lambda meta, bufs: (meta, bufs), roles=ANY_ROLE)
    svc.start()
    try:
        big = np.random.default_rng(0).integers(0, 255, 3 * PIECE + 12345, dtype=np.uint8)
        odd = np.arange(40_001, dtype=np.float64)  # a part that straddles pieces
        with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=10, tls=str(tls_dirs / "run" / "box-b"),
                    loop="asyncio") as c:  # fmt: skip
            writes.clear()
            meta, (b1, b2) = c.call("echo", {"k": 1}, [big, odd])
        assert meta == {"k": 1} and np.array_equal(b1, big) and np.array_equal(b2, odd)
        sent = big.nbytes + odd.nbytes
        assert max(writes) <= PIECE and sum(writes) > 2 * sent  # the request and the reply, in pieces
    finally:
        svc.stop()


def test_an_actor_credential_writes_only_the_partitions_of_its_joined_place(make_table):
    """Writer sessions of an actor-role connection are bound to the places joined under its
    credential's name (``run.join`` on its control connection, then writers on others)."""
    import multiprocessing as mp
    import queue

    from gearflow.roles.remote_actors import Members
    from gearflow.transport.actor import RemoteWriter
    from gearflow.transport.server.shard import ShardService

    apex = {"obs": "float32[3]", "action": "int64", "ret": "float32", "disc": "float32", "version": "int64"}
    table = make_table(spec=apex, P=4, S=64)
    members = Members("cfg: 1", {0: [0, 1], 1: [2, 3]}, queue.Queue(), mp.Event())
    with ShardService(table, token=TOKEN, learners=False) as shard:
        shard.writable = members.writable
        shard.service.register("run.join", members.join, with_connection=True, roles=ANY_ROLE)
        a0, a1 = auth.actor_credential(TOKEN, "box-a"), auth.actor_credential(TOKEN, "box-b")
        with Client(("127.0.0.1", shard.port), a0, timeout_s=10) as control:
            assert control.call("run.join", {"actor": None})[0]["partitions"] == [0, 1]
            w = RemoteWriter(("127.0.0.1", shard.port), num_streams=2, token=a0, partitions=[0, 1], timeout_s=10)
            assert w.partitions.tolist() == [0, 1]
            w.close()
            for token, parts in ((a0, [2, 3]), (a0, None), (a1, [2, 3])):  # another place; none asked; not joined
                with pytest.raises(AuthorizationError):
                    RemoteWriter(("127.0.0.1", shard.port), num_streams=2, token=token, partitions=parts, timeout_s=10)
            w = RemoteWriter(("127.0.0.1", shard.port), num_streams=2, token=TOKEN, partitions=[2, 3], timeout_s=10)
            assert w.partitions.tolist() == [2, 3]  # the learner's secret is not bound to places
            w.close()


def test_a_place_stays_bound_to_the_actor_name_that_first_joined_it(make_table):
    """A remote actor place joined under an actor credential's name is that name's for the run:
    when its connection drops, the same name gets it back on rejoin and another name cannot
    take it (it is given a free place of its own, or a clear refusal when none is left)."""
    import multiprocessing as mp
    import queue

    from gearflow.roles.remote_actors import Members
    from gearflow.transport.server.shard import ShardService

    table = make_table(spec={"obs": "float32[3]"}, P=4, S=64)
    members = Members("cfg: 1", {0: [0, 1], 1: [2, 3]}, queue.Queue(), mp.Event())
    a, b, c = (auth.actor_credential(TOKEN, n) for n in ("box-a", "box-b", "box-c"))
    with ShardService(table, token=TOKEN, learners=False) as shard:
        shard.service.register("run.join", members.join, with_connection=True, roles=ANY_ROLE)
        addr = ("127.0.0.1", shard.port)

        def join(token, actor=None):
            with Client(addr, token, timeout_s=10) as control:
                return control.call("run.join", {"actor": actor})[0]["actor"]

        def wait_free():  # the server sees the closed connection (its on_close frees the place)
            while members.joined:
                time.sleep(0.01)

        assert join(b, 1) == 1  # box-b holds place 1, then drops
        wait_free()
        with pytest.raises(ValueError, match="bound to actor credential 'box-b'"):
            join(a, 1)
        assert join(a) == 0  # box-a: the free place no other name holds
        wait_free()
        assert join(b) == 1 and join(a) == 0  # each name gets its own place back
        wait_free()
        with pytest.raises(ValueError, match="no remote actor place is free for actor credential .box-c.: the free ones are bound to names 0: box-a, 1: box-b"):
            join(c)
        assert join(TOKEN, 1) == 1  # the learner's secret is not bound to names


# ----------------------------------------------------------------- the MAC itself, and rows marked torn
def test_one_time_keys_and_tags_are_rfc_8439s():
    """The frame's one-time key is RFC 8439 §2.6.2's ``poly1305_key_gen`` (ChaCha20 block 0 under
    nonce ``0⁴ | seq``), and the Poly1305 its §2.5.2 Poly1305: both known-answer vectors."""
    mac = integrity.Sealer(bytes(range(0x80, 0xA0)))
    mac.seq = int.from_bytes(bytes(range(8)), "little")  # the vector's nonce: 00 00 00 00 | 00 01 .. 07
    mac.begin()
    assert mac._otk.raw[:32].hex() == "8ad5a08b905f81cc815040274ab29471a833b637e3fd0da508dbb8e2fdd1a646"
    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    assert mac._lib.EVP_MAC_init(mac._ctx, key, 32, None) == 1
    msg = b"Cryptographic Forum Research Group"
    assert mac._lib.EVP_MAC_update(mac._ctx, msg, len(msg)) == 1
    assert mac._lib.EVP_MAC_final(mac._ctx, mac._out, ctypes.byref(mac._outlen), 16) == 1
    assert mac._out.raw.hex() == "a8061dc1305136c6c22b8baf0c0127a9"


def _nh_reference(key: bytes, msg: bytes) -> bytes:
    """NH-Poly1305's Poly1305 input, in plain Python from its definition (integrity.py): per 1 KiB
    chunk (the last zero-padded to 16 bytes), four Toeplitz passes of NH over 16-byte units,
    four little-endian u64; then the message length."""
    k = struct.unpack(f"<{len(key) // 4}I", key)
    out = b""
    for lo in range(0, len(msg), 1024):
        c = msg[lo:lo + 1024]
        c += bytes(-len(c) % 16)
        w = struct.unpack(f"<{len(c) // 4}I", c)
        sums = [0, 0, 0, 0]
        for i in range(len(w) // 4):
            m0, m1, m2, m3 = w[4 * i:4 * i + 4]
            for p in range(4):
                kk = k[4 * i + 4 * p:4 * i + 4 * p + 4]
                sums[p] += ((m0 + kk[0]) % 2**32) * ((m2 + kk[2]) % 2**32) + ((m1 + kk[1]) % 2**32) * ((m3 + kk[3]) % 2**32)
        out += struct.pack("<4Q", *(x % 2**64 for x in sums))
    return out + struct.pack("<Q", len(msg))


@pytest.mark.parametrize("nh", ["c-simd", "c-scalar", "numpy"])
def test_the_tag_is_poly1305_over_nh_of_the_frame_by_its_definition(nh):
    """The frame tag is Poly1305 (the frame's one-time key) over NH of each 1 KiB chunk and the
    length: the C pass (AVX2 where the CPU has it, and the scalar one), and numpy's where ``_mac.c``
    is not built, each against a plain-Python NH from the definition; whole chunks, a short last
    one, an empty frame, and bytes fed in odd pieces, in pieces of many chunks (the C pass takes
    a run of whole chunks a call, up to its output batch of 128) and all at once."""
    from gearflow.transport import _mac

    if nh.startswith("c") and not hasattr(_mac, "NH"):
        pytest.skip("_mac.c is not built here")
    rng = np.random.default_rng(7)
    for size, piece in ((0, 777), (5, 777), (16, 777), (1024, 777), (3 * 1024 + 100, 777), (40_000, 777),
                        (40_000, 5_000), (300 * 1024 + 100, 70_001), (300 * 1024 + 100, 1 << 20)):  # fmt: skip
        msg = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        mac = integrity.Sealer(bytes(range(32)))
        if nh == "c-scalar":
            mac._nh = _mac.NH(mac._nh_key(), integrity._UPDATE_ADDRESS, mac._ctx, simd=False)
        elif nh == "numpy":
            mac._nh = integrity._NumpyNH(mac._nh_key(), mac._lib, mac._ctx)
        mac.begin()
        for lo in range(0, size, piece):  # pieces across the chunk edges
            mac.update(msg[lo:lo + piece])
        got = mac.final()
        want = integrity.Sealer(bytes(range(32)))
        want.begin()  # the same one-time key; its Poly1305 fed the reference NH by hand
        ref = _nh_reference(want._nh_key(), msg)
        assert want._lib.EVP_MAC_update(want._ctx, ref, len(ref)) == 1
        assert want._lib.EVP_MAC_final(want._ctx, want._out, ctypes.byref(want._outlen), 16) == 1
        assert got == want._out.raw, (nh, size, piece)


def test_a_big_frames_mac_thread_holds_its_spans_before_the_socket_write_starts(monkeypatch):
    """``seal_async(..., started=True)`` returns only once the MAC job has begun in its thread
    (uvloop's ``writelines`` keeps the GIL while it writes: a MAC thread not yet started then waits
    for the whole write), and the tag is the tag of the bytes."""
    import threading

    pool, began = integrity.mac_pool(), []
    for f in [pool.submit(time.sleep, 0.01) for _ in range(8)]:  # its threads started and idle
        f.result()

    class Recording:  # the pool, noting the thread each job begins in before it runs
        def submit(self, fn):
            return pool.submit(lambda: (began.append(threading.get_ident()), fn()))

    monkeypatch.setattr(integrity, "mac_pool", Recording)
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8)
    mac, done = integrity.Sealer(bytes(32)), threading.Event()
    mac.begin()
    mac.seal_async([data], lambda err: done.set(), started=True)
    assert began and began[0] != threading.get_ident()  # the MAC job had begun before seal_async returned
    done.wait()
    ref = integrity.Sealer(bytes(32))
    ref.begin()
    ref.update(data)
    assert mac.final() == ref.final()


def test_the_c_nh_refuses_a_bad_key_or_callback_and_an_uninitialised_object():
    """``_mac.NH``'s bad inputs are a ValueError naming them, never a crash: a key of another
    length, a null function or context, an object made without its key (nothing to feed)."""
    from gearflow.transport import _mac

    if not hasattr(_mac, "NH"):
        pytest.skip("_mac.c is not built here")
    mac = integrity.Sealer(bytes(32))
    key = mac._nh_key()
    for args, what in [((key[:-4], integrity._UPDATE_ADDRESS, mac._ctx), "1072-byte key"),
                       ((key, 0, mac._ctx), "non-null fn"), ((key, integrity._UPDATE_ADDRESS, 0), "non-null fn, ctx")]:  # fmt: skip
        with pytest.raises(ValueError, match=what):
            _mac.NH(*args)
    bare = _mac.NH.__new__(_mac.NH)
    for call in (lambda: bare.update(bytes(2048)), lambda: bare.update_at(0, 0), lambda: bare.update_spans([b"x"]),
                 bare.finish):  # fmt: skip
        with pytest.raises(ValueError, match="not initialised"):
            call()


def test_the_span_mac_is_the_mac_of_the_bytes_with_and_without_the_c_helper(monkeypatch):
    """``update_spans`` (rows by address, bytes, memoryviews, arrays; ``_mac.c`` in one call where
    it is built, numpy's NH where not) tags exactly the bytes the spans name."""
    rows = np.random.default_rng(0).integers(0, 255, (6, 3000), dtype=np.uint8)
    base = rows.__array_interface__["data"][0]
    spans = [b"head", (base + 3000, 3000), memoryview(rows[4]), (base, 0), rows[2], b"", (base + 5 * 3000, 1000)]
    flat = b"head" + rows[1].tobytes() + rows[4].tobytes() + rows[2].tobytes() + rows[5, :1000].tobytes()

    def tag(feed) -> bytes:
        mac = integrity.Sealer(bytes(32))
        mac.begin()
        feed(mac)
        return mac.final()

    want = tag(lambda m: m.update(flat))
    assert tag(lambda m: m.update_spans(spans)) == want
    monkeypatch.setattr(integrity, "_native", None)  # numpy's NH
    assert tag(lambda m: m.update_spans(spans)) == want


def _torn_frame(marks: np.ndarray) -> tuple[bytes, list]:
    """A reply sealed as the shard seals one whose tail marked ``marks``: (the frame's bytes as
    sent, its layout); rows of 300 bytes, 4 items, the marks last."""
    from gearflow.transport.framing import REPLY, encode, frame_buffers

    rows = np.arange(4 * 300, dtype=np.int64).astype(np.uint8).reshape(4, 300)
    bufs = [np.arange(4, dtype=np.int64), rows, marks]
    seal = integrity.Sealer(b"k" * integrity.KEY_BYTES)
    parts = encode(REPLY, 7, "replay.sample", {"torn": True, "names": ["obs"]}, bufs)
    seal.begin()
    for p in parts[:-1]:
        seal.update(p)
    if marks.any():  # the reseal: again, without the marked rows
        seal.restart()
        for p in integrity.masked_frame([parts[0]], frame_buffers(bufs), marks):
            seal.update(p)
    seal.update(parts[-1])
    parts.append(seal.trailer())
    return b"".join(bytes(p) for p in parts), bufs


def _open(frame: bytes, threaded: bool = False):
    """Feed ``frame`` to a real FrameReader with the matching opener: the delivered arrays, or the
    IntegrityError it raised. ``threaded``: its buffer block MACed in a MAC thread (as big frames are)."""
    from gearflow.transport.framing import REPLY, FrameLimits, FrameReader

    got = []
    reader = FrameReader(lambda *a: got.append(a[4]), FrameLimits(), {REPLY})
    reader.opener = integrity.Opener(b"k" * integrity.KEY_BYTES)
    if threaded:
        reader.opener.thread_bytes = 0
    try:
        buf = reader.get_buffer(-1)
        buf[:len(frame)] = frame
        reader.buffer_updated(len(frame))
    except integrity.IntegrityError as exc:
        return exc
    return got[0]


@pytest.mark.parametrize("threaded", [False, True], ids=["inline", "mac-thread"])
def test_rows_marked_torn_are_outside_the_mac_and_nothing_else_is(threaded):
    """A frame whose marks name item 1: changing a byte of item 1's row is accepted (the sampler
    redraws the item: its bytes are never used), changing one of item 2's row, a key, or the
    marks themselves (clearing item 1's, setting item 3's) is an IntegrityError; with no mark set
    every row is covered. The same whether the receiver MACs the block inline or in a MAC thread."""
    def opened(frame: bytes):
        return _open(frame, threaded)

    marks = np.array([0, 1, 0, 0], np.uint8)
    frame, _ = _torn_frame(marks)
    block = HEADER.size + HEADER.unpack(frame[:HEADER.size])[4]  # the buffer block: keys at 0, rows at 64, marks at 1280
    row = lambda i: block + 64 + 300 * i + 5  # noqa: E731  (a byte inside item i's row)

    def flip(at: int) -> bytes:
        b = bytearray(frame)
        b[at] ^= 0x20
        return bytes(b)

    ok = opened(frame)
    assert not isinstance(ok, Exception) and ok[2].tolist() == [0, 1, 0, 0]
    got = opened(flip(row(1)))
    assert not isinstance(got, Exception)  # a marked row: not authenticated (the sampler redraws the item)
    assert got[1][1, 5] == ok[1][1, 5] ^ 0x20 and np.array_equal(got[1][2], ok[1][2])
    for what, at in [("an unmarked row", row(2)), ("a key", block + 3), ("item 1's mark", block + 1280 + 1),
                     ("item 3's mark", block + 1280 + 3)]:  # fmt: skip
        assert isinstance(opened(flip(at)), integrity.IntegrityError), what
    clean, _ = _torn_frame(np.zeros(4, np.uint8))  # no mark: every byte is covered
    b = bytearray(clean)
    b[row(1)] ^= 0x20
    assert isinstance(opened(bytes(b)), integrity.IntegrityError)
