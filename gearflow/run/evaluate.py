"""``gearflow eval RUN_DIR``: greedy evaluation of a run's latest checkpoint.

The run's own config and agent are rebuilt from ``RUN_DIR/config.yaml``, the
learner's weights come from the newest checkpoint that verifies, and the
run's own actor class plays with ε = 0 (so agents that act over a context,
like the transformer ones, are evaluated exactly as they act in training).
Each of ``min(episodes, 32)`` environments plays its first episodes only, so
short episodes are not over-represented::

    result = evaluate("runs/cartpole_apex-20261129-120000", episodes=20)
    result["eval/return_mean"], result["eval/return_std"]

``video="out.mp4"`` also records one episode through gymnasium's renderer
(``render_mode="rgb_array"``) — for env ids gymnasium knows — written with
imageio (``pip install 'gearflow[video]'``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from gearflow.agent import make_agent
from gearflow.run.checkpoint import RunCheckpoints
from gearflow.config import load_config
from gearflow.envs import make_vec_env
from gearflow.errors import GearflowError

log = logging.getLogger("gearflow.evaluate")

MAX_PARALLEL = 32
MAX_STEPS_FACTOR = 100_000  # safety net: give up after this many env steps per wanted episode


def _policy(cfg, checkpoint, env_spec):
    agent = make_agent(cfg, env_spec, "cpu")
    agent.setup_learner()
    agent.load_state_dict(checkpoint.learner["agent"])
    network = agent.make_network()
    network.load_state_dict(agent.learner_network().state_dict())
    network.eval()
    return agent, network


def _play(cfg, agent, network, env, episodes_per_env: int, on_step=None) -> list[float]:
    """Returns of the first ``episodes_per_env`` episodes of every env of ``env``, greedily."""
    return play(cfg, agent, network, env, episodes_per_env, on_step)[0]


def play(cfg, agent, network, env, episodes_per_env: int, on_step=None, stop=None) -> tuple[list[float], int]:
    """Greedy returns of the first ``episodes_per_env`` episodes of every env of ``env`` (closed
    after) played by the run's own actor class with ``network``, and the env steps it took;
    ``stop()`` true: give up (an empty list). ``gearflow eval`` and the evaluation during training
    (:mod:`gearflow.roles.evaluator`) both play through it."""
    from gearflow.actors.process import build_actor

    E = env.num_envs
    returns: dict[int, list[float]] = {e: [] for e in range(E)}

    def on_episode(env_index: int, ret: float, length: int, epsilon: float) -> None:
        if len(returns[env_index]) < episodes_per_env:
            returns[env_index].append(float(ret))

    # greedy (ε = 0), and no writer: evaluation writes no replay
    with build_actor(cfg, 0, env=env, agent=agent, epsilon=0.0, network=network, on_episode=on_episode) as actor:
        steps, limit = 0, MAX_STEPS_FACTOR * E * episodes_per_env
        while any(len(r) < episodes_per_env for r in returns.values()):
            if stop is not None and stop():
                return [], steps
            steps += actor.step()
            if on_step is not None:
                on_step()
            if steps > limit:
                raise GearflowError(f"evaluation did not finish {episodes_per_env} episode(s) per env in {steps} steps")
    return [r for e in range(E) for r in returns[e]], steps


def eval_envs(cfg, episodes: int) -> tuple[Any, int]:
    """The config of an evaluation's env (``min(episodes, 32)`` envs, one actor) and the episodes
    each env plays."""
    parallel = min(episodes, MAX_PARALLEL)
    envs = {"env": {"num_envs": parallel, "batch_size": parallel}, "actor": {"num_actors": 1}}
    return OmegaConf.merge(cfg, envs), -(-episodes // parallel)


def summarize(returns: list[float]) -> dict[str, float]:
    """``eval/episodes``, ``eval/return_mean``/``_std``/``_min``/``_max`` of greedy ``returns``."""
    return {
        "eval/episodes": len(returns),
        "eval/return_mean": float(np.mean(returns)),
        "eval/return_std": float(np.std(returns)),
        "eval/return_min": float(np.min(returns)),
        "eval/return_max": float(np.max(returns)),
    }


def evaluate(run_dir: str | Path, episodes: int = 10, video: str | Path | None = None, seed: int = 12345,
             checkpoint: str | Path | None = None) -> dict[str, Any]:
    """Greedy returns of ``run_dir``'s newest valid checkpoint (or the ``checkpoint`` directory given)."""
    run_dir = Path(run_dir)
    if episodes < 1:
        raise GearflowError(f"--episodes {episodes}: must be ≥ 1")
    if not (run_dir / "config.yaml").is_file():
        raise GearflowError(f"{run_dir}: no config.yaml (not a gearflow run directory)")
    cfg = load_config(run_dir / "config.yaml")
    if checkpoint is not None:  # eval never reads the replay: not verified
        checkpoint = RunCheckpoints.load(checkpoint, replay=False)
    else:
        checkpoint = RunCheckpoints(run_dir / "checkpoints").latest(replay=False)
    eval_cfg, per_env = eval_envs(cfg, episodes)
    env = make_vec_env(eval_cfg.env, seed=seed)
    try:
        agent, network = _policy(cfg, checkpoint, env.env_spec)
    except BaseException:
        env.close()
        raise
    returns = _play(eval_cfg, agent, network, env, per_env)[:episodes]
    result = {"checkpoint": str(checkpoint.path), **summarize(returns)}
    if video is not None:
        result["video"] = str(record_video(cfg, agent, network, Path(video), seed))
    log.info("eval of %s: %d episodes, return %s ± %s", checkpoint.path, len(returns),
             *figures(result["eval/return_mean"], result["eval/return_std"]))  # fmt: skip
    return result


def figures(mean: float, std: float) -> tuple[str, str]:
    """``mean`` and ``std`` to the same decimals, at least three significant digits of the mean
    (one decimal from 100 on): ``(0.96, 0.049)`` → ``("0.960", "0.049")``, not ``"1.0 ± 0.0"``."""
    scale = max(abs(mean), abs(std))
    decimals = 1 if scale >= 100 or scale == 0 or not np.isfinite(scale) else min(6, 2 - int(np.floor(np.log10(scale))))
    return f"{mean:.{max(decimals, 1)}f}", f"{std:.{max(decimals, 1)}f}"


def record_video(cfg, agent, network, out: Path, seed: int) -> Path:
    """One greedy episode rendered by gymnasium, written to ``out`` (mp4, gif...)."""
    try:
        import imageio.v2 as imageio
    except ImportError:
        raise GearflowError("--video needs imageio and imageio-ffmpeg: pip install 'gearflow[video]'") from None
    env_cfg = OmegaConf.merge(
        cfg.env, {"backend": "gymnasium", "num_envs": 1, "batch_size": 1, "kwargs": {"render_mode": "rgb_array"}}
    )
    try:
        env = make_vec_env(env_cfg, seed=seed)
    except GearflowError as exc:
        raise GearflowError(f"--video renders through gymnasium, which cannot make {cfg.env.id!r}: {exc}") from None
    frames: list[np.ndarray] = []

    def grab() -> None:
        frame = env.render()
        if frame is not None:
            frames.append(np.asarray(frame))

    eval_cfg = OmegaConf.merge(cfg, {"env": {"num_envs": 1, "batch_size": 1}, "actor": {"num_actors": 1}})
    _play(eval_cfg, agent, network, env, 1, on_step=grab)
    if not frames:
        raise GearflowError(f"env {cfg.env.id!r} rendered no frames")
    out.parent.mkdir(parents=True, exist_ok=True)
    fps = int(getattr(env, "render_fps", 0) or 30)
    imageio.mimsave(out, frames, fps=fps)
    return out
