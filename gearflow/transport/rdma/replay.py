"""Replay batches read with one-sided RDMA READs: the shard selects, the learner reads.

The shard (:class:`RdmaShard`) registers its table's shared-memory segment as ONE region
(:class:`~gearflow.transport.rdma.fabric.RegionExport`) and answers two control requests, served over
the TCP control channel (:meth:`RdmaShard.register_handlers`) or called in-process:

``rdma.connect``  the learner's queue-pair endpoint in; the shard's endpoint, the region
                  (address, length, rkey) and the segment's layout out (P, S, R, the spec,
                  the item kind, each column's offset and row bytes, the counters' offset,
                  the steps a reader trusts behind RESERVE).
``rdma.select``   ``n`` in; the shard's own draw out: keys, probabilities, IS weights, each
                  item's partition, start and length (and, with stacked frames, its first
                  step's offset in its episode), and the RESERVE counters it saw. A redraw
                  names the torn keys (evicted first) and the batch's masses (reweighed).
``rdma.update``   priorities by key (the table's :meth:`update_priorities`).

The learner (:class:`RdmaSampler`, a :class:`~gearflow.replay.protocols.SamplerLike`) turns
the records into rows with the item kind's own row rule, reads the sorted unique rows of
every column in ONE chain (:func:`~gearflow.transport.rdma.fabric.plan_reads`: one READ per contiguous
row run per column) whose last, fenced READ re-reads the partitions' counters; then applies
the shared-memory path's seqlock rule (:func:`~gearflow.replay.layout.torn_items`, the rule of
``Table.overwritten``: an item whose first step is older than ``RESERVE - trusted_steps``, RESERVE
read after the copy, may have been overwritten mid-read): torn rows are discarded and
redrawn, the whole batch read and checked again, never returned. The kind's own ``gather``
then fills the batch from the staged rows, so a batch is laid out exactly as
``Table.sample`` lays it out::

    shard = RdmaShard(table, VerbsExport())                 # RdmaShard.loopback(table): the double
    shard.register_handlers(service)                        # a gearflow.transport Service
    sampler = RdmaSampler(Client(address, token).call, VerbsMemory())   # or direct_call(shard), LoopbackMemory()
    batch = sampler.sample(256)                            # Sample: data, keys, weights, probabilities
    sampler.update_priorities(batch.keys, new_priorities)

Local memory, per batch size B (allocated once, registered once)::

    [counters int64[P, 8]] [column 0 staging: c.dtype[U, *row_shape]] [column 1 ...]   (64-byte aligned)

``U`` = the row entries a batch of B can need (the kind's row arrays' total size); a
batch's sorted unique rows fill the first ones. The kind's gather reads the staging blocks
with rows renumbered to staging indices.

This module is the bridge between :mod:`gearflow.transport.rdma.fabric` (fabric, no replay) and
:mod:`gearflow.replay`; replay never imports it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gearflow.kinds.registry import kind_from_dict
from gearflow.replay.host_batch import BatchBuffers, GatherThreads, Sample
from gearflow.replay.items import FrameStacks
from gearflow.replay.layout import torn_items
from gearflow.replay.protocols import SelectorInfo
from gearflow.replay.rate_limiter import MAX_BACKOFF_S, RateLimiterTimeout
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import COUNTER_FIELDS, RESERVE, SHM_DIR
from gearflow.transport.ops import RPC
from gearflow.transport.rdma.fabric import (
    Region,
    RegionExport,
    RemoteAccessError,
    RemoteMemory,
    plan_reads,
)

log = logging.getLogger(__name__)

Call = Callable[[str, dict, list], tuple]  # (type, meta, buffers) -> (meta, buffers): the control channel
ALIGN = 64
MAX_SELECT = 1 << 16  # items one select may ask for

__all__ = ["RdmaSampler", "RdmaShard", "direct_call", "node_sampler", "pack", "segment_layout", "serve_node", "unpack"]


def pack(arrays: dict[str, np.ndarray]) -> tuple[list[str], list[np.ndarray]]:
    """Named arrays as (names, contiguous buffers): the control channel carries a list of
    buffers and the names in the metadata."""
    names = list(arrays)
    return names, [np.ascontiguousarray(arrays[k]) for k in names]


def unpack(meta: dict, buffers: list) -> dict[str, np.ndarray]:
    names = meta.get("arrays", [])
    if len(names) != len(buffers):
        raise ValueError(f"{len(names)} array names but {len(buffers)} buffers")
    return dict(zip(names, buffers))


def direct_call(shard: RdmaShard) -> Call:
    """The control channel in-process (tests, a learner next to its shard): each request's
    metadata round-trips through JSON and its buffers are copied, as over a socket."""

    def call(name: str, meta: dict, buffers: list) -> tuple[dict, list]:
        handler = shard.handlers()[name]
        reply_meta, reply_buffers = handler(json.loads(json.dumps(meta)), [np.array(b) for b in buffers])[:2]
        return json.loads(json.dumps(reply_meta)), [np.array(b) for b in reply_buffers]

    return call


def segment_base(storage) -> int:
    """The address of byte 0 of the storage's segment in this process (its header's view)."""
    return int(storage.header.ctypes.data)


def segment_layout(storage) -> dict[str, Any]:
    """What a reader of the segment needs to address rows and counters (JSON-safe)."""
    base = segment_base(storage)
    return {
        "P": storage.num_partitions,
        "S": storage.steps_per_partition,
        "R": storage.items_per_partition,
        "trusted_steps": storage.trusted_steps,
        "nbytes": storage.nbytes,
        "spec": storage.spec.to_dict(),
        "columns": {c.name: [storage.column_offsets[c.name], c.nbytes] for c in storage.spec},
        "counters": [int(storage.counters.ctypes.data) - base, COUNTER_FIELDS],
        "reserve_field": RESERVE,
    }


# ---------------------------------------------------------------------------------- shard side


class RdmaShard:
    """A shard's RDMA half: its table's segment registered once with ``export`` (a
    :class:`~gearflow.transport.rdma.fabric.RegionExport`), and the ``rdma.connect`` / ``rdma.select`` /
    ``rdma.update`` handlers (``(meta, buffers) -> (meta, buffers)``, the transport service's
    handler signature). ``lock`` serialises them with anything else that uses the table
    (a shard service's own handlers): a table is not thread-safe.

    The selection is :meth:`Table.sample`'s draw without its gather: the same scan, rate
    limiter wait, selector draw, records and keys; a redraw evicts the torn items through
    the table's own torn-item path (counted in ``replay/torn_resampled``) and reweighs the
    whole batch against the table as it is now.
    """

    def __init__(self, table, export: RegionExport, lock: threading.Lock | None = None):
        self.table = table
        self.storage = table.storage
        self.export = export
        self.lock = lock or threading.Lock()
        self.region: Region = export.register(segment_base(self.storage), self.storage.nbytes)
        self.layout = segment_layout(self.storage)
        self.layout["kind"] = table.kind.to_dict()

    @classmethod
    def loopback(cls, table, lock: threading.Lock | None = None) -> RdmaShard:
        """A shard whose region the loopback double reads (the segment's file in SHM_DIR)."""
        from gearflow.transport.rdma.fabric import LoopbackExport

        st = table.storage
        return cls(table, LoopbackExport(SHM_DIR / st.name, segment_base(st)), lock)

    @classmethod
    def serve(cls, shard_service, export: RegionExport) -> RdmaShard:
        """RDMA beside a :class:`~gearflow.transport.server.shard.ShardService`: its table, its table
        lock, its service (the rdma.* handlers registered there)."""
        shard = cls(shard_service.table, export, lock=shard_service.lock)
        shard.register_handlers(shard_service.service)
        return shard

    def handlers(self) -> dict[str, Callable]:
        return {RPC.RDMA_CONNECT: self.connect, RPC.RDMA_SELECT: self.select, RPC.RDMA_UPDATE: self.update}

    def register_handlers(self, service) -> None:
        """Serve the handlers on a :class:`~gearflow.transport.service.Service`: ``rdma.connect``
        with the connection, so the learner's queue pair is released when it disconnects."""
        service.register(RPC.RDMA_CONNECT, self.connect, with_connection=True)
        service.register(RPC.RDMA_SELECT, self.select)
        service.register(RPC.RDMA_UPDATE, self.update)

    def connect(self, meta: dict, buffers: list, connection=None) -> tuple[dict, list]:
        """A queue pair for the learner's endpoint; the region and the segment's layout."""
        endpoint = self.export.accept(meta["endpoint"])
        if connection is not None:
            connection.on_close(lambda: self.export.release(endpoint))
        sel = self.table.selector
        selector = {"name": sel.name, "importance_sampled": bool(sel.importance_sampled)}
        return {"endpoint": endpoint, "region": self.region.to_dict(), "layout": self.layout, "selector": selector}, []

    def select(self, meta: dict, buffers: list) -> tuple[dict, list]:
        """Draw ``meta["n"]`` items. A redraw (``meta["redraw"]``) carries ``evict`` (the torn
        keys) and, for proportional selectors, ``masses`` (each row's mass at its draw) and
        ``positions`` (the rows redrawn): the reply's probabilities and weights are then the
        whole batch's, reweighed once."""
        n = int(meta["n"])
        if not 1 <= n <= MAX_SELECT:
            raise ValueError(f"select needs 1 ≤ n ≤ {MAX_SELECT}, got {n}")
        t = self.table
        timeout_s = t.sample_timeout_s if meta.get("timeout_s") is None else float(meta["timeout_s"])
        beta = meta.get("beta")  # the learner's annealed IS exponent (None: the shard's own)
        if isinstance(beta, (int, float)) and t.selector.importance_sampled:
            with self.lock:
                t.selector.beta = float(beta)
        arrays = unpack(meta, buffers)
        redraw = bool(meta.get("redraw"))
        if redraw:  # the torn items go first (the table's torn-item path, counted in replay/torn_resampled)
            keys = np.ascontiguousarray(arrays["evict"], dtype=np.int64)
            with self.lock:
                slots = t.slots_of(keys)
                try:
                    t.evict_torn(slots[slots >= 0], None, 0.0, "the learner's RDMA reads")
                except RateLimiterTimeout:
                    pass  # not enough items right now: waited for below, without the lock
        deadline, delay = time.monotonic() + timeout_s, 1e-4
        while True:  # the rate limiter's wait, the lock released between tries (writers, priority updates)
            with self.lock:
                t.scan()
                if t.can_sample(n):
                    out, total = self._draw(n, arrays if redraw else None)
                    break
                if time.monotonic() > deadline:
                    t.wait_until_ready(n, 0.0)  # raises RateLimiterTimeout saying why (or it just became ready)
                    out, total = self._draw(n, arrays if redraw else None)
                    break
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
        names, bufs = pack(out)
        return {"n": n, "total": total, "arrays": names}, bufs

    def _draw(self, n: int, redraw: dict | None) -> tuple[dict[str, np.ndarray], float | None]:
        """The selector's draw of ``n`` items and their records (under the lock); a redraw's
        masses reweighed with the batch's others; the RESERVE counters after the draw."""
        t = self.table
        sel = t.selector.sample(n)
        rec = t.records(sel.slots)  # (3, n): start, seq, length
        parts = t.partitions_of(sel.slots)
        out = {
            "keys": t.keys_of(sel.slots, rec),
            "parts": parts,
            "starts": rec[0].copy(),
            "lengths": rec[2].copy(),
            "probabilities": np.asarray(sel.probabilities, np.float64),
            "weights": np.asarray(sel.weights, np.float32),
        }
        if redraw is not None and "masses" in redraw and sel.total is not None:
            masses = np.array(redraw["masses"], dtype=np.float64)
            masses[np.asarray(redraw["positions"], np.int64)] = sel.probabilities * sel.total
            reweighed = t.selector.reweigh(masses)
            if reweighed is not None:
                out["batch_probabilities"], out["batch_weights"] = reweighed
        if self.storage.step_offset is not None:  # stacked frames: the first step's offset in its episode
            out["depth"] = self.storage.step_offset[self.storage.rows(parts, rec[0])].astype(np.int64)
        out["reserve"] = self.storage.counters[:, RESERVE].copy()
        if redraw is None:  # a redraw replaces rows of a batch already counted
            t.note_sampled(n)
        return out, sel.total

    def update(self, meta: dict, buffers: list) -> tuple[dict, list]:
        arrays = unpack(meta, buffers)
        with self.lock:
            applied = self.table.update_priorities(arrays["keys"], arrays["priorities"])
        return {"applied": int(applied)}, []

    def close(self) -> None:
        self.export.close()


# ---------------------------------------------------------------------------------- learner side


class _Staging:
    """The registered local buffer for one batch size: counters, then each column's rows."""

    def __init__(self, spec: TableSpec, P: int, capacity: int):
        offsets, pos = {}, P * COUNTER_FIELDS * 8
        for c in spec:
            pos = -(-pos // ALIGN) * ALIGN
            offsets[c.name] = pos
            pos += capacity * c.nbytes
        self.buffer = np.zeros(max(pos, 1), dtype=np.uint8)  # (bytes,) registered with the memory
        self.capacity = capacity
        self.counters = self.buffer[: P * COUNTER_FIELDS * 8].view(np.int64).reshape(P, COUNTER_FIELDS)
        self.offsets = offsets
        self.tensors = {  # (capacity, *row_shape) views the kind's gather reads
            c.name: torch.from_numpy(
                self.buffer[offsets[c.name] : offsets[c.name] + capacity * c.nbytes].view(c.dtype).reshape(capacity, *c.row_shape)
            )
            for c in spec
        }  # fmt: skip


def _renumber(rows: Any, unique: np.ndarray) -> Any:
    """The kind's row arrays (nested in dicts) with storage rows replaced by staging indices."""
    if isinstance(rows, dict):
        return {k: _renumber(v, unique) for k, v in rows.items()}
    return np.searchsorted(unique, rows)


def _flat(rows: Any) -> list[np.ndarray]:
    if isinstance(rows, dict):
        return [a for v in rows.values() for a in _flat(v)]
    return [np.asarray(rows).reshape(-1)]


class RdmaSampler:
    """A learner's sampler over one shard: selection over the control channel (``call``),
    rows read with one-sided READs through ``memory`` (a
    :class:`~gearflow.transport.rdma.fabric.RemoteMemory`), checked with the seqlock rule, laid out by
    the kind's own gather. Batches view ``num_buffers`` reusable buffer sets, as
    :meth:`Table.sample`'s do, and the staged rows are gathered on the torch thread count
    the table's :class:`GatherThreads` measures fastest (``num_threads`` fixes it).

    ``reads_per_batch`` / ``torn`` count the work requests of the last batch's chains and
    the rows redrawn so far.
    """

    def __init__(self, call: Call, memory: RemoteMemory, *, num_buffers: int = 3, timeout_s: float = 60.0,
                 num_threads: int | None = None):  # fmt: skip
        self._call, self.memory = call, memory
        self.timeout_s = timeout_s
        self.gather_threads = GatherThreads(num_threads)  # staged rows → batch: Table's measured choice
        meta, _ = call(RPC.RDMA_CONNECT, {"endpoint": memory.endpoint()}, [])
        memory.connect(meta["endpoint"])
        self.region = Region.from_dict(meta["region"])
        lay = self.layout = meta["layout"]
        self.spec = TableSpec.parse(lay["spec"])
        self.kind = kind_from_dict(lay["kind"])
        self.kind.layout(self.spec, 1)  # validates the kind against the spec
        sel = meta.get("selector", {})  # the learner anneals selector.beta; select sends it
        self.selector = SelectorInfo(str(sel.get("name", "prioritized")), bool(sel.get("importance_sampled", True)))
        self.P, self.S, self._trust = int(lay["P"]), int(lay["S"]), int(lay["trusted_steps"])
        self._reserve_field = int(lay["reserve_field"])
        self._counters_at = int(lay["counters"][0])
        self._stacks = None
        if self.spec.stacked:  # the kind reads each item's first-step offset here (sent by select)
            self._stacks = FrameStacks(np.zeros(self.P * self.S, np.uint8), self.spec.stacked)
        self.batches = BatchBuffers(self.kind, self.spec, num_buffers)  # the batches' buffer sets, as a table's
        self._staging: _Staging | None = None
        self.torn = 0
        self.samples = 0
        self.reads_per_batch = 0

    @property
    def num_buffers(self) -> int:
        """Buffer sets used in turn: a batch stays valid for ``num_buffers - 1`` more samples."""
        return self.batches.num_buffers

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_size: int, timeout_s: float | None = None) -> Sample:
        """A batch drawn by the shard, read with one chain of READs, never torn."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be ≥ 1, got {batch_size}")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        meta, arrays = self._select({"n": batch_size, "timeout_s": timeout_s, "beta": self.selector.beta}, {})
        out = self.batches.next(batch_size)
        self.reads_per_batch = 0
        deadline = time.monotonic() + timeout_s
        while True:
            after = self._read(arrays, out)
            if (after < arrays["reserve"]).any():
                raise RemoteAccessError("the counters read back are older than the ones the shard saw: "
                                        "the region is not this shard's segment")  # fmt: skip
            bad = np.flatnonzero(torn_items(arrays["parts"], arrays["starts"], after, self._trust))
            if not bad.size:
                break
            if time.monotonic() > deadline:
                raise RateLimiterTimeout(f"rdma: writers kept overwriting the drawn items faster than they could be "
                                         f"read ({self.torn} redrawn so far); the shard's ring ({self.S} steps per "
                                         f"partition) is too small for the write rate")  # fmt: skip
            self.torn += bad.size
            arrays = self._redraw(arrays, meta, bad, timeout_s)
        self.samples += batch_size
        return Sample(
            data=out,
            keys=torch.from_numpy(arrays["keys"]),
            weights=torch.from_numpy(np.asarray(arrays["weights"], dtype=np.float32)),
            probabilities=torch.from_numpy(np.asarray(arrays["probabilities"], dtype=np.float64)),
        )

    def _select(self, meta: dict, arrays: dict) -> tuple[dict, dict[str, np.ndarray]]:
        names, bufs = pack(arrays)
        reply, buffers = self._call(RPC.RDMA_SELECT, {**meta, "arrays": names}, bufs)
        got = unpack(reply, buffers)
        return reply, {k: np.array(v) for k, v in got.items()}  # owned copies: a reply's buffers may be reused

    def _redraw(self, arrays: dict, meta: dict, bad: np.ndarray, timeout_s: float) -> dict:
        """Torn rows replaced by a fresh draw (their keys evicted at the shard first); with a
        proportional selector the whole batch's probabilities and weights come back reweighed."""
        ask = {"evict": arrays["keys"][bad], "positions": bad}
        if meta.get("total") is not None:
            ask["masses"] = arrays["probabilities"] * float(meta["total"])  # each row's mass at its draw
        reply, fresh = self._select({"n": int(bad.size), "timeout_s": timeout_s, "redraw": True}, ask)
        arrays = {k: v.copy() for k, v in arrays.items()}
        for k in ("keys", "parts", "starts", "lengths", "probabilities", "weights", "depth"):
            if k in fresh:
                arrays[k][bad] = fresh[k]
        if "batch_probabilities" in fresh:
            arrays["probabilities"], arrays["weights"] = fresh["batch_probabilities"], fresh["batch_weights"]
        arrays["reserve"] = np.maximum(arrays["reserve"], fresh["reserve"])
        meta["total"] = reply.get("total")
        return arrays

    def _read(self, arrays: dict[str, np.ndarray], out: dict[str, torch.Tensor]) -> np.ndarray:
        """Read every row of the batch in one chain, the counters last (fenced); fill ``out``
        with the kind's gather; return the RESERVE counters read after the rows."""
        parts, starts, lengths = arrays["parts"], arrays["starts"], arrays["lengths"]
        stack = {}
        if self._stacks is not None:
            self._stacks.offsets[parts * self.S + starts % self.S] = arrays["depth"]
            stack = {"stacks": self._stacks}
        rows = self.kind.rows(parts, starts, lengths, self.S, **stack)
        flat = _flat(rows)
        rows_sorted = np.sort(np.concatenate(flat))  # a sort, not np.unique (its hash path: 1 ms for 5k rows)
        unique = rows_sorted[np.concatenate(([True], rows_sorted[1:] != rows_sorted[:-1]))]  # (U,) sorted rows
        staging = self._staging_for(sum(a.size for a in flat))
        cols = np.array([[self.region.addr + off, nbytes, staging.offsets[name]]
                         for name, (off, nbytes) in self.layout["columns"].items()], dtype=np.int64)  # fmt: skip
        tail = np.array([[self.region.addr + self._counters_at, staging.counters.nbytes, 0]], dtype=np.int64)
        reads = plan_reads(unique, cols, tail)
        self.memory.read_chain(reads, self.region.rkey, fence_last=True)
        self.reads_per_batch += reads.shape[0]
        # the table's rule: one torch thread when that is clearly cheaper
        self.gather_threads.gather(self.kind, staging.tensors, out, _renumber(rows, unique), lengths)
        return staging.counters[:, self._reserve_field].copy()

    def _staging_for(self, entries: int) -> _Staging:
        if self._staging is None or self._staging.capacity < entries:
            self._staging = _Staging(self.spec, self.P, entries)
            self.memory.register(self._staging.buffer)
        return self._staging

    # ------------------------------------------------------------------ the rest of SamplerLike
    def update_priorities(self, keys, priorities) -> int:
        keys = np.ascontiguousarray(torch.as_tensor(keys).cpu().numpy(), dtype=np.int64).reshape(-1)
        prios = np.ascontiguousarray(torch.as_tensor(priorities).detach().cpu().numpy(), dtype=np.float64).reshape(-1)
        meta, _ = self._call(RPC.RDMA_UPDATE, {"arrays": ["keys", "priorities"]}, [keys, prios])
        return int(meta["applied"])

    def stats(self) -> dict[str, float]:
        return {"rdma/samples": self.samples, "rdma/torn_resampled": self.torn,
                "rdma/reads_per_batch": self.reads_per_batch, "rdma/chains": self.memory.chains_posted}  # fmt: skip

    def close(self) -> None:
        self.memory.close()
        self._staging = None
        self._buffers = []


# ------------------------------------------------------- RDMA's ends, as transport.choice names them
def serve_node(shard_service, export: RegionExport | None = None) -> RdmaShard:
    """The node's end (:attr:`~gearflow.transport.choice.DataPath.serve`): its table's segment
    exported (``export``; default the verbs fabric), the rdma.* handlers on the node's TCP service."""
    from gearflow.transport.rdma.fabric import VerbsExport

    return RdmaShard.serve(shard_service, VerbsExport() if export is None else export)


def node_sampler(shards, cfg, memory: RemoteMemory | None = None) -> RdmaSampler:
    """The learner's end (:attr:`~gearflow.transport.choice.DataPath.sampler`) over ``shards``
    (a :class:`~gearflow.transport.learner.RemoteShards`, connected): one shard node read with
    one-sided READs (``memory``; default the verbs fabric), its control calls over that node's
    TCP client."""
    from gearflow.errors import ConfigError
    from gearflow.replay.layout import buffer_sets
    from gearflow.transport.rdma.fabric import VerbsMemory

    if len(shards.clients) != 1:
        raise ConfigError(f"transport.kind={cfg.transport.kind} reads one shard node over RDMA; "
                          f"transport.shards lists {len(shards.clients)} (use transport.kind=tcp for several)")  # fmt: skip
    client, timeout_s = shards.clients[0], shards.timeout_s

    def call(op: str, meta: dict, bufs: list):
        return client.call(op, meta, bufs, timeout_s=timeout_s)

    memory = VerbsMemory() if memory is None else memory
    return RdmaSampler(call, memory, num_buffers=buffer_sets(cfg.learner.prefetch), timeout_s=timeout_s)
