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

