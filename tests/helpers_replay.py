"""A small table spec whose every value identifies its (partition, step), for replay tests.

Importable from tests as ``helpers_replay`` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import numpy as np

from gearflow.replay import TableSpec

SPEC = TableSpec.parse(
    {"obs": "float32[3]", "frame": "uint8[2,4]", "action": "int64", "done": "bool"}
)


def step_values(p, t):
    """Columns of step ``t`` of partition ``p`` (arrays of equal length ``p`` and ``t``):
    every value identifies (p, t)."""
    p, t = np.broadcast_arrays(np.asarray(p, np.int64), np.asarray(t, np.int64))
    obs = np.stack([p, t, (p * 7919 + t * 31) % 65521], axis=-1).astype(np.float32)
    frame = ((p * 16 + t)[..., None] + np.arange(8)).astype(np.uint8).reshape(*p.shape, 2, 4)
    return {"obs": obs, "frame": frame, "action": t * 10 + p, "done": t % 5 == 0}
