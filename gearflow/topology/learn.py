"""A plan with a learner, run in this process: ``gearflow train``'s (``local``, ``serial``,
``offline``, ``shards``) and a Ray learner role's (``shards``) — wiring only.

The run's plan (:func:`~gearflow.topology.plan.plan_run`, made once from the config) says
which roles this process runs; :meth:`Runner.connect_components` builds them with the one
builder (:class:`~gearflow.topology.build.Builder`, also used by ``gearflow serve`` and the
Ray roles), the same calls for every learner plan::

    env spec → agent → [DataParallel] → replay: Table (SharedStorage, selector, rate limiter;
               geometry.py), or RemoteShards' sampler (transport.shards)
             → ParameterStore (or the shard nodes' publisher) → Learner (learner/: the loop,
               priorities, publishing)
             → actors: LocalLauncher (roles/actor_processes.py: one process per actor, each
               build_actor(...) over a Writer of its partitions) [+ RemoteActors], or one serial
               actor in this process (run.serial=true: SerialBatches, the same classes), or the
               dataset (run.mode=offline: the dataset is the replay), or none (shards)
             → eval (run.eval_every: roles/evaluator.py, greedy episodes in a process of its
               own over the parameter store; rows into metrics.jsonl)

and :meth:`Runner.run` takes every role through one lifecycle
(:class:`~gearflow.topology.lifecycle.Lifecycle`: start, check and drain between batches, stop,
finish, close — close always, last built first).

    EnvPool actors ──Adder → WriterLike──▶ SharedStorage (one partition per env)
            ▲                                     │ scan / sample (learner process)
            │ weights (ParameterSource)           ▼
            └──────────── Learner (agent.learn) ◀── Table ── priorities ──▶ Table

A dead actor is restarted up to ``actor.max_restarts`` times; its partitions and
their data survive (the new writer continues after the old one's last step).
SIGINT/SIGTERM stop everything cleanly: no child process and no /dev/shm segment
is left behind. The exit status each ending gives ``gearflow train`` is in :mod:`gearflow.runner`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import torch
from omegaconf import DictConfig

from gearflow.agent import resolve_device
from gearflow.config import save_config
from gearflow.errors import CheckpointNotWritten, ConfigError, GearflowError
from gearflow.learner import Learner, Progress
from gearflow.log import DATEFMT, FORMAT
from gearflow.replay.storage import gc_segments, run_tag
from gearflow.roles.actor_processes import LocalLauncher
from gearflow.roles.failures import ActorFailed, explain, stalled
from gearflow.run.checkpoint import Checkpoint, RunCheckpoints, set_rng_states
from gearflow.run.display import make_display
from gearflow.run.metrics import MetricsLog
from gearflow.run.private import private_dir
from gearflow.run.tables import make_run_dir
from gearflow.topology.build import Builder
from gearflow.topology.lifecycle import Lifecycle
from gearflow.topology.plan import RunPlan, plan_run

log = logging.getLogger("gearflow.runner")

__all__ = ["ActorFailed", "Runner", "check_run_dir", "learn", "log_lost_nodes", "make_run_dir"]


class Runner:
    """Builds one training run on this machine (:meth:`connect_components`) and runs it."""

    def __init__(self, cfg: DictConfig, resume: bool = False, stop: threading.Event | None = None,
                 roles: tuple = (), *, plan: RunPlan | None = None):  # fmt: skip
        self.cfg = cfg
        # which roles this process runs (gearflow/topology/plan.py): the caller's, else made here once
        self.plan = plan if plan is not None else plan_run(cfg, resume=resume)
        if not self.plan.learns:
            raise ConfigError(f"a {self.plan.mode} plan runs no learner here: run it with gearflow.topology.run.run_plan "
                              "(gearflow train does)")  # fmt: skip
        self.run_dir = make_run_dir(cfg)
        self.resume = resume  # continue from the run directory's latest valid checkpoint
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", keep=cfg.run.keep_checkpoints, config=cfg)
        self.checkpoint: Checkpoint | None = None  # the one resumed from
        self.progress = Progress()
        # every role of the run, in build order: started, supervised, stopped and closed together
        self.roles = Lifecycle()
        self._extra_roles = tuple(roles)  # a caller's own roles (a monitor, a test's), before the plan's
        # the parts the learner loop reads (also registered on self.roles)
        self.table = None  # Table, or the shard nodes' sampler (transport.shards)
        self.params = None  # ParameterStore, or the shard nodes' publisher
        self.learner: Learner | None = None
        self.build: Builder | None = None  # the builder of this run's roles (its counters: env steps, actor weights)
        self._env_steps_offset = 0  # env steps of a resumed run not in its (restored) replay counters
        self.run_tag = run_tag(self.run_dir)  # in this run's segment headers: a resume gc touches only them
        self.stop_signal = 0  # the signal that stopped the run (0: none)
        self._metrics_log: MetricsLog | None = None  # open while run() runs: rows of the eval role
        # set by SIGINT/SIGTERM (or by whoever passed ``stop``), also before the learner exists
        self._stop = stop if stop is not None else threading.Event()

    # ------------------------------------------------------------------ wiring
    def connect_components(self) -> None:
        """Env spec → agent → replay table → parameter store → learner → actors, as the plan says
        (the builder makes each part and registers it on :attr:`roles`)."""
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)
        if self.resume:
            self.checkpoint = self.checkpoints.latest()
            log.info("resuming from %s", self.checkpoint.path)
            # left by the stopped run if it was killed: only this run's, and only of dead owners
            for name, size in gc_segments(prefix="gearflow", run=self.run_tag):
                log.info("removed /dev/shm/%s (%.1f MiB) of a dead process", name, size / 2**20)
        for role in self._extra_roles:  # first: closed last, also when the build fails
            self.roles.add(role)
        build = self.build = Builder(cfg, self.plan, self.roles, tag=self.run_tag, progress=self.progress)
        self.device = resolve_device(cfg.learner.device)
        self.agent, self.env_spec = build.agent(self.device)
        agent = self.agent
        if self.checkpoint is not None:
            self._restore_learner()
        if cfg.learner.compile:
            agent.learner_network().compile()  # in place: parameter names stay the same
        parallel = build.data_parallel(self.device, agent)  # learner.world_size > 1
        replay_dir = self.checkpoint.replay_dir if self.checkpoint is not None else None
        self.table = build.replay(agent, self.device, checkpoint_dir=replay_dir)  # or the shard nodes' sampler
        self.params = build.params(agent)  # or the shard nodes' publisher
        build.publish(self.params, agent, version=self._resumed_version())
        self.learner = build.learner(agent, self.table, self.params, parallel=parallel, **self._learner_kwargs())
        build.actors(agent, self.table, self.params)
        build.evaluator(self.params, env_steps=self.env_steps, emit=self._write_row)

    def _learner_kwargs(self) -> dict:
        return {"env_steps": self.env_steps, "actor_version": self._actor_weights_version,
                "checkpoints": self.checkpoints, "device": self.device, "stop": self._stop}

    def _resumed_version(self) -> int | None:
        """A resumed run's progress and env-step offset restored; the weights version to publish
        (version numbers continue; the learner's state was restored), None for a fresh run."""
        if self.checkpoint is None:
            return None
        r = self.checkpoint.runner
        self.progress.load_state(r["progress"])
        self.roles.drain(self.progress)  # the shard nodes' counters (transport.shards), before the offset is taken
        self._env_steps_offset = int(r["env_steps"]) - self.env_steps()
        return max(1, int(r["weights_version"]))

    def _restore_learner(self) -> None:
        try:
            self.agent.load_state_dict(self.checkpoint.learner["agent"])
        except (RuntimeError, KeyError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise ConfigError(
                f"cannot resume: {self.checkpoint.path} holds a {self.cfg.agent.name} learner that does not fit "
                f"the config's agent (were agent.* keys or the env changed?): {first}"
            ) from None
        set_rng_states(self.checkpoint.learner["rng"])

    @property
    def launcher(self) -> LocalLauncher | None:
        """This run's actor processes (the ``actors`` role), None in a plan without them."""
        return self.roles.first(LocalLauncher)

    # ------------------------------------------------------------------ counters
    def env_steps(self) -> int:
        return self._env_steps_offset + self.build.env_steps()

    def _actor_weights_version(self) -> int:
        """The oldest weights version any actor acts with (-1 before actors report)."""
        return self.build.actor_version()

    @property
    def serial_actor(self):
        """``run.serial=true``: the one actor, stepped by the batches (None in other plans)."""
        return self.build.serial_actor if self.build is not None else None

    def _write_row(self, row: dict) -> None:
        """A metrics row from a role (the eval role's results), while the metric sinks are open."""
        if self._metrics_log is not None:
            self._metrics_log.write(row)

    def _on_signal(self, signum: int, frame) -> None:
        self.stop_signal = signum
        self._stop.set()

    def _drain(self) -> None:
        self.roles.drain(self.progress)

    def _supervise(self) -> str:
        """Between batches: every role's reports in, its check (dead actors restarted); a reason
        to stop if a role failed."""
        self._drain()
        try:
            self.progress.restarts += self.roles.check()
        except ActorFailed as exc:  # stop as a limit would: checkpoint, then fail
            self._failure = exc
            return f"actor failed: {exc}"
        return ""

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        # SIGINT/SIGTERM stop the run gracefully; only the main thread may take signals (a Ray
        # learner role runs us in one of its threads, and Ray stops it otherwise)
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        for s in previous:
            signal.signal(s, self._on_signal)
        metrics_log = display = file_log = None
        self._failure: ActorFailed | None = None
        try:
            if not self.resume and ((self.run_dir / "metrics.jsonl").exists() or RunCheckpoints(self.run_dir / "checkpoints").paths()):
                raise ConfigError(
                    f"run.dir={str(self.run_dir)!r} already holds a run (metrics.jsonl or checkpoints): continue it "
                    f"with gearflow train --resume {self.run_dir}, or choose another run.dir"
                )
            check_run_dir(self.run_dir)
            self.connect_components()  # config errors surface here, before a run directory exists
            try:
                private_dir(self.run_dir)  # 0700: the run's files are its owner's only
                file_log = logging.FileHandler(self.run_dir / "train.log")
            except OSError as exc:
                raise GearflowError(f"run.dir={str(self.run_dir)!r}: cannot write there: {exc.strerror or exc}") from None
            file_log.setFormatter(logging.Formatter(FORMAT, DATEFMT))
            logging.getLogger().addHandler(file_log)
            save_config(cfg, self.run_dir / "config.yaml")
            resume_from = None
            if self.checkpoint is not None:
                resume_from = (self.checkpoint.runner["metric_offsets"], self.checkpoint.runner["env_steps"])
            metrics_log = MetricsLog(self.run_dir, tensorboard=cfg.run.tensorboard, resume_from=resume_from)
            learner = self.learner
            learner.metric_offsets = metrics_log.offsets
            self._metrics_log = metrics_log
            display = make_display(cfg.run.progress, cfg.run.max_env_steps, title=f"gearflow train {self.run_dir}")
            self.roles.start()
            batches = self.build.batches(learner, self.table)  # the serial actor's steps, or the prefetcher

            def emit(row: dict) -> None:
                metrics_log.write(row)
                display.update(row)

            steps_at_start = self.env_steps()
            reason, metrics = learner.run(batches.next_batch, between=self._supervise, emit=emit)
            if self._failure is None and (stall := stalled(self.launcher, steps_at_start, self.env_steps())):
                self._failure, reason = stall, f"actor failed: {stall}"  # a limit came first, but nothing ran
                self.roles.failed = self.launcher  # its errors explain the failure
            learner.stop.set()  # the prefetcher stops sampling
            self.roles.stop(self.progress)  # final actor counters arrive as they exit; the nodes' last progress
            summary = learner.snapshot(metrics)
            if not self.stop_signal:  # a signal: --resume continues with the shard nodes
                self.roles.finish(reason)  # the publishing learner tells the shard nodes the run is over
            summary["stop_reason"] = reason
            before_summary = metrics_log.offsets()  # a resumed run drops the summary row: no repeated step
            metrics_log.write(summary)
            self.roles.summarize(summary)  # what the roles add (transport/nodes_lost: shard nodes gone)
            unsaved = None
            if learner.checkpoints_on:  # SIGTERM/SIGINT included: resume continues here
                try:
                    summary["checkpoint"] = str(learner.save_checkpoint(metric_offsets=before_summary))
                except OSError as exc:  # a full or read-only disk: the checkpoints before it stay
                    unsaved = self._unsaved(exc)
                    summary["checkpoint_error"] = str(unsaved)
            if self.stop_signal:
                summary["stop_signal"] = signal.Signals(self.stop_signal).name
            try:
                (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            except OSError as exc:
                log.error("summary.json not written: %s", exc)
            if self._failure is not None:
                raise self._explain(self._failure, summary)
            if unsaved is not None:
                raise unsaved
            return summary
        finally:
            self._stop.set()
            try:
                self.roles.stop(self.progress)  # those not stopped yet (a failure on the way)
            finally:
                self.roles.close()  # every role, last built first, also after a failure
            self._metrics_log = None
            for closable in (display, metrics_log):
                if closable is not None:
                    closable.close()
            if file_log is not None:
                logging.getLogger().removeHandler(file_log)
                file_log.close()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _unsaved(self, exc: OSError) -> CheckpointNotWritten:
        """The error of a final checkpoint that could not be written, naming the one to resume from."""
        last = self.checkpoints.paths()
        where = (f"gearflow train --resume {self.run_dir} continues from {last[0].name}" if last
                 else "no earlier checkpoint of this run exists")  # fmt: skip
        return CheckpointNotWritten(f"the final checkpoint could not be written ({exc}); {where}")

    def _explain(self, failure: ActorFailed, summary: dict) -> ActorFailed:
        self._drain()  # the actor's own traceback, if it sent one
        errors = getattr(self.roles.failed, "errors", {})  # the failed role's (actor index → last traceback)
        return explain(failure, errors, summary, self.run_dir)


def check_run_dir(run_dir: Path) -> None:
    """A one-line :class:`GearflowError` unless ``run_dir`` is, or can be made, a writable directory
    (checked before anything starts, so nothing is left behind)."""
    path = Path(os.path.abspath(run_dir))
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise GearflowError(f"run.dir={str(run_dir)!r}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "on a read-only file system" if _read_only(existing) else "not writable"
        raise GearflowError(f"run.dir={str(run_dir)!r}: {existing} is {why}")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def learn(cfg: DictConfig, plan: RunPlan, *, resume: bool = False, stop: threading.Event | None = None) -> dict[str, float]:
    """Run the learner plan ``plan`` of ``cfg`` to completion in this process (``resume``: from its run
    directory's latest checkpoint); returns the final summary. ``stop``: setting it from another
    thread stops the run as SIGINT would (stop reason "stopped by signal", no ``stop_signal``)."""
    from gearflow.transport.auth import configure

    configure(cfg.transport)  # this process's and its children's connections
    # run.serial: one thread — the actor's many tiny acting ops share the process, and with two
    # intra-op threads on a loaded machine each op waited for a descheduled thread (a serial
    # R2D2 run took 220 s instead of 6 s next to two CPU hogs)
    torch.set_num_threads(1 if cfg.run.serial else max(1, (os.cpu_count() or 2) - cfg.actor.num_actors))
    # The prefetch thread needs the GIL between the learner's many small torch calls;
    # at the default 5 ms switch interval it gets it too rarely to stay ahead.
    sys.setswitchinterval(0.0005)
    runner = Runner(cfg, resume=resume, stop=stop, plan=plan)
    log.info("run directory %s", runner.run_dir)
    summary = runner.run()
    log.info(
        "done (%s): %d env steps, %d updates in %.0f s; return over the last 100 episodes %.1f "
        "(greediest actor %.1f)", summary["stop_reason"], summary["actor/env_steps"],
        summary["learner/updates"], summary["time/elapsed_s"], summary["actor/return_last100"],
        summary["actor/return_last100_greediest"],
    )  # fmt: skip
    log_lost_nodes(summary)
    return summary


def log_lost_nodes(summary: dict) -> None:
    """One line per shard node that was down at the run's end (``transport/nodes_lost``): the run
    went on without it and ended as it would have (exit status 0 when nothing else failed)."""
    for address, why in (summary.get("transport/nodes_lost") or {}).items():
        log.warning("lost shard node %s (%s): the run went on with the other node(s); its replay and actors "
                    "were not part of the rest of the run", address, why)  # fmt: skip
