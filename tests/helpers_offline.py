"""Small D4RL-style HDF5 datasets for the offline tests, made by playing real environments.

:func:`make_cartpole_dataset` plays gymnasium's CartPole-v1 with a scripted
policy (push towards where the pole is falling, ``3θ + θ̇ > 0``) that takes a
random action with probability ``noise``, so returns range from tens to 500.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def scripted_cartpole_action(obs: np.ndarray) -> int:
    return int(3.0 * obs[2] + obs[3] > 0)


def play_cartpole(episodes: int, seed: int = 0, noise: float = 0.2, max_steps: int = 500) -> dict[str, np.ndarray]:
    """Flat D4RL arrays of ``episodes`` CartPole-v1 episodes (``next_observations`` included)."""
    import gymnasium

    env = gymnasium.make("CartPole-v1", max_episode_steps=max_steps)
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")}
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed * 1000 + ep)
        done = False
        eps = noise * (ep % 4) / 3  # a mix of good and poor episodes
        while not done:
            a = int(rng.integers(2)) if rng.random() < eps else scripted_cartpole_action(obs)
            nxt, r, term, trunc, _ = env.step(a)
            for k, v in zip(cols, (obs, a, r, term, trunc, nxt)):
                cols[k].append(v)
            obs, done = nxt, term or trunc
    env.close()
    return {
        "observations": np.asarray(cols["observations"], np.float32),
        "actions": np.asarray(cols["actions"], np.int64),
        "rewards": np.asarray(cols["rewards"], np.float32),
        "terminals": np.asarray(cols["terminals"], bool),
        "timeouts": np.asarray(cols["timeouts"], bool),
        "next_observations": np.asarray(cols["next_observations"], np.float32),
    }


def write_hdf5(path: str | Path, data: dict[str, np.ndarray]) -> Path:
    import h5py

    path = Path(path)
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=v)
    return path


def make_cartpole_dataset(path: str | Path, episodes: int = 40, seed: int = 0, noise: float = 0.6) -> Path:
    return write_hdf5(path, play_cartpole(episodes, seed, noise))
