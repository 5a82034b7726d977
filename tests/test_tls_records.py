"""gearflow's records under TLS (transport/records.py): the TLS handshake and a key exchange inside
it, then every byte AES-128-CTR under the exchanged keys, each frame under the frame MAC and a head
tag. Real services and clients over loopback, a relay between them that flips one byte of what it
forwards; the cipher and the head key against their published vectors."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading

import numpy as np
import pytest

from gearflow.transport import auth, integrity, records
from gearflow.transport.client import Client, ServiceUnavailable
from gearflow.transport.records import KeyExchange, RecordsError, StreamCipher
from gearflow.transport.service import ANY_ROLE, Service
from tests.helpers_relay import LoopbackRelay
from tests.test_wire_security import tls_dirs  # noqa: F401 - the module's certificates fixture

TOKEN = "records-secret-0123456"

pytestmark = pytest.mark.skipif(not records.available(), reason="needs OpenSSL 3's libcrypto")


# ----------------------------------------------------------------- the cipher and the keys
# NIST SP 800-38A, F.5.1 CTR-AES128.Encrypt
_KEY = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
_IV = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
_PT = bytes.fromhex("6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51"
                    "30c81c46a35ce411e5fbc1191a0a52eff69f2445df4f9b17ad2b417be66c3710")  # fmt: skip
_CT = bytes.fromhex("874d6191b620e3261bef6864990db6ce9806f66b7970fdff8617187bb9fffdff"
                    "5ae4df3edbd5d35e5b4f09020db03eab1e031dda2fbe03d1792170a0f3009cee")  # fmt: skip


@pytest.mark.parametrize("native", [True, False], ids=["c-helper", "ctypes"])
def test_the_stream_cipher_is_aes_128_ctr_and_chains_across_pieces(native):
    def cipher():
        c = StreamCipher(_KEY, _IV)
        if not native:
            c.native = None
        elif c.native is None:
            pytest.skip("_mac.c is not built")
        return c

    c = cipher()  # in place, in uneven pieces: the keystream goes on where the last piece stopped
    buf = bytearray(_PT)
    for lo, hi in ((0, 5), (5, 21), (21, 22), (22, 64)):
        c.apply(memoryview(buf)[lo:hi])
    assert bytes(buf) == _CT
    c = cipher()  # sealed from parts (bytes, arrays, an empty one) into new buffers: the same bytes
    parts = [_PT[:3], np.frombuffer(_PT[3:40], np.uint8), b"", memoryview(_PT)[40:]]
    out = c.seal(parts)
    assert b"".join(bytes(o) for o in out) == _CT and parts[0] == _PT[:3]  # the parts are only read
    c = cipher()  # a frame over one piece: pieces of wire_io.PIECE, still one keystream
    big = np.random.default_rng(1).integers(0, 255, 3 * records.PIECE + 77, dtype=np.uint8)
    sealed = c.seal([big])
    assert [o.nbytes for o in sealed] == [records.PIECE] * 3 + [77]
    back = np.concatenate(sealed)
    cipher().apply(back)
    assert np.array_equal(back, big)
    if native:  # encrypted ahead by a thread while this one writes what is done: the same keystream
        got: list = []
        cipher().write_ahead(parts, lambda v: got.append(bytes(v)))
        assert b"".join(got) == _CT
        got.clear()
        c = cipher()
        c.write_ahead([big[:100], big[100:]], lambda v: got.append(bytes(v)))
        assert b"".join(got) == np.concatenate(sealed).tobytes()  # written as the pieces got done
        from gearflow.transport import _mac

        # each write is of bytes already encrypted: its last ones checked the moment it is handed over
        # (a writer told of bytes not done yet would find them unencrypted)
        frame = np.random.default_rng(3).integers(0, 255, 16 << 20, dtype=np.uint8)
        want, at = np.concatenate(cipher().seal([frame])), [0]

        def check(v):
            end = at[0] + len(v)
            assert bytes(v[-16:]) == want[end - 16:end].tobytes(), f"bytes {end - 16}..{end} not encrypted yet"
            at[0] = end

        cipher().write_ahead([frame], check)
        assert at[0] == frame.nbytes
        progress = np.zeros(1, np.int64)  # a failure says so at once: the writer never waits for it
        with pytest.raises(ValueError, match="spans of 3 bytes into a buffer of 2"):
            _mac.xor_spans_ahead(c.native, [b"abc"], np.empty(2, np.uint8), progress, 4096)
        assert progress[0] == -1 and _mac.wait_progress(progress, 1) == -1
        with pytest.raises(RecordsError, match="encrypting a frame failed"):  # a part the C pass cannot read
            c.write_ahead([np.arange(100, dtype=np.uint8)[::2]], lambda v: None)  # (the writer once hung here)
    with pytest.raises(ValueError, match="stream key has 16 bytes"):
        StreamCipher(bytes(32))


def test_the_head_key_is_bytes_32_to_63_of_the_frames_chacha20_block():
    """RFC 8439 A.1, test vector 1 (key and nonce zero, counter 0): the frame tag's one-time key is
    the block's first 32 bytes, the head tag's its last 32; the head tag is Poly1305 under it."""
    mac = integrity.Sealer(bytes(32))
    mac.begin()
    block = mac._otk.raw
    assert block.hex() == ("76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
                           "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")  # fmt: skip
    head = b"a header and an envelope"
    ref = mac._lib.EVP_MAC_CTX_new(integrity._poly)
    out, n = ctypes.create_string_buffer(16), ctypes.c_size_t()
    assert mac._lib.EVP_MAC_init(ref, block[32:], 32, None) == 1
    assert mac._lib.EVP_MAC_update(ref, head, len(head)) == 1
    assert mac._lib.EVP_MAC_final(ref, out, ctypes.byref(n), 16) == 1
    mac._lib.EVP_MAC_CTX_free(ref)
    assert mac.head_tag(head) == out.raw
    opener = integrity.Opener(bytes(32))
    opener.begin()
    opener.check_head(head, out.raw)
    with pytest.raises(integrity.IntegrityError, match="header and envelope failed their MAC check"):
        opener.check_head(head[:-1] + b"E", out.raw)


def _exchange(tls_dirs, extra: bytes = b""):  # noqa: F811
    """Both ends of a key exchange in memory; ``extra`` arrives with the server's key message."""
    from gearflow.transport.tls import client_context, server_context

    to_s, to_c = [], []
    srv = KeyExchange(server_context(str(tls_dirs / "run")), True, to_c.append)
    cli = KeyExchange(client_context(str(tls_dirs / "run" / "box-b")), False, to_s.append)
    cli.start()
    assert srv.feed(b"".join(to_s)) is None  # the ClientHello
    to_s.clear()
    assert cli.feed(b"".join(to_c)) is None  # the server's flight: the client's handshake is done
    to_c.clear()
    assert srv.feed(b"".join(to_s)) == b""  # its Finished and key message: the server is done
    rest = cli.feed(b"".join(to_c) + extra)  # the server's key message, then its first records
    return srv, cli, rest


def test_the_key_exchange_hands_over_at_the_record_boundary(tls_dirs):  # noqa: F811
    first = os.urandom(777)  # what the server sent right after its key message (its challenge)
    srv, cli, rest = _exchange(tls_dirs, first)
    assert rest == first  # OpenSSL read no byte past the key message's record
    c_tx, c_rx, c_mtx, c_mrx = cli.keys()
    s_tx, s_rx, s_mtx, s_mrx = srv.keys()
    assert c_mtx == s_mrx and c_mrx == s_mtx and c_mtx != c_mrx  # one MAC key per direction
    msg = os.urandom(5000)
    sealed = [tx.seal([msg])[0] for tx in (c_tx, s_tx)]
    assert bytes(sealed[0]) != msg and bytes(sealed[0]) != bytes(sealed[1])  # a keystream per direction
    for ct, rx in zip(sealed, (s_rx, c_rx)):
        rx.apply(ct)
        assert bytes(ct) == msg
    _, cli2, _ = _exchange(tls_dirs)
    assert cli2.keys()[2] != c_mtx  # fresh keys on every connection
    with pytest.raises(RecordsError, match="the key exchange is over"):
        cli.feed(b"x")


def test_the_service_issues_no_session_tickets(tls_dirs):  # noqa: F811
    """No TLS message after the handshake (gearflow's records leave TLS there) and nothing to
    resume a session with: the service's context sends TLS 1.3 no NewSessionTicket."""
    from gearflow.transport.tls import client_context, server_context

    a, b = socket.socketpair()
    ctx = server_context(str(tls_dirs / "run"))

    def serve():
        with ctx.wrap_socket(a, server_side=True) as s:
            s.sendall(b"k")  # after any tickets: the client has read them when this arrives
            s.recv(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with client_context(str(tls_dirs / "run" / "box-b")).wrap_socket(b) as c:
        assert c.recv(1) == b"k" and c.version() == "TLSv1.3"
        assert not c.session.has_ticket
        c.sendall(b"x")
    t.join(timeout=60)


def test_a_peer_flooding_the_key_exchange_is_cut_off(tls_dirs):  # noqa: F811
    from gearflow.transport.tls import server_context

    srv = KeyExchange(server_context(str(tls_dirs / "run")), True, lambda b: None)
    with pytest.raises(RecordsError, match="before the TLS key exchange was done"):
        srv.feed(bytes(records.MAX_PENDING + 1))
    srv = KeyExchange(server_context(str(tls_dirs / "run")), True, lambda b: None)
    with pytest.raises(RecordsError, match="TLS failed"):
        srv.feed(b"GET / HTTP/1.1\r\n\r\n")


# ----------------------------------------------------------------- real ends, a relay between them
class FlipRelay(LoopbackRelay):
    """Forwards bytes as they come; once :meth:`arm` ed for a direction, it flips bit 0 of the byte
    ``at`` bytes into what that direction carries from then on, once."""

    def __init__(self, port: int):
        self.armed: dict[str, int | None] = {"c2s": None, "s2c": None}
        self.seen = {"c2s": bytearray(), "s2c": bytearray()}
        self.lock = threading.Lock()
        super().__init__(port)

    def arm(self, direction: str, at: int) -> None:
        with self.lock:
            self.armed[direction] = at

    def pump(self, src, dst, direction: str, state=None) -> None:
        while True:
            try:
                chunk = bytearray(src.recv(1 << 16))
            except OSError:
                break
            if not chunk:
                break
            with self.lock:
                at = self.armed[direction]
                if at is not None:
                    if at < len(chunk):
                        chunk[at] ^= 0x01
                        self.armed[direction] = None
                    else:
                        self.armed[direction] = at - len(chunk)
                self.seen[direction] += chunk
            try:
                dst.sendall(chunk)
            except OSError:
                break
        self.shut(src, dst)


@pytest.fixture
def served(tls_dirs):  # noqa: F811
    applied = []
    svc = Service(token=TOKEN, tls=str(tls_dirs / "run"), tls_records="gearflow")

    def echo(meta, bufs):
        applied.append(meta.get("i"))
        return meta, bufs

    svc.register("echo", echo, roles=ANY_ROLE)
    svc.start()
    relay = FlipRelay(svc.port)
    yield svc, relay, applied
    relay.close()
    svc.stop()


def _client(tls_dirs, address):  # noqa: F811
    return Client(address, TOKEN, timeout_s=10, connect_timeout_s=5, tls=str(tls_dirs / "run" / "box-b"),
                  tls_records="gearflow")  # fmt: skip


MARK = b"plaintext-marker-4711"


@pytest.mark.parametrize("where", ["header", "envelope", "small-block", "big-block"])
def test_a_flipped_request_byte_is_refused_before_it_is_applied(served, tls_dirs, caplog, where):  # noqa: F811
    """A request goes c2s as header (32 B) | envelope | head tag | block | trailer, encrypted: a
    byte flipped anywhere in it closes the connection and the handler never sees the request."""
    _, relay, applied = served
    small = np.frombuffer(MARK * 8, np.uint8).copy()
    big = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)  # over MAC_THREAD_BYTES
    with _client(tls_dirs, relay.address) as c:
        meta, (back,) = c.call("echo", {"i": 0}, [small])
        assert meta == {"i": 0} and np.array_equal(back, small)
        assert MARK not in relay.seen["c2s"] and MARK not in relay.seen["s2c"] and b"GFLW" not in relay.seen["c2s"]
        at = {"header": 9, "envelope": 40, "small-block": 200, "big-block": 2_000_000}[where]
        relay.arm("c2s", at)  # everything of the first call has passed: the next c2s byte is the request's first
        with caplog.at_level(logging.WARNING), pytest.raises(ServiceUnavailable):
            c.call("echo", {"i": 1}, [big if where == "big-block" else small], timeout_s=10)
    assert applied == [0]
    what = "header and envelope failed their MAC check" if where in ("header", "envelope") else "failed its MAC check"
    assert any(what in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("size", [4096, 3 << 20], ids=["loop", "wire-thread"])
def test_a_flipped_reply_byte_never_reaches_the_caller(served, tls_dirs, size):  # noqa: F811
    """s2c: a reply's block byte flipped on the way (read by the loop, or a big block by the
    client's wire thread, decrypted and MACed as it lands) fails the call; the next call connects anew."""
    _, relay, applied = served
    data = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8)
    with _client(tls_dirs, relay.address) as c:
        assert np.array_equal(c.call("echo", {"i": 0}, [data])[1][0], data)
        relay.arm("s2c", size // 2)
        with pytest.raises(ServiceUnavailable, match="frame integrity check failed"):
            c.call("echo", {"i": 1}, [data])
        meta, (back,) = c.call("echo", {"i": 2}, [data])  # a fresh connection, fresh keys
        assert meta == {"i": 2} and np.array_equal(back, data) and c.generation == 2
    assert applied == [0, 1, 2]


def test_both_ends_must_carry_frames_the_same_way(tls_dirs):  # noqa: F811
    """gearflow's records against TLS's records, either way round: refused, saying which setting."""
    # a records client learns it in the key exchange (not retried); a TLS-records one from the
    # service's key message where its first frame should be (the last attempt's reason)
    for svc_mode, cli_mode, error, said in (("tls", "gearflow", auth.TransportMismatch, "keeps frames in TLS records"),
                                            ("gearflow", "tls", ServiceUnavailable, "uses gearflow's records under TLS")):  # fmt: skip
        svc = Service(token=TOKEN, tls=str(tls_dirs / "run"), tls_records=svc_mode)
        svc.register("echo", lambda meta, bufs: (meta, bufs), roles=ANY_ROLE)
        svc.start()
        try:
            with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=3, connect_timeout_s=3,
                        tls=str(tls_dirs / "run" / "box-b"), tls_records=cli_mode) as c, pytest.raises(error, match=said):  # fmt: skip
                c.call("echo", {})
            assert svc.counts["requests"] == 0
        finally:
            svc.stop()
    with pytest.raises(ValueError, match="transport.tls_records must be one of gearflow, tls"):
        Client(("127.0.0.1", 1), TOKEN, tls=str(tls_dirs / "run"), tls_records="dtls")


def test_integrity_off_keeps_frames_in_tls_records(tls_dirs):  # noqa: F811
    """Nothing would authenticate the frames of gearflow's records without the frame MAC."""
    svc = Service(token=TOKEN, tls=str(tls_dirs / "run"), integrity=False)
    svc.register("echo", lambda meta, bufs: (meta, bufs), roles=ANY_ROLE)
    svc.start()
    try:
        assert not svc.records
        with Client(("127.0.0.1", svc.port), TOKEN, timeout_s=10, tls=str(tls_dirs / "run" / "box-b"),
                    integrity=False) as c:  # fmt: skip
            assert c.call("echo", {"k": 1})[0] == {"k": 1}
            assert not c.records and c._proto.send_cipher is None and c._proto._tls
    finally:
        svc.stop()


def test_a_silent_or_plain_peer_never_gets_a_challenge(tls_dirs):  # noqa: F811
    """Before the TLS handshake and key exchange are done the service sends nothing of its own: a
    plain-TCP peer gets no challenge (no nonce, nothing to replay); it is refused at auth_timeout_s."""
    from gearflow.transport.service import ServiceLimits

    svc = Service(token=TOKEN, tls=str(tls_dirs / "run"), limits=ServiceLimits(auth_timeout_s=1.0))
    svc.start()
    try:
        s = socket.create_connection(("127.0.0.1", svc.port))
        s.settimeout(30)
        s.sendall(b"GFLW" + bytes(28))  # a plain gearflow header: not TLS
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        assert b"GFLW" not in got  # at most a TLS alert, then the close
        s.close()
    finally:
        svc.stop()
    assert svc.counts["auth_refused"] >= 1


def test_a_frame_that_comes_with_the_key_message_is_read(tls_dirs):  # noqa: F811
    """The service's key message and its challenge in one TCP write (here a service of the test's
    own, over a blocking socket): the client's key exchange hands the challenge on as the first
    bytes of the records, and the client answers it with its AUTH frame."""
    from gearflow.transport.framing import AUTH, CHALLENGE, ERROR, HEADER, encode
    from gearflow.transport.tls import server_context

    listener = socket.create_server(("127.0.0.1", 0))
    c = _client(tls_dirs, ("127.0.0.1", listener.getsockname()[1]))
    refused: list = []

    def connect():
        try:
            c.connect(30)
        except auth.AuthenticationError as exc:
            refused.append(exc)

    th = threading.Thread(target=connect, daemon=True)
    th.start()
    conn, _ = listener.accept()
    conn.settimeout(30)
    out: list = []
    kx = KeyExchange(server_context(str(tls_dirs / "run")), True, out.append)
    rest = None
    while rest is None:  # the handshake; the client's key message
        data = conn.recv(1 << 16)
        assert data, "the client closed during the handshake"
        rest = kx.feed(data)
        if rest is None and out:
            conn.sendall(b"".join(out))
            out.clear()
    tx, rx, mac_tx, _ = kx.keys()
    sealer = integrity.Sealer(mac_tx)

    def sealed(kind: int, meta: dict) -> bytes:  # as the service writes a frame on gearflow's records
        sealer.begin()
        parts = encode(kind, 0, "", meta)
        frame = [parts[0], sealer.head_tag(parts[0]), *parts[1:]]
        sealer.update_spans(parts)
        return b"".join(bytes(p) for p in tx.seal([*frame, sealer.trailer()]))

    assert out  # the service's key message, held back: it goes in the one write with the challenge
    conn.sendall(b"".join(out) + sealed(CHALLENGE, {"nonce": auth.new_nonce(), "version": auth.PROTOCOL, "integrity": True}))
    got = bytearray(rest)
    while len(got) < HEADER.size:
        data = conn.recv(1 << 16)
        assert data, "the client closed instead of answering the challenge"
        got += data
    head = bytearray(got[:HEADER.size])
    rx.apply(head)
    assert HEADER.unpack(head)[:3] == (b"GFLW", 3, AUTH)
    conn.sendall(sealed(ERROR, {"type": "AuthenticationError", "message": "refused by the test"}))  # not retried
    th.join(30)
    assert [str(e) for e in refused] == ["refused by the test"]
    conn.close()
    listener.close()
    c.close()
