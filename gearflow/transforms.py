"""Observation transforms for ``env.obs_transform`` (``module:function(obs) -> obs`` on a batch).

    env:
      id: CartPole-v1
      obs_transform: gearflow.transforms:mask_velocity   # (b, 4) → (b, 2): a memory task
"""

from __future__ import annotations

import numpy as np

CARTPOLE_POSITIONS = [0, 2]  # cart position, pole angle (1, 3 are their velocities)


def mask_velocity(obs: np.ndarray) -> np.ndarray:
    """CartPole without velocities: keep cart position and pole angle, (b, 4) → (b, 2).

    The velocities must then be inferred from consecutive observations, so a
    memoryless policy cannot balance the pole for long."""
    return np.ascontiguousarray(obs[:, CARTPOLE_POSITIONS])


def flatten_frames(obs: np.ndarray) -> np.ndarray:
    """Stacked frames as one vector per env, (b, 4, 84, 84) uint8 → (b, 28224) uint8.

    For agents that embed vector observations (``agents.r2d2_transformer``): its first
    layer then sees the whole frame stack at once, one token per step. A stand-in for
    a convolutional or patch tokenizer, not one (``configs/paper/`` say so)."""
    return np.ascontiguousarray(obs.reshape(obs.shape[0], -1))
