"""``gearflow bench SUITE``: benchmarks that print one JSON object per measurement.

Each line is ``{"bench", "workload", "metric", "value", "unit", "floor", "ratio"}``:
``floor`` is the same work done by the plainest possible code (a numpy gather of
the same bytes, a bare EnvPool loop) measured in the same run, and ``ratio`` is
gearflow's rate over the floor's, so the numbers compare on a noisy machine.
``cluster`` is the exception: a model (``--simulate``), its lines are the figures it
measured, one modelled size each, and a summary (``gearflow/bench/cluster.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

from gearflow.errors import GearflowError

SUITES = {
    "replay": "gearflow.bench.replay",
    "actors": "gearflow.bench.actors",
    "keys": "gearflow.bench.keys",
    "transport": "gearflow.bench.transport",
    "cluster": "gearflow.bench.cluster",
    "learner": "gearflow.bench.learner",
}
CUDA_SUITES = ("replay", "learner")  # the suites with a --device cuda run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", choices=sorted(SUITES), help="which benchmark suite to run")
    parser.add_argument("--json", action="store_true", help="JSON lines only (no table)")
    parser.add_argument(
        "--workloads", default="", help="comma-separated workload names to run (default: all)"
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply the sizes and durations of the workloads (e.g. 0.1 for a smoke run)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="replay: cpu (the replay core against the CPU floors) or cuda (zero-copy gather vs pinned "
        "memcpy and staging, device sampling at 1e6/1e7 items, Table(device='cuda') end to end); "
        "learner: the learner's device",
    )
    parser.add_argument(
        "--config", default="", action=_Configs,
        help="actors, cluster: the run config to measure (default configs/cartpole_apex.yaml); learner: "
        "configs to measure, repeated or comma-separated (a path, or a name under configs/: pong_apex, paper/mat_2m)",
    )
    parser.add_argument(
        "--seconds", type=float, default=0.0,
        help="learner: seconds of each timed phase (default 2 on cpu, 1 on cuda, x --scale)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=0.0,
        help="learner: the whole run's seconds (0: unbounded): each config gets an equal share of what is "
        "left, its later rounds and its graph form are cut where the share is spent, and configs not "
        "started in time are named skipped (launch/gpu_check.sh's step has a limit)",
    )
    parser.add_argument(
        "--run-dir", default="", help="actors: run directory of the learner workload (default runs/bench-actors-<time>)"
    )
    from gearflow.bench import cluster  # its options (numpy only at import)
    from gearflow.bench import transport as transport_suite

    cluster.add_arguments(parser)
    transport_suite.add_arguments(parser)


class _Configs(argparse.Action):
    """``--config`` given again adds to the list (comma-separated in ``args.config``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        before = getattr(namespace, self.dest, "") or ""
        setattr(namespace, self.dest, ",".join(c for c in (before, values) if c))


def record(bench: str, workload: str, metric: str, value: float, unit: str, floor: float | None = None) -> dict:
    """One measurement; ``ratio`` = value / floor when a floor was measured."""
    return {
        "bench": bench,
        "workload": workload,
        "metric": metric,
        "value": float(value),
        "unit": unit,
        "floor": None if floor is None else float(floor),
        "ratio": None if not floor else float(value) / float(floor),
    }


def emit(record: dict[str, Any], as_json: bool) -> None:
    """Print one measurement: a JSON line, or a readable row."""
    if as_json:
        print(json.dumps(record), flush=True)
        return
    ratio = record.get("ratio")
    floor = record.get("floor")
    extra = ""
    if floor is not None:
        extra = f"  floor {floor:,.4g}  ratio {ratio:.3f}" if ratio is not None else f"  floor {floor:,.4g}"
    print(
        f"{record['bench']}/{record['workload']:<14} {record['metric']:<28} "
        f"{record['value']:>14,.4g} {record['unit']:<10}{extra}",
        flush=True,
    )


def main(args: argparse.Namespace) -> int:
    if args.device != "cpu" and args.suite not in CUDA_SUITES:
        raise GearflowError(f"--device {args.device}: only the {' and '.join(CUDA_SUITES)} suites have a CUDA benchmark")
    cuda_module = args.device == "cuda" and args.suite == "replay"
    suite = SUITES[args.suite] + ("_cuda" if cuda_module else "")  # replay_cuda: the GPU workloads
    module = importlib.import_module(suite)
    wanted = [w for w in args.workloads.split(",") if w]
    return int(module.run(args, wanted, lambda rec: emit(rec, args.json)) or 0)


