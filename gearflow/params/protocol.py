"""The parameter-source interface actors read weights through.

A local run hands actors a :class:`~gearflow.params.ParameterStore` attached by
name; a network transport hands them anything with the same method::

    v = source.load_into(policy, min_version=actor.version)   # None: nothing newer
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

__all__ = ["ParameterSource"]


@runtime_checkable
class ParameterSource(Protocol):
    def load_into(self, module: torch.nn.Module, min_version: int = 0) -> Optional[int]:
        """Copy weights newer than ``min_version`` into ``module``; their version, or ``None``
        if there are none (never waits for the learner)."""
