"""Row digests: a shard's wide rows hashed once, under the learner's row key, not at every send.

A sample reply's MAC reads every byte it covers. For the wide rows (observations, frames) that
is a second pass over cold memory on the shard, beside the kernel's copy into the socket: ~0.17
of the raw socket's rate on 2 cores, over half of what integrity costs (``gearflow/transport/
README.md``). A learner that asks for them (``"row_digests": true`` in ``replay.sample``) gets a
reply whose MAC takes each wide row's *digest* — NH under the connection's row key
(:func:`~gearflow.transport.integrity.row_key`), 32 bytes per KiB — in the row's place
(:mod:`~gearflow.transport.integrity`, "Row digests"). The digest of a storage row is the same
in every reply and on every connection of that secret, so the shard keeps it: it is computed the
first time the row is drawn after it was written, and a draw of the same row again reads 32
bytes per KiB instead of the row. The first draw's digests are computed in the frame's MAC
thread while the kernel sends the rows (where the MAC read the rows before): a reply whose rows
are all new costs a little more than without digests (~0.04 of the raw socket's rate on 2 cores,
the digests written, kept and read again), one whose rows were drawn before ~0.12 less.

Which write a kept digest belongs to: each storage row remembers the absolute step it was
computed for, and a draw that finds another step there now
(:func:`~gearflow.replay.layout.row_steps` of the partition's ``COMMIT`` counter) computes the
digest again. A digest computed while a writer was overwriting its row (or
kept for a step since overwritten) is only ever sent for an item the reply's tail marks torn
(the row was reserved for writing after the draw, or before it — then the item is overwritten
and marked too): the MAC leaves those items out, as it leaves out their rows' bytes. This needs
``COMMIT`` never to move back, which the writers' rule gives (a new writer starts at
``max(RESERVE, COMMIT)``; a restored table is a new segment, served by a new shard).

Memory: 32 bytes per KiB of each wide row drawn (3.1 %: ~0.9 KB for a 28 KiB Atari stack), in the
shard's own memory (numpy pages untouched until a row is drawn), per row key — a learner secret's.

    digests = RowDigests(storage, {"obs": (base_address, row_bytes)}, key)
    d, fill = digests.of("obs", flat_rows, zero) # uint8 (N * digest_bytes(row_bytes),), in order
    if fill is not None: fill()                  # the rows not kept: in the frame's MAC thread
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from gearflow.replay.layout import row_steps
from gearflow.replay.storage import COMMIT
from gearflow.transport.integrity import RowNH, digest_bytes

__all__ = ["RowDigests"]

_NEVER = np.iinfo(np.int64).min  # no digest kept


class RowDigests:
    """The kept digests of ``columns`` (``{name: (base address, row bytes)}`` of the storage's
    columns, rows ``[0, P * S)``) under one row ``key``; ``keep=False`` (the bench's worst
    case): every draw computes its rows' digests, none is reused."""

    def __init__(self, storage, columns: dict[str, tuple[int, int]], key: bytes, keep: bool = True):
        self.nh = RowNH(key)
        self.keep = keep  # False: every draw digests its rows afresh (as if each were drawn for the first time)
        self._S = int(storage.steps_per_partition)
        self._commit = storage.counters[:, COMMIT]  # live: the writers bump it
        self._lock = threading.Lock()  # a row's digest and its step are read and written together
        n = int(storage.num_partitions) * self._S
        self._cols = {}
        for name, (base, rb) in columns.items():
            d = digest_bytes(rb)
            dig = np.zeros((n, d), np.uint8)  # untouched pages cost no memory until a row is drawn
            zero_row = np.zeros(rb, np.uint8)
            self._cols[name] = (base, rb, dig, np.full(n, _NEVER, np.int64), self.nh.digests(zero_row, rb))
        self.computed = 0  # rows digested (each draw of a row whose digest was kept adds nothing)

    def of(self, col: str, idx: np.ndarray, zero: np.ndarray | None) -> tuple[np.ndarray, Callable[[], None] | None]:
        """The digests of storage rows ``idx`` of ``col`` in order (``zero``: padding rows, sent as
        zeros), uint8 ``(N * digest_bytes,)``: the kept ones filled in now; and ``fill()`` (None
        when every one was kept), which computes the others into it and keeps them — for the
        frame's MAC thread, beside the send (it reads the rows from the segment, as the kernel
        does; what a writer overwrote meanwhile is marked torn and left out of the MAC)."""
        base, rb, dig, stamp, zero_digest = self._cols[col]
        rows = np.asarray(idx, np.int64) if zero is None else np.where(zero, 0, idx).astype(np.int64)
        d = dig.shape[1]
        with self._lock:  # a row's digest and its step change together
            step = row_steps(rows, self._commit, self._S)
            need = stamp[rows] != step if self.keep else np.ones(rows.size, bool)
            if zero is not None:
                need &= ~zero
            out = dig[rows]
        if zero is not None and zero.any():
            out[zero] = zero_digest
        if not need.any():
            return out.reshape(-1), None
        at = np.flatnonzero(need)
        new, new_step = rows[at], step[at]
        src, dst = base + new * rb, out.__array_interface__["data"][0] + at * d

        def fill() -> None:
            self.nh.digest_rows(src, rb, dst)  # into the reply (a row drawn twice in it: digested twice)
            with self._lock:
                dig[new] = out[at]
                stamp[new] = new_step
                self.computed += int(at.size)

        return out.reshape(-1), fill
