"""Per-frame integrity after the handshake: NH-Poly1305 under a one-time key per frame (ChaCha20 of
a session key per direction and the frame's sequence number), over every byte of the frame.

Each frame after ``AUTH_OK`` carries a 24-byte trailer after its buffer block::

    trailer  "<Q16s"   sequence number (this direction's frame count, from 0), tag

``tag = Poly1305(otk(seq), NH_K(c_1) | NH_K(c_2) | ... | NH_K(c_k) | le64(len))`` where
``c_1 .. c_k`` are the frame's bytes exactly as they are on the wire (header | envelope | buffer
block, padding included) cut into 1 KiB chunks (the last one shorter, zero-padded to a multiple of
16 bytes), ``len`` their count, and

* ``otk(seq)``: the frame's one-time key, the first 32 bytes of ChaCha20's keystream under the
  direction's key with counter 0 and nonce ``0⁴ | seq`` (little-endian, 8 B) — RFC 8439's
  ``poly1305_key_gen``, as ChaCha20-Poly1305 makes its MAC key, here with the frame in clear
  (integrity, not confidentiality: that is TLS's job, or gearflow's records under TLS); bytes
  32–63 of that block key the frame's *head tag* (Poly1305 over its header and envelope, sent
  after the envelope and checked before it is parsed) on gearflow's records under TLS
  (:mod:`gearflow.transport.records`, :meth:`Sealer.head_tag`): a second one-time key of the
  same block, used once;
* ``NH_K``: Adiantum's NH (Crowley & Biggers, "Adiantum", ToSC 2018; Linux's
  ``crypto/nh_generic.c``): each 16-byte unit ``i`` of a chunk (four little-endian u32 ``m0..m3``)
  adds, for each pass ``p`` of four, ``(m0 + K[4i+4p]) · (m2 + K[4i+4p+2]) + (m1 + K[4i+4p+1]) ·
  (m3 + K[4i+4p+3])`` (additions mod 2³², products and sums mod 2⁶⁴) to that pass's sum: 32 bytes
  (four little-endian u64) per chunk. ``K``: 1,072 bytes of ChaCha20's keystream under the direction's
  key and the nonce ``b"nhky" | 0⁸`` (a nonce no frame uses), one per direction and connection.

The receiver counts the frames it has accepted; a trailer whose sequence number is not the next one
(a replayed, reordered or dropped frame) or whose tag does not verify (an injected or altered frame)
is an :class:`IntegrityError`, raised before the frame is handed to anyone: its connection is
closed. The keys (:func:`session_keys`) are HKDF-SHA256 over the role's secret, salted with both
nonces of the handshake, one per direction, so a recorded frame of one connection or direction
verifies nowhere else.

Why it is a MAC (the Wegman–Carter argument, as for Poly1305 alone and for Adiantum's hash). The
sender finalises one tag per one-time key (per sequence number), and ``(r, s) = otk(seq)`` is
pseudorandom and independent of every other frame's and of ``K``; every tag the attacker sees is
masked by its own ``s``, so the tags say nothing about ``K`` or any ``r``. To forge frame ``seq`` the
attacker needs ``M' ≠ M`` (``M`` the frame the sender tagged under that key, if any) with
``Poly1305_r(H(M')) + s = t'`` for a tag ``t'`` of its choice: a collision or a chosen difference of
``x ↦ Poly1305_r(x)`` on ``H(M') ≠ H(M)``, probability ≤ ``8⌈L/16⌉ / 2¹⁰⁶`` (Poly1305's bound for an
input of ``L`` bytes), or ``H(M') = H(M)``. ``H`` (the Poly1305 input above) is injective on lengths
(the length is its last block) and, for two frames of one length, differs unless NH collides on
some chunk pair of equal length: NH with four Toeplitz-shifted passes is 2⁻¹²⁸-almost-universal on
equal-length inputs (NH is 2⁻³²-almost-universal per pass: Black et al., UMAC, CRYPTO 1999; the
Toeplitz iteration: Krovetz, and Adiantum's analysis), with ``K`` uniform and unseen. A 14.5 MB
sample reply is ~454 KB of Poly1305 input: a forgery succeeds with probability below 2⁻⁸⁸ a try
(Poly1305 over the raw 14.5 MB: 2⁻⁸³), and each failed try closes the connection.

Why NH first (chosen by measurement, 14.5 MB, one core): Poly1305 runs at 11.8–12.6 GB/s where
the CPU has AVX-512 IFMA and at 5.0 where it has only AVX2; NH reads the bytes at 21 GB/s
through Poly1305 from cache, 11.7 over a sample's rows from memory (``_mac.c``'s AVX2 pass, 22–24
GB/s alone; an AVX-512 pass ran no faster on this Zen 4 CPU, whose 512-bit operations are two 256-bit
ones) and leaves Poly1305 1/32 of them, on
either CPU. AES-128-GMAC ran at 8.0 (6.3 on AVX2), keyed BLAKE3 (the ``blake3`` package, parallel
by construction) 4.6 on one thread and no faster on two of a loaded 2-core box, HMAC-SHA256 1.1,
keyed ``hashlib.blake2b`` 0.9; POLYVAL (RFC 8452, AES-GCM-SIV's hash) with 512-bit ``VPCLMULQDQ``
and one reduction per 32–64 blocks 21–25 from cache and 11–12 over rows from memory, NH 21–23 and
10 in the same runs: not worth a new frame format. What a pass costs a 2-core round is its
second read of the bytes more than its arithmetic (with NH's loop compiled out of both ends the
bench's ``integrity_cost`` is 0.11; with two of its four passes, 0.27 against 0.28).
ChaCha20 and Poly1305 run in OpenSSL's libcrypto (the one Python's
``ssl`` module links), through its ``EVP_MAC`` / ``EVP_CIPHER`` APIs (OpenSSL ≥ 3); NH in
``_mac.c`` (``_mac.NH``: AVX2 where the CPU has it, a scalar pass that gives the same bytes, the
GIL released), or in numpy where ``_mac.c`` is not built (:class:`_NumpyNH`, ~0.9 GB/s; the same
bytes: ``tests/test_wire_security.py`` checks all three against NH written from its definition).
A one-time key is never used twice: each direction of each connection has its own session key
and counts its own frames, and a frame MACed again (a torn frame's reseal, below) finalises one
tag only. Frame format version 3 (:data:`~gearflow.transport.framing.VERSION`) is this MAC; a peer
of version 2 (Poly1305 over the raw bytes) is refused at its first frame, by name.

Off the critical path (MAC threads). A frame of at least :data:`MAC_THREAD_BYTES` (1 MiB) is
MACed in a MAC thread (:func:`mac_pool`, 2–4 per process) while the thread that moves its bytes
moves them: the sender hands the whole frame to the socket at once and the MAC thread reads the
same bytes meanwhile (both only read them; the sender's frame, its trailer and every later frame
on that connection are written in order: a frame sent while a MAC runs waits behind its trailer),
then writes the trailer. A client reads a big block in its connection's wire thread
(:mod:`gearflow.transport.wire_io`): each 256 KiB ``recv`` is fed to this direction's NH
(:attr:`Opener.native_nh`) as it lands, without the GIL, then the trailer is read and the loop
checks it. Elsewhere (a service, TLS, no ``_mac.c``) the loop reads the frame's buffer block
straight into place and a MAC thread follows it, woken once :data:`FEED_BYTES` have landed,
taking everything that has landed in one call each time; at the block's end the loop waits for
it (the tail of the last piece), then checks the trailer before the frame is delivered. The MAC input, the key and the
check are exactly those of a frame MACed inline (smaller frames are): what changes is which
thread computes it, and when. The sender's span list (~520 rows of a sample reply) goes to NH
in one call with the GIL released (``_mac.c``, built by setup.py). A sender whose socket write
keeps the GIL (uvloop's ``writelines`` writes what the socket takes before it returns) starts the
MAC thread first and writes once that thread holds the spans (``seal_async(..., started=True)``):
the MAC then runs beside the write instead of after it (measured on the shard, median of ~290
rounds: the MAC began 0.1 ms after the frame was handed over instead of 2.6 ms, once the write had
returned).

Rows marked torn (the one exception to "every byte"). A shard sends a sample reply's wide
rows straight out of its shared-memory segment (:mod:`gearflow.transport.server.wire`), where a
writer may overwrite them while the kernel copies them: the bytes the receiver gets may then
differ from the ones the sender MACed, and a MAC over them would fail a legitimate frame. Such
a frame says so: its envelope's meta holds ``"torn": true`` and its last buffer is ``uint8[n]``,
the *marks* (non-zero: that item's rows may have changed on the way). Then

    tag = Poly1305(otk(seq), header | envelope | for each buffer but the last: its padding, then
                   its bytes without the rows i where marks[i] != 0 (a buffer of n rows only:
                   shape[0] == n; any other buffer whole) | the marks' padding | the marks)

— with no mark set this is every byte of the frame, as above. The receiver MACs the frame as it
lands; at the trailer it reads the marks (unauthenticated as yet, but inside the MAC), and only
if one is set MACs the frame again without the marked rows (:func:`masked_frame`, the same
function on both sides) before checking the tag. The input is unambiguous: the header and
envelope fix every buffer's size and the marks are the MAC input's last ``n`` bytes, so a frame
with other marks, rows or bytes is a different input (a forgery needs a Poly1305 forgery). What the
MAC does not cover, the marked rows' bytes, the receiver never uses: the sampler replaces every
marked item by a fresh draw (:meth:`~gearflow.transport.learner.RemoteSampler._mend`); an attacker
can change those bytes, not what the learner trains on, and cannot set or clear a mark.

Why the sender's tag is true of the bytes sent (the seqlock argument). The shard draws the items
(time d), hands the frame's bytes straight from the segment to the socket while a MAC thread
reads the same bytes there (or MACs them inline, for a small frame), and once everything before
the marks has left the process *and* the MAC has read every byte, it marks every item a writer
may have overwritten since d (the table's seqlock rule,
:meth:`~gearflow.replay.table.Table.overwritten`, which counts a write as soon as it is
*reserved*). An item left unmarked was not written between d and that check, so its rows were
the same bytes when the MAC read them and when the kernel copied them, whichever read first. If some item
is marked, the shard MACs the frame again without the marked rows and checks again after that
pass; an item newly marked meanwhile means another pass (at most :data:`RESEAL_PASSES`, then every
item is marked: the frame then MACs only bytes that never change, the gathered columns). Only the
last pass's tag is finalised and sent: one tag per one-time key.

Row digests (a sample reply's wide rows MACed by their digests, which the shard keeps). A learner
whose ``replay.sample`` asks for them (``"row_digests": true``: ``Client.row_digests``, set where
integrity is on, ``transport.row_digests`` too, and ``_mac.c`` built) gets a reply
whose meta lists ``"digested": [[i, b], ...]`` — buffers ``i`` made of rows of ``b`` bytes (the
shard's wide columns) — and whose MAC input is the frame as above with each such buffer's bytes
replaced by its rows' digests, in order::

    D(row) = NH_R(c_1) | NH_R(c_2) | ... | NH_R(c_m)    (32 bytes per 1 KiB of the row)

``c_1 .. c_m``: the row's bytes cut into 1 KiB chunks *from the row's start* (the last one shorter,
zero-padded to a multiple of 16 bytes); ``NH_R``: NH as above under the row key ``R``
(:func:`row_key`: 1,072 bytes of HKDF-SHA256 of the connection's secret — the same on every
connection of that secret, never sent). The receiver computes ``D`` as the rows land, whichever
thread feeds the block (``_mac.NH.set_rows``: the block's row regions go to the row NH, whose
outputs go into the frame's NH in the rows' place; :class:`RowNH`). The shard keeps each storage
row's digest once computed (:mod:`gearflow.transport.server.row_digests`) and feeds the kept
digests: a row drawn again is not read again for the MAC — the sender's pass over cold rows was
~0.17 of the raw socket's rate of the ~0.30 integrity cost (``gearflow/transport/README.md``).
A row not kept yet is digested in the frame's MAC thread while the kernel sends it, as the frame
was MACed before. Only asked-for replies change: a shard that does not know the request's field
(an older one) sends the rows MACed as above, and the learner takes either, by the reply's meta.
With torn marks an item's digests are left out as its rows were (:func:`masked_frame` over the
digests; a digested buffer holds a whole number of rows per item).

Why it is still a MAC. Let ``V(M)`` be the MAC input of frame ``M``: its header and envelope as
they are, its other buffers' bytes, its digested buffers' digests. The tag is the MAC above over
``V(M)``, so a forgery of frame ``seq`` needs a forgery of that MAC on ``V`` (the bounds above, for
an input ~1/32 as long) or ``M' ≠ M`` with ``V(M') = V(M)``. ``V`` holds the header and envelope
verbatim and they fix its layout: an ``M'`` with another header or envelope (another ``digested``
list included) has another ``V``; with the same, ``M'`` differs from ``M`` only in rows of digested
buffers, and ``V(M') = V(M)`` needs ``D(row') = D(row)`` for rows of one length — an NH collision
under ``R`` on a chunk pair, ≤ 2⁻¹²⁸ (four-pass NH, as above), ``R`` being uniform to the attacker:
it is only ever used inside MAC inputs whose every tag is masked by its own one-time ``s``. One
``R`` for every connection of a secret and for the secret's life is UMAC's setting (one NH key for
all messages, a fresh mask per message). Whoever holds the secret can derive ``R`` — and can
already derive every session key of that secret (the nonces are in clear) and forge at will.
What keeping digests adds is only a way to fail: a shard that sent a digest that is not its row's
(a bug, a row changed behind the shard's back) fails the learner's check, and the connection
closes; a wrong row is never accepted. A kept digest belongs to the write of its row it was
computed for (the row's step, by its partition's ``COMMIT`` counter, which never moves back); one
computed while a writer overwrote its row, or kept for a step since overwritten, is only sent for
items the reply's marks leave out (the seqlock argument above).

    seal, opener = Sealer(key_out), Opener(key_in)
    parts = seal.seal(encode(REQUEST, 1, "replay.stats", {}))   # + trailer
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Callable

import numpy as np

from gearflow.errors import MissingDependencyError
from gearflow.transport.framing import FrameError

# the MAC rule of torn rows (also integrity.masked_frame)
from gearflow.transport.torn_marks import marks_of, masked_frame

try:  # NH without the GIL, a frame's spans in one call (setup.py builds it; else numpy's NH)
    from gearflow.transport import _mac as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["MAC_THREAD_BYTES", "RESEAL_PASSES", "TAG_BYTES", "TRAILER", "BlockMac", "IntegrityError", "Opener", "RowNH",
           "Sealer", "available", "digest_bytes", "hkdf", "mac_pool", "marks_of", "masked_frame", "require", "row_key",
           "rows_available", "session_keys"]  # fmt: skip


TRAILER = struct.Struct("<Q16s")  # sequence number, tag
TAG_BYTES = 16
ALGORITHM = "nh-poly1305 (nh as adiantum's), chacha20 one-time keys (rfc 8439)"
KEY_BYTES = 32
NH_CHUNK = 1024  # NH's message chunk: 32 bytes of NH output per 1 KiB to Poly1305
NH_KEY_BYTES = NH_CHUNK + 48  # 268 words: 256 for a chunk, 12 more for the three shifted passes
NH_OUT = 32  # NH's output per chunk (four u64 sums)
_NH_NONCE = b"nhky" + bytes(8)  # ChaCha20 nonce of the NH key (frames' nonces start with 0⁴)
_ZERO_BLOCK = bytes(64)
RESEAL_PASSES = 3  # MAC passes over a frame with torn rows before the sender marks every item
MAC_THREAD_BYTES = 1 << 20  # frames with at least this many buffer bytes are MACed in a MAC thread, beside the socket
FEED_BYTES = 256 << 10  # the receiving MAC thread is woken once this much has landed unMACed (or at the frame's end)
PIECE_BYTES = 1 << 20  # a receiver with a MAC thread reads a big block at most this much per recv: the thread follows


class IntegrityError(FrameError):
    """A frame failed its integrity check (altered, injected, replayed, reordered or dropped)."""


def hkdf(secret: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 (RFC 5869) of ``secret``: extract with ``salt``, expand with ``info``."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def session_keys(secret: bytes, transcript: bytes, server_nonce: str, client_nonce: str) -> tuple[bytes, bytes]:
    """(client → server key, server → client key) of one connection."""
    okm = hkdf(secret, bytes.fromhex(server_nonce) + bytes.fromhex(client_nonce),
               b"gearflow-frame-keys-v3|" + transcript, 2 * KEY_BYTES)  # fmt: skip
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


def row_key(secret: bytes) -> bytes:
    """The NH key of row digests (one per secret, the same on every connection that proved it):
    HKDF-SHA256 of the secret, never sent; a shard keeps the digests of its rows under it."""
    return hkdf(secret, b"gearflow-row-digests", b"nh-key-v1", NH_KEY_BYTES)


def digest_bytes(row_bytes: int) -> int:
    """A row digest's size: NH's 32 bytes per 1 KiB chunk of the row (the last one shorter)."""
    return -(-int(row_bytes) // NH_CHUNK) * NH_OUT


def rows_available() -> bool:
    """Whether this process can take frames with row digests (``_mac.c`` built, with ``set_rows``)."""
    return _native is not None and hasattr(_native.NH, "set_rows") and available()


class RowNH:
    """NH under a :func:`row_key`: :meth:`digest_rows` writes row digests (a shard's, kept with its
    rows), :meth:`digests` those of a buffer's rows; an :class:`Opener` feeds a frame's rows
    through it (``_mac.NH.set_rows``). ``_mac.c`` only (:func:`rows_available`)."""

    def __init__(self, key: bytes):
        if not rows_available():
            raise MissingDependencyError("row digests need gearflow's _mac extension (pip install -e . builds it)")
        self.nh = _native.NH(key, 0, 0, rows=True)  # its outputs feed a frame's NH once set_rows names one

    def digest_rows(self, addresses: np.ndarray, row_bytes: int, outs: np.ndarray) -> None:
        """The digest of the ``row_bytes`` at each of ``addresses`` (int64) written at ``outs``
        (int64): memory the caller keeps alive; without the GIL."""
        self.nh.digest_rows(np.ascontiguousarray(addresses, np.int64), int(row_bytes),
                            np.ascontiguousarray(outs, np.int64))  # fmt: skip

    def digests(self, buf: np.ndarray, row_bytes: int) -> np.ndarray:
        """The digests of every row of ``buf`` (C-contiguous, a whole number of rows), in order."""
        flat = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        n, d = flat.nbytes // row_bytes, digest_bytes(row_bytes)
        out = np.empty(n * d, np.uint8)
        if n:
            base, at = flat.__array_interface__["data"][0], out.__array_interface__["data"][0]
            ramp = np.arange(n, dtype=np.int64)
            self.digest_rows(base + ramp * row_bytes, row_bytes, at + ramp * d)
        return out


# ----------------------------------------------------------------- libcrypto: EVP_MAC (Poly1305), EVP_CIPHER (ChaCha20)
_lib = None
_poly = _chacha = None
_lib_error = ""
_lib_lock = threading.Lock()


def _load():
    global _lib, _poly, _chacha, _lib_error
    with _lib_lock:
        if _lib is not None or _lib_error:
            return _lib
        try:
            import ssl  # noqa: F401  (loads the libcrypto Python itself uses, so find_library agrees)

            name = ctypes.util.find_library("crypto") or "libcrypto.so.3"
            lib = ctypes.CDLL(name)  # CDLL: calls release the GIL
            lib.EVP_MAC_fetch.restype = ctypes.c_void_p
            lib.EVP_MAC_fetch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
            lib.EVP_MAC_CTX_new.restype = ctypes.c_void_p
            lib.EVP_MAC_CTX_new.argtypes = [ctypes.c_void_p]
            lib.EVP_MAC_CTX_free.argtypes = [ctypes.c_void_p]
            lib.EVP_MAC_CTX_free.restype = None
            lib.EVP_MAC_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.EVP_MAC_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            lib.EVP_MAC_update.restype = ctypes.c_int
            lib.EVP_MAC_final.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
            lib.EVP_CIPHER_fetch.restype = ctypes.c_void_p
            lib.EVP_CIPHER_fetch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
            lib.EVP_CIPHER_CTX_new.restype = ctypes.c_void_p
            lib.EVP_CIPHER_CTX_new.argtypes = []
            lib.EVP_CIPHER_CTX_free.argtypes = [ctypes.c_void_p]
            lib.EVP_CIPHER_CTX_free.restype = None
            lib.EVP_EncryptInit_ex.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                                               ctypes.c_char_p]  # fmt: skip
            lib.EVP_EncryptUpdate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                              ctypes.c_char_p, ctypes.c_int]  # fmt: skip
            poly, chacha = lib.EVP_MAC_fetch(None, b"POLY1305", None), lib.EVP_CIPHER_fetch(None, b"ChaCha20", None)
            if not poly or not chacha:
                raise OSError("this libcrypto has no Poly1305 or ChaCha20 (OpenSSL ≥ 3 is needed)")
            _lib, _poly, _chacha = lib, poly, chacha
        except (OSError, AttributeError) as exc:
            _lib_error = str(exc) or type(exc).__name__
        return _lib


def available() -> bool:
    """Whether the MAC can run here (OpenSSL ≥ 3's libcrypto is loadable)."""
    return _load() is not None


def require():
    """libcrypto, or a :class:`MissingDependencyError` saying what to install."""
    lib = _load()
    if lib is None:
        raise MissingDependencyError(
            f"transport.integrity needs OpenSSL ≥ 3's libcrypto for Poly1305 ({_lib_error}); install OpenSSL 3 "
            "or set transport.integrity=false on every end (the frames are then unprotected)"
        )
    return lib


_UPDATE_ADDRESS = 0  # EVP_MAC_update's address, for _mac.NH


def _nh(key: bytes, lib, ctx: int):
    """The NH pass of one direction, feeding the Poly1305 context ``ctx``: ``_mac.NH`` (C, AVX2
    where the CPU has it, the GIL released) where it is built, else :class:`_NumpyNH`."""
    global _UPDATE_ADDRESS
    if not _UPDATE_ADDRESS:
        _UPDATE_ADDRESS = ctypes.cast(lib.EVP_MAC_update, ctypes.c_void_p).value
    if _native is not None and hasattr(_native, "NH"):
        return _native.NH(key, _UPDATE_ADDRESS, ctx)
    return _NumpyNH(key, lib, ctx)


class _NumpyNH:
    """NH in numpy, for where ``_mac.c`` is not built: the bytes ``_mac.NH`` feeds Poly1305, at
    ~1 GB/s (``tests/test_wire_security.py`` checks both against a plain-Python NH)."""

    BLOCK = 256  # chunks per numpy pass (bounds the temporaries: ~2 MiB)

    def __init__(self, key: bytes, lib, ctx: int):
        k = np.frombuffer(key, "<u4").astype(np.uint32)
        self._keys = [k[4 * p:4 * p + NH_CHUNK // 4].reshape(-1, 4) for p in range(4)]
        self._lib, self._ctx = lib, ctx
        self.reset()

    def reset(self) -> None:
        self._part = b""
        self._total = 0

    def update(self, part) -> None:
        self._feed(np.frombuffer(part, np.uint8) if not isinstance(part, np.ndarray) else part.reshape(-1).view(np.uint8))

    def update_at(self, address: int, nbytes: int) -> None:
        if nbytes:
            self._feed(np.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), np.uint8))

    def update_spans(self, spans: list) -> None:
        for s in spans:
            if type(s) is tuple:
                self.update_at(*s)
            else:
                self.update(s)

    def _feed(self, m: np.ndarray) -> None:
        self._total += m.size
        if self._part:
            take = min(NH_CHUNK - len(self._part), m.size)
            self._part += m[:take].tobytes()
            m = m[take:]
            if len(self._part) < NH_CHUNK:
                return
            self._emit(np.frombuffer(self._part, np.uint8))
            self._part = b""
        whole = m.size // NH_CHUNK * NH_CHUNK
        for lo in range(0, whole, self.BLOCK * NH_CHUNK):
            self._emit(m[lo:min(whole, lo + self.BLOCK * NH_CHUNK)])
        if m.size > whole:
            self._part = m[whole:].tobytes()

    def _emit(self, m: np.ndarray, units: int = NH_CHUNK // 16) -> None:
        w = np.ascontiguousarray(m).view("<u4").reshape(-1, units, 4)
        out = np.empty((w.shape[0], 4), "<u8")
        for p, k in enumerate(self._keys):
            t = (w + k[:units]).astype(np.uint64)  # u32 sums wrap; u64 products and sums wrap
            out[:, p] = (t[..., 0] * t[..., 2] + t[..., 1] * t[..., 3]).sum(axis=1, dtype=np.uint64)
        b = out.tobytes()
        if self._lib.EVP_MAC_update(self._ctx, b, len(b)) != 1:
            raise IntegrityError("EVP_MAC_update failed")

    def finish(self) -> None:
        if self._part:
            n = len(self._part)
            self._emit(np.frombuffer(self._part + bytes(-n % 16), np.uint8), -(-n // 16))
        b = struct.pack("<Q", self._total)
        if self._lib.EVP_MAC_update(self._ctx, b, 8) != 1:
            raise IntegrityError("EVP_MAC_update failed")
        self.reset()


class _Mac:
    """One direction's MAC: a ChaCha20 context keyed once with the session key (it makes each
    frame's one-time key) and a Poly1305 context keyed per frame with that."""

    def __init__(self, key: bytes, row_key: bytes | None = None):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a session key has {KEY_BYTES} bytes, got {len(key)}")
        self.row_key = row_key  # frames with row digests (:func:`row_key` of the connection's secret)
        self._lib = lib = require()
        self._ctx = lib.EVP_MAC_CTX_new(_poly)
        self._kctx = lib.EVP_CIPHER_CTX_new()
        if not self._ctx or not self._kctx:
            raise MemoryError("EVP_MAC_CTX_new / EVP_CIPHER_CTX_new failed")
        if lib.EVP_EncryptInit_ex(self._kctx, _chacha, None, key, bytes(16)) != 1:
            raise IntegrityError("EVP_EncryptInit_ex (ChaCha20) failed")
        self._otk = ctypes.create_string_buffer(64)  # the frame's ChaCha20 block 0: its tag's one-time key, its head's
        self._hctx = None  # the head tag's Poly1305 (gearflow's records under TLS: records.py)
        self._otklen = ctypes.c_int()
        self._out = ctypes.create_string_buffer(TAG_BYTES)
        self._outlen = ctypes.c_size_t()
        self._nh = _nh(self._nh_key(), lib, self._ctx)  # the bulk pass: NH of each 1 KiB chunk into the Poly1305
        self.seq = 0
        self.thread_bytes = MAC_THREAD_BYTES  # frames this big are MACed in a MAC thread (seal_async, block_mac)
        self.piece_bytes = PIECE_BYTES  # a receiver's recv size while its MAC thread follows a block
        self._block_mac: BlockMac | None = None

    def _nh_key(self) -> bytes:
        """This direction's NH key: ChaCha20's keystream under its session key and the nonce
        ``b"nhky" | 0⁸`` (no frame's one-time key uses that nonce: theirs start with 0⁴)."""
        lib, out, n = self._lib, ctypes.create_string_buffer(NH_KEY_BYTES), ctypes.c_int()
        if (lib.EVP_EncryptInit_ex(self._kctx, None, None, None, bytes(4) + _NH_NONCE) != 1
                or lib.EVP_EncryptUpdate(self._kctx, out, ctypes.byref(n), bytes(NH_KEY_BYTES), NH_KEY_BYTES) != 1):  # fmt: skip
            raise IntegrityError("deriving the NH key failed")
        return out.raw

    def begin(self) -> int:
        """Start the MAC of the next frame; returns its sequence number."""
        seq = self.seq
        self.seq += 1
        self._init(seq)
        return seq

    def restart(self) -> None:
        """Start the current frame's MAC over (same sequence number and IV): what was fed so far
        is dropped, never finalised — one tag per IV leaves (or is checked)."""
        self._init(self.seq - 1)

    def _init(self, seq: int) -> None:
        lib = self._lib  # ChaCha20 block 0 under nonce 0^4 | seq: counter (4 B) | nonce (12 B)
        if (lib.EVP_EncryptInit_ex(self._kctx, None, None, None, bytes(8) + seq.to_bytes(8, "little")) != 1
                or lib.EVP_EncryptUpdate(self._kctx, self._otk, ctypes.byref(self._otklen), _ZERO_BLOCK, 64) != 1
                or lib.EVP_MAC_init(self._ctx, self._otk, 32, None) != 1):  # fmt: skip
            raise IntegrityError("deriving the frame's one-time key failed")
        self._nh.reset()

    def _head(self, head) -> bytes:
        """The frame's head tag: Poly1305 over ``head`` (its header and envelope) under bytes 32–63
        of its ChaCha20 block 0 — the frame tag's one-time key is bytes 0–31: two keys, each used
        once. Sent after the envelope on gearflow's records under TLS (:mod:`~gearflow.transport.records`),
        so a receiver parses no envelope an attacker could have altered."""
        lib = self._lib
        if self._hctx is None:
            self._hctx = lib.EVP_MAC_CTX_new(_poly)
            if not self._hctx:
                raise MemoryError("EVP_MAC_CTX_new failed")
        out, n = ctypes.create_string_buffer(TAG_BYTES), ctypes.c_size_t()
        head = bytes(head)
        if (lib.EVP_MAC_init(self._hctx, self._otk.raw[32:64], 32, None) != 1
                or lib.EVP_MAC_update(self._hctx, head, len(head)) != 1
                or lib.EVP_MAC_final(self._hctx, out, ctypes.byref(n), TAG_BYTES) != 1):  # fmt: skip
            raise IntegrityError("the head tag's Poly1305 failed")
        return out.raw

    def update(self, part) -> None:
        self._nh.update(part)

    def update_at(self, address: int, nbytes: int) -> None:
        """:meth:`update` with ``nbytes`` at ``address`` (memory the caller keeps alive), without the GIL."""
        self._nh.update_at(address, nbytes)

    def update_spans(self, spans: list) -> None:
        """:meth:`update` with each of ``spans``: an ``(address, nbytes)`` pair (memory the caller
        keeps alive: a segment row's address, computed without a Python object per row) or a
        bytes-like part. One call into C for them all, the GIL released throughout (``_mac.c``),
        where it is built; else numpy's NH (:class:`_NumpyNH`: the same bytes, ~1 GB/s)."""
        self._nh.update_spans(spans)

    @property
    def native_nh(self):
        """The ``_mac.NH`` this direction feeds (a wire thread may feed it without the GIL while
        nothing else uses this MAC), or None where ``_mac.c`` is not built (numpy's NH)."""
        return None if isinstance(self._nh, _NumpyNH) else self._nh

    def final(self) -> bytes:
        self._nh.finish()
        if self._lib.EVP_MAC_final(self._ctx, self._out, ctypes.byref(self._outlen), TAG_BYTES) != 1:
            raise IntegrityError("EVP_MAC_final failed")
        return self._out.raw

    def __del__(self):
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._lib.EVP_MAC_CTX_free(ctx)
        kctx, self._kctx = getattr(self, "_kctx", None), None
        if kctx:
            self._lib.EVP_CIPHER_CTX_free(kctx)
        hctx, self._hctx = getattr(self, "_hctx", None), None
        if hctx:
            self._lib.EVP_MAC_CTX_free(hctx)


class Sealer(_Mac):
    """The sending direction: :meth:`seal` appends the trailer of a whole frame's parts;
    :meth:`begin` / :meth:`update` / :meth:`trailer` do one frame sent in pieces (a reply with a
    tail); :meth:`seal_async` MACs a big frame's parts in a MAC thread while the caller writes
    them. Frames must be sealed in the order they go on the wire."""

    def seal(self, parts: list) -> list:
        self.begin()
        self.update_spans(parts)
        parts.append(self.trailer())
        return parts

    def seal_async(self, spans: list, done: Callable[[BaseException | None], None], started: bool = False,
                   before=()) -> None:  # fmt: skip
        """MAC ``spans`` into the frame begun in a MAC thread (:func:`mac_pool`); ``done(error)``
        is called there once they are all read (``error``: None, or what the MAC raised). Until
        then nothing else may use this sealer, and the spans' bytes must stay as they are.
        ``started``: return once the MAC thread holds the spans (it then runs without the GIL) —
        for a caller about to write them in a call that keeps the GIL (uvloop's ``writelines``:
        otherwise the MAC thread could not start until that write returned). ``before``: callables
        the MAC thread runs first (they complete spans: a reply's row digests)."""
        go = threading.Event() if started else None

        def job() -> None:
            err = None
            try:
                if go is not None:  # the caller waits for the GIL, which update_spans releases once it parsed the spans
                    go.set()
                for fn in before:
                    fn()
                self.update_spans(spans)
            except BaseException as exc:  # noqa: BLE001 - handed to done(): the caller closes its connection
                err = exc
            done(err)

        mac_pool().submit(job)
        if go is not None:
            go.wait()

    def trailer(self) -> bytes:
        return TRAILER.pack(self.seq - 1, self.final())

    def head_tag(self, head) -> bytes:
        """The head tag of the frame begun (:meth:`_Mac._head`): call once, after :meth:`begin`."""
        return self._head(head)


class Opener(_Mac):
    """The receiving direction: :meth:`begin` at a frame's header, :meth:`update` with its bytes
    (or, for a big buffer block, :meth:`block_mac`: a MAC thread follows the block as it lands),
    :meth:`check` with its trailer (raises :class:`IntegrityError`)."""

    def block_mac(self, block: np.ndarray) -> BlockMac:
        """This direction's :class:`BlockMac`, started on ``block`` (the frame's buffer block,
        after its header and envelope went through :meth:`update`)."""
        if self._block_mac is None:
            self._block_mac = BlockMac(self)
        self._block_mac.start(block)
        return self._block_mac

    @property
    def row_nh(self) -> RowNH | None:
        """NH under this connection's row key (None: no row key, or no ``_mac.c``)."""
        rows = getattr(self, "_row_nh", False)
        if rows is False:
            rows = self._row_nh = RowNH(self.row_key) if self.row_key is not None and rows_available() else None
        return rows

    def set_rows(self, plan: np.ndarray) -> None:
        """The frame begun has row digests: its block (fed from now on, by any path) has the row
        regions ``plan`` (int64 ``(start, end, row_bytes)`` triples); each row is fed to this
        connection's :class:`RowNH` and its digest takes its place in the MAC input."""
        rows = self.row_nh
        if rows is None or self.native_nh is None:
            raise IntegrityError("a frame with row digests, where this connection has no row key or no _mac.c: "
                                 "it never asks for them")  # fmt: skip
        self._nh.set_rows(rows.nh, np.ascontiguousarray(plan, np.int64))

    def check_head(self, head, tag) -> None:
        """The head tag of the frame begun, before its envelope is parsed (raises :class:`IntegrityError`)."""
        if not hmac.compare_digest(bytes(tag), self._head(head)):
            raise IntegrityError(f"frame {self.seq - 1}'s header and envelope failed their MAC check: altered or "
                                 "injected on the way")  # fmt: skip

    def check(self, trailer) -> None:
        seq, tag = TRAILER.unpack(bytes(trailer))
        want = self.seq - 1
        if seq != want:
            raise IntegrityError(f"frame sequence number {seq}, expected {want}: a replayed, reordered or dropped frame")
        if not hmac.compare_digest(tag, self.final()):
            raise IntegrityError(f"frame {seq} failed its MAC check: altered or injected on the way")


# ----------------------------------------------------------------- MAC threads
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def mac_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's MAC threads (2 to 4, by cores): a big frame's MAC runs there while the
    thread that moves its bytes moves them (and, on gearflow's records, its encryption ahead of
    the writes: ``records.StreamCipher.write_ahead``). A job never waits for bytes (a receiving
    job ends when it has caught up), so a few threads serve every connection."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 1)),
                                                              thread_name_prefix="gearflow-mac")  # fmt: skip
    return _pool


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


class BlockMac:
    """The receiving side's MAC of one frame's buffer block in a MAC thread, following the bytes
    as they land (the loop thread goes on receiving meanwhile): :meth:`landed` with how many of
    the block's bytes are in (the thread is woken once ``FEED_BYTES`` wait unMACed, and MACs
    everything that has landed in one call each time), :meth:`finish` at the block's end: waits
    until every byte is MACed (then the opener's context is the caller's again). The bytes up to
    ``landed`` must not change until then. ``Opener.block_mac(block)`` makes and starts one.

        bm = opener.block_mac(block)          # the header and envelope are MACed already
        bm.landed(filled)                     # each time bytes land
        bm.finish(); opener.check(trailer)
    """

    def __init__(self, mac: _Mac):
        self._mac = mac
        self._cv = threading.Condition(threading.Lock())
        self._block: np.ndarray | None = None
        self._base = 0
        self._lo = self._hi = 0  # [0, _lo) MACed; [_lo, _hi) landed, not MACed yet
        self._busy = False  # a job is queued or running
        self._error: BaseException | None = None

    def start(self, block: np.ndarray) -> None:
        self._block, self._base = block, block.__array_interface__["data"][0]
        self._lo = self._hi = 0
        self._error = None

    def landed(self, hi: int, final: bool = False) -> None:
        with self._cv:
            self._hi = hi
            if self._busy or hi <= self._lo or (hi - self._lo < FEED_BYTES and not final):
                return
            self._busy = True
        mac_pool().submit(self._run)

    def _run(self) -> None:
        block, lo = self._block, self._lo  # the block stays alive while it is read
        try:
            while True:
                with self._cv:
                    hi = self._hi
                    if hi <= lo:  # caught up: the next landed() wakes a new job
                        self._lo, self._busy = lo, False
                        self._cv.notify_all()
                        return
                self._update(block, lo, hi)
                lo = hi
        except BaseException as exc:  # noqa: BLE001 - raised by finish() in the receiving thread
            with self._cv:
                self._error, self._lo, self._busy = exc, lo, False
                self._cv.notify_all()

    def _update(self, block: np.ndarray, lo: int, hi: int) -> None:
        self._mac.update_at(self._base + lo, hi - lo)

    def finish(self) -> None:
        """Wait until the whole block is MACed; raises :class:`IntegrityError` if the MAC failed."""
        nbytes = self._block.nbytes
        self.landed(nbytes, final=True)
        with self._cv:
            while self._busy:
                self._cv.wait()
            err, lo = self._error, self._lo
        self._block = None
        if err is not None:
            raise IntegrityError(f"the frame's MAC failed in its MAC thread: {err}") from err
        if lo != nbytes:  # pragma: no cover - a bug, never a peer's doing
            raise IntegrityError(f"the MAC thread covered {lo} of the block's {nbytes} bytes")
