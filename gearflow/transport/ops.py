"""The wire's requests, typed: every request name as one constant (:class:`RPC`: ``RPC.REPLAY_SAMPLE``,
``RPC.RUN_JOIN``, ...), and the ops of a ``replay.write`` request, with one encoder and one decoder
for both sides.

A remote writer (:class:`~gearflow.transport.actor.RemoteWriter`, the log-shipping
:class:`~gearflow.transport.actor.ShippingWriter`) builds a batch of writer calls as a list of
these ops and :func:`encode_ops` puts them in the request's meta; the shard
(:class:`~gearflow.transport.server.ShardService`) turns them back with :func:`decode_ops`,
which checks every op and every range it names against the request's buffers *before* one op
is applied, so a malformed batch is refused whole (a ``ValueError`` naming the op, its position
in the batch and the field) and nothing the shard already stored is touched.

Request layout (``meta = {"session", "ops"}``; buffers ``[ints int64, floats float64, <one per
column, in spec order>]``): each column buffer holds the rows of every append/extend of the
batch, in op order; an op names how many rows it takes and where its ints/floats are. On the
wire an op is a JSON list, its code first, then its fields in the order below (an optional
field last, left out when unset)::

    ["a", k, o]                    Append: streams ints[o:o+k], the next k rows
    ["x", stream, n(, t0)]         Extend: the next n rows of one stream (which must be at step t0)
    ["i", m, o, fo, s, e, t(, d)]  CreateItems: priorities floats[fo:fo+m], num_steps ints[o:o+m],
                                   streams ints[o+m:o+2m] (s = -1) or the one stream s, then (e = 1)
                                   the m ends; insert timeout t seconds; d = 1: expired="drop",
                                   d = 0 or absent: "raise"
    ["e", k, o]                    EndEpisode: the streams ints[o:o+k]; k = -1: every stream
    ["E", stream, k]               Episodes: k episodes of the stream ended (the EPISODES counter only)
    ["f"]                          Flush (a heartbeat)

    ops = [Append(count=8, ints_at=0), CreateItems(count=8, ints_at=8, floats_at=0, stream=-1,
           has_ends=False, timeout_s=60.0, drop=False)]
    meta = {"session": s, "ops": encode_ops(ops)}       # [["a", 8, 0], ["i", 8, 8, 0, -1, 0, 60.0, 0]]
    decode_ops(meta["ops"], ints=24, floats=8, rows=8) == ops
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Union

__all__ = [
    "RPC",
    "RPCS",
    "Append",
    "CreateItems",
    "EndEpisode",
    "Episodes",
    "Extend",
    "Flush",
    "Rpc",
    "WriteOp",
    "decode_ops",
    "encode_ops",
]


class Rpc(str):
    """The name of one request of the wire (a ``str``: it is sent, registered and compared as
    the plain name). Every name is one constant below, used by the side that registers its
    handler and by every side that calls it: a misspelt name is a NameError where it is
    written, not an "unknown request" from the other end."""

    __slots__ = ()


class RPC:
    """Every request name of the wire, one constant each: ``RPC.REPLAY_SAMPLE``, ``RPC.RUN_JOIN``."""

    # the shard (transport/server/shard.py): a learner's reads and writes of its table
    REPLAY_INFO = Rpc("replay.info")  # the table's spec, kind, selector, partitions (a learner's first call)
    REPLAY_STATS = Rpc("replay.stats")  # the table's counters (any role)
    REPLAY_SAMPLE = Rpc("replay.sample")  # a batch: keys, weights, columns
    REPLAY_UPDATE_PRIORITIES = Rpc("replay.update_priorities")  # new priorities by key
    REPLAY_TOTAL = Rpc("replay.total")  # the selector's total priority and size (the split of a batch; a health probe)
    REPLAY_CHECKPOINT = Rpc("replay.checkpoint")  # the node's table saved on its own disk
    # a remote writer's session (transport/server/sessions.py, transport/actor/)
    REPLAY_OPEN_WRITER = Rpc("replay.open_writer")
    REPLAY_CLOSE_WRITER = Rpc("replay.close_writer")
    REPLAY_WRITE = Rpc("replay.write")  # a batch of the typed write ops above
    # weights
    PARAMS_GET = Rpc("params.get")  # an actor's read of the latest weights
    PARAMS_PUSH = Rpc("params.push")  # a learner's new weights to a shard node
    # a run's members and progress (roles/remote_actors.py's Members; transport/server/node.py)
    RUN_JOIN = Rpc("run.join")  # a remote actor asks for a place
    RUN_REPORT = Rpc("run.report")  # what a remote actor reports; the reply says whether the run is over
    RUN_PROGRESS = Rpc("run.progress")  # what a node's actors reported since a cursor
    RUN_STOP = Rpc("run.stop")  # the run is over: a shard node stops
    # RDMA's control messages beside the TCP data path (transport/rdma/replay.py)
    RDMA_CONNECT = Rpc("rdma.connect")
    RDMA_SELECT = Rpc("rdma.select")
    RDMA_UPDATE = Rpc("rdma.update")


RPCS = tuple(v for k, v in vars(RPC).items() if isinstance(v, Rpc))  # every request name


# a field's kind: what the decoder accepts (and the encoder writes) for it
_COUNT, _OFFSET, _STREAM, _ANY_STREAM, _EVERY, _FLAG, _SECONDS = (
    "count", "offset", "stream", "stream or -1", "count or -1", "flag", "seconds")  # fmt: skip
_LOW = {_COUNT: 0, _OFFSET: 0, _STREAM: 0, _ANY_STREAM: -1, _EVERY: -1}


def _field(kind: str, optional: bool = False):
    return dataclasses.field(default=None if optional else dataclasses.MISSING,
                             metadata={"kind": kind, "optional": optional})  # fmt: skip


@dataclass(slots=True)
class Append:
    """``append`` of one step per stream: the streams at ``ints[ints_at:ints_at+count]``, the next ``count`` rows."""

    CODE: ClassVar[str] = "a"
    NAME: ClassVar[str] = "append"
    count: int = _field(_COUNT)
    ints_at: int = _field(_OFFSET)

    def ints(self) -> int:
        return self.count

    def rows(self) -> int:
        return self.count


@dataclass(slots=True)
class Extend:
    """``extend`` of one stream by the next ``count`` rows; ``first_step``: the shard's partition
    must be at that step (a shipped log continues exactly where it stopped)."""

    CODE: ClassVar[str] = "x"
    NAME: ClassVar[str] = "extend"
    stream: int = _field(_STREAM)
    count: int = _field(_COUNT)
    first_step: int | None = _field(_OFFSET, optional=True)

    def ints(self) -> int:
        return 0

    def rows(self) -> int:
        return self.count


@dataclass(slots=True)
class CreateItems:
    """``create_items`` of ``count`` items: priorities ``floats[floats_at:+count]``, num_steps
    ``ints[ints_at:+count]``, then the streams (``stream = -1``; else every item is of ``stream``),
    then the ends (``has_ends``); the insert's timeout; ``drop``: ``expired="drop"`` (None: the
    field is left out, read as ``"raise"``, as writers before it sent)."""

    CODE: ClassVar[str] = "i"
    NAME: ClassVar[str] = "create_items"
    count: int = _field(_COUNT)
    ints_at: int = _field(_OFFSET)
    floats_at: int = _field(_OFFSET)
    stream: int = _field(_ANY_STREAM)
    has_ends: bool = _field(_FLAG)
    timeout_s: float = _field(_SECONDS)
    drop: bool | None = _field(_FLAG, optional=True)

    def ints(self) -> int:
        return self.count * (1 + (self.stream < 0) + bool(self.has_ends))

    def rows(self) -> int:
        return 0

    @property
    def expired(self) -> str:
        return "drop" if self.drop else "raise"


@dataclass(slots=True)
class EndEpisode:
    """``end_episode`` of the streams ``ints[ints_at:ints_at+count]``; ``count = -1``: every stream."""

    CODE: ClassVar[str] = "e"
    NAME: ClassVar[str] = "end_episode"
    count: int = _field(_EVERY)
    ints_at: int = _field(_OFFSET)

    def ints(self) -> int:
        return max(self.count, 0)

    def rows(self) -> int:
        return 0


@dataclass(slots=True)
class Episodes:
    """``count`` episodes of ``stream`` ended (the EPISODES counter only: a shipped log's items carry their own ends)."""

    CODE: ClassVar[str] = "E"
    NAME: ClassVar[str] = "episodes"
    stream: int = _field(_STREAM)
    count: int = _field(_COUNT)

    def ints(self) -> int:
        return 0

    def rows(self) -> int:
        return 0


@dataclass(slots=True)
class Flush:
    """``flush``: a heartbeat."""

    CODE: ClassVar[str] = "f"
    NAME: ClassVar[str] = "flush"

    def ints(self) -> int:
        return 0

    def rows(self) -> int:
        return 0


WriteOp = Union[Append, Extend, CreateItems, EndEpisode, Episodes, Flush]
OPS: dict[str, type] = {c.CODE: c for c in (Append, Extend, CreateItems, EndEpisode, Episodes, Flush)}
_FIELDS = {code: tuple((f.name, f.metadata["kind"], f.metadata["optional"]) for f in dataclasses.fields(cls))
           for code, cls in OPS.items()}  # fmt: skip
_NEED = {code: sum(not optional for _, _, optional in fields) for code, fields in _FIELDS.items()}  # required fields
_LOWS = {code: tuple(_LOW.get(kind) for _, kind, _ in fields) for code, fields in _FIELDS.items()}  # None: flag, seconds


def encode_ops(ops: list[WriteOp]) -> list[list]:
    """The ops as the JSON lists of a ``replay.write`` request (the one encoder)."""
    out = []
    for op in ops:
        raw: list = [op.CODE]
        for name, kind, optional in _FIELDS[op.CODE]:
            v = getattr(op, name)
            if v is None and optional:
                continue
            # seconds go as given (an int stays an int: the bytes earlier writers sent); flags and counts as ints
            raw.append((v if type(v) in (int, float) else float(v)) if kind == _SECONDS else int(v))
        out.append(raw)
    return out


def _bad(raw: list, j: int, code: str, pos: int) -> ValueError:
    """The error of field ``j`` of op ``pos`` (built only when a field is refused)."""
    name, kind, _ = _FIELDS[code][j - 1]
    want = {_FLAG: "0 or 1", _SECONDS: "a number of seconds"}.get(kind, f"an int ≥ {_LOW.get(kind)}")
    return ValueError(f"replay.write: op {pos} ({OPS[code].NAME}) field {j} ({name}) must be {want}, got {raw[j]!r}")


def decode_ops(raw_ops: Any, ints: int, floats: int, rows: int | None) -> list[WriteOp]:
    """A ``replay.write`` request's ``meta["ops"]`` as typed ops (the one decoder), every field
    and every range checked against the request's buffers: ``ints`` / ``floats`` elements, ``rows``
    rows per column buffer (None: no column buffers sent). Raises a ``ValueError`` that names the
    op (its position and name) and the field, before anything is applied."""
    if not isinstance(raw_ops, list):
        raise ValueError(f"replay.write: meta.ops must be a list of ops, got {type(raw_ops).__name__}")
    out: list[WriteOp] = []
    used_rows = 0
    for pos, raw in enumerate(raw_ops):
        code = raw[0] if isinstance(raw, list) and raw else None
        if not isinstance(code, str) or code not in OPS:
            raise ValueError(f"replay.write: op {pos} is not one of {', '.join(OPS)}: {str(raw)[:40]}")
        fields, need = _FIELDS[code], _NEED[code]
        if not need + 1 <= len(raw) <= len(fields) + 1:
            names = ", ".join(n for n, _, _ in fields)
            raise ValueError(f"replay.write: op {pos} ({OPS[code].NAME}) has {len(raw) - 1} fields, takes "
                             f"{need}{'' if need == len(fields) else f' to {len(fields)}'} ({names}): {str(raw)[:60]}")  # fmt: skip
        vals, lows = raw[1:], _LOWS[code]
        for j, v in enumerate(vals):  # inline: this runs for every op of every batch
            lo = lows[j]
            if lo is not None:  # an int field
                if type(v) is not int or v < lo:
                    raise _bad(raw, j + 1, code, pos)
            elif fields[j][1] == _FLAG:  # 0 or 1 (kept as the int: it reads as a bool and encodes to itself)
                if type(v) is not int or not 0 <= v <= 1:
                    raise _bad(raw, j + 1, code, pos)
            elif (type(v) is not float and type(v) is not int) or v != v:  # seconds, not NaN (kept as sent)
                raise _bad(raw, j + 1, code, pos)
        op = OPS[code](*vals)
        k = op.ints()
        if k:
            at = op.ints_at
            if at + k > ints:
                raise ValueError(f"replay.write: op {pos} ({op.NAME}) reads ints[{at}:{at + k}], the ints buffer "
                                 f"holds {ints}")  # fmt: skip
        if code == "i" and op.floats_at + op.count > floats:
            raise ValueError(f"replay.write: op {pos} ({op.NAME}) reads floats[{op.floats_at}:{op.floats_at + op.count}], "
                             f"the floats buffer holds {floats}")  # fmt: skip
        n = op.rows()
        if n:
            if rows is None:
                raise ValueError(f"replay.write: op {pos} ({op.NAME}) writes {n} rows but no column buffers were sent")
            if used_rows + n > rows:
                raise ValueError(f"replay.write: op {pos} ({op.NAME}) writes rows [{used_rows}, {used_rows + n}), "
                                 f"the column buffers hold {rows}")  # fmt: skip
            used_rows += n
        out.append(op)
    return out
