"""One-sided RDMA READs out of a remote memory region, behind a small transport interface.

GEAR's data path: a shard registers its whole shared-memory replay segment as ONE memory
region; a learner connects a reliable-connected (RC) queue pair to it, bootstrapped over the
TCP control channel, and reads rows with ``IBV_WR_RDMA_READ`` work requests, so the shard's
CPU does nothing per batch. This module is the fabric part and knows nothing of replay
(:mod:`gearflow.transport.rdma.replay` plans a batch's reads and checks them):

* :class:`RemoteMemory` (the learner's end): ``endpoint`` / ``connect`` (the QP bootstrap),
  ``register`` (the local buffer reads land in), ``read_chain`` (one chain of READ work
  requests, one signalled completion), ``close``.
* :class:`RegionExport` (the shard's end): ``register`` (a region: address, length, rkey),
  ``accept`` (one QP per learner, connected to the learner's endpoint), ``close``.
* :class:`VerbsMemory` / :class:`VerbsExport`: pyverbs (Context, PD, MR, CQ, RC QP, SGE,
  SendWR with ``IBV_WR_RDMA_READ``, polled CQ). Needs pyverbs and a device.
* :class:`LoopbackMemory` / :class:`LoopbackExport`: a double that reads the real shared-memory
  segment (mapped read-only by path) by address and rkey, checking the key and the bounds
  exactly as the responder's NIC would: an rkey the shard did not register, or a range
  outside its region, is a :class:`RemoteAccessError` and leaves the connection unusable
  (an RC QP goes to the error state). It drives the same planning and seqlock logic in tests.
* :func:`plan_reads`: sorted unique rows → one READ per contiguous row run per column.

A read is ``(remote_addr, length, local_offset)`` (int64 rows of an ``(n, 3)`` array)::

    export = LoopbackExport(path="/dev/shm/gearflow_x", base=segment_address)      # shard
    region = export.register(segment_address, segment_nbytes)
    mem = LoopbackMemory()                                                          # learner
    mem.connect(export.accept(mem.endpoint()))
    buf = np.zeros(1 << 20, np.uint8); mem.register(buf)
    mem.read_chain(np.array([[region.addr + 4096, 64, 0]]), region.rkey)            # buf[:64] = segment[4096:4160]

pyverbs is imported only by the Verbs classes and the probes, never at import time.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gearflow.errors import ConfigError, GearflowError
from gearflow.transport.choice import require_rdma

log = logging.getLogger(__name__)

READ_FIELDS = 3  # a read: remote_addr, length, local_offset
MAX_READ_BYTES = 1 << 30  # one work request reads at most this much (ports allow 2 GiB - 1)

__all__ = [
    "LoopbackExport",
    "LoopbackMemory",
    "Region",
    "RegionExport",
    "RemoteAccessError",
    "RemoteMemory",
    "VerbsExport",
    "VerbsMemory",
    "plan_reads",
]


class RemoteAccessError(GearflowError):
    """An RDMA READ the responder refused (an rkey it did not register, a range outside the
    region) or a chain that did not complete. The queue pair is in the error state afterwards:
    connect again."""


@dataclass(frozen=True)
class Region:
    """A registered memory region as a peer addresses it: its first byte's address in the
    registering process, its length, and the remote key that grants reads of it."""

    addr: int
    length: int
    rkey: int

    def to_dict(self) -> dict[str, int]:
        return {"addr": self.addr, "length": self.length, "rkey": self.rkey}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Region:
        return cls(int(d["addr"]), int(d["length"]), int(d["rkey"]))


# ---------------------------------------------------------------------------------- planning


def plan_reads(rows: np.ndarray, columns: np.ndarray, tail: np.ndarray | None = None,
               max_bytes: int = MAX_READ_BYTES) -> np.ndarray:
    """READ work requests for ``rows`` of every column: one per contiguous run of rows per
    column (coalesced), split only where a run exceeds ``max_bytes``.

    ``rows``: sorted unique int64 storage rows (U,); row ``rows[i]`` of a column lands at
    local row ``i`` of that column's staging block. ``columns``: int64 ``(C, 3)``, per column
    (remote address of its row 0, bytes per row, local offset of its staging block).
    ``tail``: reads appended as they are (the counter re-read). Returns int64 ``(n, 3)``
    ``(remote_addr, length, local_offset)``, column by column::

        plan_reads(np.array([3, 4, 5, 9]), np.array([[1000, 8, 0]]))
        # [[1024, 24, 0], [1072, 8, 24]]: rows 3..5 in one read, row 9 in another
    """
    rows = np.asarray(rows, dtype=np.int64)
    columns = np.asarray(columns, dtype=np.int64).reshape(-1, 3)
    if rows.size == 0:
        runs_at, run_rows = np.zeros(0, np.int64), np.zeros(0, np.int64)
    else:
        cut = np.flatnonzero(np.diff(rows) != 1) + 1  # where a run of consecutive rows breaks
        runs_at = np.concatenate(([0], cut))  # (K,) index in rows of each run's first row
        run_rows = np.diff(np.concatenate((runs_at, [rows.size])))  # (K,) rows per run
    plans = []
    for remote0, row_bytes, local0 in columns.tolist():
        at, n = runs_at, run_rows
        most = max(1, max_bytes // max(row_bytes, 1))  # rows one read may carry
        if n.size and n.max() > most:  # split long runs into pieces of ≤ most rows
            pieces = -(-n // most)
            first = np.repeat(np.cumsum(pieces) - pieces, pieces)
            k = np.arange(pieces.sum()) - first  # piece number within its run
            at = np.repeat(at, pieces) + k * most
            n = np.minimum(np.repeat(n, pieces) - k * most, most)
        plan = np.empty((at.size, 3), dtype=np.int64)
        plan[:, 0] = remote0 + rows[at] * row_bytes
        plan[:, 1] = n * row_bytes
        plan[:, 2] = local0 + at * row_bytes
        plans.append(plan)
    if tail is not None:
        plans.append(np.asarray(tail, dtype=np.int64).reshape(-1, 3))
    return np.concatenate(plans) if plans else np.zeros((0, 3), np.int64)


def _check_reads(reads: Any) -> np.ndarray:
    reads = np.ascontiguousarray(reads, dtype=np.int64)
    if reads.ndim != 2 or reads.shape[1] != READ_FIELDS:
        raise ValueError(f"reads must be an (n, 3) array of (remote_addr, length, local_offset), got shape {reads.shape}")
    if reads.shape[0] == 0:
        raise ValueError("a chain needs at least one read")
    if (reads[:, 1] <= 0).any() or (reads[:, 0] < 0).any() or (reads[:, 2] < 0).any():
        raise ValueError("every read needs a length > 0 and non-negative addresses")
    return reads


# ---------------------------------------------------------------------------------- interfaces


@runtime_checkable
class RemoteMemory(Protocol):
    """The learner's end of a one-sided read connection."""

    reads_posted: int  # work requests posted so far
    chains_posted: int  # chains (each with one signalled completion) posted so far
    last_chain: int  # work requests in the last chain

    def endpoint(self) -> dict[str, Any]:
        """What the peer needs to connect its queue pair to this one (JSON-safe)."""

    def connect(self, peer: dict[str, Any]) -> None:
        """Connect to the peer's endpoint (from :meth:`RegionExport.accept`)."""

    def register(self, buffer: np.ndarray) -> int:
        """Register the C-contiguous local buffer reads land in (replacing any earlier one);
        returns its local key."""

    def read_chain(self, reads: np.ndarray, rkey: int, fence_last: bool = True) -> None:
        """Post one chain of READs (``(n, 3)``: remote_addr, length, local_offset) and wait for
        its one signalled completion. ``fence_last``: the last read starts only after every
        earlier one completed (the seqlock's counter re-read)."""

    def close(self) -> None: ...


@runtime_checkable
class RegionExport(Protocol):
    """The shard's end: its registered regions and one queue pair per connected learner."""

    def register(self, address: int, length: int) -> Region: ...

    def accept(self, peer: dict[str, Any]) -> dict[str, Any]:
        """A queue pair for the learner at ``peer``, connected; returns its endpoint."""

    def release(self, endpoint: dict[str, Any]) -> None:
        """Close the queue pair :meth:`accept` returned ``endpoint`` for (its learner left)."""

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------- loopback


class LoopbackExport:
    """The shard's end of the loopback double: regions of one file mapping (the shared-memory
    segment at ``path``, mapped at ``base`` in the shard), each with a random 32-bit rkey.

    ``accept`` hands the learner's double this responder's region table (the keys and bounds
    a NIC would check); nothing else about the regions travels outside :class:`Region`.
    """

    def __init__(self, path: str | os.PathLike, base: int):
        self.path = os.fspath(path)
        self.base = int(base)
        self._regions: list[Region] = []
        self._qps = 0
        self.connected: set[int] = set()  # queue pairs accepted and not released

    def register(self, address: int, length: int) -> Region:
        size = os.stat(self.path).st_size
        if not (self.base <= address and address + length <= self.base + size and length > 0):
            raise ValueError(f"[{address:#x}, +{length}) is not inside {self.path} mapped at {self.base:#x} ({size} bytes)")
        region = Region(int(address), int(length), secrets.randbits(32))
        self._regions.append(region)
        return region

    def deregister(self, region: Region) -> None:
        self._regions = [r for r in self._regions if r != region]

    def accept(self, peer: dict[str, Any]) -> dict[str, Any]:
        if peer.get("fabric") != "loopback":
            raise ValueError(f"a loopback region cannot connect to a {peer.get('fabric')!r} endpoint")
        self._qps += 1
        self.connected.add(self._qps)
        return {"fabric": "loopback", "qp_num": self._qps, "path": self.path, "base": self.base,
                "regions": [[r.rkey, r.addr, r.length] for r in self._regions]}  # fmt: skip

    def release(self, endpoint: dict[str, Any]) -> None:
        self.connected.discard(int(endpoint["qp_num"]))

    def close(self) -> None:
        self._regions = []
        self.connected.clear()


class LoopbackMemory:
    """The learner's end of the loopback double: reads the shard's segment file (mapped
    read-only) by remote address and rkey, as the responder's NIC would: the rkey must be one
    the shard registered and ``[addr, addr + length)`` inside that region, the local range
    inside the registered buffer. A refused or failed chain raises :class:`RemoteAccessError`
    and leaves the connection unusable (an RC queue pair in the error state), as hardware does.
    """

    def __init__(self) -> None:
        self.reads_posted = self.chains_posted = self.last_chain = 0
        self._map: mmap.mmap | None = None
        self._view: np.ndarray | None = None
        self._base = 0
        self._regions = np.zeros((0, 3), dtype=np.int64)  # rkey, addr, length
        self._local: np.ndarray | None = None
        self._broken: str | None = None
        self._qp_num = secrets.randbits(24)

    def endpoint(self) -> dict[str, Any]:
        return {"fabric": "loopback", "qp_num": self._qp_num}

    def connect(self, peer: dict[str, Any]) -> None:
        if peer.get("fabric") != "loopback":
            raise ValueError(f"a loopback memory cannot connect to a {peer.get('fabric')!r} endpoint")
        self.close()
        fd = os.open(peer["path"], os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, dtype=np.uint8)
        self._base = int(peer["base"])
        self._regions = np.asarray(peer["regions"], dtype=np.int64).reshape(-1, 3)
        self._broken = None

    def register(self, buffer: np.ndarray) -> int:
        if not (isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.flags.writeable):
            raise ValueError("the local buffer must be a writable C-contiguous numpy array")
        self._local = buffer.reshape(-1).view(np.uint8)
        return 1

    def read_chain(self, reads: np.ndarray, rkey: int, fence_last: bool = True) -> None:
        reads = _check_reads(reads)
        if self._view is None:
            raise RemoteAccessError("read_chain before connect: no queue pair is connected")
        if self._broken is not None:
            raise RemoteAccessError(f"the queue pair is in the error state ({self._broken}); connect again")
        if self._local is None:
            raise RemoteAccessError("no local buffer is registered for the reads to land in")
        self.chains_posted += 1
        self.reads_posted += reads.shape[0]
        self.last_chain = reads.shape[0]
        match = self._regions[self._regions[:, 0] == int(rkey)]
        remote, length, local = reads[:, 0], reads[:, 1], reads[:, 2]
        if match.size == 0:
            self._fail(f"remote access error: rkey {int(rkey):#x} is not a region the peer registered")
        inside = np.zeros(reads.shape[0], dtype=bool)
        for _, addr, size in match.tolist():
            inside |= (remote >= addr) & (remote + length <= addr + size)
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            self._fail(f"remote access error: read {i} [{int(remote[i]):#x}, +{int(length[i])}) is outside "
                       f"the region of rkey {int(rkey):#x}")  # fmt: skip
        bad = local + length > self._local.size
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self._fail(f"local length error: read {i} lands at [{int(local[i])}, +{int(length[i])}) beyond "
                       f"the {self._local.size}-byte registered buffer")  # fmt: skip
        src, dst = self._view, self._local
        for r, n, off in (reads - [self._base, 0, 0]).tolist():  # in posting order (the fence holds)
            dst[off : off + n] = src[r : r + n]

    def _fail(self, why: str) -> None:
        self._broken = why
        raise RemoteAccessError(why)

    def close(self) -> None:
        self._view = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still held; the mapping goes when it is freed
            self._map = None


# ---------------------------------------------------------------------------------- pyverbs


def _verbs() -> tuple[Any, Any]:
    """(pyverbs enums module, the pyverbs package): the one place pyverbs is imported."""
    pyverbs = require_rdma("RDMA READs (transport=rdma)")
    try:
        enums = importlib.import_module("pyverbs.enums")
    except ImportError:  # newer rdma-core
        enums = importlib.import_module("pyverbs.libibverbs_enums")
    return enums, pyverbs


class _VerbsPort:
    """An opened device and port: Context, PD, the port's LID, active MTU and GID."""

    def __init__(self, device: str | None, port: int, gid_index: int):
        self.e, _ = _verbs()
        from pyverbs.device import Context, get_device_list
        from pyverbs.pd import PD

        if device is None:
            found = get_device_list()
            if not found:
                raise ConfigError("no RDMA device: ibv_devices lists none")
            device = found[0].name.decode() if isinstance(found[0].name, bytes) else str(found[0].name)
        self.device, self.port, self.gid_index = device, int(port), int(gid_index)
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        attr = self.ctx.query_port(self.port)
        self.lid, self.mtu = int(attr.lid), int(attr.active_mtu)
        try:
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index).gid)
        except Exception:  # noqa: BLE001 - an IB port without a GID table entry: LID routing only
            self.gid = "0000:0000:0000:0000:0000:0000:0000:0000"
        dev_attr = self.ctx.query_device()
        self.max_qp_wr = int(dev_attr.max_qp_wr)
        self.max_rd_atom = max(1, min(16, int(dev_attr.max_qp_rd_atom), int(dev_attr.max_qp_init_rd_atom)))

    def endpoint(self, qp: Any, psn: int) -> dict[str, Any]:
        return {"fabric": "verbs", "qp_num": int(qp.qp_num), "lid": self.lid, "gid": self.gid, "psn": psn,
                "mtu": self.mtu, "device": self.device}  # fmt: skip

    def make_qp(self, cq: Any, max_send_wr: int) -> Any:
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=self.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        attr = QPAttr(port_num=self.port)
        attr.qp_access_flags = self.e.IBV_ACCESS_REMOTE_READ  # the shard's QP answers READs
        attr.pkey_index = 0
        return QP(self.pd, init, attr)  # created in INIT

    def to_rts(self, qp: Any, psn: int, peer: dict[str, Any]) -> None:
        """INIT → RTR → RTS toward ``peer`` (ibv_rc_pingpong's timers; READs both ways)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        if peer.get("fabric") != "verbs":
            raise ValueError(f"a verbs queue pair cannot connect to a {peer.get('fabric')!r} endpoint")
        attr = QPAttr(port_num=self.port)
        attr.path_mtu = min(self.mtu, int(peer["mtu"]))
        attr.dest_qp_num = int(peer["qp_num"])
        attr.rq_psn = int(peer["psn"])  # the peer's send PSN
        attr.sq_psn = psn
        attr.max_dest_rd_atomic = self.max_rd_atom  # READs this QP answers at once
        attr.max_rd_atomic = self.max_rd_atom  # READs this QP has in flight at once
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.qp_access_flags = self.e.IBV_ACCESS_REMOTE_READ
        gid = str(peer.get("gid") or "")
        if gid and set(gid) - set("0:"):  # RoCE (and routed IB) need the global route header
            gr = GlobalRoute(dgid=GID(gid), sgid_index=self.gid_index)
            attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=int(peer["lid"]))
        else:
            attr.ah_attr = AHAttr(port_num=self.port, is_global=0, dlid=int(peer["lid"]))
        qp.to_rts(attr)

    def close(self) -> None:
        for name in ("pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)


class VerbsExport:
    """The shard's end over pyverbs: ``register`` makes one memory region (remote read only)
    over an existing mapping (the segment: no copy), ``accept`` one RC queue pair per learner.

    Untested on hardware here (no RDMA device on the development machine); the tests marked
    ``rdma`` run it where ``ibv_devices`` lists one.
    """

    def __init__(self, device: str | None = None, port: int = 1, gid_index: int = 0):
        self._port = _VerbsPort(device, port, gid_index)
        self._mrs: list[Any] = []
        self._qps: list[tuple[Any, Any]] = []

    def register(self, address: int, length: int) -> Region:
        from pyverbs.mr import MR

        mr = MR(self._port.pd, int(length), self._port.e.IBV_ACCESS_REMOTE_READ, address=int(address))
        self._mrs.append(mr)
        return Region(int(address), int(length), int(mr.rkey))

    def accept(self, peer: dict[str, Any]) -> dict[str, Any]:
        from pyverbs.cq import CQ

        cq = CQ(self._port.ctx, 16, None, None, 0)
        qp = self._port.make_qp(cq, 1)
        psn = secrets.randbits(24)
        self._port.to_rts(qp, psn, peer)
        self._qps.append((qp, cq))
        return self._port.endpoint(qp, psn)

    def release(self, endpoint: dict[str, Any]) -> None:
        keep = []
        for qp, cq in self._qps:
            if int(qp.qp_num) == int(endpoint["qp_num"]):
                qp.close()
                cq.close()
            else:
                keep.append((qp, cq))
        self._qps = keep

    def close(self) -> None:
        for qp, cq in self._qps:
            qp.close()
            cq.close()
        for mr in self._mrs:
            mr.close()
        self._qps, self._mrs = [], []
        self._port.close()


class VerbsMemory:
    """The learner's end over pyverbs: an RC queue pair, a registered local buffer, and
    :meth:`read_chain`: one linked list of ``IBV_WR_RDMA_READ`` SendWRs (one SGE each),
    only the last signalled (and fenced: it starts after every earlier READ completed),
    posted with one ``ibv_post_send`` and completed by one polled CQ entry.

    pyverbs copies an SGE into its SendWR when the WR is made, so a chain's WRs are made
    per batch (one Python object per coalesced read, not per row). A chain longer than the
    send queue (``max_chain``, capped by the device's ``max_qp_wr``) is posted as several
    chains, each waited for. Untested on hardware here; see :class:`VerbsExport`.
    """

    def __init__(self, device: str | None = None, port: int = 1, gid_index: int = 0,
                 max_chain: int = 4096, timeout_s: float = 10.0):
        from pyverbs.cq import CQ

        self._port = p = _VerbsPort(device, port, gid_index)
        self.max_chain = max(2, min(int(max_chain), p.max_qp_wr))
        self.timeout_s = timeout_s
        self.reads_posted = self.chains_posted = self.last_chain = 0
        self._cq = CQ(p.ctx, 4, None, None, 0)
        self._qp = p.make_qp(self._cq, self.max_chain)
        self._psn = secrets.randbits(24)
        self._mr: Any = None
        self._buffer: np.ndarray | None = None
        self._broken: str | None = None

    def endpoint(self) -> dict[str, Any]:
        return self._port.endpoint(self._qp, self._psn)

    def connect(self, peer: dict[str, Any]) -> None:
        self._port.to_rts(self._qp, self._psn, peer)

    def register(self, buffer: np.ndarray) -> int:
        from pyverbs.mr import MR

        if not (isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.flags.writeable):
            raise ValueError("the local buffer must be a writable C-contiguous numpy array")
        if self._mr is not None:
            self._mr.close()
        self._buffer = buffer
        self._mr = MR(self._port.pd, buffer.nbytes, self._port.e.IBV_ACCESS_LOCAL_WRITE, address=buffer.ctypes.data)
        return int(self._mr.lkey)

    def read_chain(self, reads: np.ndarray, rkey: int, fence_last: bool = True) -> None:
        reads = _check_reads(reads)
        if self._broken is not None:
            raise RemoteAccessError(f"the queue pair is in the error state ({self._broken}); connect again")
        if self._mr is None:
            raise RemoteAccessError("no local buffer is registered for the reads to land in")
        from pyverbs.wr import SGE, SendWR

        e, m = self._port.e, self.max_chain
        if (reads[:, 2] + reads[:, 1] > self._buffer.nbytes).any():
            raise RemoteAccessError("a read lands beyond the registered local buffer")
        local0, lkey, rkey = int(self._buffer.ctypes.data), int(self._mr.lkey), int(rkey)
        self.last_chain = reads.shape[0]
        for lo in range(0, reads.shape[0], m):
            part = reads[lo : lo + m].tolist()
            final = lo + m >= reads.shape[0]
            flags = e.IBV_SEND_SIGNALED | (e.IBV_SEND_FENCE if fence_last and final else 0)
            chain, nxt = [], None  # built last to first: each WR links to the one after it
            for raddr, length, off in reversed(part):
                sge = SGE(local0 + off, length, lkey)
                wr = SendWR(opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge], send_flags=flags, next_wr=nxt)
                wr.set_wr_rdma(rkey, raddr)
                chain.append(wr)  # kept alive until the completion: the list points into them
                nxt, flags = wr, 0
            self._qp.post_send(nxt)
            self.chains_posted += 1
            self.reads_posted += len(part)
            self._wait(e)
            del chain

    def _wait(self, e: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            npolled, wcs = self._cq.poll(1)
            if npolled:
                wc = wcs[0]
                if wc.status != e.IBV_WC_SUCCESS:
                    self._broken = f"completion status {wc.status}"
                    raise RemoteAccessError(f"RDMA READ chain failed: work completion status {wc.status} "
                                            f"(IBV_WC_REM_ACCESS_ERR = {e.IBV_WC_REM_ACCESS_ERR})")  # fmt: skip
                return
            if time.monotonic() > deadline:
                self._broken = "no completion"
                raise RemoteAccessError(f"RDMA READ chain did not complete within {self.timeout_s:.1f} s")

    def close(self) -> None:
        for name in ("_qp", "_mr", "_cq"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)
        self._port.close()
