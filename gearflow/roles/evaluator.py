"""Greedy evaluation during training (``run.eval_every``): one process of its own, the ``eval`` role.

The role (:class:`EvalProcess`, in the learner's process) decides when an evaluation is due and
asks for it; the process (:func:`run_eval_process`) reads the latest weights from the run's
parameter store exactly as an actor does (``ParameterStore.attach`` + ``load_into``), plays
``run.eval_episodes`` greedy episodes on envs of its own through the same code as ``gearflow
eval`` (:func:`gearflow.run.evaluate.play`: the run's actor class with ε = 0 and no writer), and
sends the returns back. Nobody waits for it: the learner only looks at its queue between
batches, and the actors never know it exists::

    ev = EvalProcess(cfg, params.name, env_steps=env_steps, updates=lambda: progress.updates,
                     elapsed=lambda: time.monotonic() - progress.start, emit=metrics_log.write)
    ev.start()
    ev.check(); ev.drain(progress)       # between batches: request when due, rows out when played
    ev.stop(); ev.close()

Each result is one metrics row at the training step of the weights evaluated (``actor/env_steps``,
``learner/updates``, ``time/elapsed_s`` when the evaluation was asked for): ``eval/return_mean``,
``eval/return_std``, ``eval/return_min``, ``eval/return_max``, ``eval/episodes``, ``eval/env_steps``
(env steps the evaluation itself took), ``eval/weights_version``, ``eval/seconds``.

Evaluations never queue up: one that falls due while the previous one still plays is asked for
when that one is done. **A crash of the eval process never stops the run**: it is logged (its
traceback's last line), the process is restarted and the lost evaluation asked for again, up to
``actor.max_restarts`` times; after that, or when it dies of the same error twice (a restart
cannot mend it), evaluation is switched off for the rest of the run and the run goes on.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable

from omegaconf import DictConfig

from gearflow.actors.process import stop_processes
from gearflow.config import eval_period, to_yaml
from gearflow.reports import queued

log = logging.getLogger("gearflow.runner")

__all__ = ["EvalProcess", "run_eval_process"]

SEED_OFFSET = 7_000_003  # evaluation envs' seeds: away from every actor's (env.seed + 100003·run.seed + i·E)


class EvalProcess:
    """The ``eval`` role: the evaluation process, asked for an evaluation when one is due
    (module docstring). A period in steps counts ``env_steps()`` (``updates()`` in
    ``run.mode=offline``, which takes none); one in seconds, wall time."""

    name = "eval"

    def __init__(self, cfg: DictConfig, params_name: str, *, env_steps: Callable[[], int], updates: Callable[[], int],
                 elapsed: Callable[[], float], emit: Callable[[dict], None]):  # fmt: skip
        self.unit, self.every = eval_period(cfg)
        self.cfg_yaml, self.params_name = to_yaml(cfg), params_name
        self.episodes = int(cfg.run.eval_episodes)
        self.seed = int(cfg.env.seed) + 100_003 * int(cfg.run.seed) + SEED_OFFSET
        self.max_restarts = int(cfg.actor.max_restarts)
        offline = cfg.run.mode == "offline"  # no env steps: count learner updates
        self._steps = updates if offline else env_steps
        self.env_steps, self.updates, self.elapsed, self.emit = env_steps, updates, elapsed, emit
        self.ctx = mp.get_context("spawn")
        self.stop_event = self.ctx.Event()
        self.results: mp.Queue = self.ctx.Queue()
        self.requests: mp.Queue | None = None  # a fresh one per process: a dead one's request is not replayed twice
        self.proc: mp.Process | None = None
        self.pending: dict | None = None  # the evaluation being played
        self.ready = False  # the process has its policy built: a request is played at once
        self.next_at = 0.0  # when the next one is due (steps or monotonic seconds)
        self.count = 0  # evaluations asked for
        self.restarts = 0
        self.errors: dict[str, str] = {}  # "eval" → the last traceback
        self._last_error = ""
        self.off = False  # switched off after failing for good

    # ------------------------------------------------------------------ lifecycle
    def _now(self) -> float:
        return time.monotonic() if self.unit == "seconds" else float(self._steps())

    def _spawn(self) -> None:
        self.ready = False
        self.requests = self.ctx.Queue()
        self.proc = self.ctx.Process(target=run_eval_process, name="eval", daemon=True,
                                     args=(self.cfg_yaml, self.params_name, self.requests, self.results,
                                           self.stop_event, os.getpid()))  # fmt: skip
        self.proc.start()
        log.info("eval: process %d plays %d greedy episodes every %g %s", self.proc.pid, self.episodes,
                 self.every, "s" if self.unit == "seconds" else "steps")  # fmt: skip

    def start(self) -> None:
        now = self._now()
        # a fresh run: the first at one period; a resumed one: at its next multiple
        self.next_at = now + self.every if self.unit == "seconds" else (math.floor(now / self.every) + 1) * self.every
        self._spawn()

    def check(self) -> int:
        """Restart a dead evaluation process (or switch evaluation off); ask for one when due.
        Never raises for the evaluation's own failure: the run goes on. Returns 0 (actor restarts
        only are counted)."""
        if self.off or self.stop_event.is_set() or self.proc is None:
            return 0
        if not self.proc.is_alive():
            self._died()
            if self.off:
                return 0
        if self.ready and self.pending is None and self._now() >= self.next_at:
            self._request()
        return 0

    def _request(self) -> None:
        now = self._now()
        self.count += 1
        self.pending = {"n": self.count, "seed": self.seed + 1009 * self.count, "actor/env_steps": int(self.env_steps()),
                        "learner/updates": int(self.updates()), "time/elapsed_s": float(self.elapsed())}  # fmt: skip
        self.next_at = now + self.every if self.unit == "seconds" else (math.floor(now / self.every) + 1) * self.every
        self.requests.put(self.pending)

    def _died(self) -> None:
        code = self.proc.exitcode
        self.proc.join()
        self._fold(self._reports())  # its error report is in the queue before it exits
        error = self.errors.get("eval", "")
        last = error.strip().splitlines()[-1] if error.strip() else f"exit code {code}"
        same = bool(error) and error == self._last_error
        self._last_error = error
        self.pending = None
        if same or self.restarts >= self.max_restarts:
            why = "the same error twice" if same else f"already restarted {self.restarts} times"
            log.error("eval: the evaluation process died (%s; %s): evaluation is off for the rest of this run, "
                      "which goes on (gearflow eval RUN_DIR evaluates its checkpoints)", last, why)  # fmt: skip
            self.off = True
            return
        self.restarts += 1
        log.error("eval: the evaluation process died (%s); restarting it (%d/%d), the run goes on", last,
                  self.restarts, self.max_restarts)  # fmt: skip
        self.next_at = self._now()  # the lost evaluation is asked for again
        self._spawn()

    def drain(self, progress=None) -> None:
        """Write a metrics row for every evaluation played."""
        self._fold(self._reports())

    def _reports(self) -> list:
        return queued(self.results)

    def _fold(self, reports: list) -> None:
        for msg in reports:
            if msg.get("type") == "error":
                self.errors["eval"] = msg["error"]
                continue
            if msg.get("type") == "ready":  # its policy is built: the weights are read when asked
                self.ready = self.proc is not None and msg["pid"] == self.proc.pid
                continue
            req = msg["request"]
            if self.pending is not None and self.pending["n"] == req["n"]:
                self.pending = None
            row = {k: req[k] for k in ("actor/env_steps", "learner/updates", "time/elapsed_s")}
            row.update(msg["summary"], **{"eval/env_steps": msg["steps"], "eval/weights_version": msg["version"],
                                          "eval/seconds": msg["seconds"]})  # fmt: skip
            from gearflow.run.evaluate import figures

            log.info("eval at %d env steps, %d updates (weights v%d): return %s ± %s over %d episodes (%.1f s)",
                     row["actor/env_steps"], row["learner/updates"], msg["version"],
                     *figures(row["eval/return_mean"], row["eval/return_std"]), row["eval/episodes"], msg["seconds"])  # fmt: skip
            self.emit(row)

    def stop(self, drain: Callable[[], None] = lambda: None, timeout: float = 10.0) -> None:
        """Stop the process (an evaluation in play is given up), reading what it sent meanwhile."""
        self.stop_event.set()
        stop_processes([self.proc], drain, timeout)

    def finish(self, reason: str) -> None:
        pass

    def close(self) -> None:
        for q in (self.requests, self.results):
            if q is not None:
                q.close()
                q.join_thread()


def run_eval_process(cfg_yaml: str, params_name: str, requests, results, stop_event, parent_pid: int) -> None:
    """Spawn target of the evaluation process: attach the parameter store by name; for each request,
    the latest weights into the policy, ``run.eval_episodes`` greedy episodes on fresh envs (seeded
    by the request), the returns back on ``results``. Ends when ``stop_event`` is set or the learner
    ``parent_pid`` is gone (even SIGKILLed); an error is sent as ``{"type": "error"}`` and exits 1."""
    from omegaconf import OmegaConf

    from gearflow.actors.process import StopWhen, actor_agent, enter_actor_process
    from gearflow.envs import make_vec_env, probe_env_spec
    from gearflow.params import ParameterStore
    from gearflow.run.evaluate import eval_envs, play, summarize

    cfg = OmegaConf.create(cfg_yaml)
    enter_actor_process(int(cfg.actor.get("nice", 0)))  # as the actors: the learner wins a contended core
    stopped = StopWhen(stop_event, parent_pid).is_set
    params = None
    try:
        params = ParameterStore.attach(params_name)
        eval_cfg, per_env = eval_envs(cfg, int(cfg.run.eval_episodes))
        agent = actor_agent(eval_cfg, probe_env_spec(cfg.env))
        network = agent.make_network()
        # the role asks only now, so the weights read below are those of the step it asked at
        results.put({"type": "ready", "pid": os.getpid()})
        while not stopped():
            try:
                req = requests.get(timeout=0.2)
            except queue.Empty:
                continue
            t0 = time.monotonic()
            version = params.load_into(network, min_version=0)  # the latest weights, as an actor reads them
            env = make_vec_env(eval_cfg.env, seed=int(req["seed"]))
            returns, steps = play(eval_cfg, agent, network, env, per_env, stop=stopped)  # closes env
            if not returns:  # told to stop mid-evaluation
                break
            returns = returns[: int(cfg.run.eval_episodes)]
            results.put({"type": "result", "request": req, "summary": summarize(returns), "steps": int(steps),
                         "version": int(version or 0), "seconds": time.monotonic() - t0})  # fmt: skip
    except Exception:
        results.put({"type": "error", "error": traceback.format_exc()})
        raise SystemExit(1) from None
    finally:
        if params is not None:
            params.close()
