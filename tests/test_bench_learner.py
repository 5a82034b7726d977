"""``gearflow bench learner``: one config's figures and the do-nothing loop's, as JSON lines with
their floors, on the CPU (short phases: the lines and their sense, not the speed)."""

from __future__ import annotations

import argparse
import json

import pytest

from gearflow.bench import add_arguments, main
from gearflow.errors import GearflowError


def bench(*argv: str) -> list[dict]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["learner", "--json", *argv])


def test_cartpole_and_the_noop_loop_lines(capsys):
    assert main(bench("--config", "cartpole_apex", "--seconds", "0.3")) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    got = {(r["workload"], r["metric"]): r for r in lines}
    assert all(r["bench"] == "learner" for r in lines)
    loop = got["cartpole_apex", "loop_updates_per_s"]
    floor = got["cartpole_apex", "learn_updates_per_s"]["value"]
    assert loop["floor"] == floor > 0 and loop["ratio"] == pytest.approx(loop["value"] / floor)
    assert got["cartpole_apex", "host_reads_per_update"]["value"] == 0
    assert got["cartpole_apex", "aten_ops_per_update"]["value"] > 20
    assert 0 <= got["cartpole_apex", "wait_fraction"]["value"] <= 1
    assert got["cartpole_apex", "learn_gflop_per_update"]["value"] > 0
    noop = got["noop", "loop_cpu_us_per_update"]
    assert noop["value"] > 0 and noop["floor"] > 0 and got["noop", "loop_wall_us_per_update"]["value"] > 0


def test_configs_repeat_or_comma_separate_and_cuda_without_a_gpu_is_said():
    args = bench("--config", "pong_apex", "--config", "paper/mat_2m,halfcheetah_dpg")
    assert args.config == "pong_apex,paper/mat_2m,halfcheetah_dpg"
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(GearflowError, match="torch sees no CUDA device"):
            main(bench("--device", "cuda"))
    with pytest.raises(GearflowError, match="neither a YAML file nor a config"):
        main(bench("--config", "no_such_config", "--seconds", "0.1"))
