"""A learner's view of shard nodes (``transport.shards``): its table, its weights' way out, its progress (the learner side).

With ``transport.shards = [HOST:PORT, ...]`` (the nodes' ``gearflow serve`` addresses),
``gearflow train`` keeps no replay of its own and starts no actors: the nodes hold the replay
and run the actors. The runner plugs three pieces of :class:`RemoteShards` where the local
table, parameter store and launcher would go::

    shards = RemoteShards(cfg, agent)       # connects, checks the nodes hold the agent's items
    learner = Learner(cfg.learner, agent, shards.sampler, shards.params, progress, run=cfg.run, env_steps=shards.env_steps, ...)
    shards.poll(progress)                   # between batches: the nodes' episodes and counters
    shards.end_run("reached run.max_env_steps")   # the publishing learner: the nodes stop and exit

* ``sampler`` — a :class:`~gearflow.transport.learner.RemoteSampler` over every node (exact global
  prioritized draws, see there), or, with ``transport.kind=rdma`` (or ``auto`` where an RDMA device
  and pyverbs are usable) and one node, an :class:`~gearflow.transport.rdma.replay.RdmaSampler` that
  reads the rows with one-sided RDMA READs.
* ``params`` — :class:`PushedParams`: ``publish`` sends the weights to every node
  (``params.push``), whose actors load them from the node's parameter store.
* ``poll`` — ``run.progress`` of each node (at most every 0.25 s; a node that says ``more``, a page
  of its backlog, at once): episodes and counters, with the actor's index in the run, folded into
  the learner's :class:`~gearflow.learner.Progress`; the run's env steps are the sum of the nodes'.
* ``health`` — a :class:`~gearflow.transport.learner.health.NodeHealth` the four share: a node
  whose call times out (``transport.node_timeout_s``) or is refused is marked down at once for
  all of them (nothing waits on it again), re-probed in the background and re-admitted when it
  answers; ``lost()`` names the nodes down at the run's end (the summary's
  ``transport/nodes_lost``, and a warning line).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from gearflow.errors import ConfigError, GearflowError
from gearflow.reports import fold_report
from gearflow.replay.layout import buffer_sets
from gearflow.transport.client import Client, RequestTimeout, ServiceUnavailable
from gearflow.transport.learner.health import NodeHealth
from gearflow.transport.learner.sampler import LEARNER_PREFETCH, RemoteSampler
from gearflow.transport.ops import RPC

log = logging.getLogger("gearflow.runner")

__all__ = ["PushedParams", "RemoteShards", "ShardsUnavailable", "TolerantSampler"]

POLL_S = 0.25
NODE_TIMEOUT_S = 15.0  # transport.node_timeout_s's default (and what 0 means): gearflow/config.py says why


class ShardsUnavailable(GearflowError, TimeoutError):
    """No batch now: a shard node does not answer (a TimeoutError, so the prefetcher asks again)."""


class TolerantSampler:
    """A sampler over shard nodes that rides out a node's outage (a node restarted by Ray comes
    back on its address): a draw that fails because a node is unreachable reads as "no batch
    yet" (:class:`ShardsUnavailable`, a ``TimeoutError``) until ``patience_s`` passes without
    one batch, then the error is raised (the run stops, checkpointed); priority updates for an
    unreachable node are dropped (its items are gone with it); stats repeat the last ones read."""

    def __init__(self, inner, patience_s: float, health: NodeHealth | None = None):
        self.inner, self.patience_s, self.health = inner, float(patience_s), health
        self._since: float | None = None  # when the current outage began
        self._stats: dict[str, float] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def sample(self, batch_size: int, timeout_s: float | None = None):
        try:
            batch = self.inner.sample(batch_size, timeout_s)
        except (ServiceUnavailable, RequestTimeout) as exc:
            now = time.monotonic()
            if self._since is None:
                self._since = now
                log.warning("a shard node does not answer (%s); waiting up to %.0f s for it", exc, self.patience_s)
            if now - self._since > self.patience_s:
                raise
            time.sleep(min(0.2, float(timeout_s or 0.2)))
            raise ShardsUnavailable(str(exc)) from None
        if self._since is not None:
            down = len(self.health.addresses) - len(self.health.live()) if self.health is not None else 0
            if down:  # a node marked down: the next rounds went to the others
                log.warning("sampling goes on over %d shard node(s) after %.1f s (%d down)",
                            len(self.health.live()), time.monotonic() - self._since, down)  # fmt: skip
            else:
                log.warning("every shard node answers again after %.1f s", time.monotonic() - self._since)
            self._since = None
        return batch

    def update_priorities(self, keys, priorities) -> int:
        try:
            return self.inner.update_priorities(keys, priorities)
        except (ServiceUnavailable, RequestTimeout) as exc:
            log.debug("priorities for an unreachable shard node dropped: %s", exc)
            return 0

    def stats(self) -> dict[str, float]:
        try:
            self._stats = self.inner.stats()
        except (ServiceUnavailable, RequestTimeout) as exc:
            log.debug("stats of an unreachable shard node: %s", exc)
        return dict(self._stats)

    def close(self) -> None:
        self.inner.close()


class PushedParams:
    """A :class:`~gearflow.params.protocol.ParameterPublisher` that sends each version to every
    node (``params.push``). A push is answered before the next is sent (one version in flight
    per node: a slow node delays the learner by one push at most, and never queues versions).
    A node that does not answer misses the versions of its outage (logged once) and gets the
    next one when it is back (a node restarted by Ray)."""

    def __init__(self, clients: list, timeout_s: float, health: NodeHealth | None = None):
        self.clients, self.timeout_s, self.health = clients, float(timeout_s), health
        self.version = 0
        self._pending: list = []
        self._down: set[str] = set()

    def latest_version(self) -> int:
        return self.version

    def _lost(self, c, exc: BaseException) -> None:
        if self.health is not None:
            self.health.mark_down(self.clients.index(c), exc)
        if c.address_text not in self._down:
            self._down.add(c.address_text)
            log.warning("shard node %s: weights not delivered (%s); it gets the next version once it answers",
                        c.address_text, exc)  # fmt: skip

    def _wait(self) -> None:
        pending, self._pending = self._pending, []
        for c, fut in pending:
            try:
                c.result(fut, RPC.PARAMS_PUSH, self.timeout_s)
                self._down.discard(c.address_text)
            except (ServiceUnavailable, RequestTimeout) as exc:
                self._lost(c, exc)

    def publish(self, params: Any, version: int | None = None) -> int:
        state = params.state_dict() if isinstance(params, torch.nn.Module) else dict(params)
        version = self.version + 1 if version is None else int(version)
        if version <= self.version:
            raise ValueError(f"version {version} is not newer than the latest published version {self.version}")
        names = list(state)
        bufs = [np.ascontiguousarray(state[n].detach().float().cpu().numpy() if state[n].dtype == torch.bfloat16
                                     else state[n].detach().cpu().numpy()) for n in names]  # fmt: skip
        self._wait()
        for i, c in enumerate(self.clients):
            if self.health is not None and self.health.is_down(i):
                self._down.add(c.address_text)
                continue  # it gets the version after it is back
            try:
                self._pending.append((c, c.submit(RPC.PARAMS_PUSH, {"version": version, "names": names}, bufs,
                                                  timeout_s=self.timeout_s)))  # fmt: skip
            except (ServiceUnavailable, RequestTimeout) as exc:
                self._lost(c, exc)
        self.version = version
        return version

    def close(self) -> None:
        try:
            self._wait()
        except GearflowError as exc:  # the run is over: a node already gone loses nothing
            log.debug("last weights push not answered: %s", exc)


class RemoteShards:
    """The shard nodes of ``cfg.transport.shards`` as the learner's table, publisher and actors."""

    def __init__(self, cfg: DictConfig, agent, *, publisher: bool = True, seed: int | None = None):
        from gearflow.run.private import config_token
        from gearflow.transport.auth import resolve_token
        from gearflow.transport.choice import choose_transport

        t = cfg.transport
        self.addresses = [str(a) for a in t.shards]
        try:
            token = resolve_token(config_token(t)).decode()
        except ValueError as exc:
            raise ConfigError(f"transport.shards: {exc}") from None
        # a node's silence, or a call's wait, before it is marked down (transport.node_timeout_s; 0: the default)
        self.timeout_s = float(t.get("node_timeout_s", 0) or 0) or NODE_TIMEOUT_S
        self.choice = choose_transport(str(t.kind))
        self.publisher = publisher
        self.clients: list = []
        self.sampler = None
        self.health = NodeHealth(self.addresses, token, timeout_s=self.timeout_s, loop=str(t.loop))
        try:
            self.clients = [Client(a, token, timeout_s=self.timeout_s, loop=str(t.loop)) for a in self.addresses]
            for c in self.clients:  # one clear line for an unreachable node, before anything else
                try:
                    c.connect(timeout_s=self.timeout_s)
                except GearflowError as exc:
                    raise GearflowError(f"transport.shards: cannot reach the shard node {c.address_text}: {exc}") from None
            self.sampler = self.choice.sampler(self, cfg)  # a transport beside TCP (rdma), or None
            if self.sampler is None:
                self.sampler = RemoteSampler(self.addresses, token, prefetch=LEARNER_PREFETCH, timeout_s=self.timeout_s,
                                             num_buffers=buffer_sets(cfg.learner.prefetch),
                                             seed=cfg.run.seed if seed is None else seed, loop=str(t.loop),
                                             health=self.health)  # fmt: skip
            log.info("learner samples %d shard node(s) %s over %s (%s)", len(self.clients), ", ".join(self.addresses),
                     self.choice.transport, self.choice.reason)  # fmt: skip
            want = agent.item_kind().to_dict()
            if self.sampler.kind.to_dict() != want:
                raise ConfigError(f"transport.shards: the nodes hold {self.sampler.kind.to_dict()} items, the agent "
                                  f"learns from {want} (serve the same config on the nodes)")  # fmt: skip
            from gearflow.replay.spec import replay_spec

            want_spec = replay_spec(agent.replay_columns(), cfg.replay.frame_stack).to_dict()
            have_spec = self.sampler.spec.to_dict()
            if have_spec != want_spec:
                raise ConfigError(f"transport.shards: the nodes' replay columns are {have_spec}, the agent learns from "
                                  f"{want_spec} (serve the same env, agent and replay.frame_stack on the nodes)")  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.params = PushedParams(self.clients, self.timeout_s, self.health)
        self.health.on_change(lambda i, up: None if up else self.clients[i].drop())
        self.health.start_heartbeats()
        self.sampler = TolerantSampler(self.sampler, patience_s=max(120.0, 4 * float(cfg.replay.timeout_s)),
                                       health=self.health)  # fmt: skip
        n = len(self.clients)
        self._cursors, self._steps, self._base = [0] * n, [0] * n, [0] * n
        self._epochs: list = [None] * n
        self._down: set[int] = set()  # nodes whose last poll failed (logged once per outage)
        self._next_poll = 0.0
        self.errors: dict[int, str] = {}

    # ----------------------------------------------------------------- progress
    def env_steps(self) -> int:
        return int(sum(self._base) + sum(self._steps))

    def poll(self, progress, force: bool = False) -> None:
        """Fold the nodes' reports since the last poll into ``progress`` (at most every 0.25 s).
        A node that does not answer is logged and skipped: the learner goes on."""
        now = time.monotonic()
        if not force and now < self._next_poll:
            return
        self._next_poll = now + POLL_S
        futs = []
        for i, c in enumerate(self.clients):
            if self.health.is_down(i):
                self._lost(i, "marked down")
                continue
            try:
                futs.append((i, c, c.submit(RPC.RUN_PROGRESS, {"cursor": self._cursors[i]}, timeout_s=self.timeout_s)))
            except GearflowError as exc:
                self._lost(i, exc)
        for i, c, fut in futs:
            try:
                meta, _ = c.result(fut, RPC.RUN_PROGRESS, self.timeout_s)
            except GearflowError as exc:
                self._lost(i, exc)
                continue
            if i in self._down:
                self._down.discard(i)
                log.warning("shard node %s answers again", c.address_text)
            epoch = meta.get("epoch")
            if self._epochs[i] is not None and epoch != self._epochs[i]:  # restarted: a fresh table and log
                log.warning("shard node %s was restarted (a fresh table): its counters start again", c.address_text)
                self._base[i] += self._steps[i]
                self._steps[i] = 0
                if self._cursors[i]:
                    self._cursors[i] = 0
                    self._next_poll = 0.0  # read the new log at once
                    self._epochs[i] = epoch
                    continue
            self._epochs[i] = epoch
            if meta.get("lost"):
                log.warning("shard node %s: %d reports dropped before this learner read them", c.address_text, meta["lost"])
            self._cursors[i] = int(meta["cursor"])
            if meta.get("more"):  # a page of a backlog (a learner started late): the next one at once
                self._next_poll = 0.0
            self._steps[i] = int(meta["env_steps"])
            if not self.publisher:  # another learner publishes: the nodes know the latest version
                self.params.version = max(self.params.version, int(meta.get("weights_version", 0)))
            for m in meta["messages"]:
                fold_report(progress, m, self.errors, source=f"shard node {c.address_text}: actor")

    def _lost(self, i: int, exc: BaseException | str) -> None:
        if isinstance(exc, (ServiceUnavailable, RequestTimeout)):
            self.health.mark_down(i, exc)
        if i not in self._down:
            self._down.add(i)
            log.warning("shard node %s: no progress (%s); the learner goes on with what it can sample",
                        self.clients[i].address_text, exc)  # fmt: skip

    def end_run(self, reason: str) -> None:
        """Tell every node the run is over (they stop their actors and exit); unreachable ones are logged."""
        for i, c in enumerate(self.clients):
            if self.health.is_down(i):
                log.warning("shard node %s: run.stop not sent (the node is down)", c.address_text)
                continue
            try:
                c.call(RPC.RUN_STOP, {"reason": reason}, timeout_s=min(10.0, self.timeout_s))
            except GearflowError as exc:
                log.warning("shard node %s: run.stop not delivered (%s)", c.address_text, exc)

    def lost(self) -> dict[str, str]:
        """The nodes down now (``{address: since when and why}``): lost for the rest of the run."""
        return self.health.lost()

    def close(self) -> None:
        if getattr(self, "health", None) is not None:
            self.health.close()
        if getattr(self, "params", None) is not None:
            self.params.close()
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        for c in self.clients:
            c.close()
        self.clients = []
