"""A user's own environment behind ``env.factory``: a corridor the agent must walk to its end.

The env-factory contract (docs/custom_agent.md, "Your own environment"): gearflow calls
``make(num_envs=, seed=, **env.kwargs)`` and takes a gymnasium ``VectorEnv`` whose autoreset mode is
``AutoresetMode.NEXT_STEP`` (the step that ends an episode returns its final observation, the next
step returns the reset one). ``env.id`` is then only a label. Check it with
``gearflow check-env corridor.yaml`` before training.
"""

from __future__ import annotations

import gymnasium
import numpy as np


class Corridor(gymnasium.Env):
    """Cells 0..length-1, start in cell 0; action 1 steps right, 0 steps left (walls hold you).
    Reward 1 for reaching the last cell (terminated), -0.01 per step; truncated after ``max_steps``.
    Observation: the one-hot cell, float32[length]."""

    metadata = {"render_modes": []}

    def __init__(self, length: int = 8, max_steps: int = 50):
        self.length, self.max_steps = int(length), int(max_steps)
        self.observation_space = gymnasium.spaces.Box(0.0, 1.0, (self.length,), np.float32)
        self.action_space = gymnasium.spaces.Discrete(2)
        self.cell = self.steps = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.length, dtype=np.float32)  # the dtype the space declares, every step
        obs[self.cell] = 1.0
        return obs

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cell = self.steps = 0
        return self._obs(), {}

    def step(self, action):
        self.cell = int(np.clip(self.cell + (1 if int(action) == 1 else -1), 0, self.length - 1))
        self.steps += 1
        terminated = self.cell == self.length - 1
        reward = 1.0 if terminated else -0.01
        return self._obs(), reward, terminated, self.steps >= self.max_steps, {}


def make(num_envs: int, seed: int, length: int = 8, max_steps: int = 50) -> gymnasium.vector.VectorEnv:
    """``env.factory: corridor:make``; ``env.kwargs: {length: 8, max_steps: 50}``."""
    del seed  # gearflow seeds the envs through reset(seed=seed + i)
    fns = [lambda: Corridor(length, max_steps) for _ in range(num_envs)]
    return gymnasium.vector.SyncVectorEnv(fns, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
