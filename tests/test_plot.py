"""``gearflow plot`` (issue 31, point 6): a chosen metric, smoothing, seeds of one config aggregated into a
mean or IQM with a bootstrap band, resumes marked; and the small points of 7: TensorBoard gets no
duplicate point at a resume, the first row after a resume shows no policy lag of the whole version
count, ``gearflow eval`` does not round 0.96 to 1.0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gearflow.run.aggregate import aggregate, common_grid, iqm, smooth
from gearflow.run.metrics import MetricsLog, read_metrics, read_resumes
from gearflow.run.plot import group_runs, plot_runs

ROOT = Path(__file__).resolve().parents[1]


def _run(path: Path, seed: int, *, slope: float = 1.0, resume_at: int | None = None,
         name: str = "corridor") -> Path:  # fmt: skip
    """A run directory as gearflow train leaves it: config.yaml, metrics.jsonl (+ resumes.jsonl), written
    by the real MetricsLog; training return rising with ``slope``, eval rows every fifth row."""
    from omegaconf import OmegaConf

    path.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"env": {"id": "CartPole-v1", "seed": seed}, "agent": {"name": "agents.apex_dqn"},
                                     "run": {"seed": seed, "dir": str(path), "name": name}}), path / "config.yaml")
    rng = np.random.default_rng(seed)

    def row(i: int) -> dict:
        r = {"actor/env_steps": 1000 * i, "time/elapsed_s": 2.0 * i, "learner/updates": 50 * i,
             "actor/return_last100": slope * i + rng.normal(), "actor/env_steps_per_s": 500.0 if i > 1 else 0.0,
             "learner/updates_per_s": 25.0}  # fmt: skip
        if i % 5 == 0:
            r["eval/return_mean"] = 2 * slope * i + 3 * rng.normal()
        return r

    sink = MetricsLog(path, tensorboard=False)
    for i in range(1, 31 if resume_at is None else resume_at + 1):
        sink.write(row(i))
    offsets = sink.offsets()
    sink.close()
    if resume_at is not None:
        sink = MetricsLog(path, tensorboard=False, resume_from=(offsets, 1000 * resume_at))
        for i in range(resume_at + 1, 31):
            sink.write({**row(i), "actor/env_steps_per_s": 0.0 if i == resume_at + 1 else 500.0})
        sink.close()
    return path


def test_iqm_and_the_bootstrap_band():
    rng = np.random.default_rng(0)
    ys = rng.normal(size=(7, 50))
    assert np.allclose(iqm(ys), np.sort(ys, axis=0)[1:6].mean(axis=0))  # scipy's trim_mean(ys, 0.25): 1 cut each end
    assert np.allclose(iqm(rng.normal(size=(8, 3)) * 0 + np.arange(8)[:, None]), 3.5)  # 2, 3, 4, 5
    centre, low, high = aggregate(ys, "iqm", ci=0.95, reps=500)
    assert np.all(low <= centre + 1e-12) and np.all(centre <= high + 1e-12) and np.all(high - low > 0)
    narrow = aggregate(ys, "mean", ci=0.5, reps=500)
    assert np.mean(narrow[2] - narrow[1]) < np.mean(high - low)
    same = aggregate(np.ones((3, 10)), "mean")  # identical seeds: no spread
    assert np.allclose(same[1], 1.0) and np.allclose(same[2], 1.0)
    one = aggregate(ys[:1], "mean")
    assert np.array_equal(one[1], one[2])
    grid, resampled = common_grid([(np.array([0.0, 10.0]), np.array([0.0, 10.0])),
                                   (np.array([2.0, 12.0]), np.array([0.0, 1.0]))], points=5)  # fmt: skip
    assert grid[0] == 2.0 and grid[-1] == 10.0 and resampled.shape == (2, 5)
    assert np.allclose(resampled[0], grid) and np.isclose(resampled[1, -1], 0.8)
    assert np.allclose(smooth(np.ones(5), 0.9), 1.0)  # debiased: a constant stays constant
    with pytest.raises(ValueError, match="must be in"):
        smooth(np.ones(3), 1.0)


def test_seeds_of_one_config_are_one_group(tmp_path):
    a = [_run(tmp_path / f"a{s}", s) for s in range(3)]
    b = _run(tmp_path / "b", 0, name="other")
    assert group_runs([a[0], b, a[1], a[2]]) == [a, [b]]


def test_plot_aggregates_seeds_marks_resumes_and_chooses_the_metric(tmp_path):
    import matplotlib.image

    runs = [_run(tmp_path / f"seed{s}", s, resume_at=12 if s == 1 else None) for s in range(3)]
    assert read_resumes(runs[1]) == [{"row": 12, "actor/env_steps": 12000, "time/elapsed_s": 24.0}]
    assert [r["actor/env_steps"] for r in read_metrics(runs[1])] == [1000 * i for i in range(1, 31)]
    out = plot_runs(runs, out=tmp_path / "iqm.png", agg="iqm", smoothing=0.6)
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 1000
    # the band: pixels of the fill's colour (C0 at alpha 0.25 over white) exist; with --separate none do
    band = np.array([0.780, 0.867, 0.927])  # matplotlib's C0 (#1f77b4) at alpha 0.25 over white

    def band_pixels(img) -> int:
        return int((np.abs(img[..., :3] - band) < 0.03).all(axis=-1).sum())

    separate = matplotlib.image.imread(plot_runs(runs, out=tmp_path / "sep.png", group=False))
    assert band_pixels(image) > 5 * max(band_pixels(separate), 100)  # (anti-aliased lines give a few)
    # the default metric is the eval return where logged; any logged scalar can be chosen
    r = subprocess.run([sys.executable, "-m", "gearflow", "plot", *map(str, runs), "-o", str(tmp_path / "x.png"),
                        "--metric", "learner/updats"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 2 and "did you mean learner/updates" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "gearflow", "plot", *map(str, runs), "-o", str(tmp_path / "t.png"),
                        "--metric", "actor/return_last100", "--x", "time", "--agg", "mean", "--smooth", "0.9"],
                       capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resume_adds_no_duplicate_tensorboard_point(tmp_path):
    """The first run's summary row (dropped on resume) and the resumed run's first row, at the
    checkpoint's step, both reached TensorBoard before."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsLog(tmp_path, tensorboard=True)
    sink.write({"actor/env_steps": 100, "learner/loss": 1.0})
    sink.write({"actor/env_steps": 200, "learner/loss": 0.9})
    offsets = sink.offsets()  # the final checkpoint keeps the rows before the summary
    sink.write({"actor/env_steps": 300, "learner/loss": 0.8, "stop_reason": "stopped by signal"})
    sink.close()
    sink = MetricsLog(tmp_path, tensorboard=True, resume_from=(offsets, 300))
    sink.write({"actor/env_steps": 300, "learner/loss": 0.7})  # actors not stepping yet
    sink.write({"actor/env_steps": 300, "learner/loss": 0.6})
    sink.write({"actor/env_steps": 400, "learner/loss": 0.5})
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("learner/loss")] == [
        (100, 1.0), (200, 0.9), (300, 0.7), (400, 0.5)]  # fmt: skip
    assert [r["learner/loss"] for r in read_metrics(tmp_path)] == [1.0, 0.9, 0.7, 0.6, 0.5]  # the files keep all


def test_the_first_row_after_a_resume_has_no_policy_lag_yet(tmp_path):
    """Before any actor reported (a resumed run's first row), the lag is unknown, not the version count."""
    import torch

    from gearflow.learner import Learner, Progress
    from gearflow.params import ParameterStore
    from gearflow.run.display import log_line

    net = torch.nn.Linear(2, 2)
    params = ParameterStore.create(net)
    try:
        params.publish(net, version=2100)

        class NoStats:
            def stats(self):
                return {}

        progress = Progress()
        from omegaconf import OmegaConf

        cfg = OmegaConf.create({"learner": {"bf16": False}, "run": {"checkpoint_every": "0"}})
        learner = Learner(cfg.learner, object(), NoStats(), params, progress, run=cfg.run, env_steps=lambda: 0,
                          actor_version=progress.actor_weights_version)  # fmt: skip
        row = learner.snapshot({})
        assert np.isnan(row["actor/policy_lag"]) and " lag - " in log_line(row)
        progress.actor_counters[0] = {"actor/env_steps": 10, "actor/weight_version": 2095}
        assert learner.snapshot({})["actor/policy_lag"] == 5
    finally:
        params.close()


def test_eval_figures_keep_small_returns():
    from gearflow.run.evaluate import figures

    assert figures(0.96, 0.049) == ("0.960", "0.049")
    assert figures(475.25, 12.5) == ("475.2", "12.5")
    assert figures(-21.0, 0.0) == ("-21.0", "0.0")
