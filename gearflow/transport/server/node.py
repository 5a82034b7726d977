"""NodeService: a shard node's server — its replay shard plus the learner's control messages.

What ``gearflow serve`` (:class:`~gearflow.topology.shard_node.ShardNode`) and a Ray shard role
serve: a :class:`~gearflow.transport.server.ShardService` over the node's table and parameter
store (``replay.*``, ``params.get``), the server end of the transport ``transport.kind`` resolves
to beside TCP (:meth:`~gearflow.transport.choice.TransportChoice.serve`: RDMA's ``rdma.*``
handlers over the exported segment; TCP: none), the remote actors'
``run.join`` / ``run.report`` when the node has any (``members``, handed in), and:

* ``params.push`` — the learner's new weights (``version``, ``names`` + one buffer per tensor),
  checked against the node's network (``template``) and published into the node's parameter
  store; its actors pick them up as from a local learner.
* ``run.progress`` — what the node's actors reported since ``cursor`` (``relay.since``: episodes,
  counters, errors, with the actor's index in the *run*), the node's env steps, and whether the
  node is stopping. A learner polls it; several learners (data-parallel) each keep their own cursor.
  A reply is a page that fits the envelope the caller accepts (``Connection.peer_limits``: a node
  whose actors ran unthrottled before any learner polled holds ~100,000 reports, 230 KB a 4,096
  of them); ``"more": true`` says the next page is ready (the learner asks again at once).
* ``run.stop`` — the run is over: ``on_stop(reason)`` (the node stops its actors and exits).

    server = NodeService(table, store, template, relay=relay, on_stop=node.stopped_by, ...)
    server.start()        # the bound port; server.close() stops it (the table stays the caller's)
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gearflow.transport.choice import choose_transport
from gearflow.transport.ops import RPC
from gearflow.transport.server.shard import ShardService
from gearflow.transport.service import ANY_ROLE

log = logging.getLogger("gearflow.serve")

__all__ = ["NodeService"]

PAGE_SLACK = 1024  # bytes of a run.progress envelope left to its op name and buffer list


def _json_len(x) -> int:
    """Bytes of ``x`` in a frame's envelope (``framing.encode``'s JSON)."""
    return len(json.dumps(x, separators=(",", ":"), allow_nan=False))


def _cut(msg: dict, room: int) -> dict:
    """A report alone too big for a page (a long error text): its strings cut to fit ``room``."""
    limit = max(16, room // (6 * max(1, len(msg))))  # JSON escapes take ≤ 6 B a character
    return {k: (v[:limit] + f" [cut: {len(v)} characters]" if isinstance(v, str) and len(v) > limit else v)
            for k, v in msg.items()}  # fmt: skip


class NodeService:
    """The server of one shard node (see the module docstring). ``template``: the node's network's
    state (what a push must match); ``relay``: the node's numbered reports (``since(cursor)`` →
    ``(reports, next cursor, dropped)``); ``env_steps``: the node's env steps now; ``remote``: the
    partitions remote actors may write; ``members``: their ``run.join`` / ``run.report`` handlers
    (or None); ``transport``: ``transport.kind`` (``auto | tcp | rdma``)."""

    def __init__(self, table, params, template: dict[str, torch.Tensor], *, relay, env_steps: Callable[[], int],
                 stop_event: threading.Event, on_stop: Callable[[str], None], num_actors: int, ladder_offset: int,
                 network: str, remote: Sequence[int] = (), members: Any = None, host: str = "127.0.0.1",
                 port: int = 0, token: str | None = None, loop: str = "auto", transport: str = "auto",
                 checkpoint_dir: str | None = None, limits=None):  # fmt: skip
        self.table, self.params, self._template = table, params, template
        self.relay, self.env_steps, self.stop_event, self.on_stop = relay, env_steps, stop_event, on_stop
        self.num_actors, self.ladder_offset, self.network = int(num_actors), int(ladder_offset), network
        self.epoch = secrets.token_hex(8)  # a restarted node is another epoch: learners restart their cursors
        self.data_path = None
        self.shard = ShardService(table, params=params, partitions=sorted(int(p) for p in remote), host=host, port=port,
                                  token=token, loop=loop, checkpoint_dir=checkpoint_dir, limits=limits)  # fmt: skip
        s = self.shard.service
        if members is not None:
            self.shard.writable = members.writable  # an actor credential writes the partitions of places it joined
            s.register(RPC.RUN_JOIN, members.join, with_connection=True, roles=ANY_ROLE)
            s.register(RPC.RUN_REPORT, members.report, with_connection=True, inline=True, roles=ANY_ROLE)
        self.transport = choose_transport(transport)  # auto: RDMA where a device and pyverbs are usable
        self.data_path = self.transport.serve(self.shard)  # beside TCP (rdma: one-sided READs, rdma.*), or None
        log.info("shard transport: %s (%s)", self.transport.transport, self.transport.reason)
        s.register(RPC.PARAMS_PUSH, self._params_push)  # the learners' (the default role)
        s.register(RPC.RUN_PROGRESS, self._progress, inline=True, with_connection=True, roles=ANY_ROLE)
        s.register(RPC.RUN_STOP, self._stop, with_connection=True)

    @property
    def port(self) -> int:
        return self.shard.port

    def start(self) -> int:
        return self.shard.start()

    def close(self) -> None:
        self.shard.stop()
        if self.data_path is not None:
            self.data_path.close()
            self.data_path = None

    # ----------------------------------------------------------------- handlers
    def _params_push(self, meta: dict, bufs):
        version, names = meta.get("version"), meta.get("names")
        if type(version) is not int or version < 1:
            raise ValueError(f"params.push: version must be an int ≥ 1, got {version!r}")
        if not isinstance(names, list) or len(names) != len(bufs) or set(names) != set(self._template):
            raise ValueError(f"params.push: the weights must name exactly the {len(self._template)} tensors of the "
                             f"node's {self.network} network (got {len(bufs)} buffers)")  # fmt: skip
        state = {}
        for n, a in zip(names, bufs):
            t = torch.from_numpy(a)
            want = self._template[n]
            if tuple(t.shape) != tuple(want.shape) or t.dtype != want.dtype:
                raise ValueError(f"params.push: {n!r} is {t.dtype}{list(t.shape)}, the node's network holds "
                                 f"{want.dtype}{list(want.shape)} (is the learner's agent config the node's?)")
            state[n] = t
        if version <= self.params.latest_version():
            return {"version": self.params.latest_version(), "applied": False}, []
        self.params.publish(state, version=version)
        return {"version": version, "applied": True}, []

    def _progress(self, meta: dict, bufs, conn):
        cursor = meta.get("cursor", 0)
        if type(cursor) is not int or cursor < 0:
            raise ValueError(f"run.progress: cursor must be an int ≥ 0, got {cursor!r}")
        items, nxt, lost = self.relay.since(cursor)
        reply = {"messages": [], "cursor": nxt, "lost": lost, "env_steps": self.env_steps(),
                 "actors": self.num_actors, "ladder_offset": self.ladder_offset,
                 "weights_version": self.params.latest_version(), "epoch": self.epoch,
                 "stopping": self.stop_event.is_set(), "more": False}  # fmt: skip
        # the page: as many reports as fit the caller's envelope (the reply's other fields and the
        # envelope's own keys leave PAGE_SLACK); always one at least, cut if it alone does not fit
        room = conn.peer_limits.max_meta_bytes - PAGE_SLACK - _json_len(reply)
        page = []
        for m in items:
            n = _json_len(m) + 1
            if n > room:
                if not page:
                    page.append(_cut(m, room))
                break
            page.append(m)
            room -= n
        if len(page) < len(items):
            reply["cursor"], reply["more"] = nxt - (len(items) - len(page)), True
        reply["messages"] = page
        return reply, []

    def _stop(self, meta: dict, bufs, conn):
        reason = meta.get("reason")
        self.on_stop(f"run.stop from {conn.peer}" + (f": {str(reason)[:200]}" if reason else ""))
        return {}, []
