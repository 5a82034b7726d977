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
* ``run.stop`` — the run is over: ``on_stop(reason)`` (the node stops its actors and exits).

    server = NodeService(table, store, template, relay=relay, on_stop=node.stopped_by, ...)
    server.start()        # the bound port; server.close() stops it (the table stays the caller's)
"""

from __future__ import annotations

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
        s.register(RPC.RUN_PROGRESS, self._progress, inline=True, roles=ANY_ROLE)
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

    def _progress(self, meta: dict, bufs):
        cursor = meta.get("cursor", 0)
        if type(cursor) is not int or cursor < 0:
            raise ValueError(f"run.progress: cursor must be an int ≥ 0, got {cursor!r}")
        items, nxt, lost = self.relay.since(cursor)
        return {"messages": items, "cursor": nxt, "lost": lost, "env_steps": self.env_steps(),
                "actors": self.num_actors, "ladder_offset": self.ladder_offset,
                "weights_version": self.params.latest_version(), "epoch": self.epoch,
                "stopping": self.stop_event.is_set()}, []  # fmt: skip

    def _stop(self, meta: dict, bufs, conn):
        reason = meta.get("reason")
        self.on_stop(f"run.stop from {conn.peer}" + (f": {str(reason)[:200]}" if reason else ""))
        return {}, []
