"""Curves of several runs (seeds of one config) as one: resampling onto a common x, smoothing,
the mean or the interquartile mean (IQM) across runs, and a percentile bootstrap confidence band
over runs — rliable's method (Agarwal et al. 2021, "Deep RL at the Edge of the Statistical
Precipice") for one task, where its stratified bootstrap is a bootstrap over runs::

    grid, ys = common_grid([(x0, y0), (x1, y1), (x2, y2)])      # (G,), (runs, G)
    centre, low, high = aggregate(ys, "iqm", ci=0.95, seed=0)   # (G,) each
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["AGGREGATES", "aggregate", "common_grid", "iqm", "smooth"]


def smooth(y: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: a debiased exponential moving average; ``weight`` in [0, 1), 0 = none."""
    y = np.asarray(y, dtype=np.float64)
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight}: must be in [0, 1)")
    if weight == 0.0 or y.size == 0:
        return y
    out, last, norm = np.empty_like(y), 0.0, 0.0
    for i, v in enumerate(y):
        last = weight * last + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out[i] = last / norm
    return out


def common_grid(curves: Sequence[tuple[np.ndarray, np.ndarray]], points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Every curve ``(x, y)`` (x increasing) linearly resampled on ``points`` xs over the range all
    of them cover: ``grid`` (G,), ``ys`` (runs, G)."""
    lo = max(float(np.min(x)) for x, _ in curves)
    hi = min(float(np.max(x)) for x, _ in curves)
    if hi < lo:
        raise ValueError("the runs' curves do not overlap on the x axis")
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([lo])
    return grid, np.stack([np.interp(grid, np.asarray(x, float), np.asarray(y, float)) for x, y in curves])


def iqm(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Interquartile mean along ``axis``: the mean of the middle 50 % (``scipy.stats.trim_mean(x, 0.25)``:
    ``floor(n/4)`` values cut at each end, so fewer than 4 runs give the plain mean)."""
    v = np.sort(np.asarray(values, dtype=np.float64), axis=axis)
    n = v.shape[axis]
    cut = int(0.25 * n)
    return np.take(v, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


AGGREGATES = {"mean": lambda v, axis: np.mean(v, axis=axis), "iqm": iqm}


def aggregate(ys: np.ndarray, how: str = "mean", ci: float = 0.95, reps: int = 2000,
              seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """The aggregate of ``ys`` (runs, G) across runs and its percentile bootstrap interval: runs drawn
    with replacement ``reps`` times, the aggregate of each draw, the ``(1 ± ci) / 2`` quantiles.
    One run gives a band of zero width."""
    if how not in AGGREGATES:
        raise ValueError(f"aggregate {how!r}: choose one of {', '.join(AGGREGATES)}")
    f = AGGREGATES[how]
    ys = np.asarray(ys, dtype=np.float64)
    centre = f(ys, 0)
    n = ys.shape[0]
    if n < 2:
        return centre, centre.copy(), centre.copy()
    rng = np.random.default_rng(seed)
    draws = f(ys[rng.integers(n, size=(reps, n))], 1)  # (reps, G)
    low, high = np.quantile(draws, [(1 - ci) / 2, (1 + ci) / 2], axis=0)
    return centre, low, high
