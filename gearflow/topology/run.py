"""Run a plan in this process: the one place a plan is turned into a running process.

An entry point chooses the plan once (``gearflow train`` / ``serve``, :mod:`gearflow.runner`;
a Ray role for its own sub-plan) and hands it here::

    plan = plan_run(cfg)                      # or plan_run(cfg, "serve")
    summary = run_plan(cfg, plan)             # builds its roles with the one builder, runs them

=================  ===================================================================
the plan           this process
=================  ===================================================================
``dry_run``        prints the memory plan (:meth:`Builder.dry_run`); nothing starts
has ``learner``    trains (:func:`~gearflow.topology.learn.learn`: ``local``, ``serial``,
                   ``offline``, ``shards``)
``shard_service``  serves a shard until a learner ends the run
                   (:func:`~gearflow.topology.shard_node.serve_node`: ``serve``, ``shard``)
otherwise          drives a cluster (:func:`drive`: ``ray``): its roles run elsewhere
=================  ===================================================================
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from gearflow.topology.build import Builder
from gearflow.topology.lifecycle import Lifecycle
from gearflow.topology.plan import RunPlan

log = logging.getLogger("gearflow.runner")

__all__ = ["drive", "run_plan"]


def run_plan(cfg: DictConfig, plan: RunPlan, *, resume: bool = False, stop: threading.Event | None = None,
             address_file: str | None = None, on_started: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run ``plan`` (made from ``cfg``) in this process until it is over; its summary (the module
    docstring says which process each plan is). ``resume``, ``stop``: a learner's
    (:func:`~gearflow.topology.learn.learn`); ``address_file``: a shard node's; ``on_started``: a
    cluster's (:func:`drive`)."""
    if "dry_run" in plan:
        return Builder(cfg, plan, Lifecycle(), tag="").dry_run()
    if plan.learns:
        from gearflow.topology.learn import learn

        return learn(cfg, plan, resume=resume, stop=stop)
    if "shard_service" in plan:
        from gearflow.topology.shard_node import serve_node

        return serve_node(cfg, plan, address_file=address_file)
    return drive(cfg, plan, on_started=on_started)


def drive(cfg: DictConfig, plan: RunPlan, *, on_started: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """A cluster plan (``ray``): this process drives roles that run elsewhere. The builder makes
    them in the plan's order (placed and started on the cluster: :func:`~gearflow.topology.cluster.build_cluster`); the run
    is the last one's ``wait()`` (the learners', which returns the run's summary); then every role
    is stopped and closed, last built first, also after a failure. ``on_started(handles)``: called
    once every role runs, with each role's handles by its ``key`` (tests kill a role there)."""
    roles = Lifecycle()
    try:
        from gearflow.topology.cluster import build_cluster

        last = build_cluster(Builder(cfg, plan, roles, tag=""))
        roles.start()
        if on_started is not None:
            on_started({r.key: r.handles for r in roles if hasattr(r, "handles")})
        summary = last.wait()
    finally:
        try:
            roles.stop(None)
        finally:
            roles.close()
    log.info("done on a cluster (%s): %s env steps, %s updates in %.0f s; return over the last 100 episodes %s; %s",
             summary.get("stop_reason"), summary.get("actor/env_steps"), summary.get("learner/updates"),
             summary.get("time/elapsed_s", 0.0), summary.get("actor/return_last100"),
             ", ".join(f"{k.removeprefix('cluster/')} {v}" for k, v in summary.items() if k.startswith("cluster/")))  # fmt: skip
    return summary
