"""Local launcher: actor processes on this machine (``spawn``), supervised.

Each actor process runs :func:`~gearflow.actors.process.run_actor_process`: it attaches
the replay segment and the parameter store by name and writes its own partitions. A dead
actor is restarted up to ``actor.max_restarts`` times, unless it died of a failure a restart cannot
mend (:mod:`gearflow.roles.failures`: a contract violation, or the same error twice); its partitions and their data
survive (the new writer continues after the old one's last step). What actors report
(episodes, counters, errors) arrives on one queue and is folded into the run's
:class:`~gearflow.learner.Progress` by :meth:`LocalLauncher.drain`::

    launcher = LocalLauncher(cfg, storage.name, params.name, partitions)
    launcher.start()
    launcher.drain(progress); progress.restarts += launcher.check()   # in the learner loop
    launcher.stop(drain=lambda: launcher.drain(progress)); launcher.close()

A cluster launcher (Ray) offers the same five methods.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Callable

import numpy as np
from omegaconf import DictConfig

from gearflow.actors.process import actor_process_main, stop_processes
from gearflow.config import to_yaml
from gearflow.reports import fold_report, queued
from gearflow.roles.failures import ActorFailed, FailureLog

log = logging.getLogger("gearflow.runner")

__all__ = ["ActorFailed", "LocalLauncher"]


class LocalLauncher:
    """Starts actor processes and restarts the ones that die."""

    def __init__(self, cfg: DictConfig, storage_name: str, params_name: str, partitions: list[np.ndarray]):
        self._target = actor_process_main  # run_actor_process; a reported error is not printed twice
        self.cfg_yaml = to_yaml(cfg)
        self.max_restarts = cfg.actor.max_restarts
        self.ctx = mp.get_context("spawn")
        self.stop_event = self.ctx.Event()
        self.metrics: mp.Queue = self.ctx.Queue()
        self.storage_name, self.params_name, self.partitions = storage_name, params_name, partitions
        self.procs: list[mp.Process | None] = [None] * len(partitions)
        self.restarts = [0] * len(partitions)
        self.errors: dict[int, str] = {}  # last line of each actor's last traceback
        self.failures = FailureLog()  # what a dead actor died of: restart it or not (roles/failures.py)
        self._read: list = []  # reports read by check() before drain() folds them

    def _start(self, i: int) -> None:
        proc = self.ctx.Process(
            target=self._target,
            name=f"actor-{i}",
            args=(self.cfg_yaml, i, self.storage_name, self.partitions[i].tolist(),
                  self.params_name, self.metrics, self.stop_event, os.getpid()),
            daemon=True,
        )  # fmt: skip
        proc.start()
        self.procs[i] = proc

    def start(self) -> None:
        for i in range(len(self.partitions)):
            self._start(i)

    def check(self) -> int:
        """Restart dead actors; raise once one has died more than ``max_restarts`` times."""
        restarted = 0
        for i, proc in enumerate(self.procs):
            if proc is None or proc.is_alive() or self.stop_event.is_set():
                continue
            code = proc.exitcode
            proc.join()
            self._read += self._reports()  # its failure report is in the queue before it exits
            if self.restarts[i] >= self.max_restarts:
                raise ActorFailed(
                    f"actor {i} died (exit code {code}) and was already restarted "
                    f"{self.restarts[i]} times (actor.max_restarts={self.max_restarts})", actor=i
                )
            if why := self.failures.verdict(i):
                raise ActorFailed(why, actor=i, deterministic=True)
            self.restarts[i] += 1
            log.error("actor %d died (exit code %s); restarting it (%d/%d)", i, code,
                      self.restarts[i], self.max_restarts)
            self._start(i)
            restarted += 1
        return restarted

    def drain(self, progress) -> None:
        """Fold what the actors sent (episodes, counters, errors) into ``progress``."""
        read, self._read = self._read + self._reports(), []
        for msg in read:
            fold_report(progress, msg, self.errors)

    def _reports(self) -> list:
        """Every report in the queue now (failure reports noted in :attr:`failures`)."""
        out = queued(self.metrics)
        for msg in out:
            self.failures.note(msg)
        return out

    def stop(self, drain: Callable[[], None] = lambda: None, timeout: float = 10.0) -> None:
        """Ask every actor to stop and wait for it; ``drain`` keeps reading the metrics
        queue meanwhile (a child cannot exit while its queue buffer is unflushed)."""
        self.stop_event.set()
        stop_processes(self.procs, drain, timeout)

    def close(self) -> None:
        self.metrics.close()
        self.metrics.join_thread()
