"""Sample replies sent straight out of the shard's shared-memory segment.

A learner's batch over TCP would otherwise be copied twice on the shard: gathered into the
table's batch buffers, then into the socket. :class:`WireRows` leaves the wide columns
(rows of at least ``min_row_bytes``: frames, observations) out of the gather and hands
the socket the rows themselves — one ``memoryview`` per run of consecutive storage rows,
written by ``writev`` — so the kernel's copy is the only one, as a raw socket's would be.

The narrow columns, keys, probabilities and weights are gathered as before. Since the
kernel reads the wide rows while the reply drains, a writer may overwrite them meanwhile:
the reply's last buffer, ``torn`` (uint8, one per item), is filled only once everything
before it has left the process (the service's reply *tail*), by the table's seqlock rule
(:meth:`~gearflow.replay.table.Table.overwritten`). The sampler redraws the items marked
there, as a local table redraws torn items (:class:`~gearflow.transport.learner.RemoteSampler`).
Under ``transport.integrity`` the frame's MAC reads the rows straight from the segment too, just
before they are written, and leaves the marked rows out (the tail checks the marks again after
each MAC pass: :mod:`gearflow.transport.integrity`, "Rows marked torn"), so a row a writer changed
on the way fails no MAC and is never used. Each piece comes with its address, so the MAC takes
the rows without a Python object per row.

    wire = WireRows(table, min_row_bytes=1024)
    batch, slots, rec = table.draw(256, None, wire.gathered)       # under the table lock
    meta, bufs, on_sent, tail = wire.reply(batch, slots, rec, {"total": ...}, release)
    # bufs[-1] is torn: the service writes it after the rest, once tail() has filled it
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gearflow.replay.items import ItemKind
from gearflow.transport.framing import Chunks
from gearflow.transport.server.row_digests import RowDigests
from gearflow.transport.torn_marks import ROW_DIGESTS

__all__ = ["MAX_KEYS", "WireRows"]

MAX_KEYS = 4  # row keys (secrets) whose digests a shard keeps at once


class WireRows:
    """Which of ``table``'s columns a sample reply sends out of the segment, and the reply
    buffers of one draw. ``columns``: none when the kind has no
    :meth:`~gearflow.replay.items.ItemKind.wire_rows` map, or ``min_row_bytes`` is None."""

    def __init__(self, table, min_row_bytes: int | None = 1024):
        st = table.storage
        self.table = table
        stacked = st.spec.stacked or {}
        kind_maps = type(table.kind).wire_rows is not ItemKind.wire_rows
        self.columns: list[str] = []
        if min_row_bytes is not None and kind_maps and not getattr(table, "_device", None):
            self.columns = [c.name for c in st.spec if c.name not in stacked
                            and st.columns[c.name][0].nbytes >= min_row_bytes]  # fmt: skip
        # the storage columns the table gathers (one dict, kept: the kinds cache plans by it)
        self.gathered = {n: t for n, t in st.tensors.items() if n not in self.columns} if self.columns else None
        self._flat = {n: memoryview(st.columns[n].reshape(-1).view(np.uint8)) for n in self.columns}
        self._base = {n: st.columns[n].__array_interface__["data"][0] for n in self.columns}  # for the frame MAC
        self._row_bytes = {n: st.columns[n][0].nbytes for n in self.columns}
        self._zeros = memoryview(np.zeros(0, np.uint8))
        self._zeros_at = 0  # its address
        self.torn = 0  # items marked torn in replies (the sampler redraws them)
        self._digests: dict[bytes, RowDigests] = {}  # kept row digests, by row key
        self.keep_digests = True  # False: a draw digests its rows afresh every time (the bench's worst case)

    def __bool__(self) -> bool:
        return bool(self.columns)

    def row_digests(self, key: bytes) -> RowDigests:
        """The kept digests of the wide columns under row ``key`` (one set per key: a learner
        secret's; the oldest set is dropped past :data:`MAX_KEYS`)."""
        d = self._digests.get(key)
        if d is None:
            if len(self._digests) >= MAX_KEYS:
                self._digests.pop(next(iter(self._digests)))
            cols = {n: (self._base[n], self._row_bytes[n]) for n in self.columns}
            d = self._digests[key] = RowDigests(self.table.storage, cols, key, self.keep_digests)
        return d

    def reply(self, batch, slots: np.ndarray, rec: np.ndarray, meta: dict, release: Callable[[], None],
              row_key: bytes | None = None) -> tuple:  # fmt: skip
        """The ``replay.sample`` handler's result for a draw ``(batch, slots, rec)`` made with
        :attr:`gathered`: ``meta`` with the output ``names``; the buffers — keys,
        probabilities, weights, every output (the wide ones as :class:`Chunks` of segment
        rows) — and ``release`` (the batch's buffer set is free once the reply is sent). With
        wide columns, a last buffer ``torn`` (``meta["torn"]``) and the tail that fills it
        once the rest has been written (counting the items it marks in :attr:`torn`).
        ``row_key``: the frame MAC takes the wide rows' digests under it in their place
        (``meta["digested"]``: :mod:`~gearflow.transport.server.row_digests`)."""
        names = list(batch.data)
        bufs = [batch.keys, batch.probabilities, batch.weights]
        if not self.columns:
            return {**meta, "names": names}, [*bufs, *(batch.data[n] for n in names)], release
        spec = []
        try:
            digests = self.row_digests(row_key) if row_key is not None else None
            rows, lengths = self.table.rows_of(slots, rec)
            wired = self.table.kind.wire_rows(self.columns, rows, lengths)
            for name in names:
                out = batch.data[name]
                w = wired.get(name)
                if w is None:
                    bufs.append(out)
                    continue
                col, idx, zero = w
                pieces, addresses = self._pieces(col, idx, zero)
                d, fill = digests.of(col, idx, zero) if digests is not None else (None, None)
                if d is not None:
                    spec.append([len(bufs), self._row_bytes[col]])
                bufs.append(Chunks(out.numpy().dtype, tuple(out.shape), pieces, addresses, d, fill))
        except BaseException:
            release()
            raise
        if spec:
            meta = {**meta, ROW_DIGESTS: spec}
        torn = np.zeros(slots.size, np.uint8)

        def tail() -> None:  # called again after each of the MAC's passes over a reply with torn rows
            bad = self.table.overwritten(slots, rec)
            if bad.size:
                self.torn += int((torn[bad] == 0).sum())
                torn[bad] = 1

        return {**meta, "names": names, "torn": True}, [*bufs, torn], release, tail

    def _pieces(self, col: str, idx: np.ndarray, zero: np.ndarray | None) -> tuple[list, list]:
        """Runs of consecutive rows ``idx`` of column ``col`` (and of padding rows, ``zero``) as
        views, and the address of each."""
        flat, rb = self._flat[col], self._row_bytes[col]
        n = idx.size
        cut = np.diff(idx) != 1
        if zero is not None:
            both = zero[1:] & zero[:-1]
            cut = (cut & ~both) | (zero[1:] != zero[:-1])
        starts = np.flatnonzero(np.concatenate(([True], cut)))
        sizes = (np.append(starts[1:], n) - starts) * rb
        first = idx[starts] * rb
        addresses = first + self._base[col]
        if zero is None:
            return [flat[a:a + m] for a, m in zip(first.tolist(), sizes.tolist())], addresses.tolist()
        z = zero[starts]
        need = int(sizes[z].max()) if z.any() else 0
        if need > self._zeros.nbytes:
            self._zeros = memoryview(np.zeros(need, np.uint8))
            self._zeros_at = np.frombuffer(self._zeros, np.uint8).__array_interface__["data"][0]
        zeros = self._zeros
        addresses[z] = self._zeros_at
        return ([zeros[:m] if zk else flat[a:a + m] for a, m, zk in zip(first.tolist(), sizes.tolist(), z.tolist())],
                addresses.tolist())  # fmt: skip
