"""gearflow's records under TLS: the TLS handshake authenticates both ends and carries fresh key
material; after it the connection leaves TLS, and every byte is encrypted by a stream cipher of
gearflow's while the frame MAC (:mod:`gearflow.transport.integrity`) protects each frame.

Why. A TLS transport under asyncio or uvloop encrypts in OpenSSL's memory BIOs: the sender's bytes
are copied into the BIO as records and out of it to the socket, the receiver's from its read buffer
into the BIO, into OpenSSL's record buffer and out again, and each record is a Python-driven step.
The frame MAC already authenticates every frame, off the critical path (MAC threads, the wire
thread's MAC as bytes land); what TLS adds beyond it is confidentiality, which a stream cipher
gives at one pass over the bytes, in place on the receiver, as they land. Measured
(``gearflow bench transport --workloads sample``, 14.5 MB batches, ``gearflow/transport/README.md``):
TLS's records 0.28–0.34 of the raw socket, gearflow's records 0.45–0.55 (median 0.485 of 15 runs).

The connection (both ends have ``transport.tls`` and ``transport.integrity`` on; with integrity off
frames stay in TLS records — nothing else would authenticate them):

1. **TLS handshake** over the plain TCP connection, driven here through :class:`ssl.SSLObject` and
   memory BIOs: mutual certificates of the run's CA, as :mod:`~gearflow.transport.tls` sets up.
2. **Key exchange inside TLS.** Each end, its handshake done, writes one TLS record holding
   :data:`MESSAGE` — ``b"GFKY"``, the version, 32 random bytes — and reads the peer's. Only the two
   TLS endpoints ever see those bytes (an on-path attacker sees ciphertext under TLS's keys; TLS's
   ECDHE gives them forward secrecy). ``K = HKDF-SHA256(ikm = client's random | server's random,
   salt = "gearflow records v1", info = "keys")``, 96 bytes: an AES-128 key per direction, then a
   32-byte frame-MAC key per direction for the frames before the secret handshake.
3. **Records.** After its peer's key message, each end stops feeding TLS: every byte it sends from
   then on is ``P XOR AES-128-CTR(k_dir, counter from 0)`` (one keystream per direction and
   connection, never restarted: a key is used for one stream only), and what it receives is
   decrypted the same way, in place, as it lands. The bytes that came with the peer's key message
   (OpenSSL reads a memory BIO a record at a time: they are still in it) are the first of that
   stream. Every frame from the first (the service's CHALLENGE) carries the frame MAC's trailer —
   under the key exchange's MAC keys until the secret handshake's own (``auth.frame_keys``) take
   over at ``AUTH_OK``, as they do without TLS — and a **head tag** after its envelope: Poly1305,
   keyed by bytes 32–63 of the frame's ChaCha20 block (``Sealer.head_tag``; bytes 0–31 are the
   frame tag's one-time key), over the frame's header and envelope, checked before the envelope is
   parsed.

A frame of ≥ 1 MiB is encrypted ahead of its writes (:meth:`StreamCipher.write_ahead`): a MAC-pool
thread runs the AES over the whole frame without the GIL while the loop writes what is done — the
shard's loop thread was the bound, its AES in series with its sends.

Why it is as safe as TLS's records here (the argument: ``docs/security.md``, "Records under TLS").
Confidentiality: CTR under a key known only to the two TLS endpoints, each keystream position
used once. Integrity: every byte of a frame the receiver uses is under the frame MAC, checked
before delivery; CTR maps each ciphertext to one plaintext, so a changed ciphertext is a changed
plaintext, which fails that MAC (SSH's CTR mode with a MAC over the plaintext and a sequence
number, as proven by Bellare, Kohno and Namprempre 2002 and, with the length field handled before
the MAC, Paterson and Watson 2010). What the receiver reads before a tag is checked is only the
32-byte header, whose fields an observer of the traffic learns anyway (sizes, kinds); the envelope
waits for its head tag, so no error of parsing depends on bytes an attacker could have altered.

    kx = KeyExchange(context, server_side=False, write=transport.write)
    kx.start()                          # the client's ClientHello
    rest = kx.feed(data)                # None until the peer's key message came; then the bytes after it
    tx, rx, mac_tx, mac_rx = kx.keys()  # StreamCipher ×2, frame-MAC keys ×2
    done = kx.step(data)                # the same for a protocol: None, the error, or (rest, tx, rx, Sealer, Opener)
"""

from __future__ import annotations

import ctypes
import os
import ssl
import struct
from collections.abc import Callable

import numpy as np

from gearflow.errors import GearflowError
from gearflow.transport import integrity
from gearflow.transport.auth import TransportMismatch
from gearflow.transport.tls import pieces
from gearflow.transport.wire_io import PIECE

try:
    from gearflow.transport import _mac as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["MESSAGE", "KeyExchange", "RecordsError", "StreamCipher", "available"]

MESSAGE = struct.Struct("<4sH32s")  # b"GFKY", version, random
MAGIC, VERSION = b"GFKY", 1
KEY_BYTES = 16  # AES-128
SALT, INFO = b"gearflow records v1", b"keys"
MAX_PENDING = 256 << 10  # bytes a peer may have sent ahead of the key exchange (a handshake is ~4 KB)
_CTR = None


class RecordsError(GearflowError, ConnectionError):
    """The TLS handshake or the key exchange inside it failed; the message says how."""


def _ctr():
    """(libcrypto, its AES-128-CTR, EVP_EncryptUpdate's address and a prototype taking addresses)."""
    global _CTR
    if _CTR is None:
        lib = integrity.require()
        lib.EVP_CIPHER_fetch.restype = ctypes.c_void_p
        cipher = lib.EVP_CIPHER_fetch(None, b"AES-128-CTR", None)
        if not cipher:
            raise RecordsError("this libcrypto has no AES-128-CTR")
        address = ctypes.cast(lib.EVP_EncryptUpdate, ctypes.c_void_p).value
        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                 ctypes.c_void_p, ctypes.c_int)  # fmt: skip
        _CTR = (lib, cipher, address, proto(address))
    return _CTR


def available() -> bool:
    """Whether gearflow's records can run here (OpenSSL ≥ 3's libcrypto, with AES-128-CTR)."""
    try:
        _ctr()
    except (GearflowError, OSError):
        return False
    return True


class StreamCipher:
    """One direction's keystream: AES-128-CTR under ``key`` from counter block ``iv``, going on
    where the last call stopped. One thread at a time (the connection's writer, or its reader)."""

    def __init__(self, key: bytes, iv: bytes = bytes(16)):
        if len(key) != KEY_BYTES or len(iv) != 16:
            raise ValueError(f"a stream key has {KEY_BYTES} bytes and its counter block 16, got {len(key)}, {len(iv)}")
        lib, cipher, address, self._update = _ctr()
        self._lib = lib
        self._ctx = lib.EVP_CIPHER_CTX_new()
        if not self._ctx:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        if lib.EVP_EncryptInit_ex(self._ctx, cipher, None, key, iv) != 1:
            raise RecordsError("EVP_EncryptInit_ex (AES-128-CTR) failed")
        self.native = (address, self._ctx) if _native is not None and hasattr(_native, "xor_spans") else None

    def apply(self, buf) -> None:
        """``buf`` (writable, C-contiguous) through the keystream, in place."""
        n = memoryview(buf).nbytes
        if not n:
            return
        if self.native is not None:
            _native.xor_inplace(self.native, buf)
        else:
            a = np.frombuffer(buf, np.uint8)
            self._run(a.ctypes.data, a.ctypes.data, n)

    def seal(self, parts: list) -> list:
        """``parts`` (bytes-like) through the keystream into new buffers of at most
        :data:`~gearflow.transport.wire_io.PIECE` bytes each, in order (the parts are only read):
        each piece is encrypted just before the caller writes it (:meth:`seal_iter`)."""
        return list(self.seal_iter(parts))

    def seal_iter(self, parts: list):
        """:meth:`seal` a piece at a time: the next piece is encrypted when asked for, so the one
        before can leave while it is in cache."""
        for group in pieces(parts, PIECE):
            n = sum(len(v) for v in group)
            out = np.empty(n, np.uint8)
            if self.native is not None:
                _native.xor_spans(self.native, group, out)
            else:
                at = out.ctypes.data
                for v in group:
                    src = np.frombuffer(v, np.uint8)
                    self._run(at, src.ctypes.data, len(v))
                    at += len(v)
            yield out

    def write_ahead(self, parts: list, write: Callable) -> None:
        """``parts`` through the keystream to ``write`` (a transport's), encrypted ahead by a thread
        of :func:`~gearflow.transport.integrity.mac_pool` into one buffer while this thread writes
        what is done, a piece or more at a time, waiting for the next without the GIL: the AES
        runs beside the writes instead of in series with them (a big frame on a busy loop).
        Raises :class:`RecordsError` if the encryption failed (the connection is unusable)."""
        if self.native is None or not hasattr(_native, "xor_spans_ahead"):
            for piece in self.seal_iter(parts):
                write(memoryview(piece))
            return
        total = sum(memoryview(p).nbytes for p in parts)
        out, progress = np.empty(total, np.uint8), np.zeros(1, np.int64)
        job = integrity.mac_pool().submit(_ahead, self.native, parts, out, progress)
        view, sent = memoryview(out), 0
        while sent < total:
            ready = _native.wait_progress(progress, sent + 1)
            if ready < 0:
                break
            write(view[sent:ready])
            sent = ready
        err = job.exception()
        if err is not None or sent < total:
            raise RecordsError(f"encrypting a frame failed ({err}): the connection is unusable")

    def _run(self, out: int, src: int, n: int) -> None:
        outl = ctypes.c_int()
        while n:
            take = min(n, 1 << 30)
            if self._update(self._ctx, out, ctypes.byref(outl), src, take) != 1 or outl.value != take:
                raise RecordsError("EVP_EncryptUpdate (AES-128-CTR) failed")
            out, src, n = out + take, src + take, n - take

    def __del__(self):
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._lib.EVP_CIPHER_CTX_free(ctx)


def _ahead(native: tuple, parts: list, out: np.ndarray, progress: np.ndarray) -> None:
    """:meth:`StreamCipher.write_ahead`'s job: any failure (one raised before the C pass stored
    its progress too, such as a part it cannot read) reads -1, so the writer never waits on it."""
    try:
        _native.xor_spans_ahead(native, parts, out, progress, PIECE)
    except BaseException:
        progress[0] = -1
        raise


class KeyExchange:
    """One end of steps 1–2 of the module docstring over a plain transport: ``write(bytes)`` sends
    TLS's bytes, :meth:`feed` takes what arrived; once the peer's key message is in, :meth:`feed`
    returns the bytes that came after it (gearflow's records) and :meth:`keys` the keys."""

    def __init__(self, context: ssl.SSLContext, server_side: bool, write: Callable[[bytes], None]):
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=server_side)
        self.server_side = server_side
        self._write = write
        self._mine = os.urandom(32)
        self._got = bytearray()
        self._handshaken = self._sent = False
        self.done = False

    def step(self, data=b"") -> tuple | BaseException | None:
        """:meth:`feed` ``data`` for a protocol (``FramedProtocol.start_records``), without raising:
        None while the exchange goes on; the :class:`RecordsError` or
        :class:`~gearflow.transport.auth.TransportMismatch` that ended it; or the hand-over ``(the
        bytes after the peer's key message, send cipher, receive cipher, Sealer, Opener)`` — the
        frame MAC of the frames before the secret handshake's keys take over."""
        try:
            rest = self.feed(data)
            if rest is None:
                return None
            tx, rx, mac_tx, mac_rx = self.keys()
        except (RecordsError, TransportMismatch) as exc:
            return exc
        return rest, tx, rx, integrity.Sealer(mac_tx), integrity.Opener(mac_rx)

    def start(self) -> None:
        """Begin the handshake (the client's first flight; nothing for the server)."""
        self._step()

    def feed(self, data) -> bytes | None:
        """Bytes from the peer: None while the exchange goes on, the bytes after the peer's key
        message once it is done. Raises :class:`RecordsError`, or
        :class:`~gearflow.transport.auth.TransportMismatch` for a peer that carries frames otherwise
        (the connection must be closed)."""
        if self.done:
            raise RecordsError("the key exchange is over: feed the records, not the exchange")
        if self._in.pending + len(data) > MAX_PENDING:
            raise RecordsError(f"the peer sent over {MAX_PENDING} bytes before the TLS key exchange was done")
        self._in.write(data)
        return self._step()

    def _step(self) -> bytes | None:
        try:
            if not self._handshaken:
                try:
                    self._tls.do_handshake()
                except ssl.SSLWantReadError:
                    return None
                self._handshaken = True
            if not self._sent:
                self._tls.write(MESSAGE.pack(MAGIC, VERSION, self._mine))
                self._sent = True
            while len(self._got) < MESSAGE.size:
                try:
                    chunk = self._tls.read(MESSAGE.size - len(self._got))
                except ssl.SSLWantReadError:
                    return None
                if not chunk:
                    raise RecordsError("the peer ended TLS before its key message")
                self._got += chunk
        except ssl.SSLError as exc:
            raise RecordsError(f"TLS failed: {exc.reason or exc}") from None
        finally:
            if self._out.pending:
                self._write(self._out.read())
        magic, version, _ = MESSAGE.unpack(bytes(self._got))
        if magic != MAGIC:
            who = "the client" if self.server_side else "the service"
            raise TransportMismatch(f"{who} keeps frames in TLS records (transport.tls_records=tls or transport.integrity="
                                    "false there, or a gearflow without records under TLS) and this side uses gearflow's "
                                    "records: set transport.tls_records and transport.integrity the same on both ends")  # fmt: skip
        if version != VERSION:
            raise TransportMismatch(f"records version {version} from the peer, this side speaks {VERSION}: upgrade both ends")
        self.done = True
        return self._in.read()

    def keys(self) -> tuple[StreamCipher, StreamCipher, bytes, bytes]:
        """(send cipher, receive cipher, send MAC key, receive MAC key) of this end."""
        if not self.done:
            raise RecordsError("the key exchange is not done")
        theirs = bytes(self._got[4 + 2:MESSAGE.size])
        client, server = (theirs, self._mine) if self.server_side else (self._mine, theirs)
        k = integrity.hkdf(client + server, SALT, INFO, 2 * KEY_BYTES + 2 * integrity.KEY_BYTES)
        c2s, s2c = k[:KEY_BYTES], k[KEY_BYTES:2 * KEY_BYTES]
        m_c2s, m_s2c = k[2 * KEY_BYTES:2 * KEY_BYTES + 32], k[2 * KEY_BYTES + 32:]
        if self.server_side:
            return StreamCipher(s2c), StreamCipher(c2s), m_s2c, m_c2s
        return StreamCipher(c2s), StreamCipher(s2c), m_c2s, m_s2c

    @property
    def peer_certificate(self) -> dict | None:
        return self._tls.getpeercert()
