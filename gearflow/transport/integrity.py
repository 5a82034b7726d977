"""Per-frame integrity after the handshake: AES-128-GMAC under a session key per direction,
over every byte of a frame and its sequence number.

Each frame after ``AUTH_OK`` carries a 24-byte trailer after its buffer block::

    trailer  "<Q16s"   sequence number (this direction's frame count, from 0), tag

``tag = GMAC(key, iv = 0⁴ | seq (little-endian, 8 B), header | envelope | buffer block)``: the
frame's bytes exactly as they are on the wire (padding included). The receiver counts the
frames it has accepted; a trailer whose sequence number is not the next one (a replayed,
reordered or dropped frame) or whose tag does not verify (an injected or altered frame) is
an :class:`IntegrityError`, raised before the frame is handed to anyone: its connection is
closed. The keys (:func:`session_keys`) are HKDF-SHA256 over the role's secret, salted with
both nonces of the handshake, one per direction, so a recorded frame of one connection or
direction verifies nowhere else.

GMAC (AES-GCM with the frame as associated data and no plaintext) runs in OpenSSL's
libcrypto (the one Python's ``ssl`` module links), through its ``EVP_MAC`` API (OpenSSL ≥ 3),
with AES-NI and carry-less multiplication: 8 GB/s on one core here, against 0.47 GB/s for
keyed ``hashlib.blake2b`` and 1.1 GB/s for HMAC-SHA256 (14.5 MB, this machine). A 96-bit IV
never repeats under one key: each direction of each connection has its own key and counts
its own frames.

    seal, opener = Sealer(key_out), Opener(key_in)
    parts = seal.seal(encode(REQUEST, 1, "replay.stats", {}))   # + trailer
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import hmac
import struct
import threading

import numpy as np

from gearflow.errors import MissingDependencyError
from gearflow.transport.framing import FrameError

__all__ = ["TAG_BYTES", "TRAILER", "IntegrityError", "Opener", "Sealer", "available", "hkdf", "require", "session_keys"]

TRAILER = struct.Struct("<Q16s")  # sequence number, tag
TAG_BYTES = 16
ALGORITHM = "aes-128-gmac"
KEY_BYTES = 16


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
               b"gearflow-frame-keys-v2|" + transcript, 2 * KEY_BYTES)  # fmt: skip
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


# ----------------------------------------------------------------- libcrypto's EVP_MAC (GMAC)
class _Param(ctypes.Structure):  # OSSL_PARAM
    _fields_ = [("key", ctypes.c_char_p), ("data_type", ctypes.c_uint), ("data", ctypes.c_void_p),
                ("data_size", ctypes.c_size_t), ("return_size", ctypes.c_size_t)]  # fmt: skip


_UTF8_STRING, _OCTET_STRING = 4, 5
_lib = None
_gmac = None
_lib_error = ""
_lib_lock = threading.Lock()


def _load():
    global _lib, _gmac, _lib_error
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
            lib.EVP_MAC_final.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
            gmac = lib.EVP_MAC_fetch(None, b"GMAC", None)
            if not gmac:
                raise OSError("this libcrypto has no GMAC (OpenSSL ≥ 3 is needed)")
            _lib, _gmac = lib, gmac
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
            f"transport.integrity needs OpenSSL ≥ 3's libcrypto for AES-GMAC ({_lib_error}); install OpenSSL 3 "
            "or set transport.integrity=false on every end (the frames are then unprotected)"
        )
    return lib


def _address(part) -> tuple[int, int]:
    """(address, nbytes) of a bytes-like part (bytes, memoryview, numpy array), without a copy."""
    a = part if type(part) is np.ndarray and part.flags.c_contiguous else np.frombuffer(part, dtype=np.uint8)
    return a.__array_interface__["data"][0], a.nbytes


class _Mac:
    """One direction's GMAC: a libcrypto context keyed once, re-initialised per frame with its IV."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a session key has {KEY_BYTES} bytes, got {len(key)}")
        self._lib = lib = require()
        self._ctx = lib.EVP_MAC_CTX_new(_gmac)
        if not self._ctx:
            raise MemoryError("EVP_MAC_CTX_new failed")
        self._key = key
        self._cipher = ctypes.create_string_buffer(b"AES-128-GCM")
        self._iv = ctypes.create_string_buffer(12)
        self._params = (_Param * 3)()
        self._params[0] = _Param(b"cipher", _UTF8_STRING, ctypes.cast(self._cipher, ctypes.c_void_p), 11, 0)
        self._params[1] = _Param(b"iv", _OCTET_STRING, ctypes.cast(self._iv, ctypes.c_void_p), 12, 0)
        self._params[2] = _Param(None, 0, None, 0, 0)
        self._out = ctypes.create_string_buffer(TAG_BYTES)
        self._outlen = ctypes.c_size_t()
        self.seq = 0

    def begin(self) -> int:
        """Start the MAC of the next frame; returns its sequence number."""
        seq = self.seq
        self.seq += 1
        ctypes.memmove(self._iv, b"\0\0\0\0" + seq.to_bytes(8, "little"), 12)
        if self._lib.EVP_MAC_init(self._ctx, self._key, KEY_BYTES, self._params) != 1:
            raise IntegrityError("EVP_MAC_init failed")
        return seq

    def update(self, part) -> None:
        if isinstance(part, bytes):
            if part:
                self._lib.EVP_MAC_update(self._ctx, part, len(part))
            return
        addr, n = _address(part)
        if n:
            self._lib.EVP_MAC_update(self._ctx, addr, n)

    def final(self) -> bytes:
        if self._lib.EVP_MAC_final(self._ctx, self._out, ctypes.byref(self._outlen), TAG_BYTES) != 1:
            raise IntegrityError("EVP_MAC_final failed")
        return self._out.raw

    def __del__(self):
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._lib.EVP_MAC_CTX_free(ctx)


class Sealer(_Mac):
    """The sending direction: :meth:`seal` appends the trailer of a whole frame's parts;
    :meth:`begin` / :meth:`update` / :meth:`trailer` do one frame sent in pieces (a reply with a
    tail). Frames must be sealed in the order they go on the wire."""

    def seal(self, parts: list) -> list:
        self.begin()
        for p in parts:
            self.update(p)
        parts.append(self.trailer())
        return parts

    def trailer(self) -> bytes:
        return TRAILER.pack(self.seq - 1, self.final())


class Opener(_Mac):
    """The receiving direction: :meth:`begin` at a frame's header, :meth:`update` with its bytes,
    :meth:`check` with its trailer (raises :class:`IntegrityError`)."""

    def check(self, trailer) -> None:
        seq, tag = TRAILER.unpack(bytes(trailer))
        want = self.seq - 1
        if seq != want:
            raise IntegrityError(f"frame sequence number {seq}, expected {want}: a replayed, reordered or dropped frame")
        if not hmac.compare_digest(tag, self.final()):
            raise IntegrityError(f"frame {seq} failed its MAC check: altered or injected on the way")
