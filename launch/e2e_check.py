"""One timed end-to-end run of a config (actor processes → replay → learner), reported as one
JSON line: the ``gpu_check.sh`` end-to-end steps, also runnable on a CPU to check the keys.

    python launch/e2e_check.py NAME CONFIG [--seconds 120] [KEY=VALUE ...]

The run is ``gearflow.runner.train`` in this process (the learner runs here; the actors are
its spawned processes) with ``run.max_seconds`` set, no env-step limit, no checkpoints, in a
temporary run directory. Printed (one line, prefixed ``gpu_check: e2e``)::

    {"name", "config", "overrides", "stop_reason", "elapsed_s", "updates", "updates_per_s",
     "tokens_per_s", "samples_per_s", "env_steps_per_s", "learner_wait_fraction",
     "steady": {"rows", "updates_per_s", "tokens_per_s", "env_steps_per_s"},
     "learner_device", "replay_device", "bf16",
     "gpu": {"name", "total_gib", "peak_used_gib", "torch_max_allocated_gib", "torch_max_reserved_gib"} | null}

``updates_per_s`` etc. are over the whole run (filling the replay included); ``steady`` is the
mean of the metric rows logged after the first learner update (one row per 5 s).
``learner_wait_fraction`` is the learner's time waiting for a batch over its waiting + learning
time (the whole run).
``tokens`` are the steps learned from (items × their valid steps: a transition is one, an
R2D2 window its unpadded steps). ``gpu.peak_used_gib`` is the device's used memory (all
processes: learner, CuPy pool, CUDA contexts) sampled every 0.5 s; the ``torch_*`` figures
are this (the learner's) process's torch allocator. Exit status 1 when no update happened.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)


class GpuMemory:
    """Peak device memory in use (all processes), sampled by a thread."""

    def __init__(self, period_s: float = 0.5):
        import torch

        self.torch, self.peak, self.total = torch, 0, 0
        self._stop = threading.Event()
        self._thread = None
        if torch.cuda.is_available():
            self.total = torch.cuda.get_device_properties(0).total_memory
            self._thread = threading.Thread(target=self._poll, args=(period_s,), daemon=True)
            self._thread.start()

    def _poll(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                free, total = self.torch.cuda.mem_get_info()
            except RuntimeError:  # the driver is gone (run ended badly): keep the last peak
                return
            self.peak = max(self.peak, total - free)

    def report(self) -> dict | None:
        self._stop.set()
        if self._thread is None:
            return None
        self._thread.join(timeout=2)
        t = self.torch.cuda
        return {
            "name": t.get_device_name(0),
            "total_gib": round(self.total / GIB, 2),
            "peak_used_gib": round(self.peak / GIB, 3),
            "torch_max_allocated_gib": round(t.max_memory_allocated() / GIB, 3),
            "torch_max_reserved_gib": round(t.max_memory_reserved() / GIB, 3),
        }


def steady_rates(metrics_path: Path) -> dict:
    """Means of the logged rates over the rows after the first learner update."""
    rows = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    rows = [r for r in rows if r.get("learner/updates", 0) > 0 and "learner/updates_per_s" in r]
    keys = {"updates_per_s": "learner/updates_per_s", "tokens_per_s": "learner/tokens_per_s",
            "env_steps_per_s": "actor/env_steps_per_s"}  # fmt: skip
    out = {"rows": len(rows)}
    for name, key in keys.items():
        vals = [float(r[key]) for r in rows if key in r]
        out[name] = round(sum(vals) / len(vals), 4) if vals else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="label of this step in the report")
    parser.add_argument("config", help="YAML config (relative to the repository root or absolute)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE dotlist overrides")
    parser.add_argument("--seconds", type=float, default=120.0, help="run.max_seconds of the run")
    args = parser.parse_intermixed_args(argv)

    sys.path.insert(0, str(ROOT))
    from gearflow.config import load_config
    from gearflow.runner import train

    config = Path(args.config) if Path(args.config).is_absolute() else ROOT / args.config
    with tempfile.TemporaryDirectory(prefix="gearflow-e2e-") as tmp:
        run_dir = Path(tmp) / "run"
        overrides = [*args.overrides, f"run.max_seconds={args.seconds}", "run.max_env_steps=0", "run.stop_at_return=0",
                     "run.checkpoint_every=0", f"run.dir={run_dir}", "run.progress=log", "run.tensorboard=false"]  # fmt: skip
        cfg = load_config(config, overrides)
        gpu = GpuMemory()
        start = time.monotonic()
        summary = train(cfg)
        wall = time.monotonic() - start
        elapsed = float(summary["time/elapsed_s"])
        report = {
            "name": args.name,
            "config": args.config,
            "overrides": list(args.overrides),
            "stop_reason": summary.get("stop_reason"),
            "elapsed_s": round(elapsed, 1),
            "wall_s": round(wall, 1),
            "updates": int(summary["learner/updates"]),
            "updates_per_s": round(summary["learner/updates"] / elapsed, 3),
            "tokens_per_s": round(summary["learner/tokens"] / elapsed, 1),
            "samples_per_s": round(summary["learner/samples"] / elapsed, 1),
            "env_steps_per_s": round(summary["actor/env_steps"] / elapsed, 1),
            "learner_wait_fraction": round(float(summary["learner/wait_fraction"]), 4),
            "steady": steady_rates(run_dir / "metrics.jsonl"),
            "learner_device": str(cfg.learner.device),
            "replay_device": str(cfg.replay.device),
            "bf16": bool(cfg.learner.bf16),
            "gpu": gpu.report(),
        }
    print("gpu_check: e2e " + json.dumps(report), flush=True)
    return 0 if report["updates"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
