"""``gearflow bench actors``: actor throughput against a bare EnvPool loop, and learner waiting.

Workloads (``--config`` picks the env and sizes; default ``configs/cartpole_apex.yaml``):

* ``random`` — one :class:`~gearflow.actors.Actor` with a random policy (no
  network) writing n-step transitions into a real shared-memory table, against
  a bare EnvPool loop with random actions and the same ``num_envs`` /
  ``batch_size``, timed in the same run. ``ratio`` = actor / bare.
* ``policy`` — the same actor with the config's agent (apex_dqn's MLP) acting
  ε-greedily over the Ape-X ladder.
* ``learner`` — a short real run of the config (actor processes + learner):
  the learner's fraction of time spent waiting for a batch.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import numpy as np
from omegaconf import OmegaConf

from gearflow.actors.process import make_actor
from gearflow.bench import record
from gearflow.agent import ActOutput, make_agent
from gearflow.config import load_config
from gearflow.envs import make_vec_env
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import SharedStorage

Emit = Callable[[dict], None]
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cartpole_apex.yaml"


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
    from gearflow.actors.adders import adder_class_for

    E, kind = int(env.num_envs), agent.item_kind()
    steps = max(int(steps_per_partition), adder_class_for(kind).min_steps(cfg, kind))
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


def _bare_loop(cfg, seconds: float) -> float:
    """Env steps/s of the plainest async EnvPool loop with random actions."""
    env = make_vec_env(cfg.env, seed=0)
    rng = np.random.default_rng(0)
    try:
        env.async_reset()
        n = env.num_actions
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            obs, _, _, _, ids = env.recv()
            env.send(rng.integers(0, n, len(ids), dtype=np.int64), ids)
            steps += len(ids)
        return steps / (time.perf_counter() - start)
    finally:
        env.close()


def _actor_rate(cfg, seconds: float, random_policy: bool) -> float:
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, "cpu")
    if random_policy:
        agent = RandomPolicy(agent, env.num_actions)
    E = env.num_envs
    with scratch_actor(cfg, agent, env, max(4096, cfg.replay.capacity // E)) as actor:
        for _ in range(20):
            actor.step()  # warm up: first episodes, first items
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            steps += actor.step()
        return steps / (time.perf_counter() - start)


def run(args, wanted: list[str], emit: Emit) -> int:
    import torch

    from gearflow.runner import train

    torch.set_num_threads(1)
    cfg = load_config(args.config or DEFAULT_CONFIG, [f"run.seed={args.seed}"])
    seconds = max(1.0, 5.0 * args.scale)
    todo = wanted or ["random", "policy", "learner"]
    unknown = set(todo) - {"random", "policy", "learner"}
    if unknown:
        from gearflow.errors import GearflowError

        raise GearflowError(f"unknown workload(s) {sorted(unknown)}; choose from random, policy, learner")
    shape = f"num_envs={cfg.env.num_envs},batch_size={cfg.env.batch_size or max(1, cfg.env.num_envs // 2)}"
    if "random" in todo or "policy" in todo:
        bare = _bare_loop(cfg, seconds)
    if "random" in todo:
        emit(_record("random", f"env_steps_per_s[{cfg.env.id},{shape}]", _actor_rate(cfg, seconds, True), "steps/s", bare))
    if "policy" in todo:
        emit(_record("policy", f"env_steps_per_s[{cfg.env.id},{shape}]", _actor_rate(cfg, seconds, False), "steps/s", bare))
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
    return 0
