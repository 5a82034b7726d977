"""``gearflow plot RUN_DIR [RUN_DIR ...]``: learning curves from runs' ``metrics.jsonl``.

One PNG with three panels, every run overlaid (labelled by its directory name):
mean return over the last 100 episodes vs env steps, the same vs wall-clock
time, and throughput (env steps/s, learner updates/s) vs wall-clock time::

    plot_runs(["runs/cartpole_apex-20261129-120000"], out="curves.png")
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from gearflow.errors import GearflowError
from gearflow.run.metrics import read_metrics


def _series(rows: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for row in rows:
        a, b = row.get(x), row.get(y)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b):
            xs.append(float(a))
            ys.append(float(b))
    return xs, ys


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Write the PNG; returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GearflowError(f"gearflow plot needs matplotlib ({exc}); pip install matplotlib") from None
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    for path, rows in runs:
        if not rows:
            raise GearflowError(f"{path}: metrics.jsonl has no rows yet")
    out = Path(out) if out else runs[0][0] / "curves.png"

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for path, rows in runs:
        label = path.name
        line = axes[0].plot(*_series(rows, "actor/env_steps", "actor/return_last100"), label=label)[0]
        color = line.get_color()
        axes[0].plot(*_series(rows, "actor/env_steps", "actor/return_last100_greediest"),
                     color=color, linestyle=":", label=f"{label} (greediest actor)")  # fmt: skip
        axes[1].plot(*_series(rows, "time/elapsed_s", "actor/return_last100"), color=color, label=label)
        axes[2].plot(*_series(rows, "time/elapsed_s", "actor/env_steps_per_s"), color=color,
                     label=f"{label} env steps/s")  # fmt: skip
        axes[2].plot(*_series(rows, "time/elapsed_s", "learner/updates_per_s"), color=color, linestyle="--",
                  label=f"{label} updates/s")  # fmt: skip
    axes[0].set(xlabel="env steps", ylabel="return (mean of last 100 episodes)", title="return vs env steps")
    axes[1].set(xlabel="wall-clock seconds", ylabel="return (mean of last 100 episodes)", title="return vs time")
    axes[2].set(xlabel="wall-clock seconds", ylabel="per second", title="throughput", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
