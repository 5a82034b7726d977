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

from gearflow.agent import make_agent, resolve_device
from gearflow.config import save_config, to_yaml
from gearflow.envs import make_vec_env
from gearflow.errors import ConfigError, GearflowError
from gearflow.params import ParameterStore
from gearflow.replay import RateLimiter, SharedStorage, Table, TableSpec, make_selector
from gearflow.replay.storage import COMMIT

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
    data_age: float = 0.0
    actor_counters: dict[int, dict] = field(default_factory=dict)  # latest "counters" message per actor

    def add_episode(self, actor: int, ret: float) -> None:
        self.returns.setdefault(actor, collections.deque(maxlen=100)).append(ret)
        self.all_returns.append(ret)
        self.episodes += 1

    def greediest_return(self) -> float:
        """Mean of the last 100 episodes of the greediest actor (the highest index)."""
        if not self.returns:
            return float("nan")
        actor = max(self.returns)
        return float(np.mean(self.returns[actor]))


class ActorSupervisor:
    """Starts actor processes and restarts the ones that die."""

    def __init__(self, cfg: DictConfig, storage_name: str, params_name: str, partitions: list[np.ndarray]):
        from gearflow.actor import run_actor_process

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
                raise GearflowError(
                    f"actor {i} died (exit code {code}) and was already restarted "
                    f"{self.restarts[i]} times (actor.max_restarts={self.max_restarts})"
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

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.run_dir = make_run_dir(cfg)
        self.progress = Progress()
        self._stop = threading.Event()
        self.table: Table | None = None
        self.params: ParameterStore | None = None
        self.supervisor: ActorSupervisor | None = None
        self.serial_actor = None

    # ------------------------------------------------------------------ wiring
    def connect_components(self) -> None:
        """Env spec → agent → replay table → parameter store → actors."""
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)
        probe_cfg = OmegaConf.merge(cfg.env, {"num_envs": 1, "batch_size": 1})
        probe = make_vec_env(probe_cfg, seed=cfg.env.seed)
        env_spec = probe.env_spec
        probe.close()
        self.device = resolve_device(cfg.learner.device)
        self.agent = make_agent(cfg, env_spec, self.device)
        self.agent.setup_learner()

        num_actors = 1 if cfg.run.serial else cfg.actor.num_actors
        P = num_actors * cfg.env.num_envs
        S = cfg.replay.capacity // P
        kind = self.agent.item_kind()
        if kind.name != cfg.replay.item:
            raise ConfigError(
                f"replay.item={cfg.replay.item!r}: agent {cfg.agent.name} learns from {kind.name} items"
            )
        R = S if kind.name == "transition" else S // max(1, getattr(kind, "period", 1)) + 2
        storage = SharedStorage.create(TableSpec.parse(self.agent.replay_columns()), P, S, R)
        selector = make_selector(cfg.replay.selector, P * R, seed=cfg.run.seed, **selector_kwargs(cfg))
        limiter = RateLimiter(
            min_size_to_sample=cfg.replay.min_size_to_sample,
            samples_per_insert=cfg.replay.samples_per_insert,
            error_buffer=cfg.replay.error_buffer,
        )
        self.table = Table(storage, kind, selector, limiter, num_buffers=cfg.learner.prefetch + 2,
                           sample_timeout_s=cfg.replay.timeout_s)  # fmt: skip
        self.lock = threading.Lock()
        self.params = ParameterStore.create(self.agent.learner_network())
        self.params.publish(self.agent.learner_network())
        partitions = [np.arange(a * cfg.env.num_envs, (a + 1) * cfg.env.num_envs) for a in range(num_actors)]
        if cfg.run.serial:
            from gearflow.actor import Actor

            self.serial_actor = Actor(cfg, 0, storage, partitions[0], self.params, self.agent,
                                      on_episode=lambda env, ret, length, eps: self.progress.add_episode(0, ret))
        else:
            self.supervisor = ActorSupervisor(cfg, storage.name, self.params.name, partitions)
        log.info("replay: %d partitions × %d steps (%.1f MiB), item=%s, selector=%s", P, S,
                 storage.nbytes / 2**20, cfg.replay.item, cfg.replay.selector)

    # ------------------------------------------------------------------ loop
    def env_steps(self) -> int:
        return int(self.table.storage.counters[:, COMMIT].sum())

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

    def _learn_step(self, batch) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics, priorities = self.agent.learn(batch)
        with self.lock:
            self.table.update_priorities(batch.keys, priorities)
        self.progress.learn_s += time.perf_counter() - t0
        self.progress.updates += 1
        if "version" in batch.data:  # how many publications old the sampled data is
            self.progress.data_age = float(self.params.latest_version() - batch.data["version"].double().mean())
        if self.progress.updates % self.cfg.learner.publish_every == 0:
            self.params.publish(self.agent.learner_network())
        sel = self.table.selector
        if hasattr(sel, "beta") and self.cfg.run.max_env_steps:
            frac = min(1.0, self.env_steps() / self.cfg.run.max_env_steps)
            sel.beta = self.cfg.replay.beta + (1.0 - self.cfg.replay.beta) * frac
        return metrics

    def snapshot(self, metrics: dict[str, float]) -> dict[str, float]:
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
            signal.signal(s, lambda *_: self._stop.set())
        metrics_file = None
        prefetch = None
        try:
            self.connect_components()  # config errors surface here, before a run directory exists
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            metrics_file = open(self.run_dir / "metrics.jsonl", "a")
            if self.supervisor is not None:
                self.supervisor.start()
                prefetch = Prefetcher(self.table, self.lock, cfg.learner.batch_size, cfg.learner.prefetch, self._stop)
            last_log, last_steps, last_updates, metrics = time.monotonic(), 0, 0, {}
            reason = ""
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
                    self.progress.restarts += self.supervisor.check()
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
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                    log.info(
                        "steps %d (%.0f/s) updates %d (%.1f/s) replay %d return100 %.1f greediest %.1f "
                        "lag %.1f wait %.0f%%", steps, row["actor/env_steps_per_s"], updates,
                        row["learner/updates_per_s"], row["replay/size"], row["actor/return_last100"],
                        row["actor/return_last100_greediest"], row["actor/policy_lag"],
                        100 * row["learner/wait_fraction"],
                    )  # fmt: skip
                    last_log, last_steps, last_updates = now, steps, updates
            if self.supervisor is not None:  # final actor counters arrive as they exit
                self._stop.set()
                self.supervisor.stop(drain=self._drain_metrics)
            summary = self.snapshot(metrics)
            summary["stop_reason"] = reason
            metrics_file.write(json.dumps(summary) + "\n")
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
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
            if metrics_file is not None:
                metrics_file.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


def train(cfg: DictConfig) -> dict[str, float]:
    """Run ``cfg`` to completion; returns the final summary."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - (0 if cfg.run.serial else cfg.actor.num_actors)))
    # The prefetch thread needs the GIL between the learner's many small torch calls;
    # at the default 5 ms switch interval it gets it too rarely to stay ahead.
    sys.setswitchinterval(0.0005)
    runner = Runner(cfg)
    log.info("run directory %s", runner.run_dir)
    summary = runner.run()
    log.info(
        "done (%s): %d env steps, %d updates in %.0f s; return over the last 100 episodes %.1f "
        "(greediest actor %.1f)", summary["stop_reason"], summary["actor/env_steps"],
        summary["learner/updates"], summary["time/elapsed_s"], summary["actor/return_last100"],
        summary["actor/return_last100_greediest"],
    )  # fmt: skip
    return summary
