"""``gearflow train`` and ``gearflow serve`` as functions: choose the plan once, run it.

    summary = train(cfg)                        # the config's plan: local, serial, offline, a learner
                                                # over shard nodes, launcher=ray (this process drives)
    summary = train(cfg, resume=True)           # from the run directory's latest checkpoint
    summary = serve(cfg, address_file="addr")   # a shard node until a learner ends the run

The plan (:func:`~gearflow.topology.plan.plan_run`) is made here, once, unless the caller made it
(the ``gearflow`` command does, :mod:`gearflow.cli`); :func:`~gearflow.topology.run.run_plan` builds
its roles with the one builder and runs them (a learner's loop:
:class:`~gearflow.topology.learn.Runner`; a shard node: :class:`~gearflow.topology.shard_node.ShardNode`;
a cluster's driver). Nothing else is decided here.

Exit status of ``gearflow train`` (so a scheduler can tell the cases apart):

    0    finished: a stopping limit was reached (final checkpoint written)
    2    a user error (config, run directory, checkpoint): one line, nothing started or left
    3    an actor failed more than ``actor.max_restarts`` times, or of a failure a restart cannot
         mend (a contract violation of the agent or env, the same error twice), or the run made
         no env step while its actors failed, whatever limit came first
         (``roles/failures.py``): the final checkpoint is written and ``--resume`` continues
         the run once the cause is fixed
    4    the final checkpoint could not be written (a full or read-only disk): the error
         names the last checkpoint written, from which ``--resume`` continues
    130  stopped by SIGINT, 143 by SIGTERM (128 + the signal, as a shell reports it), after
         the final checkpoint: ``--resume`` continues the run
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from gearflow.topology.plan import RunPlan, plan_run
from gearflow.topology.run import run_plan

__all__ = ["serve", "train"]


def train(cfg: DictConfig, resume: bool = False, stop: threading.Event | None = None, *, plan: RunPlan | None = None,
          on_started: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run ``cfg``'s ``train`` plan to completion (``resume``: from its run directory's latest
    checkpoint); returns the final summary. ``stop``: setting it from another thread stops a
    learner's run as SIGINT would (stop reason "stopped by signal", no ``stop_signal``);
    ``on_started``: a cluster run's hook once every role runs (``{"shards", "groups", "learners"}``)."""
    plan = plan_run(cfg, resume=resume) if plan is None else plan
    return run_plan(cfg, plan, resume=resume, stop=stop, on_started=on_started)


def serve(cfg: DictConfig, *, address_file: str | None = None, plan: RunPlan | None = None) -> dict[str, Any]:
    """Run ``cfg``'s ``serve`` plan (a shard node) until a learner ends the run; returns its summary.
    ``address_file``: written with ``host:port`` once listening (for scripts and launchers)."""
    plan = plan_run(cfg, command="serve") if plan is None else plan
    return run_plan(cfg, plan, address_file=address_file)
