"""Wire format of the TCP data plane: a fixed header, a small JSON envelope, raw array buffers.

One frame::

    header   32 bytes, little-endian  "<4sHHQIIQ"
             magic b"GFLW", version, kind, request id, envelope bytes,
             number of buffers, buffer bytes (every buffer, with its padding)
    envelope UTF-8 JSON object (never pickle): {"op": name, "meta": {...},
             "bufs": [[dtype, [shape...]], ...]}
    head tag on gearflow's records under TLS only (:mod:`gearflow.transport.records`): 16 bytes,
             Poly1305 of the header and envelope (``Sealer.head_tag``), checked before the
             envelope is parsed
    buffers  the raw bytes of each array, C order, each starting at a multiple of
             ALIGN bytes from the start of the buffer block (zero padding between)
    trailer  after the handshake, with transport.integrity on: 24 bytes "<Q16s",
             the direction's sequence number and the NH-Poly1305 tag of every byte above
             (:mod:`gearflow.transport.integrity`; checked before the frame is delivered);
             a frame whose meta says ``"torn": true`` ends with a uint8 buffer of marks, and
             its tag leaves out the marked rows (the rows a writer may have changed while
             they were sent: their items are redrawn, never used)

Every length in the header is checked against :class:`FrameLimits` before a byte of
the frame's body is allocated; the envelope's dtypes (an allow-list, :data:`DTYPES`),
shapes (non-negative ints, at most ``max_dims`` of them) and the sum of their sizes
(which must equal the header's buffer bytes) are checked before the buffer block is
allocated. A violation raises :class:`FrameError` naming the problem.

Receiving (:class:`FrameReader`, an ``asyncio.BufferedProtocol`` helper): small
frames are read into one reused staging buffer and parsed out of it; a large buffer
block is read straight into its destination (``alloc(nbytes)``, a pooled buffer on
the service side), so uvloop's ``recv_into`` fills it without an intermediate copy; a
protocol that calls :meth:`FramedProtocol.read_blocks_in_wire_thread` (the client) has a big
block read by its connection's wire thread instead (:mod:`gearflow.transport.wire_io`: MACed as
it lands, the loop's reading paused meanwhile).
Sending (:func:`encode`): a list ``[header + envelope, buf0, pad, buf1, ...]`` of
bytes and ``memoryview`` s of the arrays themselves (a :class:`Chunks` buffer: its pieces,
say rows of a shared-memory column), for ``transport.writelines``
(uvloop: one ``writev``, no copy). The arrays must not change until the transport
has drained them.

    parts = encode(REQUEST, 7, "replay.stats", {"x": 1}, [np.arange(4)])
    transport.writelines(parts)
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gearflow.errors import GearflowError
from gearflow.transport.tls import pieces
from gearflow.transport.torn_marks import marks_of, masked_frame, row_plan
from gearflow.transport.wire_io import WIRE_BYTES, WireIO

__all__ = [
    "ALIGN",
    "AUTH",
    "AUTH_OK",
    "CHALLENGE",
    "DTYPES",
    "ERROR",
    "HEADER",
    "KINDS",
    "MAGIC",
    "REPLY",
    "REQUEST",
    "VERSION",
    "Chunks",
    "FrameError",
    "FrameLimits",
    "FrameReader",
    "FramedProtocol",
    "as_array",
    "encode",
    "new_event_loop",
]  # fmt: skip

MAGIC = b"GFLW"
VERSION = 3  # 2: frames after the handshake may carry an integrity trailer; 3: its tag is NH-Poly1305
HEADER = struct.Struct("<4sHHQIIQ")  # magic, version, kind, request id, envelope, buffers, buffer bytes
ALIGN = 64  # each buffer starts at a multiple of this many bytes in the buffer block

# frame kinds
CHALLENGE, AUTH, AUTH_OK, REQUEST, REPLY, ERROR = 1, 2, 3, 4, 5, 6
KINDS = {CHALLENGE: "challenge", AUTH: "auth", AUTH_OK: "auth_ok", REQUEST: "request", REPLY: "reply", ERROR: "error"}

# the dtypes a buffer may have (little-endian, native on every machine gearflow runs on)
DTYPES = {
    name: np.dtype(name)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
}  # fmt: skip
_ZEROS = bytes(ALIGN)


class FrameError(GearflowError, ValueError):
    """A frame breaks the format or a limit (bad magic or version, a length over its limit,
    a dtype not allowed, a malformed envelope); the message names which."""


@dataclass(frozen=True)
class FrameLimits:
    """What one frame may hold; checked before anything is allocated for it."""

    max_frame_bytes: int = 256 << 20  # header + envelope + buffer block
    max_meta_bytes: int = 64 << 10  # the JSON envelope
    max_buffers: int = 64
    max_dims: int = 8

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_meta_bytes", "max_buffers", "max_dims"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"transport limit {name} must be ≥ 1, got {getattr(self, name)}")
        if self.max_frame_bytes < HEADER.size + self.max_meta_bytes:
            raise ValueError(
                f"max_frame_bytes ({self.max_frame_bytes}) must hold a header ({HEADER.size}) and an "
                f"envelope of max_meta_bytes ({self.max_meta_bytes})"
            )


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_array(x: Any) -> np.ndarray:
    """A C-contiguous numpy array of ``x`` (a numpy array, a CPU torch tensor, a list), without
    a copy where it already is one; a dtype outside :data:`DTYPES` is a :class:`FrameError`."""
    if type(x) is not np.ndarray:
        if hasattr(x, "numpy") and hasattr(x, "is_cpu"):  # a torch tensor: CPU, detached
            x = x.detach().numpy() if x.is_cpu else x.detach().cpu().numpy()
        else:
            x = np.asarray(x)
    if x.dtype.name not in DTYPES or not x.dtype.isnative:
        raise FrameError(f"buffer dtype {x.dtype} is not allowed (allowed: {', '.join(DTYPES)})")
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


class Chunks:
    """One buffer of a frame sent as several byte pieces (``memoryview`` s: rows of a
    shared-memory column, say), declared to the receiver as an array of ``dtype`` and
    ``shape``: the pieces' bytes must add up to its size. The receiver sees one array.
    ``addresses`` (optional, one int per piece): where each piece's bytes start, for the frame
    MAC (:meth:`~gearflow.transport.integrity.Sealer.update_spans`) without a lookup per piece.
    ``digests`` (optional, uint8): what the frame MAC takes in the buffer's place — its rows'
    digests, in order (a reply whose meta lists it in ``digested``: :mod:`~gearflow.transport.torn_marks`);
    ``fill()`` (optional) completes them, in the frame's MAC thread before the MAC reads them.
    """

    __slots__ = ("addresses", "digests", "dtype", "fill", "nbytes", "ndim", "parts", "shape")

    def __init__(self, dtype: Any, shape: Sequence[int], parts: list, addresses: list | None = None,
                 digests: np.ndarray | None = None, fill: Callable[[], None] | None = None):  # fmt: skip
        self.dtype, self.shape, self.parts = np.dtype(dtype), tuple(int(n) for n in shape), parts
        self.addresses, self.digests, self.fill = addresses, digests, fill
        self.ndim = len(self.shape)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        got = sum(p.nbytes for p in parts)
        if got != self.nbytes:
            raise ValueError(f"pieces of {got} bytes for a {self.dtype.name}{list(self.shape)} buffer of {self.nbytes}")
        if self.dtype.name not in DTYPES:
            raise FrameError(f"buffer dtype {self.dtype} is not allowed (allowed: {', '.join(DTYPES)})")


class Fill:
    """An entry of :func:`encode`'s ``spans`` that is no bytes: ``fn()`` completes the spans after
    it (a reply's row digests), run in the frame's MAC thread before the MAC reads them
    (:meth:`FramedProtocol.send`)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn


def encode(kind: int, request_id: int, op: str, meta: dict | None, buffers: Sequence[Any] = (),
           limits: FrameLimits | None = None, spans: list | None = None) -> list:
    """The parts of one frame for ``transport.writelines``: the header and envelope as one bytes
    object, then each buffer's bytes (a view of the array, or a :class:`Chunks` ' pieces: no
    copy) and its padding. ``spans`` (a list): filled with one entry per part for the frame MAC
    (:meth:`~gearflow.transport.integrity.Sealer.update_spans`): ``(address, nbytes)`` where it
    is known without a lookup, else the part itself.

    Raises :class:`FrameError` for a frame the receiver's ``limits`` would refuse."""
    arrays = [b if type(b) is Chunks else as_array(b) for b in buffers]
    descr, total = [], 0
    for a in arrays:
        total = _align(total) + a.nbytes
        descr.append([a.dtype.name, list(a.shape)])
    envelope = json.dumps({"op": op, "meta": meta or {}, "bufs": descr}, separators=(",", ":"),
                          allow_nan=False).encode()  # fmt: skip
    if limits is not None:
        _check_sizes(len(envelope), len(arrays), total, limits)
        deep = [a.ndim for a in arrays if a.ndim > limits.max_dims]
        if deep:
            raise FrameError(f"a buffer of {deep[0]} dimensions exceeds max_dims={limits.max_dims}")
    parts: list = [HEADER.pack(MAGIC, VERSION, kind, request_id, len(envelope), len(arrays), total) + envelope]
    if spans is not None:
        spans.append(parts[0])
    pos = 0
    for a in arrays:
        pad = _align(pos) - pos
        if pad:
            parts.append(_ZEROS[:pad])
            if spans is not None:
                spans.append(parts[-1])
        if type(a) is Chunks:
            parts.extend(a.parts)
            if spans is None:
                pass
            elif a.digests is not None:  # the MAC takes its rows' digests in its place
                if a.fill is not None:  # (completed in the MAC thread, beside the send)
                    spans.append(Fill(a.fill))
                spans.append(a.digests)
            else:
                spans.extend(zip(a.addresses, (p.nbytes for p in a.parts)) if a.addresses is not None else a.parts)
        elif a.nbytes:
            parts.append(memoryview(a.reshape(-1)).cast("B"))
            if spans is not None:
                spans.append((a.__array_interface__["data"][0], a.nbytes))
        pos += pad + a.nbytes
    return parts


def frame_buffers(buffers: Sequence[Any]) -> list[tuple]:
    """``(padding, pieces, nbytes, rows)`` of each buffer as :func:`encode` lays it out for the MAC
    (``rows``: its leading dimension, None for a scalar; a :class:`Chunks` with ``digests``: those): what
    :func:`~gearflow.transport.torn_marks.masked_frame` takes on the sending side."""
    out, pos = [], 0
    for b in buffers:
        a = b if type(b) is Chunks else as_array(b)
        pad = _align(pos) - pos
        if type(a) is Chunks and a.digests is not None:  # as the MAC takes it: its rows' digests
            pieces, nbytes = [memoryview(a.digests)], a.digests.nbytes
        else:
            pieces = a.parts if type(a) is Chunks else ([memoryview(a.reshape(-1)).cast("B")] if a.nbytes else [])
            nbytes = a.nbytes
        out.append((_ZEROS[:pad], pieces, nbytes, a.shape[0] if a.ndim else None))
        pos += pad + a.nbytes
    return out


def _check_sizes(meta_len: int, nbufs: int, buf_bytes: int, limits: FrameLimits) -> None:
    if meta_len > limits.max_meta_bytes:
        raise FrameError(f"envelope of {meta_len} bytes exceeds max_meta_bytes={limits.max_meta_bytes}")
    if nbufs > limits.max_buffers:
        raise FrameError(f"{nbufs} buffers exceed max_buffers={limits.max_buffers}")
    if HEADER.size + meta_len + buf_bytes > limits.max_frame_bytes:
        raise FrameError(
            f"frame of {HEADER.size + meta_len + buf_bytes} bytes exceeds max_frame_bytes={limits.max_frame_bytes}"
        )


def parse_header(raw, limits: FrameLimits, kinds: frozenset) -> tuple[int, int, int, int, int]:
    """(kind, request id, envelope bytes, buffers, buffer bytes) of a 32-byte header, every field
    checked against ``limits`` and the ``kinds`` accepted now."""
    magic, version, kind, rid, meta_len, nbufs, buf_bytes = HEADER.unpack(raw)
    if magic != MAGIC:
        if magic == b"GFKY":  # records.MAGIC: the peer's key message, inside TLS
            raise FrameError("the peer uses gearflow's records under TLS (transport.tls_records=gearflow, integrity on) "
                             "and this side TLS's records: set transport.tls_records and transport.integrity the same "
                             "on both ends")  # fmt: skip
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a gearflow peer")
    if version != VERSION:
        raise FrameError(f"protocol version {version} (this side speaks {VERSION})")
    if kind not in kinds:
        raise FrameError(f"frame kind {KINDS.get(kind, kind)!r} not accepted here (expected {sorted(KINDS[k] for k in kinds)})")
    if meta_len < 2:
        raise FrameError(f"envelope of {meta_len} bytes is too short for a JSON object")
    _check_sizes(meta_len, nbufs, buf_bytes, limits)
    return kind, rid, meta_len, nbufs, buf_bytes


def _reject_constant(name: str):
    raise FrameError(f"envelope holds the non-finite number {name}")


def parse_envelope(raw, nbufs: int, buf_bytes: int, limits: FrameLimits) -> tuple[str, dict, list]:
    """(op, meta, [(dtype, shape, offset)]) of an envelope; the buffers' dtypes, shapes and total
    size are checked against the header and ``limits``."""
    try:
        env = json.loads(bytes(raw).decode("utf-8"), parse_constant=_reject_constant)
    except FrameError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"envelope is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(env, dict) or set(env) != {"op", "meta", "bufs"}:
        raise FrameError("envelope must be a JSON object with exactly the keys op, meta, bufs")
    op, meta, bufs = env["op"], env["meta"], env["bufs"]
    if not isinstance(op, str) or len(op) > 128:
        raise FrameError("envelope op must be a string of at most 128 characters")
    if not isinstance(meta, dict):
        raise FrameError(f"envelope meta must be a JSON object, got {type(meta).__name__}")
    if not isinstance(bufs, list) or len(bufs) != nbufs:
        raise FrameError(f"envelope describes {len(bufs) if isinstance(bufs, list) else '?'} buffers, header says {nbufs}")
    layout, pos = [], 0
    for i, d in enumerate(bufs):
        if not (isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and isinstance(d[1], list)):
            raise FrameError(f"buffer {i}: description must be [dtype, shape]")
        dtype = DTYPES.get(d[0])
        if dtype is None:
            raise FrameError(f"buffer {i}: dtype {d[0][:32]!r} is not allowed (allowed: {', '.join(DTYPES)})")
        shape = d[1]
        if len(shape) > limits.max_dims:
            raise FrameError(f"buffer {i}: {len(shape)} dimensions exceed max_dims={limits.max_dims}")
        if not all(type(s) is int and 0 <= s <= limits.max_frame_bytes for s in shape):
            raise FrameError(f"buffer {i}: shape must be non-negative ints, got {str(shape)[:80]}")
        nbytes = math.prod(shape) * dtype.itemsize  # python ints: no overflow
        if math.prod(s for s in shape if s) * dtype.itemsize > limits.max_frame_bytes:  # a zero-size array too
            raise FrameError(f"buffer {i}: shape {str(shape)[:80]} is too large (over max_frame_bytes={limits.max_frame_bytes})")
        pos = _align(pos)
        if pos + nbytes > buf_bytes:
            raise FrameError(f"buffer {i}: {nbytes} bytes at offset {pos} overrun the {buf_bytes} buffer bytes of the header")
        layout.append((dtype, tuple(shape), pos))
        pos += nbytes
    if pos != buf_bytes:
        raise FrameError(f"buffers take {pos} bytes, header says {buf_bytes}")
    return op, meta, layout


class FrameReader:
    """Incremental frame parser behind an ``asyncio.BufferedProtocol``.

    The protocol forwards ``get_buffer`` / ``buffer_updated`` here; each complete frame calls
    ``on_frame(kind, request_id, op, meta, arrays, block)`` where ``arrays`` are numpy views of
    ``block`` (the buffer block ``alloc(nbytes)`` returned: the caller's to keep or recycle).
    A violation raises :class:`FrameError` out of ``buffer_updated`` (the protocol closes the
    connection); no byte after it is parsed. ``kinds`` (mutable) are the kinds accepted now.
    """

    def __init__(self, on_frame: Callable, limits: FrameLimits, kinds, alloc: Callable[[int], Any] | None = None,
                 staging: int = 256 << 10):  # fmt: skip
        self.on_frame, self.limits, self.kinds = on_frame, limits, frozenset(kinds)
        self.alloc = alloc or (lambda n: np.empty(n, dtype=np.uint8))
        self._stage = bytearray(max(staging, 2 * (HEADER.size + limits.max_meta_bytes)))
        self._view = memoryview(self._stage)
        self._lo = self._hi = 0  # unparsed bytes: _stage[_lo:_hi]
        self._head: tuple | None = None  # parsed header of the frame in progress
        self._env: tuple | None = None  # parsed envelope, once the header's envelope arrived
        self._block = None  # the frame's buffer block (numpy uint8)
        self._filled = 0  # bytes of _block received
        self._direct = False  # reading straight into _block
        self.frames = 0
        self.opener = None  # integrity.Opener once the handshake made the keys: every frame's trailer checked
        self._maced = 0  # bytes of the frame's buffer block the opener has taken (as they arrive: cache-hot)
        self._bmac = None  # a big block's MAC, in a MAC thread following the bytes (integrity.BlockMac)
        self._head_bytes: list = []  # with an opener: the frame's header and envelope (a torn frame's re-MAC)
        self._rows = None  # with an opener: the frame's row regions when its MAC takes row digests (torn_marks.row_plan)
        # wire(view, nh, trailer): the protocol's wire thread reads the rest of a big block (and its
        # trailer) without the loop, MACed as it lands; it calls wire_landed() back in the loop
        self.wire: Callable | None = None
        self._wired = False  # this frame's block goes through the wire thread
        self.failed = False
        self.hold = False  # True: parse no further frame out of the staged bytes (back-pressure)
        self.head_tags = False  # each envelope is followed by its head tag, checked before it is parsed (records.py)

    # -------------------------------------------------------------- protocol side

    @property
    def staging_bytes(self) -> int:
        """Bytes of the reader's staging buffer (what a client can make the service hold)."""
        return len(self._stage)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct:  # with a MAC, pieces of opener.piece_bytes: MACed (here, or by its thread) while in cache
            end = self._filled + self.opener.piece_bytes if self.opener is not None else None
            return memoryview(self._block)[self._filled:end]
        if self._hi == len(self._stage):  # compact: move the unparsed tail to the front
            n = self._hi - self._lo
            self._stage[:n] = self._stage[self._lo:self._hi]
            self._lo, self._hi = 0, n
        return self._view[self._hi:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.failed:
            return
        try:
            if self._direct:
                self._filled += nbytes
                if self._bmac is not None:  # a MAC thread takes what landed while the loop receives on
                    self._bmac.landed(self._filled)
                elif self.opener is not None:  # MAC each piece as it lands, while it is in cache
                    self.opener.update(self._block[self._maced:self._filled])
                    self._maced = self._filled
                if self._filled == self._block.nbytes:
                    self._direct = False
                    if self.opener is None:
                        self._deliver()
                    else:  # its trailer comes through the staging buffer
                        self._parse()
                return
            self._hi += nbytes
            self._parse()
        except FrameError:
            self.failed = True
            raise

    def wire_landed(self, trailer: bytearray | None) -> None:
        """The wire thread filled the block (MACed it, with an opener) and read ``trailer``: the
        frame is checked and delivered as one read through the loop would be (raises
        :class:`FrameError`). The staging buffer is empty: nothing was read past the trailer."""
        if self.failed or not self._wired:
            return
        self._wired = False
        self._filled = self._maced = self._block.nbytes
        if trailer is not None:
            self._view[:_TRAILER_BYTES] = trailer
            self._lo, self._hi = 0, _TRAILER_BYTES
        try:
            self._parse()
        except FrameError:
            self.failed = True
            raise

    def resume(self) -> None:
        """Parse the frames staged while :attr:`hold` was set (raises :class:`FrameError`)."""
        self.hold = False
        if not self._direct and not self.failed:
            try:
                self._parse()
            except FrameError:
                self.failed = True
                raise

    # -------------------------------------------------------------- parsing
    def _parse(self) -> None:
        while True:
            avail = self._hi - self._lo
            if self._head is None:
                if self.hold or avail < HEADER.size:
                    return
                self._head = parse_header(self._view[self._lo:self._lo + HEADER.size], self.limits, self.kinds)
                if self.opener is not None:
                    self.opener.begin()
                    self._head_bytes = [bytes(self._view[self._lo:self._lo + HEADER.size])]
                    self.opener.update(self._head_bytes[0])
                self._lo += HEADER.size
                continue
            _, _, meta_len, nbufs, buf_bytes = self._head
            if self._env is None:
                tag = _HEAD_TAG_BYTES if self.head_tags else 0
                if avail < meta_len + tag:
                    return
                if tag:  # gearflow's records: nothing of the envelope is read before its tag is checked
                    end = self._lo + meta_len
                    self.opener.check_head(self._head_bytes[0] + bytes(self._view[self._lo:end]), self._view[end:end + tag])
                self._env = parse_envelope(self._view[self._lo:self._lo + meta_len], nbufs, buf_bytes, self.limits)
                if self.opener is not None:
                    self._head_bytes.append(bytes(self._view[self._lo:self._lo + meta_len]))
                    self.opener.update(self._head_bytes[1])
                    self._rows = self._row_plan()
                self._lo += meta_len + tag
                self._block = self.alloc(buf_bytes) if buf_bytes else _EMPTY
                self._filled = 0
                self._wired = (self.wire is not None and buf_bytes >= WIRE_BYTES
                               and (self.opener is None or self.opener.native_nh is not None))  # fmt: skip
                if self.opener is not None and buf_bytes >= self.opener.thread_bytes and not self._wired:
                    self._bmac = self.opener.block_mac(self._block)
                continue
            need = self._block.nbytes - self._filled
            take = min(need, avail)
            if take:
                self._block[self._filled:self._filled + take] = np.frombuffer(self._view[self._lo:self._lo + take], np.uint8)
                self._filled += take
                self._lo += take
            if self._filled < self._block.nbytes:  # the rest goes straight into the block
                if self._bmac is not None and take:
                    self._bmac.landed(self._filled)
                self._lo = self._hi = 0
                if self._wired:  # by the wire thread: the bytes staged so far are MACed here, first
                    nh, trailer = None, None
                    if self.opener is not None:
                        self.opener.update(self._block[:self._filled])
                        self._maced, nh, trailer = self._filled, self.opener.native_nh, bytearray(_TRAILER_BYTES)
                    self.wire(memoryview(self._block)[self._filled:], nh, trailer)
                    return
                self._direct = True
                return
            if self.opener is not None:  # the trailer: checked before anyone sees the frame
                if self._bmac is not None:  # every byte MACed (the thread's last piece) before the check
                    bmac, self._bmac = self._bmac, None
                    bmac.finish()
                    self._maced = self._block.nbytes
                if self._maced < self._block.nbytes:
                    self.opener.update(self._block[self._maced:])
                    self._maced = self._block.nbytes
                if self._hi - self._lo < _TRAILER_BYTES:
                    return
                self._unmark()
                self.opener.check(self._view[self._lo:self._lo + _TRAILER_BYTES])
                self._lo += _TRAILER_BYTES
                self._maced = 0
            self._deliver()
            if self._lo == self._hi:
                self._lo = self._hi = 0

    def _row_plan(self):
        """A frame with row digests: its block's row regions, fed from now on to the opener's row
        NH (whichever thread feeds the block); None for any other frame."""
        _, meta, layout = self._env
        try:
            plan = row_plan(meta, layout)
        except ValueError as exc:
            raise FrameError(f"malformed frame: {exc}") from None
        if plan is not None:
            self.opener.set_rows(plan)
        return plan

    def _unmark(self) -> None:
        """A frame with torn marks, some set: its MAC again, without the marked rows (the rule of
        :func:`~gearflow.transport.torn_marks.masked_frame`; the marks are checked with the rest)."""
        _, meta, layout = self._env
        n = marks_of(meta, layout)
        if n is None:
            return
        block, pieces, pos = self._block, [], 0
        marks = block[layout[-1][2]:]
        if not marks.any():
            return
        rows = {int(start): int(rb) for start, _, rb in self._rows} if self._rows is not None else {}
        for dt, shape, off in layout:
            nbytes = math.prod(shape) * dt.itemsize
            data = block[off:off + nbytes]
            if off in rows and nbytes:  # its rows' digests, as the MAC took them
                data = self.opener.row_nh.digests(data, rows[off])
            pieces.append((block[pos:off], [data], data.nbytes, shape[0] if shape else None))
            pos = off + nbytes
        self.opener.restart()
        for p in masked_frame(self._head_bytes, pieces, marks):
            self.opener.update(p)
        self.opener.update(marks)

    def _deliver(self) -> None:
        kind, rid, _, _, _ = self._head
        op, meta, layout = self._env
        block = self._block
        arrays = [np.frombuffer(block, dtype=dt, count=math.prod(shape), offset=off).reshape(shape)
                  if math.prod(shape) else np.empty(shape, dtype=dt) for dt, shape, off in layout]  # fmt: skip
        self._head = self._env = self._block = None
        self._wired = False
        self.frames += 1
        self.on_frame(kind, rid, op, meta, arrays, block)


_EMPTY = np.empty(0, dtype=np.uint8)
_TRAILER_BYTES = 24  # integrity.TRAILER.size
_HEAD_TAG_BYTES = 16  # integrity.TAG_BYTES
_KX_BUFFER = 64 << 10  # what one read takes during the TLS handshake of gearflow's records
AHEAD_BYTES = 1 << 20  # on gearflow's records, a write this big is encrypted ahead by a thread (records.write_ahead)


class FramedProtocol(asyncio.BufferedProtocol):
    """Base of both ends: frames in through a :class:`FrameReader`, frames out with
    :meth:`send` (``writelines``), and ``on_sent`` callbacks run once the transport has
    drained what was written before them (the write-buffer limits are ``high = low = 0``,
    so ``pause_writing`` fires when anything is left buffered and ``resume_writing`` when
    it is all gone): until then the arrays of a frame must stay as they are."""

    def __init__(self, reader: FrameReader):
        self.reader = reader
        self.sealer = None  # integrity.Sealer once the handshake made the keys: every frame sent gets a trailer
        self._sealing = False  # a frame sent in pieces (send(..., more=True)) is open
        self.transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsent: list[Callable[[], None]] = []  # run when the write buffer drains
        self._mac_job: list | None = None  # [more, on_sent] of a frame whose MAC runs in a MAC thread
        self._backlog: list[tuple] = []  # frames sent meanwhile: written after its trailer, in order
        self._wire: WireIO | None | bool = None  # the connection's wire thread (False: none here), made on first use
        self._tls = False  # the transport encrypts: frames go to it in pieces (tls.pieces)
        self._kx = None  # records.KeyExchange while gearflow's records under TLS are being keyed
        self._kx_buf: bytearray | None = None
        self._tx = self._rx = None  # records.StreamCipher of each direction once keyed: every byte after the exchange
        self._rx_view: memoryview | None = None  # what get_buffer handed out last (decrypted in buffer_updated)
        self.closed = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        transport.set_write_buffer_limits(high=0, low=0)
        self._tls = transport.get_extra_info("sslcontext") is not None

    wire_threads = True  # a big block is read by a wire thread where the protocol asks and the transport allows

    def wire_io(self) -> WireIO | None:
        """This connection's wire thread, or None (TLS, no ``_mac.c``, ``wire_threads`` off, closed)."""
        if self._wire is None:
            self._wire = (self.wire_threads and not self.closed and WireIO.of(self.transport)) or False
        return self._wire or None

    def read_blocks_in_wire_thread(self) -> None:
        """From now on a big buffer block is read by the wire thread (:meth:`FrameReader.wire`),
        the loop's reading paused meanwhile: for a protocol that pauses its reading for nothing else."""
        if self.wire_io() is not None:
            self.reader.wire = self._wire_read

    def _wire_read(self, view: memoryview, nh, trailer: bytearray | None) -> None:
        self.transport.pause_reading()
        self._wire.recv(view, nh, trailer, functools.partial(self._to_loop, self._wire_landed, trailer), self._rx)

    # ----------------------------------------------------------------- gearflow's records under TLS
    def start_records(self, kx) -> None:
        """gearflow's records under TLS on this plain connection (:mod:`~gearflow.transport.records`):
        ``kx`` (a ``records.KeyExchange`` writing to this transport) runs TLS's handshake and the key
        exchange inside it first; :meth:`records_ready` once frames may flow, each encrypted,
        MACed and head-tagged."""
        self._kx_buf = bytearray(_KX_BUFFER)
        self._kx = kx
        self._kx_feed(b"")  # the client's first flight

    @property
    def send_cipher(self):
        """This connection's outgoing ``records.StreamCipher`` on gearflow's records (a client
        encrypts its requests with it, under its send lock), else None."""
        return self._tx

    def records_ready(self) -> None:
        """The key exchange is done (the service sends its challenge here)."""

    def records_failed(self, exc: BaseException) -> None:
        """The TLS handshake or the key exchange failed: the connection is closed."""
        logging.getLogger(__name__).info("transport: %s; closing the connection", exc)
        self.transport.abort()

    def _kx_feed(self, data: bytes) -> None:
        done = self._kx.step(data)  # None (not yet), the error that ended it, or the hand-over
        if done is None:
            return
        self._kx = self._kx_buf = None
        if isinstance(done, BaseException):
            return self.records_failed(done)
        # every frame from the first is MACed (these keys until the secret handshake's own) and head-tagged
        rest, self._tx, self._rx, self.sealer, self.reader.opener = done
        self.reader.head_tags = True
        self.records_ready()
        if rest and not self.closed:  # the first bytes of the peer's records came with its key message
            view = memoryview(bytearray(rest))
            self._rx.apply(view)
            while len(view) and not (self.closed or self.reader.failed):
                dst = self.reader.get_buffer(len(view))
                n = min(len(dst), len(view))
                dst[:n] = view[:n]
                view = view[n:]
                try:
                    self.reader.buffer_updated(n)
                except FrameError as exc:
                    return self.frame_error(exc)

    def _to_loop(self, then: Callable, *args) -> None:
        """In a MAC or wire thread: hand its result back to the loop."""
        try:
            self._loop.call_soon_threadsafe(then, *args)
        except RuntimeError:  # the loop is closed: its connections are gone
            pass

    def _wire_landed(self, trailer: bytearray | None, error: BaseException | None) -> None:
        t = self.transport
        if self.closed or t is None or t.is_closing():
            return
        if error is not None:
            logging.getLogger(__name__).info("transport: receiving a frame failed (%s); closing the connection", error)
            t.abort()
            return
        try:
            self.reader.wire_landed(trailer)
        except FrameError as exc:
            self.frame_error(exc)
            return
        if not (self.closed or t.is_closing()):
            t.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._kx is not None:
            return memoryview(self._kx_buf)
        view = self.reader.get_buffer(sizehint)
        if self._rx is not None:
            self._rx_view = view
        return view

    def buffer_updated(self, nbytes: int) -> None:
        if self._kx is not None:
            return self._kx_feed(bytes(self._kx_buf[:nbytes]))
        if self._rx is not None:  # decrypted in place as it lands, before the reader (and the MAC) see it
            self._rx.apply(self._rx_view[:nbytes])
        try:
            self.reader.buffer_updated(nbytes)
        except FrameError as exc:
            self.frame_error(exc)

    def frame_error(self, exc: FrameError) -> None:
        raise NotImplementedError

    def begin_frame(self, parts: list) -> list:
        """Begin a frame's MAC (the sealer's next sequence number): ``parts`` as they go on the
        wire — on gearflow's records, the head tag after the envelope (``parts[0]``)."""
        self.sealer.begin()
        if self.reader.head_tags:
            return [parts[0], self.sealer.head_tag(parts[0]), *parts[1:]]
        return parts

    def send(self, parts: list, on_sent: Callable[[], None] | None = None, more: bool = False,
             spans: list | None = None) -> None:  # fmt: skip
        """Write ``parts`` (one frame, or with ``more=True`` the first pieces of one whose rest
        the next ``send`` writes); ``on_sent()`` once they have drained (and, for a frame MACed in
        a MAC thread, once the MAC has read them). ``spans``: the same bytes for the MAC
        (:func:`encode`'s ``spans``). A frame of ``sealer.thread_bytes`` or more is written at once
        while a MAC thread reads it (:meth:`~gearflow.transport.integrity.Sealer.seal_async`); its
        trailer follows when the MAC is done, and frames sent meanwhile wait behind it, in order."""
        t = self.transport
        if self.closed or t is None or t.is_closing():
            if on_sent is not None:
                on_sent()
            return
        if self._mac_job is not None:  # the frame before is being MACed: this one goes after its trailer
            self._backlog.append((parts, on_sent, more, spans))
            return
        written = parts
        if self.sealer is not None:
            if not self._sealing:
                written = self.begin_frame(parts)
            self._sealing = more
            macs = parts if spans is None else spans
            fills = [m.fn for m in macs if type(m) is Fill] if spans is not None else ()
            if fills:
                macs = [m for m in macs if type(m) is not Fill]
            if fills or sum(s[1] if type(s) is tuple else len(s) for s in macs) >= self.sealer.thread_bytes:
                # a big frame (or one whose MAC input is completed first): its bytes go to the socket
                # now and a MAC thread reads them meanwhile (both only read them); its trailer, and
                # any frame after it, once the MAC is done
                self._mac_job = job = [more, on_sent]
                self.sealer.seal_async(macs, functools.partial(self._to_loop, self._sealed, job), started=True,
                                       before=fills)  # fmt: skip
                self._write(written)
                return
            self.sealer.update_spans(macs)
            if not more:
                written = [*written, self.sealer.trailer()]
        self._write(written)
        if on_sent is not None:
            self._after_drain(on_sent)

    def _write(self, parts: list) -> None:
        """``writelines``; to a TLS transport in pieces (``tls.pieces``: each piece's records leave
        before the next is encrypted); on gearflow's records, each piece encrypted just before it
        is written (a copy: the parts are free once this returns, as with any write)."""
        if self._tx is not None:
            if sum(memoryview(p).nbytes for p in parts) >= AHEAD_BYTES:  # AES ahead, in a thread
                try:
                    self._tx.write_ahead(parts, self.transport.write)
                except ConnectionError as exc:  # records.RecordsError: the stream is cut short
                    logging.getLogger(__name__).error("transport: %s; closing the connection", exc)
                    self.transport.abort()
                return
            for piece in self._tx.seal_iter(parts):
                self.transport.write(memoryview(piece))
            return
        if not self._tls:
            self.transport.writelines(parts)
            return
        for piece in pieces(parts):
            self.transport.writelines(piece)

    def _after_drain(self, on_sent: Callable[[], None]) -> None:
        t = self.transport
        if self.closed or t is None or t.get_write_buffer_size() == 0:
            on_sent()
        else:
            self._unsent.append(on_sent)

    def _sealed(self, job: list, error: BaseException | None) -> None:
        """A big frame's MAC is done (in the loop): its trailer goes out, its ``on_sent`` waits for
        the drain as any frame's, and the frames sent meanwhile follow in order."""
        self._mac_job = None
        more, on_sent = job
        t = self.transport
        if error is not None:
            logging.getLogger(__name__).error("transport: a frame's MAC failed (%s); closing the connection", error)
            if t is not None:
                t.abort()
        elif not more and not (self.closed or t is None or t.is_closing()):
            self._write([self.sealer.trailer()])
        if on_sent is not None:
            self._after_drain(on_sent)
        backlog, self._backlog = self._backlog, []
        for frame in backlog:  # one that starts another MAC queues the rest behind it again
            self.send(*frame)

    @property
    def replies_unsent(self) -> int:
        """Frames written (or waiting for a frame's MAC before them) whose ``on_sent`` waits for
        the transport to drain."""
        return len(self._unsent) + (self._mac_job is not None) + len(self._backlog)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        self._run_unsent()

    def _run_unsent(self) -> None:
        unsent, self._unsent = self._unsent, []
        for cb in unsent:
            try:
                cb()
            except Exception:  # pragma: no cover - a callback's own bug must not kill the loop
                logging.getLogger(__name__).exception("transport: on_sent callback failed")

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._wire:
            self._wire.close()  # a wire thread still moving a frame stops with an error
        self._run_unsent()  # the transport holds no reference to the buffers any more


def new_event_loop(kind: str = "auto") -> asyncio.AbstractEventLoop:
    """An event loop of ``kind``: ``uvloop``, ``asyncio``, or ``auto`` (uvloop when installed)."""
    if kind not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"transport.loop must be auto, uvloop or asyncio, got {kind!r}")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                from gearflow.errors import MissingDependencyError

                raise MissingDependencyError("transport.loop=uvloop needs uvloop: pip install uvloop") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
