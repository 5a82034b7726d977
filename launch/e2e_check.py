"""One timed end-to-end run of a config (actor processes → replay → learner), reported as one
JSON line: the ``gpu_check.sh`` end-to-end steps, also runnable on a CPU to check the keys.

    python launch/e2e_check.py NAME CONFIG [--seconds 120] [--steady-rows N] [--steady-s S] [--jsonl FILE]
                               [--run-dir DIR] [--plan] [KEY=VALUE ...]

The run is ``gearflow.runner.train`` in this process (the learner runs here; the actors are
its spawned processes) with ``run.max_seconds`` set, no env-step limit, no checkpoints, in
``--run-dir`` (its metrics.jsonl is written as the run goes) or a temporary run directory.
``--jsonl``: a ``{"name", "progress": {...}}`` line is appended every ``--progress-s`` seconds
(the newest metric row's rates, the steady rows so far and the GPU memory so far: a killed run
keeps them) and the report at the end. ``--steady-rows N``: the run stops at the first progress
line that counts N steady rows (stop reason ``reached N steady rows``), ``--steady-s S`` at the
first whose steady rows span S seconds (``reached S s of steady updates``; gpu_check's replay
pairs: 30), ``--seconds`` being only their deadline: a check that asserts on the steady rates
waits for them, not for a duration
that a loaded machine spends starting up. ``--plan``: the report carries the dry run's memory plan of the same
config (``plan``: the learner's planned bytes, ``gearflow.tools.dryrun.memory_plan``) next to
the measured GPU memory. Printed (one line, prefixed ``gpu_check: e2e``)::

    {"name", "config", "overrides", "stop_reason", "elapsed_s", "updates", "updates_per_s",
     "tokens_per_s", "samples_per_s", "env_steps_per_s", "learner_wait_fraction",
     "steady": {"rows", "seconds", "updates_per_s", "tokens_per_s", "env_steps_per_s"},
     "learner_device", "replay_device", "bf16",
     "gpu": {"name", "total_gib", "peak_used_gib", "learner_process_peak_gib", "other_processes_peak_gib",
             "torch_max_allocated_gib", "torch_max_reserved_gib", "cupy_pool_gib"} | null,
     "plan": {"learner_total_gib", "parameters", "activation_gib", "replay_host_gib", ...} | absent,
     "plan_vs_learner": {"plan_gib", "torch_max_allocated_gib", "ratio", "learner_process_peak_gib"} | absent}

``updates_per_s`` etc. are over the whole run (filling the replay included); ``steady`` is the
mean of the metric rows logged after the first learner update (one row per 5 s), the first of
them left out when there are more (its interval began before learning did), and ``seconds`` the
time those rows cover.
``learner_wait_fraction`` is the learner's time waiting for a batch over its waiting + learning
time (the whole run).
``tokens`` are the steps learned from (items × their valid steps: a transition is one, an
R2D2 window its unpadded steps). ``gpu.peak_used_gib`` is the device's used memory (all
processes: learner, CuPy pool, CUDA contexts) sampled every 0.5 s; ``gpu.learner_process_peak_gib``
is this (the learner's) process alone and ``gpu.other_processes_peak_gib`` everything else on the
GPU (actors that act there: gato_80m's), per ``nvidia-smi --query-compute-apps`` every 2 s (None
without nvidia-smi); the ``torch_*`` figures are the learner's torch allocator and ``cupy_pool_gib``
its replay's CuPy pool. With ``--plan`` the report's ``plan_vs_learner`` puts the plan's learner
total beside what the learner's allocator held. Exit status 1 when no update happened.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = float(1 << 30)


class ProcessMemory:
    """Peak device memory of this process (the learner: its CUDA context, torch's allocator, the
    replay's CuPy pool) and of every other process on the GPUs (the actors, when they act there),
    from ``nvidia-smi --query-compute-apps=pid,used_memory`` (MiB per process; the figure the
    driver charges each one). ``available`` is False where nvidia-smi is missing or fails."""

    QUERY = ("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")

    def __init__(self, pid: int | None = None):
        self.pid = os.getpid() if pid is None else pid
        self.learner = self.others = self.others_count = 0  # peaks: bytes, bytes, processes
        self.available = shutil.which(self.QUERY[0]) is not None

    def poll(self) -> None:
        if not self.available:
            return
        try:
            out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            self.available = False
            return
        mine = others = count = 0
        for line in out.splitlines():
            pid, _, mib = (part.strip() for part in line.partition(","))
            if not (pid.isdigit() and mib.isdigit()):  # "[N/A]" (no permission) or a header
                continue
            if int(pid) == self.pid:
                mine += int(mib) << 20
            else:
                others, count = others + (int(mib) << 20), count + 1
        self.learner, self.others = max(self.learner, mine), max(self.others, others)
        self.others_count = max(self.others_count, count)

    def report(self) -> dict:
        if not self.available:
            return {"learner_process_peak_gib": None, "other_processes_peak_gib": None}
        return {"learner_process_peak_gib": round(self.learner / GIB, 3),
                "other_processes_peak_gib": round(self.others / GIB, 3), "other_processes": self.others_count}


class GpuMemory:
    """Peak device memory in use (all processes), and this (the learner's) process's own
    (:class:`ProcessMemory`, every ``process_every`` polls), sampled by a thread."""

    def __init__(self, period_s: float = 0.5, process_every: int = 4):
        import torch

        self.torch, self.peak, self.total = torch, 0, 0
        self.available = torch.cuda.is_available()
        self.processes, self.process_every = ProcessMemory(), process_every
        self._stop = threading.Event()
        self._thread = None
        if torch.cuda.is_available():
            self.total = torch.cuda.get_device_properties(0).total_memory
            self._thread = threading.Thread(target=self._poll, args=(period_s,), daemon=True)
            self._thread.start()

    def _poll(self, period_s: float) -> None:
        polls = 0
        while not self._stop.wait(period_s):
            try:
                free, total = self.torch.cuda.mem_get_info()
            except RuntimeError:  # the driver is gone (run ended badly): keep the last peak
                return
            self.peak = max(self.peak, total - free)
            if polls % self.process_every == 0:
                self.processes.poll()
            polls += 1

    def now(self) -> dict | None:
        """The figures so far (the run goes on)."""
        if not self.available:
            return None
        t = self.torch.cuda
        cupy = sys.modules.get("cupy")  # the replay's device vectors and batch buffers (replay.device=cuda)
        return {
            "name": t.get_device_name(0),
            "total_gib": round(self.total / GIB, 2),
            "peak_used_gib": round(self.peak / GIB, 3),
            **self.processes.report(),
            "torch_max_allocated_gib": round(t.max_memory_allocated() / GIB, 3),
            "torch_max_reserved_gib": round(t.max_memory_reserved() / GIB, 3),
            "cupy_pool_gib": None if cupy is None else round(cupy.get_default_memory_pool().total_bytes() / GIB, 3),
        }

    def report(self) -> dict | None:
        self._stop.set()
        if self._thread is None:
            return None
        self._thread.join(timeout=2)
        return self.now()


def append_line(path: str | None, row: dict) -> None:
    """One JSON line, flushed: what a kill leaves is still whole lines."""
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def read_rows(metrics_path: Path) -> list[dict]:
    rows = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a row being written
                continue
    return rows


PROGRESS_KEYS = ("time/elapsed_s", "actor/env_steps", "learner/updates", "learner/updates_per_s",
                 "learner/tokens_per_s", "learner/samples_per_s", "actor/env_steps_per_s", "learner/wait_fraction")


class ProgressLines:
    """Appends the newest metric row's figures and the GPU memory so far every ``period_s``;
    ``steady_rows`` / ``steady_s``: sets ``run_stop`` (the run's stop event) at the first line that
    counts that many steady rows / whose steady rows span that many seconds, and ``reason`` says so."""

    def __init__(self, name: str, jsonl: str | None, metrics_path: Path, gpu: GpuMemory, period_s: float,
                 steady_rows: int = 0, run_stop: threading.Event | None = None, steady_s: float = 0.0):  # fmt: skip
        self.name, self.jsonl, self.metrics_path, self.gpu = name, jsonl, metrics_path, gpu
        self.steady_rows, self.steady_s, self.run_stop, self.reason = steady_rows, steady_s, run_stop, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        if jsonl or steady_rows or steady_s:
            self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                rows = read_rows(self.metrics_path)
                last = rows[-1] if rows else {}
                steady = len(steady_of(rows))
                append_line(self.jsonl, {"name": self.name, "t": round(time.time(), 3), "progress": {
                    **{k: last[k] for k in PROGRESS_KEYS if k in last}, "rows": len(rows), "steady_rows": steady,
                    "gpu": self.gpu.now()}})  # fmt: skip
                reason = stop_reason(rows, self.steady_rows, self.steady_s)
                if reason and self.run_stop is not None:
                    self.reason = reason
                    self.run_stop.set()
                    return
            except Exception as exc:  # noqa: BLE001 - a progress line is never worth the run
                append_line(self.jsonl, {"name": self.name, "progress_error": f"{type(exc).__name__}: {exc}"})

    def stop(self) -> None:
        self._stop.set()


def memory_plan_gib(cfg) -> dict:
    """The dry run's figures of ``cfg`` that a GPU run measures against (GiB)."""
    from gearflow.tools.dryrun import memory_plan

    plan = memory_plan(cfg)
    learner, replay = plan["learner"], plan.get("replay", {})
    out = {"learner_total_gib": round(learner["total_bytes"] / GIB, 3), "parameters": learner["parameters"],
           "parameter_gib": round(learner["parameter_bytes"] / GIB, 3),
           "optimizer_state_gib": None if learner["optimizer_state_bytes"] is None
                                   else round(learner["optimizer_state_bytes"] / GIB, 3),
           "activation_gib": None if learner["activation_bytes"] is None else round(learner["activation_bytes"] / GIB, 3),
           "activation_method": learner["activation_method"],
           "batch_gib": round(learner["batch_bytes"] / GIB, 3)}  # fmt: skip
    for key in ("segment_bytes", "total_bytes"):
        if isinstance(replay.get(key), (int, float)):
            out[f"replay_{key.replace('_bytes', '')}_gib"] = round(replay[key] / GIB, 3)
    return out


def plan_vs_learner(plan: dict, gpu: dict | None) -> dict | None:
    """The dry run's learner total beside what the learner's own allocator held at its peak
    (``ratio`` = measured / planned) and the learner process's whole use (context, CuPy pool)."""
    planned = plan.get("learner_total_gib") if isinstance(plan, dict) else None
    if gpu is None or not planned:
        return None
    held = gpu["torch_max_allocated_gib"]
    return {"plan_gib": planned, "torch_max_allocated_gib": held, "ratio": round(held / planned, 3),
            "learner_process_peak_gib": gpu.get("learner_process_peak_gib")}


def steady_span(rows: list[dict]) -> float:
    """Seconds the steady rows cover after the first of them: from its time to the last one's."""
    steady = steady_of(rows)
    return float(steady[-1]["time/elapsed_s"] - steady[0]["time/elapsed_s"]) if len(steady) > 1 else 0.0


def stop_reason(rows: list[dict], steady_rows: int = 0, steady_s: float = 0.0) -> str:
    """Why the run may stop now ("" when it may not): enough steady rows, or steady seconds."""
    if steady_rows and len(steady_of(rows)) >= steady_rows:
        return f"reached {steady_rows} steady rows"
    if steady_s and steady_span(rows) >= steady_s:
        return f"reached {steady_s:g} s of steady updates"
    return ""


def steady_of(rows: list[dict]) -> list[dict]:
    """The metric rows logged after the first learner update (the summary row has no rates)."""
    return [r for r in rows if r.get("learner/updates", 0) > 0 and "learner/updates_per_s" in r]


def steady_rates(metrics_path: Path) -> dict:
    """Means of the logged rates over the rows after the first learner update (the first of them
    left out when there are more: its interval began before learning did) and the seconds they span."""
    all_rows = read_rows(metrics_path)
    rows = steady_of(all_rows)
    span = steady_span(all_rows)
    rows = rows[1:] if len(rows) > 1 else rows
    keys = {"updates_per_s": "learner/updates_per_s", "tokens_per_s": "learner/tokens_per_s",
            "env_steps_per_s": "actor/env_steps_per_s"}  # fmt: skip
    out = {"rows": len(rows), "seconds": round(span, 1)}
    for name, key in keys.items():
        vals = [float(r[key]) for r in rows if key in r]
        out[name] = round(sum(vals) / len(vals), 4) if vals else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="label of this step in the report")
    parser.add_argument("config", help="YAML config (relative to the repository root or absolute)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE dotlist overrides")
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="run.max_seconds of the run (with --steady-rows: its deadline)")
    parser.add_argument("--steady-s", type=float, default=0.0,
                        help="stop once the steady rows span this many seconds (0: run --seconds)")
    parser.add_argument("--steady-rows", type=int, default=0,
                        help="stop once this many metric rows after the first update exist (0: run --seconds)")
    parser.add_argument("--jsonl", default=None, help="append progress lines and the report here (flushed)")
    parser.add_argument("--run-dir", default=None, help="the run's directory (default: a temporary one)")
    parser.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--plan", action="store_true", help="add the dry run's memory plan to the report")
    args = parser.parse_intermixed_args(argv)

    sys.path.insert(0, str(ROOT))
    from gearflow.config import load_config
    from gearflow.runner import train

    config = Path(args.config) if Path(args.config).is_absolute() else ROOT / args.config
    with tempfile.TemporaryDirectory(prefix="gearflow-e2e-") as tmp:
        run_dir = Path(args.run_dir).resolve() if args.run_dir else Path(tmp) / "run"
        overrides = [*args.overrides, f"run.max_seconds={args.seconds}", "run.max_env_steps=0", "run.stop_at_return=0",
                     "run.checkpoint_every=0", f"run.dir={run_dir}", "run.progress=log", "run.tensorboard=false"]  # fmt: skip
        cfg = load_config(config, overrides)
        plan = None
        if args.plan:
            try:
                plan = memory_plan_gib(cfg)
            except Exception as exc:  # noqa: BLE001 - the run still says something
                plan = {"error": f"{type(exc).__name__}: {exc}"}
            append_line(args.jsonl, {"name": args.name, "plan": plan})
        gpu = GpuMemory()
        run_stop = threading.Event()
        progress = ProgressLines(args.name, args.jsonl, run_dir / "metrics.jsonl", gpu, args.progress_s,
                                 steady_rows=args.steady_rows, run_stop=run_stop, steady_s=args.steady_s)  # fmt: skip
        start = time.monotonic()
        try:
            summary = train(cfg, stop=run_stop)
        finally:
            progress.stop()
        wall = time.monotonic() - start
        elapsed = float(summary["time/elapsed_s"])
        reason = summary.get("stop_reason")
        if progress.reason and reason == "stopped by signal" and "stop_signal" not in summary:
            reason = progress.reason  # the stop this script asked for, not a signal
        report = {
            "name": args.name,
            "config": args.config,
            "overrides": list(args.overrides),
            "stop_reason": reason,
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
        if plan is not None:
            report["plan"] = plan
            report["plan_vs_learner"] = plan_vs_learner(plan, report["gpu"])
    append_line(args.jsonl, report)
    print("gpu_check: e2e " + json.dumps(report), flush=True)
    return 0 if report["updates"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
