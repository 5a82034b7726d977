"""``gearflow train``: the single-machine runner.

:meth:`Runner.connect_components` is the one place where the graph is wired::

    EnvPool actor processes ──steps/items──▶ SharedStorage (one partition per env)
            ▲                                     │ scan / sample (learner process)
            │ weights (ParameterStore)            ▼
            └──────────── Learner (agent.learn) ◀── Table ── priorities ──▶ Table

Actors are spawned (``spawn`` start method) and watched by a supervisor that
restarts a dead one up to ``actor.max_restarts`` times; its partitions and
their data survive (the new writer continues after the old one's last step).
``run.serial=true`` runs one actor and the learner in this process with the
same classes. SIGINT/SIGTERM stop everything cleanly: no child process and no
/dev/shm segment is left behind.

Exit status of ``gearflow train`` (so a scheduler can tell the cases apart):

    0    finished: a stopping limit was reached (final checkpoint written)
    2    a user error (config, run directory, checkpoint): one line, nothing started or left
    3    an actor failed more than ``actor.max_restarts`` times: the final checkpoint is
         written and ``--resume`` continues the run
    130  stopped by SIGINT, 143 by SIGTERM (128 + the signal, as a shell reports it), after
         the final checkpoint: ``--resume`` continues the run
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from gearflow.actors.base import env_seed
from gearflow.agent import make_agent, resolve_device
from gearflow.checkpoint import Checkpoint, RunCheckpoints, rng_states, set_rng_states
from gearflow.config import parse_period, save_config, to_yaml
from gearflow.envs import make_vec_env
from gearflow.errors import ConfigError, GearflowError
from gearflow.log import FORMAT, DATEFMT
from gearflow.metrics import MetricsLog
from gearflow.native.device_replay import resolve_replay_device
from gearflow.params import ParameterStore
from gearflow.progress import make_display
from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, make_selector
from gearflow.replay.checkpoint import restore_checkpoint
from gearflow.replay.items import records_per_partition
from gearflow.replay.storage import COMMIT, gc_segments, run_tag

log = logging.getLogger("gearflow.runner")


def selector_kwargs(cfg: DictConfig) -> dict[str, Any]:
    r = cfg.replay
    if r.selector == "prioritized":
        return {"alpha": r.alpha, "beta": r.beta}
    if r.selector == "top_k":
        return {"k": r.top_k}
    return {}


def make_run_dir(cfg: DictConfig) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.run.name}-{stamp}"


@dataclass
class Progress:
    """What the runner tracks for logs and the final summary."""

    start: float = field(default_factory=time.monotonic)
    updates: int = 0
    episodes: int = 0
    wait_s: float = 0.0
    learn_s: float = 0.0
    returns: dict[int, collections.deque] = field(default_factory=dict)  # per actor
    all_returns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100))
    restarts: int = 0
    samples: int = 0  # items learned from
    tokens: int = 0  # steps learned from (items × their valid steps)
    data_age: float = 0.0
    actor_counters: dict[int, dict] = field(default_factory=dict)  # latest "counters" message per actor

    def add_episode(self, actor: int, ret: float) -> None:
        self.returns.setdefault(actor, collections.deque(maxlen=100)).append(ret)
        self.all_returns.append(ret)
        self.episodes += 1

    def state(self, now: float) -> dict[str, Any]:
        """JSON-able counters for a checkpoint (``now``: ``time.monotonic()``)."""
        return {
            "elapsed_s": now - self.start, "updates": self.updates, "episodes": self.episodes,
            "samples": self.samples, "tokens": self.tokens,
            "wait_s": self.wait_s, "learn_s": self.learn_s, "restarts": self.restarts,
            "returns": {str(a): list(r) for a, r in self.returns.items()},
            "all_returns": list(self.all_returns),
        }  # fmt: skip

    def load_state(self, state: dict[str, Any]) -> None:
        self.start = time.monotonic() - float(state["elapsed_s"])
        self.updates, self.episodes = int(state["updates"]), int(state["episodes"])
        self.wait_s, self.learn_s = float(state["wait_s"]), float(state["learn_s"])
        self.restarts = int(state["restarts"])
        self.samples, self.tokens = int(state.get("samples", 0)), int(state.get("tokens", 0))
        self.returns = {int(a): collections.deque(r, maxlen=100) for a, r in state["returns"].items()}
        self.all_returns = collections.deque(state["all_returns"], maxlen=100)

    def greediest_return(self) -> float:
        """Mean of the last 100 episodes of the greediest actor (the highest index)."""
        if not self.returns:
            return float("nan")
        actor = max(self.returns)
        return float(np.mean(self.returns[actor]))


class ActorFailed(GearflowError):
    """An actor died more than ``actor.max_restarts`` times (the run stops, checkpointed)."""

    exit_code = 3

    def __init__(self, message: str, actor: int):
        super().__init__(message)
        self.actor = actor


class ActorSupervisor:
    """Starts actor processes and restarts the ones that die."""

    def __init__(self, cfg: DictConfig, storage_name: str, params_name: str, partitions: list[np.ndarray]):
        from gearflow.actors.process import run_actor_process

        self._target = run_actor_process
        self.cfg_yaml = to_yaml(cfg)
        self.max_restarts = cfg.actor.max_restarts
        self.ctx = mp.get_context("spawn")
        self.stop_event = self.ctx.Event()
        self.metrics: mp.Queue = self.ctx.Queue()
        self.storage_name, self.params_name, self.partitions = storage_name, params_name, partitions
        self.procs: list[mp.Process | None] = [None] * len(partitions)
        self.restarts = [0] * len(partitions)

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
            if self.restarts[i] >= self.max_restarts:
                raise ActorFailed(
                    f"actor {i} died (exit code {code}) and was already restarted "
                    f"{self.restarts[i]} times (actor.max_restarts={self.max_restarts})", actor=i
                )
            self.restarts[i] += 1
            log.error("actor %d died (exit code %s); restarting it (%d/%d)", i, code,
                      self.restarts[i], self.max_restarts)
            self._start(i)
            restarted += 1
        return restarted

    def stop(self, drain: Callable[[], None] = lambda: None, timeout: float = 10.0) -> None:
        """Ask every actor to stop and wait for it; ``drain`` keeps reading the metrics
        queue meanwhile (a child cannot exit while its queue buffer is unflushed)."""
        self.stop_event.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p is not None and p.is_alive() for p in self.procs):
            drain()
            time.sleep(0.05)
        drain()
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join()

    def close(self) -> None:
        self.metrics.close()
        self.metrics.join_thread()


class Prefetcher:
    """Samples batches in a background thread, ``depth`` ahead of the learner."""

    def __init__(self, table: Table, lock: threading.Lock, batch_size: int, depth: int, stop: threading.Event):
        self.table, self.lock, self.batch_size = table, lock, batch_size
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = stop
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                with self.lock:
                    try:
                        batch = self.table.sample(self.batch_size, timeout_s=0.2)
                    except TimeoutError:
                        continue
                while not self.stop.is_set():
                    try:
                        self.queue.put(batch, timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # surfaced in the learner thread
            self.error = exc

    def get(self, timeout: float) -> Any:
        if self.error is not None:
            raise self.error
        return self.queue.get(timeout=timeout)


class Runner:
    """Builds and runs one training run on this machine."""

    def __init__(self, cfg: DictConfig, resume: bool = False):
        self.cfg = cfg
        self.run_dir = make_run_dir(cfg)
        self.resume = resume  # continue from the run directory's latest valid checkpoint
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", keep=cfg.run.keep_checkpoints)
        self.checkpoint: Checkpoint | None = None  # the one resumed from
        self.progress = Progress()
        self._stop = threading.Event()
        self.table: Table | None = None
        self.params: ParameterStore | None = None
        self.supervisor: ActorSupervisor | None = None
        self.serial_actor = None
        self._env_steps_offset = 0  # env steps of a resumed run not in its (restored) replay counters
        self._pending_tokens = None  # tensor: valid steps learned from since the last row
        self._last_batch_version = None  # (latest published version, tensor: mean version of the batch)
        self.run_tag = run_tag(self.run_dir)  # in this run's segment headers: a resume gc touches only them
        self.stop_signal = 0  # the signal that stopped the run (0: none)
        self._actor_errors: dict[int, str] = {}  # last line of each actor's last traceback

    # ------------------------------------------------------------------ wiring
    def connect_components(self) -> None:
        """Env spec → agent → replay table → parameter store → actors."""
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)
        if self.resume:
            self.checkpoint = self.checkpoints.latest()
            log.info("resuming from %s", self.checkpoint.path)
            # left by the stopped run if it was killed: only this run's, and only of dead owners
            for name, size in gc_segments(prefix="gearflow", run=self.run_tag):
                log.info("removed /dev/shm/%s (%.1f MiB) of a dead process", name, size / 2**20)
        probe_cfg = OmegaConf.merge(cfg.env, {"num_envs": 1, "batch_size": 1})
        probe = make_vec_env(probe_cfg, seed=cfg.env.seed)
        env_spec = probe.env_spec
        probe.close()
        self.device = resolve_device(cfg.learner.device)
        self.agent = make_agent(cfg, env_spec, self.device)
        self.agent.setup_learner()
        if self.checkpoint is not None:
            try:
                self.agent.load_state_dict(self.checkpoint.learner["agent"])
            except (RuntimeError, KeyError, ValueError) as exc:
                first = str(exc).strip().splitlines()[0]
                raise ConfigError(
                    f"cannot resume: {self.checkpoint.path} holds a {cfg.agent.name} learner that does not fit "
                    f"the config's agent (were agent.* keys or the env changed?): {first}"
                ) from None
            set_rng_states(self.checkpoint.learner["rng"])
        if cfg.learner.compile:
            self.agent.learner_network().compile()  # in place: parameter names stay the same

        num_actors = 1 if cfg.run.serial else cfg.actor.num_actors
        P = num_actors * cfg.env.num_envs
        S = cfg.replay.capacity // P
        kind = self.agent.item_kind()
        if kind.name != cfg.replay.item:
            raise ConfigError(
                f"replay.item={cfg.replay.item!r}: agent {cfg.agent.name} learns from {kind.name} items"
            )
        R = records_per_partition(kind, S)
        spec = TableSpec.parse(self.agent.replay_columns())
        replay_device = resolve_replay_device(cfg.replay.device, cfg.replay.selector)  # before any segment
        if replay_device == "cuda" and self.device.type != "cuda":
            raise ConfigError(
                f"replay.device={cfg.replay.device!r} assembles batches on the GPU, but the learner runs on "
                f"{self.device} (learner.device={cfg.learner.device!r}); use learner.device=cuda or replay.device=cpu"
            )
        if self.checkpoint is not None and self.checkpoint.replay_dir is not None:
            self.table = self._restore_table(self.checkpoint.replay_dir, spec, (P, S, R), replay_device)
        else:
            storage = SharedStorage.create(spec, P, S, R, run_tag=self.run_tag)
            selector = make_selector(cfg.replay.selector, P * R, seed=cfg.run.seed, **selector_kwargs(cfg))
            limiter = RateLimiter(
                min_size_to_sample=cfg.replay.min_size_to_sample,
                samples_per_insert=cfg.replay.samples_per_insert,
                error_buffer=cfg.replay.error_buffer,
            )
            try:
                self.table = Table(storage, kind, selector, limiter, num_buffers=cfg.learner.prefetch + 2,
                                   sample_timeout_s=cfg.replay.timeout_s, device=replay_device)  # fmt: skip
            except BaseException:
                storage.close()
                storage.unlink()
                raise
        storage = self.table.storage
        self.lock = threading.Lock()
        try:
            self.params = ParameterStore.create(self.agent.learner_network(), run_tag=self.run_tag)
        except BaseException:
            self.table.close()
            self.table = None
            raise
        if self.checkpoint is not None:  # version numbers continue; the learner's state is restored
            r = self.checkpoint.runner
            self.progress.load_state(r["progress"])
            self._env_steps_offset = int(r["env_steps"]) - self.env_steps()
            self.params.publish(self.agent.learner_network(), version=max(1, int(r["weights_version"])))
        else:
            self.params.publish(self.agent.learner_network())
        partitions = [np.arange(a * cfg.env.num_envs, (a + 1) * cfg.env.num_envs) for a in range(num_actors)]
        if cfg.run.mode == "offline":  # the dataset is the replay (a restored checkpoint already has it); no actors
            from gearflow.offline import load_dataset

            if self.table.size == 0:
                load_dataset(cfg.run.dataset, self.table, self.agent, env_spec)
        elif cfg.run.serial:
            from gearflow.actors.process import make_actor

            env = make_vec_env(cfg.env, seed=env_seed(cfg, 0))
            try:
                self.serial_actor = make_actor(cfg, 0, self.agent, env, storage, partitions[0], self.params,
                                               on_episode=lambda env, ret, length, eps: self.progress.add_episode(0, ret))
            except BaseException:
                env.close()
                raise
        else:
            self.supervisor = ActorSupervisor(cfg, storage.name, self.params.name, partitions)
        log.info("replay: %d partitions × %d steps (%.1f MiB), item=%s, selector=%s", P, S,
                 storage.nbytes / 2**20, cfg.replay.item, cfg.replay.selector)

    def _restore_table(self, path: Path, spec: TableSpec, geometry: tuple[int, int, int], device: str) -> Table:
        """The replay table of a checkpoint, refused if the config no longer matches its layout,
        item kind or selector; its rate limiter, timeout and buffer count follow the config."""
        cfg = self.cfg
        table = restore_checkpoint(path, device=device, run_tag=self.run_tag)
        st = table.storage
        have = (st.num_partitions, st.steps_per_partition, st.items_per_partition)
        problem = ""
        if have != geometry or st.spec.to_dict() != spec.to_dict():
            problem = (
                f"the checkpoint's replay has (partitions, steps, items) = {have} and columns "
                f"{list(st.spec.names)}, the config asks for {geometry} and {list(spec.names)} "
                "(replay.capacity, actor.num_actors, env.num_envs, run.serial and the agent must stay as they were)"
            )
        elif table.kind.to_dict() != self.agent.item_kind().to_dict():
            problem = (
                f"the checkpoint's items are {table.kind.to_dict()}, the config asks for "
                f"{self.agent.item_kind().to_dict()} (replay.item, sequence_length, sequence_period, burn_in "
                "and max_episode_length must stay as they were)"
            )
        elif table.selector.name != cfg.replay.selector:
            problem = (
                f"replay.selector={cfg.replay.selector!r}, but the checkpoint's table was filled with the "
                f"{table.selector.name!r} selector (its priorities and order are part of the checkpoint)"
            )
        if problem:
            table.close()
            raise ConfigError(f"cannot resume: {problem}")
        table.set_rate_limiter(RateLimiter(
            min_size_to_sample=cfg.replay.min_size_to_sample,
            samples_per_insert=cfg.replay.samples_per_insert,
            error_buffer=cfg.replay.error_buffer,
        ))  # fmt: skip
        table.num_buffers = max(table.num_buffers, cfg.learner.prefetch + 2)
        table.sample_timeout_s = cfg.replay.timeout_s
        log.info("replay restored: %d items, %d env steps", table.size, self.env_steps_in(table))
        return table

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, metric_offsets: dict[str, int] | None = None) -> Path:
        """Learner, counters and (``run.checkpoint_replay``) the replay, atomically.
        ``metric_offsets``: where a resumed run continues the metric files (default: their end)."""
        t0 = time.perf_counter()
        now = time.monotonic()
        self._read_pending()
        runner_state = {
            "env_steps": self.env_steps(),
            "weights_version": self.params.latest_version(),
            "progress": self.progress.state(now),
            "metric_offsets": metric_offsets if metric_offsets is not None else self.metrics.offsets(),
            "config": to_yaml(self.cfg),
        }
        learner_state = {"agent": self.agent.state_dict(), "rng": rng_states()}
        with self.lock:  # the prefetcher samples under the same lock
            table = self.table if self.cfg.run.checkpoint_replay else None
            path = self.checkpoints.save(self.progress.updates, learner_state, runner_state, table)
        self._last_checkpoint = (time.monotonic(), self.progress.updates)
        log.info("checkpoint %s written in %.2f s", path, time.perf_counter() - t0)
        return path

    def _periodic_checkpoint(self) -> None:
        """A periodic checkpoint; one that cannot be written (disk full, read-only) is removed,
        logged, and retried at the next period: training goes on, older checkpoints stay."""
        try:
            self.save_checkpoint()
        except OSError as exc:
            self._last_checkpoint = (time.monotonic(), self.progress.updates)
            log.warning("checkpoint at %d updates not written (%s); training continues, the previous "
                        "checkpoints are intact, the next period retries", self.progress.updates, exc)

    def _on_signal(self, signum: int, frame) -> None:
        self.stop_signal = signum
        self._stop.set()

    def _checkpoint_due(self) -> bool:
        kind, every = self._checkpoint_period
        when, updates = self._last_checkpoint
        if kind == "updates":
            return self.progress.updates - updates >= every
        if kind == "seconds":
            return time.monotonic() - when >= every
        return False

    # ------------------------------------------------------------------ loop
    @staticmethod
    def env_steps_in(table: Table) -> int:
        return int(table.storage.counters[:, COMMIT].sum())

    def env_steps(self) -> int:
        return self._env_steps_offset + self.env_steps_in(self.table)

    def _done(self) -> str:
        r = self.cfg.run
        if self._stop.is_set():
            return "stopped by signal"
        if r.max_env_steps and self.env_steps() >= r.max_env_steps:
            return f"reached run.max_env_steps={r.max_env_steps}"
        if r.max_updates and self.progress.updates >= r.max_updates:
            return f"reached run.max_updates={r.max_updates}"
        if r.max_seconds and time.monotonic() - self.progress.start >= r.max_seconds:
            return f"reached run.max_seconds={r.max_seconds}"
        greedy = self.progress.returns.get(max(self.progress.returns, default=-1))
        if r.stop_at_return and greedy is not None and len(greedy) == greedy.maxlen:
            if float(np.mean(greedy)) >= r.stop_at_return:
                return f"reached run.stop_at_return={r.stop_at_return}"
        return ""

    def _drain_metrics(self) -> None:
        if self.supervisor is None:
            return
        while True:
            try:
                msg = self.supervisor.metrics.get_nowait()
            except queue.Empty:
                return
            kind = msg.get("type") if isinstance(msg, dict) else None
            if kind == "episode":
                self.progress.add_episode(int(msg["actor"]), float(msg["actor/episode_return"]))
            elif kind == "counters":
                self.progress.actor_counters[int(msg["actor"])] = msg
            elif kind == "error":
                log.error("actor %s raised:\n%s", msg.get("actor"), msg.get("error"))
                lines = str(msg.get("error", "")).strip().splitlines()
                self._actor_errors[int(msg["actor"])] = lines[-1] if lines else "?"

    def _learn_step(self, batch) -> dict[str, float]:
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.learner.bf16):
            metrics, priorities = self.agent.learn(batch)
        if isinstance(priorities, torch.Tensor):
            priorities = priorities.detach().float()
        with self.lock:
            self.table.update_priorities(batch.keys, priorities)
        self.progress.learn_s += time.perf_counter() - t0
        self.progress.updates += 1
        self.progress.samples += len(batch.keys)
        # Per-batch reductions stay tensors (on the GPU path, reading them would wait for the
        # device every update); :meth:`_read_pending` turns them into numbers when a row is made.
        mask = batch.data.get("mask")  # sequence/episode items: valid steps; transitions: one each
        if mask is None:
            self.progress.tokens += len(batch.keys)
        else:
            total = mask.sum()
            self._pending_tokens = total if self._pending_tokens is None else self._pending_tokens + total
        if "version" in batch.data:  # how many publications old the sampled data is
            self._last_batch_version = (self.params.latest_version(), batch.data["version"].double().mean())
        if self.progress.updates % self.cfg.learner.publish_every == 0:
            self.params.publish(self.agent.learner_network())
        sel = self.table.selector
        if hasattr(sel, "beta") and self.cfg.run.max_env_steps:
            frac = min(1.0, self.env_steps() / self.cfg.run.max_env_steps)
            sel.beta = self.cfg.replay.beta + (1.0 - self.cfg.replay.beta) * frac
        return metrics

    def _read_pending(self) -> None:
        """Fold the learner's per-batch tensor reductions into the progress counters."""
        if self._pending_tokens is not None:
            self.progress.tokens += int(self._pending_tokens)
            self._pending_tokens = None
        if self._last_batch_version is not None:
            latest, mean = self._last_batch_version
            self.progress.data_age = float(latest - mean)
            self._last_batch_version = None

    def snapshot(self, metrics: dict[str, float]) -> dict[str, float]:
        self._read_pending()
        p = self.progress
        elapsed = max(1e-9, time.monotonic() - p.start)
        busy = p.wait_s + p.learn_s
        row = {
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
            "learner/weights_version": self.params.latest_version(),
            "actor/weights_version_min": self._actor_weights_version(),
            # versions the slowest actor is behind the learner, and the age of sampled data
            "actor/policy_lag": self.params.latest_version() - max(0, self._actor_weights_version()),
            "replay/sample_age_versions": p.data_age,
            **self.table.stats(),
            **metrics,
        }
        return row

    def _actor_weights_version(self) -> int:
        """The oldest weights version any actor acts with (-1 before actors report)."""
        if self.serial_actor is not None:
            return int(self.serial_actor.version)
        versions = [int(c.get("actor/weight_version", -1)) for c in self.progress.actor_counters.values()]
        return min(versions) if versions else -1

    def run(self) -> dict[str, float]:
        cfg = self.cfg
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, self._on_signal)
        self.metrics = None
        display = file_log = None
        prefetch = None
        try:
            if not self.resume and ((self.run_dir / "metrics.jsonl").exists() or RunCheckpoints(self.run_dir / "checkpoints").paths()):
                raise ConfigError(
                    f"run.dir={str(self.run_dir)!r} already holds a run (metrics.jsonl or checkpoints): continue it "
                    f"with gearflow train --resume {self.run_dir}, or choose another run.dir"
                )
            check_run_dir(self.run_dir)
            self.connect_components()  # config errors surface here, before a run directory exists
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                file_log = logging.FileHandler(self.run_dir / "train.log")
            except OSError as exc:
                raise GearflowError(f"run.dir={str(self.run_dir)!r}: cannot write there: {exc.strerror or exc}") from None
            file_log.setFormatter(logging.Formatter(FORMAT, DATEFMT))
            logging.getLogger().addHandler(file_log)
            save_config(cfg, self.run_dir / "config.yaml")
            resume_from = None
            if self.checkpoint is not None:
                resume_from = (self.checkpoint.runner["metric_offsets"], self.checkpoint.runner["env_steps"])
            self.metrics = MetricsLog(self.run_dir, tensorboard=cfg.run.tensorboard, resume_from=resume_from)
            self._checkpoint_period = parse_period(cfg.run.checkpoint_every)
            self._last_checkpoint = (time.monotonic(), self.progress.updates)
            display = make_display(cfg.run.progress, cfg.run.max_env_steps, title=f"gearflow train {self.run_dir}")
            if self.supervisor is not None:
                self.supervisor.start()
            if self.serial_actor is None:  # actor processes, or offline: batches come from the prefetcher
                prefetch = Prefetcher(self.table, self.lock, cfg.learner.batch_size, cfg.learner.prefetch, self._stop)
            last_log, last_steps, last_updates, metrics = time.monotonic(), self.env_steps(), self.progress.updates, {}
            last_samples, last_tokens = self.progress.samples, self.progress.tokens
            reason = ""
            failure: ActorFailed | None = None
            while not (reason := self._done()):
                if self.serial_actor is not None:
                    self.serial_actor.step()
                    self.table.scan()
                    if self.table.rate_limiter.can_sample(self.table.size, self.table.inserts, self.table.samples, cfg.learner.batch_size):
                        t0 = time.perf_counter()
                        batch = self.table.sample(cfg.learner.batch_size)
                        self.progress.wait_s += time.perf_counter() - t0
                        metrics = self._learn_step(batch)
                else:
                    self._drain_metrics()
                    if self.supervisor is not None:
                        try:
                            self.progress.restarts += self.supervisor.check()
                        except ActorFailed as exc:  # stop as a limit would: checkpoint, then fail
                            failure, reason = exc, f"actor failed: {exc}"
                            break
                    t0 = time.perf_counter()
                    try:
                        batch = prefetch.get(timeout=0.5)
                    except queue.Empty:
                        if self.progress.updates:
                            self.progress.wait_s += time.perf_counter() - t0
                        continue
                    if self.progress.updates:
                        self.progress.wait_s += time.perf_counter() - t0
                    metrics = self._learn_step(batch)
                now = time.monotonic()
                if now - last_log >= cfg.run.log_every_s:
                    row = self.snapshot(metrics)
                    steps, updates = row["actor/env_steps"], row["learner/updates"]
                    row["actor/env_steps_per_s"] = (steps - last_steps) / (now - last_log)
                    row["learner/updates_per_s"] = (updates - last_updates) / (now - last_log)
                    row["learner/samples_per_s"] = (self.progress.samples - last_samples) / (now - last_log)
                    row["learner/tokens_per_s"] = (self.progress.tokens - last_tokens) / (now - last_log)
                    last_samples, last_tokens = self.progress.samples, self.progress.tokens
                    self.metrics.write(row)
                    display.update(row)
                    last_log, last_steps, last_updates = now, steps, updates
                if self._checkpoint_due():
                    self._periodic_checkpoint()
            if self.supervisor is not None:  # final actor counters arrive as they exit
                self._stop.set()
                self.supervisor.stop(drain=self._drain_metrics)
            summary = self.snapshot(metrics)
            summary["stop_reason"] = reason
            before_summary = self.metrics.offsets()  # a resumed run drops the summary row: no repeated step
            self.metrics.write(summary)
            if self._checkpoint_period[0] != "off":  # SIGTERM/SIGINT included: resume continues here
                summary["checkpoint"] = str(self.save_checkpoint(metric_offsets=before_summary))
            if self.stop_signal:
                summary["stop_signal"] = signal.Signals(self.stop_signal).name
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            if failure is not None:
                self._drain_metrics()  # the actor's own traceback, if it sent one
                error = self._actor_errors.get(failure.actor, "no traceback received (killed by a signal?)")
                where = (f"final checkpoint {summary['checkpoint']}; continue with gearflow train --resume "
                         f"{self.run_dir}") if "checkpoint" in summary else "no checkpoint (run.checkpoint_every=0)"
                failure.args = (f"{failure}; its last error: {error}; {where}",)
                raise failure
            return summary
        finally:
            self._stop.set()
            if prefetch is not None:
                prefetch.thread.join(timeout=5)
            if self.supervisor is not None:
                self.supervisor.stop(drain=self._drain_metrics)
                self.supervisor.close()
            if self.serial_actor is not None:
                self.serial_actor.close()
            if self.table is not None:
                self.table.close()
            if self.params is not None:
                self.params.close()
            if display is not None:
                display.close()
            if self.metrics is not None:
                self.metrics.close()
            if file_log is not None:
                logging.getLogger().removeHandler(file_log)
                file_log.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


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


def train(cfg: DictConfig, resume: bool = False) -> dict[str, float]:
    """Run ``cfg`` to completion (``resume``: from its run directory's latest checkpoint);
    returns the final summary."""
    if cfg.run.dry_run:  # memory plan only: no actors, no shared memory, no run directory
        from gearflow.dryrun import dry_run

        return dry_run(cfg)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - (0 if cfg.run.serial else cfg.actor.num_actors)))
    # The prefetch thread needs the GIL between the learner's many small torch calls;
    # at the default 5 ms switch interval it gets it too rarely to stay ahead.
    sys.setswitchinterval(0.0005)
    runner = Runner(cfg, resume=resume)
    log.info("run directory %s", runner.run_dir)
    summary = runner.run()
    log.info(
        "done (%s): %d env steps, %d updates in %.0f s; return over the last 100 episodes %.1f "
        "(greediest actor %.1f)", summary["stop_reason"], summary["actor/env_steps"],
        summary["learner/updates"], summary["time/elapsed_s"], summary["actor/return_last100"],
        summary["actor/return_last100_greediest"],
    )  # fmt: skip
    return summary
