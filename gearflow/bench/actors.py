"""``gearflow bench actors``: actor throughput against a bare EnvPool loop, and learner waiting.

Workloads (``--config`` picks the env and sizes; default ``configs/cartpole_apex.yaml``):

* ``random`` — one :class:`~gearflow.kinds.transition.Actor` with a random policy (no
  network) writing n-step transitions into a real shared-memory table, against
  a bare EnvPool loop with random actions and the same ``num_envs`` /
  ``batch_size``, stepped in alternating slices of the same run (median rate of 5
  slices each, as every actor workload here). ``ratio`` = actor / bare.
* ``policy`` — the same actor with the config's agent (apex_dqn's MLP) acting
  ε-greedily over the Ape-X ladder.
* ``learner`` — a short real run of the config (actor processes + learner):
  the learner's fraction of time spent waiting for a batch.
* ``transformer`` — the R2D2 transformer actor of ``configs/cartpole_masked_r2d2.yaml``
  writing sequence windows, at contexts 10, 40 (the config's) and 80: re-running the
  whole context every step (``agent.kv_cache=false``, the floor) against the
  key/value-cached actor, stepped in alternating slices of the same run (median
  rate of 5 slices each); ``ratio`` = cached / full recompute. Each
  context also reports the policy's own time per recv (``act_us_per_recv``) and the
  mean length of the episodes that ended (a context longer than the episodes never
  hops; with none ended, the steps per env: a lower bound).
* ``transformer_long`` — the same on ``Acrobot-v1`` (500-step episodes), where every
  context fills and hops.
* ``dt`` — the Decision Transformer actor of ``configs/cartpole_dt.yaml`` at contexts
  10 (the config's) and 40, full recompute against cached.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import numpy as np
from omegaconf import OmegaConf

from gearflow.actors.process import make_actor
from gearflow.agent import ActOutput, make_agent
from gearflow.bench import record
from gearflow.config import load_config
from gearflow.envs import make_vec_env
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import SharedStorage

Emit = Callable[[dict], None]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIGS / "cartpole_apex.yaml"
WORKLOADS = ("random", "policy", "learner", "transformer", "transformer_long", "dt")
# transformer workloads: (config, overrides, contexts, metric label)
TRANSFORMER_WORKLOADS = {
    "transformer": ("cartpole_masked_r2d2.yaml", [], (10, 40, 80), "CartPole-v1 masked"),
    "transformer_long": ("cartpole_masked_r2d2.yaml", ["env.id=Acrobot-v1", "env.obs_transform=null"], (10, 40, 80),
                         "Acrobot-v1"),
    "dt": ("cartpole_dt.yaml", [], (10, 40), "CartPole-v1"),
}  # fmt: skip


def _record(workload: str, metric: str, value: float, unit: str, floor: float | None = None) -> dict:
    return record("actors", workload, metric, value, unit, floor)


class RandomPolicy:
    """Wraps an agent so that acting is uniform random (no forward pass)."""

    def __init__(self, agent, num_actions: int):
        self._agent, self._num_actions = agent, num_actions

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def act(self, network, obs, epsilon, rng=None) -> ActOutput:
        rng = rng or np.random.default_rng()
        k = len(obs)
        return ActOutput(
            actions=rng.integers(0, self._num_actions, k, dtype=np.int64),
            values=np.zeros((k, self._num_actions), dtype=np.float32),
        )


@contextlib.contextmanager
def scratch_actor(cfg, agent, env, steps_per_partition: int, **kwargs):
    """The agent's actor over ``env``, writing into a private segment of ``steps_per_partition``
    steps per env (at least its adder's ``min_steps``) that nobody samples. On exit the actor
    (or, if it could not be made, ``env``) is closed and the segment unlinked."""
    from gearflow.kinds.registry import kind_def

    E, kind = int(env.num_envs), agent.item_kind()
    steps = max(int(steps_per_partition), kind_def(kind.name).adder.min_steps(cfg.actor, kind))
    storage = SharedStorage.create(TableSpec.parse(agent.replay_columns()), E, steps)
    actor = None
    try:
        actor = make_actor(cfg, 0, agent, env, storage, np.arange(E), None, **kwargs)
        yield actor
    finally:
        if actor is not None:
            actor.close()
        else:
            env.close()
        storage.close()
        storage.unlink()


@contextlib.contextmanager
def _bare_stepper(cfg):
    """One recv/send of the plainest async EnvPool loop with random actions (returns the env
    steps it made): the floor of the actor workloads."""
    env = make_vec_env(cfg.env, seed=0)
    rng = np.random.default_rng(0)
    try:
        env.async_reset()
        n = env.num_actions

        def step() -> int:
            *_, ids = env.recv()
            env.send(rng.integers(0, n, len(ids), dtype=np.int64), ids)
            return len(ids)

        yield step
    finally:
        env.close()


@contextlib.contextmanager
def _actor_stepper(cfg, random_policy: bool):
    """``actor.step`` of the config's actor (a random policy, or the config's agent) writing a
    scratch table, warmed up (first episodes, first items)."""
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, "cpu")
    if random_policy:
        agent = RandomPolicy(agent, env.num_actions)
    with scratch_actor(cfg, agent, env, max(4096, cfg.replay.capacity // env.num_envs)) as actor:
        for _ in range(20):
            actor.step()
        yield actor.step


def _alternating(steppers: dict, seconds: float, rounds: int = 5) -> tuple[dict, dict]:
    """Steps each stepper (a callable returning the env steps it made) in ``rounds`` alternating
    slices of ``seconds / rounds`` (the order rotating each round), so a load change on a shared
    machine hits every one alike: ``({name: median steps/s over its slices}, {name: steps})``."""
    names = list(steppers)
    rates: dict = {n: [] for n in names}
    total = dict.fromkeys(names, 0)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            step, steps, start = steppers[name], 0, time.perf_counter()
            while time.perf_counter() - start < seconds / rounds:
                steps += step()
            rates[name].append(steps / (time.perf_counter() - start))
            total[name] += steps
    return {n: float(np.median(r)) for n, r in rates.items()}, total


class TimedPolicy:
    """Wraps an agent and adds up the seconds spent in ``act`` / ``act_cached``."""

    def __init__(self, agent):
        self._agent, self.seconds, self.calls = agent, 0.0, 0

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def act(self, *args, **kwargs):
        return self._timed(self._agent.act, *args, **kwargs)

    def act_cached(self, *args, **kwargs):
        return self._timed(self._agent.act_cached, *args, **kwargs)


def actor_rate(cfg, seconds: float, random_policy: bool) -> float:
    """Env steps/s of the config's actor alone (``bench cluster``'s actor figure)."""
    with _actor_stepper(cfg, random_policy) as step:
        return _alternating({"actor": step}, seconds, rounds=1)[0]["actor"]


def _transformer(workload: str, seconds: float, seed: int, emit: Emit, rounds: int = 5) -> None:
    """Full recompute (``agent.kv_cache=false``, the floor) vs the cached actor at each context.

    Both actors are built first, then stepped in alternating slices (``rounds`` each of
    ``seconds / rounds``), so a load change on a shared machine hits both; each rate is the
    median over its slices."""
    name, overrides, contexts, label = TRANSFORMER_WORKLOADS[workload]
    for C in contexts:
        with contextlib.ExitStack() as stack:
            actors, agents, lengths = {}, {}, {}
            for kv in (False, True):
                cfg = load_config(CONFIGS / name, [*overrides, f"agent.context={C}",
                                                   f"agent.kv_cache={str(kv).lower()}", f"run.seed={seed}"])  # fmt: skip
                env = make_vec_env(cfg.env, seed=0)
                agents[kv] = TimedPolicy(make_agent(cfg, env.env_spec, "cpu"))
                lengths[kv] = []
                actors[kv] = stack.enter_context(scratch_actor(
                    cfg, agents[kv], env, max(4096, cfg.replay.capacity // env.num_envs),
                    on_episode=lambda env_index, ret, length, eps, out=lengths[kv]: out.append(length)))  # fmt: skip
                for _ in range(20):
                    actors[kv].step()  # warm up: first episodes, first items
                agents[kv].seconds, agents[kv].calls = 0.0, 0
            rate, steps_total = _alternating({kv: actors[kv].step for kv in (False, True)}, seconds, rounds)
        act_us = {kv: 1e6 * a.seconds / max(1, a.calls) for kv, a in agents.items()}
        ended = lengths[False] + lengths[True]
        # of the episodes that ended; without one, the steps per env (a lower bound: none ended)
        length = float(np.mean(ended)) if ended else steps_total[True] / cfg.env.num_envs
        shape = f"{label},num_envs={cfg.env.num_envs},batch_size={cfg.env.batch_size},context={C}"
        emit(_record(workload, f"env_steps_per_s[{shape},kv_cache=false]", rate[False], "steps/s"))
        emit(_record(workload, f"env_steps_per_s[{shape},kv_cache=true]", rate[True], "steps/s", rate[False]))
        for kv in (False, True):
            emit(_record(workload, f"act_us_per_recv[{shape},kv_cache={str(kv).lower()}]", act_us[kv], "us"))
        emit(_record(workload, f"episode_length_mean[{shape}]", length, "steps"))


def run(args, wanted: list[str], emit: Emit) -> int:
    import torch

    from gearflow.runner import train

    torch.set_num_threads(1)
    cfg = load_config(args.config or DEFAULT_CONFIG, [f"run.seed={args.seed}"])
    seconds = max(1.0, 5.0 * args.scale)
    todo = wanted or list(WORKLOADS)
    unknown = set(todo) - set(WORKLOADS)
    if unknown:
        from gearflow.errors import GearflowError

        raise GearflowError(f"unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    shape = f"num_envs={cfg.env.num_envs},batch_size={cfg.env.batch_size or max(1, cfg.env.num_envs // 2)}"
    acting = [w for w in ("random", "policy") if w in todo]
    if acting:  # each actor and the bare loop in alternating slices of one run
        with contextlib.ExitStack() as stack:
            steppers = {"bare": stack.enter_context(_bare_stepper(cfg))}
            for w in acting:
                steppers[w] = stack.enter_context(_actor_stepper(cfg, random_policy=w == "random"))
            rate, _ = _alternating(steppers, seconds * len(steppers))
        for w in acting:
            emit(_record(w, f"env_steps_per_s[{cfg.env.id},{shape}]", rate[w], "steps/s", rate["bare"]))
    if "learner" in todo:
        run_cfg = OmegaConf.merge(
            cfg,
            {"run": {"max_seconds": max(10.0, 30.0 * args.scale), "max_env_steps": 0,
                     "dir": str(Path(args.run_dir) if args.run_dir else Path("runs") / time.strftime("bench-actors-%Y%m%d-%H%M%S")),
                     "log_every_s": 1e9}},
        )  # fmt: skip
        summary = train(run_cfg)
        emit(_record("learner", "batch_wait_fraction", summary["learner/wait_fraction"], "fraction"))
        emit(_record("learner", "updates_per_s", summary["learner/updates"] / summary["time/elapsed_s"], "updates/s"))
        emit(_record("learner", "env_steps_per_s", summary["actor/env_steps"] / summary["time/elapsed_s"], "steps/s"))
    for workload in TRANSFORMER_WORKLOADS:
        if workload in todo:
            _transformer(workload, seconds, args.seed, emit)
    return 0
