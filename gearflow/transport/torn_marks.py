"""The MAC rules of sample replies: which bytes the MAC covers when some of a reply's rows were
overwritten while it was sent (torn marks), and where a reply's rows are when the MAC takes
their digests in their place (row digests). See :mod:`gearflow.transport.integrity`'s docstring
for why both are sound. A leaf (numpy only): the frame reader (:mod:`~gearflow.transport.framing`),
the sealing side (:mod:`~gearflow.transport.service`) and :mod:`~gearflow.transport.integrity`
all apply them."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["marks_of", "masked_frame", "row_plan"]

ROW_DIGESTS = "digested"  # a reply's meta: [[buffer index, row bytes], ...], buffers whose rows the MAC takes as digests
MIN_ROW_BYTES = 64  # a row digest is 32 bytes per KiB: shorter rows gain nothing


def marks_of(meta: dict, layout: list) -> int | None:
    """The number of marks ``n`` when a frame carries torn marks (``meta["torn"] is True`` and its
    last buffer is ``uint8`` of shape ``(n,)``: ``layout`` is ``[(dtype, shape), ...]``), else None."""
    if meta.get("torn") is not True or not layout:
        return None
    dtype, shape = layout[-1][0], layout[-1][1]
    if np.dtype(dtype) != np.uint8 or len(shape) != 1:
        return None
    return int(shape[0])


def row_plan(meta: dict, layout: list):
    """The row regions of a frame whose meta lists ``digested`` (``[[buffer index, row bytes],
    ...]``, indexes ascending), as int64 ``(start, end, row_bytes)`` triples of its buffer block
    (``layout``: ``[(dtype, shape, offset), ...]``); None when it lists none. A buffer of row
    digests holds a whole number of rows, and with torn marks a whole number per item (its rows
    are then left out item by item). Raises ``ValueError`` naming what is wrong."""
    spec = meta.get(ROW_DIGESTS)
    if spec is None:
        return None
    n = marks_of(meta, layout)
    if not isinstance(spec, list) or not spec or len(spec) > len(layout):
        raise ValueError(f"{ROW_DIGESTS} must be a non-empty list of at most {len(layout)} [buffer, row bytes] pairs")
    plan, last = [], -1
    for e in spec:
        if not (isinstance(e, list) and len(e) == 2 and all(type(x) is int for x in e)):
            raise ValueError(f"{ROW_DIGESTS}: each entry must be [buffer index, row bytes], got {str(e)[:60]}")
        i, rb = e
        if not last < i < len(layout) - (n is not None):
            raise ValueError(f"{ROW_DIGESTS}: buffer {i} is out of order or not a data buffer")
        dtype, shape, off = layout[i][:3]
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        lead = shape[0] if shape else 1
        if rb < MIN_ROW_BYTES or nbytes % rb or (n is not None and lead == n and n and (nbytes // n) % rb):
            raise ValueError(f"{ROW_DIGESTS}: buffer {i} of {nbytes} bytes is not rows of {rb} bytes"
                             + (" (a whole number per item)" if n is not None else ""))  # fmt: skip
        if nbytes:
            plan.append((off, off + nbytes, rb))
        last = i
    return np.array(plan, np.int64).reshape(-1, 3) if plan else None


def _kept(pieces: list, nbytes: int, rows: int, keep_lo: np.ndarray, keep_hi: np.ndarray, n: int):
    """The bytes of one buffer (``pieces`` in order, ``nbytes`` in all, ``rows`` the leading dim)
    without its marked rows when it has ``n`` rows; kept rows are ``[keep_lo[k], keep_hi[k])``."""
    if rows != n or nbytes == 0 or n == 0:
        yield from pieces
        return
    rb = nbytes // n
    lo, hi = (keep_lo * rb).tolist(), (keep_hi * rb).tolist()
    pos, k = 0, 0
    for p in pieces:
        m = p if type(p) is memoryview else memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8))
        m = m.cast("B") if m.format != "B" or m.ndim != 1 else m
        end = pos + m.nbytes
        while k < len(lo) and lo[k] < end:
            a, b = max(lo[k], pos), min(hi[k], end)
            if a < b:
                yield m[a - pos:b - pos]
            if hi[k] <= end:
                k += 1
            else:
                break
        pos = end


def masked_frame(head: list, buffers: list, marks: np.ndarray):
    """The MAC input of a frame with torn marks, up to (not including) the marks themselves:
    ``head`` (the header's and envelope's bytes), then for each of ``buffers`` — ``(padding,
    pieces, nbytes, rows)`` in frame order, the marks' entry last — its padding and its bytes
    without the rows ``marks`` sets (buffers of ``len(marks)`` rows only), and the marks' padding.
    The shard's reseal and the receiver's check call it alike (see the module docstring)."""
    n = int(marks.size)
    keep = np.concatenate(([0], (marks == 0).view(np.int8), [0]))
    edges = np.flatnonzero(np.diff(keep))
    lo, hi = edges[0::2], edges[1::2]
    yield from head
    for i, (pad, pieces, nbytes, rows) in enumerate(buffers):
        if len(pad):
            yield pad
        if i == len(buffers) - 1:
            return
        yield from _kept(pieces, nbytes, rows, lo, hi, n)
