"""``gearflow check-env CONFIG``: a user's env and agent put through the actors' contract before a run.

Builds the env (``env.factory`` or ``env.id``) and steps it with random actions through the same
checks actors apply (:mod:`gearflow.actors.contract`: observation shape and dtype, reward and flag
shapes, NaN); builds the agent, its replay columns and item kind; runs a few recvs through the
run's own actor class into a small replay table (every ``act()`` answer checked: actions' shape,
dtype and range, values' shape); then samples one batch and makes one learn step (metrics and
priorities checked). One line per check; every problem is one line starting ``FAIL``::

    problems = check_env(cfg, steps=200)     # prints the report, returns the problem lines
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional

import numpy as np
from omegaconf import OmegaConf

from gearflow.errors import GearflowError

__all__ = ["check_env", "random_actions"]


def random_actions(space, b: int, rng: np.random.Generator) -> np.ndarray:
    """``b`` actions of ``space``: uniform over a Discrete or a bounded Box, else ``space.sample()``."""
    name = type(space).__name__
    if name == "Discrete":
        return (int(getattr(space, "start", 0)) + rng.integers(int(space.n), size=b)).astype(np.int64)
    if name == "Box" and np.isfinite(space.low).all() and np.isfinite(space.high).all():
        return rng.uniform(space.low, space.high, size=(b, *space.shape)).astype(space.dtype)
    return np.asarray([space.sample() for _ in range(b)])


def _first_line(exc: BaseException) -> str:
    """The exception's first line; gearflow's own errors without their type (their text says it all)."""
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    return text[0] if isinstance(exc, GearflowError) else f"{type(exc).__name__}: {text[0]}"


class _Report:
    def __init__(self, out: Callable[[str], None]):
        self.out, self.problems = out, []

    def ok(self, what: str) -> None:
        self.out(f"ok    {what}")

    def note(self, what: str) -> None:
        self.out(f"note  {what}")

    def fail(self, what: str) -> None:
        if what in self.problems:  # the env's fault again, seen through the actor: said once
            return
        self.problems.append(what)
        self.out(f"FAIL  {what}")


def _failure(exc: BaseException, cfg) -> str:
    """One line: the message, and where it was raised when that is the agent's or env's code."""
    from gearflow.actors.contract import describe_failure

    if isinstance(exc, GearflowError):
        return _first_line(exc)
    d = describe_failure(exc, cfg)
    return f"{_first_line(exc)} (at {d['culprit'] + ', ' if d['culprit'] else ''}{d['where']})"


def _check_env_alone(cfg, report: _Report, steps: int):
    """The env with random actions through the actors' recv checks; returns its spec, or None."""
    from gearflow.actors.contract import CheckedEnv, env_label
    from gearflow.envs import make_vec_env

    label = env_label(cfg.env)
    try:
        env = make_vec_env(cfg.env, seed=int(cfg.env.seed))
    except Exception as exc:
        report.fail(f"{label}: cannot be made: {_failure(exc, cfg)}")
        return None
    spec = env.env_spec
    checked = CheckedEnv(env, cfg.env)
    try:
        report.ok(f"{label}: {env.backend}, {env.num_envs} envs (batch {env.batch_size}), observations "
                  f"{np.dtype(spec.obs_dtype)}{list(spec.obs_shape)}, actions {spec.action_space}")
        if cfg.env.factory:
            report.note(f"env.id={cfg.env.id!r} is only a label with env.factory (the factory makes the env; "
                        "it is called with num_envs=, seed= and **env.kwargs)")
        if spec.num_actions is None and type(spec.action_space).__name__ != "Box":
            report.note(f"action space {spec.action_space}: the actors' checks know Discrete and Box only")
        rng = np.random.default_rng(0)
        checked.async_reset()
        done = 0
        for _ in range(steps):
            _, _, term, trunc, ids = checked.recv()
            done += int(np.count_nonzero(np.asarray(term) | np.asarray(trunc)))
            checked.send(random_actions(spec.action_space, len(ids), rng), ids)
        report.ok(f"{label}: {steps} recvs with random actions ({done} episode ends): observations, rewards, "
                  "flags and env ids fit the spec")
    except Exception as exc:
        report.fail(_failure(exc, cfg))
    finally:
        env.close()
    return spec


def _small_run_config(cfg):
    """``cfg`` for one serial actor over a small table that never waits on the rate limiter."""
    B = min(int(cfg.learner.batch_size), 16)
    return OmegaConf.merge(cfg, {
        "run": {"serial": True}, "actor": {"num_actors": 1, "remote_actors": 0},
        "replay": {"min_size_to_sample": B, "samples_per_insert": 0, "timeout_s": 5.0, "device": "cpu"},
        "learner": {"batch_size": B, "prefetch": 1},
    }), B  # fmt: skip


def _check_agent(cfg, spec, report: _Report, steps: int) -> None:
    """The agent: its columns and item kind, ``steps`` recvs through the run's actor, one learn step."""
    from gearflow.actors.contract import agent_label
    from gearflow.actors.process import make_actor
    from gearflow.agent import make_agent
    from gearflow.envs import make_vec_env
    from gearflow.geometry import replay_geometry
    from gearflow.replay.spec import replay_spec
    from gearflow.run.tables import make_table

    small, B = _small_run_config(cfg)
    try:
        agent = make_agent(small, spec, "cpu")
    except Exception as exc:
        report.fail(f"agent module '{cfg.agent.name}': cannot be made: {_failure(exc, cfg)}")
        return
    label = agent_label(agent)
    try:
        kind = agent.item_kind()
        table_spec = replay_spec(agent.replay_columns(), small.replay.frame_stack)
    except Exception as exc:
        report.fail(f"{label}: replay_columns()/item_kind(): {_failure(exc, cfg)}")
        return
    if kind.name != cfg.replay.item:
        report.fail(f"{label}: item_kind() is {kind.name!r}, the config's replay.item is {cfg.replay.item!r}")
        return
    report.ok(f"{label}: {kind.name} items, replay columns {', '.join(f'{c.name} {c.describe()}' for c in table_spec.columns)}")
    from gearflow.kinds.registry import kind_def

    try:  # a small ring per env: twice what the actor's adder needs, at least 512 steps
        small.replay.capacity = int(small.env.num_envs) * max(512, 2 * kind_def(kind.name).adder.min_steps(small.actor, kind))
    except (KeyError, ValueError, TypeError) as exc:
        report.fail(f"{label}: no actor writes its item kind {kind!r}: {_first_line(exc)}")
        return
    geom = replay_geometry(small, kind)
    table = make_table(small.replay, kind, table_spec, geom, "cpu", 0,  # tag 0: no run owns it
                       seed=int(cfg.run.seed), prefetch=1)
    env = actor = None
    try:
        env = make_vec_env(small.env, seed=int(cfg.env.seed))
        try:
            actor = make_actor(small, 0, agent, env, table.storage, geom.partitions_of(0), None)
        except Exception as exc:
            report.fail(f"{label}: its actor cannot be built: {_failure(exc, cfg)}")
            return
        try:
            for _ in range(steps):
                actor.step()
            extra = 0
            while table.scan() >= 0 and not table.can_sample(B) and extra < 20 * steps:  # windows/episodes
                actor.step()  # take longer than transitions to become items
                extra += 1
        except Exception as exc:
            report.fail(_failure(exc, cfg))
            return
        report.ok(f"{label}: {actor.env_steps} env steps through {type(actor).__name__}: act() answers fit the "
                  f"action space {spec.action_space} ({table.size} items written)")
        if not table.can_sample(B):
            report.fail(f"{label}: no batch of {B} items after {actor.env_steps} env steps (episodes too long "
                        "for the check's table?)")
            return
        _check_learn(agent, table.sample(B), B, label, cfg, report)
    finally:
        if actor is not None:
            actor.close()
        elif env is not None:
            env.close()
        table.close()


def _check_learn(agent, batch, B: int, label: str, cfg, report: _Report) -> None:
    try:
        agent.setup_learner()
        metrics, priorities = agent.learn(batch)
    except Exception as exc:
        report.fail(f"{label}: learn() on a batch of {B}: {_failure(exc, cfg)}")
        return
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        report.fail(f"{label}: learn() returned metrics of type {type(metrics).__name__}; expected a dict "
                    "{'learner/...': number}")
        return
    bad = [k for k, v in metrics.items() if not isinstance(_number(v), numbers.Real)]
    if bad:
        report.fail(f"{label}: learn() metric {bad[0]!r} is {type(metrics[bad[0]]).__name__}, not a number")
    p = priorities.detach().cpu().numpy() if hasattr(priorities, "detach") else np.asarray(priorities)
    if p.shape != (B,):
        report.fail(f"{label}: learn() returned priorities of shape {p.shape}, expected ({B},): one per sampled item")
    elif not (np.isfinite(p).all() and (p >= 0).all()):
        report.fail(f"{label}: learn() returned priorities that are negative, NaN or inf ({p[:4].tolist()} ...)")
    else:
        report.ok(f"{label}: one learn step on a batch of {B}: {len(metrics)} metrics, priorities ({B},) ≥ 0")


def _number(v):
    if hasattr(v, "item") and getattr(v, "numel", lambda: getattr(v, "size", 1))() == 1:
        return v.item()
    return v


def check_env(cfg, steps: int = 200, out: Optional[Callable[[str], None]] = None) -> list[str]:
    """Print the report (``out``, default ``print``); return the problems (empty: all good)."""
    report = _Report(out or print)
    if steps < 1:
        raise ValueError(f"--steps {steps}: must be ≥ 1")
    spec = _check_env_alone(cfg, report, steps)
    if spec is not None:
        _check_agent(cfg, spec, report, steps)
    report.out(f"{len(report.problems)} problem(s)" if report.problems else "no problems found")
    return report.problems
