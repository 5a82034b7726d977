"""``gearflow plot RUN_DIR [RUN_DIR ...]``: learning curves from runs' ``metrics.jsonl``.

One PNG with two panels. Left: a metric (``--metric``, any logged scalar; default the eval return
``eval/return_mean`` where runs log one, else the training return ``actor/return_last100``) against
env steps, wall-clock seconds or updates (``--x``), smoothed (``--smooth``, TensorBoard's weight).
Runs that are seeds of one config (the same ``config.yaml`` but for ``run.seed``, ``env.seed``,
and ``run.dir``) are one curve: their mean or IQM (``--agg``) on a common x with a
percentile bootstrap band over the runs (``--ci``; :mod:`gearflow.run.aggregate`). Right:
throughput (env steps/s, updates/s) against time, each run in its own line, broken where it
was resumed instead of dropping to zero while its actors start. Resumes (``resumes.jsonl``) are
marked on both panels::

    plot_runs(["runs/a-seed0", "runs/a-seed1", "runs/a-seed2"], out="curves.png", agg="iqm")
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from gearflow.errors import GearflowError
from gearflow.run.aggregate import AGGREGATES, aggregate, common_grid, smooth
from gearflow.run.metrics import read_metrics, read_resumes

__all__ = ["X_AXES", "group_runs", "plot_runs"]

X_AXES = {"steps": ("actor/env_steps", "env steps"), "time": ("time/elapsed_s", "wall-clock seconds"),
          "updates": ("learner/updates", "learner updates")}  # fmt: skip
SEED_KEYS = (("run", "seed"), ("run", "dir"), ("env", "seed"))
DEFAULT_METRICS = ("eval/return_mean", "actor/return_last100")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict], x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(float(r[x]), float(r[y])) for r in rows if _number(r.get(x)) and _number(r.get(y))]
    a = np.asarray(pts, dtype=np.float64).reshape(-1, 2)
    return a[:, 0], a[:, 1]


def _config_key(run_dir: Path) -> str:
    """The run's config without the keys seeds of one config differ in (its directory name if none)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return f"dir:{run_dir.resolve()}"
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    for group, key in SEED_KEYS:
        if isinstance(cfg.get(group), dict):
            cfg[group].pop(key, None)
    return OmegaConf.to_yaml(OmegaConf.create(cfg))


def group_runs(run_dirs: Sequence[Path]) -> list[list[Path]]:
    """Runs grouped as seeds of one config, in the order first seen."""
    groups: dict[str, list[Path]] = {}
    for d in run_dirs:
        groups.setdefault(_config_key(d), []).append(d)
    return list(groups.values())


def _label(runs: list[Path]) -> str:
    names = [r.name for r in runs]
    if len(names) == 1:
        return names[0]
    prefix = Path(names[0]).name
    while prefix and not all(n.startswith(prefix) for n in names):
        prefix = prefix[:-1]
    return f"{prefix.rstrip('-_') or names[0]} ({len(names)} seeds)"


def _metric_for(runs: dict[Path, list[dict]], metric: str | None) -> str:
    have = {k for rows in runs.values() for r in rows for k, v in r.items() if _number(v)}
    if metric is None:
        for m in DEFAULT_METRICS:
            if m in have:
                return m
        raise GearflowError(f"the runs log neither {' nor '.join(DEFAULT_METRICS)}: choose one with --metric")
    if metric not in have:
        import difflib

        close = difflib.get_close_matches(metric, sorted(have), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise GearflowError(f"--metric {metric!r}: no run logs it{hint}; logged: {', '.join(sorted(have))}")
    return metric


def _segments(rows: list[dict], resumes: list[dict]) -> list[list[dict]]:
    """The rows split where the run was resumed (the rows before each resume, then after)."""
    cuts = sorted({int(r.get("row", 0)) for r in resumes if 0 < int(r.get("row", 0)) < len(rows)})
    bounds = [0, *cuts, len(rows)]
    return [rows[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _throughput(ax, rows: list[dict], resumes: list[dict], key: str, **style) -> None:
    """``key`` per second against time, one line per segment, without the zero rows at a segment's
    start (its actors were starting: no step yet) or the summary rows (they carry no rate)."""
    label = style.pop("label")
    for i, seg in enumerate(_segments(rows, resumes)):
        t, v = _series(seg, "time/elapsed_s", key)
        first = int(np.argmax(v > 0)) if (v > 0).any() else len(v)
        ax.plot(t[first:], v[first:], label=label if i == 0 else None, **style)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None, metric: str | None = None,
              x: str = "steps", smoothing: float = 0.0, agg: str = "mean", ci: float = 0.95,
              group: bool = True) -> Path:  # fmt: skip
    """Write the PNG; returns its path. ``group=False``: every run its own curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise GearflowError(f"gearflow plot needs matplotlib ({exc}); pip install matplotlib") from None
    if x not in X_AXES:
        raise GearflowError(f"--x {x!r}: choose one of {', '.join(X_AXES)}")
    if agg not in AGGREGATES:
        raise GearflowError(f"--agg {agg!r}: choose one of {', '.join(AGGREGATES)}")
    if not 0.0 <= smoothing < 1.0:
        raise GearflowError(f"--smooth {smoothing}: must be in [0, 1) (TensorBoard's smoothing weight)")
    if not 0.0 < ci < 1.0:
        raise GearflowError(f"--ci {ci}: must be in (0, 1)")
    dirs = [Path(d) for d in run_dirs]
    rows = {d: read_metrics(d) for d in dirs}
    for d, r in rows.items():
        if not r:
            raise GearflowError(f"{d}: metrics.jsonl has no rows yet")
    resumes = {d: read_resumes(d) for d in dirs}
    metric = _metric_for(rows, metric)
    xkey, xlabel = X_AXES[x]
    out = Path(out) if out else dirs[0] / "curves.png"

    fig, (ax, tp) = plt.subplots(1, 2, figsize=(14, 4.8))
    for runs in group_runs(dirs) if group else [[d] for d in dirs]:
        curves = [c for c in (_series(rows[d], xkey, metric) for d in runs) if len(c[0])]
        if not curves:
            continue
        curves = [(cx, smooth(cy, smoothing)) for cx, cy in curves]
        label = _label(runs)
        if len(curves) == 1:
            line = ax.plot(*curves[0], label=label)[0]
        else:
            try:
                grid, ys = common_grid(curves)
            except ValueError as exc:
                raise GearflowError(f"{label}: {exc} ({xlabel})") from None
            centre, low, high = aggregate(ys, agg, ci=ci)
            line = ax.plot(grid, centre, label=f"{label}: {agg}, {ci:.0%} bootstrap CI")[0]
            ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.25, linewidth=0)
        color = line.get_color()
        for d in runs:
            for r in resumes[d]:
                if _number(r.get(xkey)):
                    ax.axvline(float(r[xkey]), color=color, linestyle=":", alpha=0.7)
                if _number(r.get("time/elapsed_s")):
                    tp.axvline(float(r["time/elapsed_s"]), color=color, linestyle=":", alpha=0.7)
            _throughput(tp, rows[d], resumes[d], "actor/env_steps_per_s", color=color, label=f"{d.name} env steps/s")
            _throughput(tp, rows[d], resumes[d], "learner/updates_per_s", color=color, linestyle="--",
                        label=f"{d.name} updates/s")  # fmt: skip
    if any(resumes.values()):
        ax.plot([], [], color="grey", linestyle=":", label="resumed")
    title = metric + (f" (smoothed {smoothing:g})" if smoothing else "")
    ax.set(xlabel=xlabel, ylabel=metric, title=title)
    tp.set(xlabel="wall-clock seconds", ylabel="per second", title="throughput", yscale="log")
    for a in (ax, tp):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
