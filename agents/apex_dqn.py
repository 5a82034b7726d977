"""Ape-X DQN: dueling double DQN with n-step targets and prioritized replay.

Horgan et al. 2018, "Distributed Prioritized Experience Replay", https://arxiv.org/abs/1803.00933
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class Config:
    network: str = "mlp"
    """Torso: ``mlp`` for vector observations, ``nature_cnn`` for stacked Atari frames."""
    hidden_sizes: List[int] = field(default_factory=lambda: [256, 256])
    """Widths of the MLP torso's hidden layers."""
    dueling: bool = True
    """Dueling value/advantage heads (Wang et al. 2016)."""
    double: bool = True
    """Double-Q targets: the online network picks the bootstrap action, the target network values it."""
    optimizer: str = "adam"
    """``adam`` or ``rmsprop`` (Ape-X used centred RMSProp)."""
    lr: float = 1e-4
    """Learning rate."""
    adam_eps: float = 1.5e-4
    """Adam / RMSProp epsilon."""
    target_update_period: int = 2500
    """Learner updates between copies of the online network into the target network."""
    max_grad_norm: float = 40.0
    """Global gradient-norm clip."""
