"""Observation transforms for ``env.obs_transform`` (``module:function(obs) -> obs`` on a batch).

    env:
      id: CartPole-v1
      obs_transform: gearflow.transforms:mask_velocity   # (b, 4) → (b, 2): a memory task

    env:
      id: WalkerWalk-v1                                    # DeepMind Control: a dict of float64 arrays
      obs_transform: gearflow.transforms:flatten_float32   # → one float32 (b, 24) array
"""

from __future__ import annotations

import numpy as np

CARTPOLE_POSITIONS = [0, 2]  # cart position, pole angle (1, 3 are their velocities)


def mask_velocity(obs: np.ndarray) -> np.ndarray:
    """CartPole without velocities: keep cart position and pole angle, (b, 4) → (b, 2).

    The velocities must then be inferred from consecutive observations, so a
    memoryless policy cannot balance the pole for long."""
    return np.ascontiguousarray(obs[:, CARTPOLE_POSITIONS])



def flatten_float32(obs) -> np.ndarray:
    """One float32 array (b, D) of an observation batch: a dict of arrays (DeepMind Control's
    ``{"position": (b, 3), "velocity": (b, 2)}``; keys in sorted order, each flattened to (b, -1)
    and concatenated) or an array (MuJoCo's float64 (b, 17)), cast to float32.

    >>> flatten_float32({"velocity": np.ones((2, 2)), "position": np.zeros((2, 3))}).shape   # (2, 5)
    """
    if isinstance(obs, dict):
        parts = [np.asarray(obs[k]) for k in sorted(obs)]
        b = parts[0].shape[0]
        return np.concatenate([p.reshape(b, -1).astype(np.float32, copy=False) for p in parts], axis=1)
    obs = np.asarray(obs)
    return np.ascontiguousarray(obs.reshape(obs.shape[0], -1), dtype=np.float32)
