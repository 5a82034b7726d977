"""The learner loop: learn step, priority write-back, β schedule, weight publishing, metric rows,
stop limits, periodic checkpoints.

:class:`Learner` reads replay through the sampler interface
(:class:`~gearflow.replay.protocols.SamplerLike`: ``sample`` / ``update_priorities`` /
``stats``) and publishes through the parameter store; it does not know where actors run::

    learner = Learner(cfg.learner, agent, table, params, progress, run=cfg.run, env_steps=lambda: ...)
    batches = Prefetcher(table, learner.lock, cfg.learner.batch_size, cfg.learner.prefetch, stop)
    reason = learner.run(batches.next_batch, between=supervise, emit=metrics.write)

With ``parallel`` (a :class:`~gearflow.distributed.DataParallel`, ``learner.world_size > 1``)
every iteration first agrees with the other learners: all learn in the same iterations and stop
in the same one, so they make the same number of updates; only rank 0 publishes weights and
writes checkpoints.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig

from gearflow.config import parse_period
from gearflow.learner.access import ReplayAccess
from gearflow.learner.graph import learn_function
from gearflow.learner.progress import Progress
from gearflow.replay.protocols import SamplerLike
from gearflow.run.checkpoint import RunCheckpoints, rng_states

if TYPE_CHECKING:
    from gearflow.distributed import DataParallel

log = logging.getLogger("gearflow.runner")

CHECK_EVERY_S = 0.05  # seconds between the loop's checks: stop limits, supervision, β


def read_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """A learn step's metrics as numbers: its 0-dim tensors stacked per device and read back at
    once (a metric row's one host read per device; agents never read them in ``learn``), the rest
    (numbers) as floats. Keeps the order of ``metrics``."""
    by_device: dict[Any, list[str]] = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"metric {k!r} is a tensor of shape {tuple(v.shape)}; a metric is one number")
            by_device.setdefault(v.device, []).append(k)
    read: dict[str, float] = {}
    for names in by_device.values():
        values = torch.stack([metrics[k].detach().reshape(()).float() for k in names]).tolist()
        read.update(zip(names, values))
    return {k: read[k] if k in read else float(v) for k, v in metrics.items()}


@dataclass
class BetaSchedule:
    """Prioritized replay's IS exponent annealed linearly from ``start`` to 1 over ``steps`` env steps."""

    start: float
    steps: int

    def __call__(self, env_steps: int) -> float:
        return self.start + (1.0 - self.start) * min(1.0, env_steps / self.steps)


class Learner:
    """Learns from batches, writes priorities back, anneals β, publishes weights, makes metric
    rows and checkpoints; :meth:`run` is the loop. ``env_steps()`` counts the run's env steps;
    ``actor_version()`` the oldest weights version an actor acts with. ``parallel``: this
    learner's data-parallel group (None: the only learner)."""

    def __init__(self, learner: DictConfig, agent, table: SamplerLike, params, progress: Progress, *,
                 run: DictConfig, env_steps: Callable[[], int], actor_version: Callable[[], int],
                 checkpoints: RunCheckpoints | None = None, beta: BetaSchedule | None = None,
                 device: torch.device = torch.device("cpu"), stop: threading.Event | None = None,
                 parallel: DataParallel | None = None):  # fmt: skip
        # its own groups only: ``learner`` (batch, publishing, bf16) and ``run`` (limits, logging,
        # checkpoints); the checkpoints record the run's whole config themselves
        self.learner_cfg, self.run_cfg = learner, run
        self.agent, self.table, self.params, self.progress = agent, table, params, progress
        if parallel is not None:  # the ranks' highest count (each misses what a killed shard took with it)
            own = env_steps
            env_steps = lambda: max(own(), parallel.env_steps)
        self.env_steps, self.actor_version, self.checkpoints = env_steps, actor_version, checkpoints
        self.beta, self.device, self.parallel = beta, device, parallel
        self.publisher = parallel is None or parallel.is_publisher  # rank 0: weights and checkpoints
        # the table's critical sections (the prefetcher's draws, checkpoints) and the priority
        # write-backs the learn step queues without taking it (gearflow/learner/access.py)
        self.lock = ReplayAccess(table, device, int(learner.get("device_batches", 0)))
        self.stop = stop if stop is not None else threading.Event()  # set: the run stops (signals)
        # what the loop reads every update, as plain values (an OmegaConf read costs ~10 µs)
        # (``get``: a caller's partial config, a test's, leaves a limit off)
        self.publish_every = int(learner.get("publish_every", 10))
        self._max_env_steps, self._max_updates = int(run.get("max_env_steps") or 0), int(run.get("max_updates") or 0)
        self._max_seconds, self._stop_at_return = float(run.get("max_seconds") or 0), float(run.get("stop_at_return") or 0)
        self._log_every_s = float(run.get("log_every_s", 5.0))
        self.check_every_s = CHECK_EVERY_S
        self._pending_tokens = None  # tensor: valid steps learned from since the last row
        self._last_batch_version = None  # (latest published version, tensor: mean version of the batch)
        self._age_due = True  # the next batch's data age is taken (set again by each check)
        self._weights = None  # WeightPublisher, made at the first publish
        self._graph, self._graphed = bool(learner.get("graph", False)), None  # learner.graph
        self._checkpoint_period = parse_period(run.checkpoint_every)
        self._last_checkpoint = (time.monotonic(), progress.updates)
        self.metric_offsets: Callable[[], dict[str, int]] = dict  # where a resume continues the metric files
        if learner.bf16 and not getattr(agent, "bf16", False):  # the agent applies bf16 itself
            log.warning("learner.bf16=true, but agent %s does not say it runs its forward passes in bf16 (no "
                        "true 'bf16' attribute): it learns in fp32; see docs/custom_agent.md, 'bf16'",
                        type(agent).__module__)  # fmt: skip

    # ------------------------------------------------------------------ one update
    def learn_step(self, batch) -> dict[str, Any]:
        """One update: ``agent.learn``, its priorities queued for the table (applied by the sampling
        side before its next draw: the step neither takes the table's lock nor waits for the
        device), the counters, and weights published every ``learner.publish_every``. Returns the
        agent's metrics as it gave them (tensors are read when a row is made: :func:`read_metrics`)."""
        t0 = time.perf_counter()
        # learner.bf16: the agent runs its forward passes under bf16 autocast and computes
        # targets, TD errors, priorities, backward and the optimizer step in fp32
        # (gearflow/precision.py), so no autocast here.
        if self._graph:  # learner.graph: the graphed learn, made at the first update
            self._graph, self._graphed = False, learn_function(self.agent, self.device, True)
        metrics, priorities = (self._graphed or self.agent.learn)(batch)
        access = self.lock
        access.writeback.put(batch.keys, priorities)
        if not access.sampler_applies:  # no sampling thread (serial runs, a caller's own batches): now
            with access:
                access.writeback.apply()
        p = self.progress
        p.learn_s += time.perf_counter() - t0
        p.updates += 1
        n = batch.keys.shape[0]
        p.samples += n
        # Per-batch reductions stay tensors (on the GPU path, reading them would wait for the
        # device every update); :meth:`read_pending` turns them into numbers when a row is made.
        data = batch.data
        mask = data.get("mask")  # sequence/episode items: valid steps; transitions: one each
        if mask is None:
            p.tokens += n
        else:
            total = mask.sum()
            self._pending_tokens = total if self._pending_tokens is None else self._pending_tokens + total
        if self._age_due and "version" in data:  # how many publications old the sampled data is (a
            self._age_due = False  # batch after each check: a row reports the latest one)
            self._last_batch_version = (self.params.latest_version(), data["version"].double().mean())
        release = getattr(batch, "release", None)  # every read of the batch is queued on this stream:
        if release is not None:  # the GPU path may refill its buffers once the stream passes here
            release()
        if p.updates % self.publish_every == 0 and self.publisher:
            self.publish()
        return metrics

    def publish(self) -> None:
        """Publish the learner network's weights (a CUDA learner: from a pinned staging copy, by a
        helper thread; the step goes on: :class:`~gearflow.params.publisher.WeightPublisher`)."""
        if self._weights is None:
            from gearflow.params.publisher import WeightPublisher

            self._weights = WeightPublisher(self.params, self.agent.learner_network, self.device)
        self._weights.publish()

    def anneal(self) -> None:
        """β of the table's selector from the run's env steps (the loop calls it with its checks,
        every :attr:`check_every_s`: β moves over millions of steps)."""
        if self.beta is not None:
            self.table.selector.beta = self.beta(self.env_steps())

    def read_pending(self) -> None:
        """Fold the learner's per-batch tensor reductions into the progress counters."""
        if self._pending_tokens is not None:
            self.progress.tokens += int(self._pending_tokens)
            self._pending_tokens = None
        if self._last_batch_version is not None:
            latest, mean = self._last_batch_version
            self.progress.data_age = float(latest - mean)
            self._last_batch_version = None

    def snapshot(self, metrics: dict[str, Any]) -> dict[str, float]:
        """A metric row: the run's counters, the table's and the data-parallel group's stats, and
        ``metrics`` (the latest learn step's, read back here: :func:`read_metrics`)."""
        self.read_pending()
        p = self.progress
        elapsed = max(1e-9, time.monotonic() - p.start)
        busy = p.wait_s + p.learn_s
        latest, oldest = self.params.latest_version(), self.actor_version()
        return {
            "time/elapsed_s": elapsed,
            "actor/env_steps": self.env_steps(),
            "actor/episodes": p.episodes,
            "actor/return_last100": float(np.mean(p.all_returns)) if p.all_returns else float("nan"),
            "actor/return_last100_greediest": p.greediest_return(),
            "actor/restarts": p.restarts,
            "learner/updates": p.updates,
            "learner/samples": p.samples,
            "learner/tokens": p.tokens,
            "learner/wait_fraction": p.wait_s / busy if busy else 0.0,
            "learner/weights_version": latest,
            "actor/weights_version_min": oldest,
            # versions the slowest actor is behind the learner (none before an actor acted: a resumed
            # run's first row is not the whole version count), and the age of sampled data
            "actor/policy_lag": latest - oldest if oldest >= 0 else float("nan"),
            "replay/sample_age_versions": p.data_age,
            **self.table.stats(),
            **(self.parallel.stats() if self.parallel is not None else {}),
            **read_metrics(metrics),
        }

    # ------------------------------------------------------------------ the loop
    def done(self) -> str:
        """Why the run stops now ("" while it goes on): a signal or a ``run.*`` limit."""
        p = self.progress
        if self.stop.is_set():
            return "stopped by signal"
        if self._max_env_steps and self.env_steps() >= self._max_env_steps:
            return f"reached run.max_env_steps={self._max_env_steps}"
        if self._max_updates and p.updates >= self._max_updates:
            return f"reached run.max_updates={self._max_updates}"
        if self._max_seconds and time.monotonic() - p.start >= self._max_seconds:
            return f"reached run.max_seconds={self._max_seconds}"
        greedy = p.returns.get(p.greediest())  # the greediest actor that is acting
        if self._stop_at_return and greedy is not None and len(greedy) == greedy.maxlen:
            if float(np.mean(greedy)) >= self._stop_at_return:
                return f"reached run.stop_at_return={self._stop_at_return}"
        return ""

    def run(self, next_batch: Callable[[], Any], *, between: Callable[[], str] = lambda: "",
            emit: Callable[[dict], None] = lambda row: None) -> tuple[str, dict[str, float]]:
        """Learn until :meth:`done` or ``between()`` (supervision) gives a reason; a metric row goes
        to ``emit`` every ``run.log_every_s``, a checkpoint is written every ``run.checkpoint_every``.
        Returns the reason and the last metrics.

        The checks (:meth:`done`, ``between()``, β's annealing) run every :attr:`check_every_s`
        seconds, not every update (they cost tens of µs: env-step counters, every actor's
        supervision); a signal (``stop``) and ``run.max_updates`` are checked every update.

        Data-parallel (``parallel``): each iteration the ranks agree (:meth:`DataParallel.agree
        <gearflow.distributed.DataParallel.agree>`) to learn only when every rank has a batch
        (a rank's batch waits for the next iteration otherwise) and to stop when any rank has a
        reason; a rank stopped by another's reason returns "stopped with the other learners".
        ``env_steps()`` is then the ranks' highest count as of the last agree, or this rank's own
        if higher."""
        p, every, signal, max_updates = self.progress, self._log_every_s, self.stop, self._max_updates
        self._last_checkpoint = (time.monotonic(), p.updates)
        last_log, last_steps, last_updates, metrics = time.monotonic(), self.env_steps(), p.updates, {}
        last_samples, last_tokens = p.samples, p.tokens
        # data-parallel: a batch this rank holds while another rank has none; it stays valid (the
        # table keeps learner.prefetch + 2 buffer sets, a prefetcher drawing refills GROUP_SETS:
        # the queue's, the prefetch thread's, and the one the learner holds, which is this one
        # until it is learned)
        pending, next_check = None, 0.0
        while True:
            if self.parallel is None:
                now = time.monotonic()
                if now >= next_check or signal.is_set() or (max_updates and p.updates >= max_updates):
                    if (reason := self.done()) or (reason := between()):
                        break
                    self.anneal()
                    self._age_due = True
                    next_check = now + self.check_every_s
                batch = next_batch()
            else:  # every iteration: the ranks agree on it anyway
                self.anneal()
                self._age_due = True
                reason = self.done() or between()
                batch = pending if pending is not None or reason else next_batch()
                learn, stop = self.parallel.agree(batch is not None, bool(reason), self.env_steps())
                if stop:
                    reason = reason or "stopped with the other learners"
                    break
                pending, batch = (None, batch) if learn else (batch, None)
            if batch is not None:
                metrics = self.learn_step(batch)
            now = time.monotonic()
            if now - last_log >= every:
                row = self.snapshot(metrics)
                steps, updates, dt = row["actor/env_steps"], row["learner/updates"], now - last_log
                row["actor/env_steps_per_s"] = (steps - last_steps) / dt
                row["learner/updates_per_s"] = (updates - last_updates) / dt
                row["learner/samples_per_s"] = (p.samples - last_samples) / dt
                row["learner/tokens_per_s"] = (p.tokens - last_tokens) / dt
                last_samples, last_tokens = p.samples, p.tokens
                emit(row)
                last_log, last_steps, last_updates = now, steps, updates
            if self._checkpoint_due(now):
                self._periodic_checkpoint()
        return reason, metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, metric_offsets: dict[str, int] | None = None) -> Path:
        """Learner, counters and (``run.checkpoint_replay``) the replay, atomically.
        ``metric_offsets``: where a resumed run continues the metric files (default: their end)."""
        t0 = time.perf_counter()
        now = time.monotonic()
        if self._weights is not None:  # a staged publish in flight reaches the store first
            self._weights.flush()
        self.read_pending()
        runner_state = {
            "env_steps": self.env_steps(),
            "weights_version": self.params.latest_version(),
            "progress": self.progress.state(now),
            "metric_offsets": metric_offsets if metric_offsets is not None else self.metric_offsets(),
        }
        learner_state = {"agent": self.agent.state_dict(), "rng": rng_states()}
        with self.lock:  # the prefetcher samples under the same lock
            self.lock.writeback.apply()  # the learn steps' last priorities go into the saved table
            table = self.table if self.run_cfg.checkpoint_replay else None
            path = self.checkpoints.save(self.progress.updates, learner_state, runner_state, table)
        self._last_checkpoint = (time.monotonic(), self.progress.updates)
        log.info("checkpoint %s written in %.2f s", path, time.perf_counter() - t0)
        return path

    @property
    def checkpoints_on(self) -> bool:
        """Whether this learner writes checkpoints (``run.checkpoint_every``; data-parallel: rank 0 only)."""
        return self.publisher and self._checkpoint_period[0] != "off"

    def _periodic_checkpoint(self) -> None:
        """A periodic checkpoint; one that cannot be written (disk full, read-only) is removed,
        logged, and retried at the next period: training goes on, older checkpoints stay."""
        try:
            self.save_checkpoint()
        except OSError as exc:
            self._last_checkpoint = (time.monotonic(), self.progress.updates)
            log.warning("checkpoint at %d updates not written (%s); training continues, the previous "
                        "checkpoints are intact, the next period retries", self.progress.updates, exc)

    def _checkpoint_due(self, now: float | None = None) -> bool:
        if not self.publisher:
            return False
        kind, every = self._checkpoint_period
        when, updates = self._last_checkpoint
        if kind == "updates":
            return self.progress.updates - updates >= every
        if kind == "seconds":
            return (time.monotonic() if now is None else now) - when >= every
        return False
