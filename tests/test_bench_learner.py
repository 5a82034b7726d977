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


def test_a_budget_shares_itself_among_the_configs_and_cuts_what_does_not_fit(capsys, monkeypatch):
    """``--budget-s``: the do-nothing loop first, each config a deadline at an equal share of what
    is left, and configs that cannot start named skipped (the GPU call's step has a limit). The
    configs here stand in by recording their deadlines and taking the time their share gives."""
    import time

    from gearflow.bench import learner

    seen = []

    def config(path, device, seconds, emit, seed=0, matmul=None, deadline=None, **_):
        seen.append((learner._name(path), deadline - time.perf_counter()))
        if len(seen) == 2:  # the second config overruns the whole budget: nothing is left for the third
            time.sleep(3.1)

    order = []
    monkeypatch.setattr(learner, "bench_config", config)
    monkeypatch.setattr(learner, "_noop", lambda seconds, seed, emit: order.append(("noop", len(seen))))
    args = bench("--config", "cartpole_apex,halfcheetah_dpg,cartpole_masked_r2d2", "--budget-s", "3")
    assert main(args) == 0
    assert order == [("noop", 0)]  # before any config
    assert [n for n, _ in seen] == ["cartpole_apex", "halfcheetah_dpg"]
    # a third of 3 s, then half of what was left (lower bounds loose: a loaded machine's scheduling)
    assert 0.5 < seen[0][1] <= 1.0 and seen[0][1] < seen[1][1] <= 1.5
    assert "budget spent: skipped cartpole_masked_r2d2" in capsys.readouterr().err


def test_a_config_past_its_deadline_measures_one_round_of_its_eager_form(monkeypatch):
    from gearflow.bench import learner

    calls = {"floor": 0, "loop": 0}

    def floor(*a, **k):
        calls["floor"] += 1
        return 100.0

    def loop(*a, **k):
        calls["loop"] += 1
        return {"updates_per_s": 90.0, "tokens_per_s": 0.0, "wait_fraction": 0.0, "cpu_us_per_update": 1.0}

    monkeypatch.setattr(learner, "learn_floor", floor)
    monkeypatch.setattr(learner, "loop_rate", loop)
    monkeypatch.setattr(learner, "host_reads", lambda *a, **k: None)
    lines = []
    learner.bench_config(learner.config_path("cartpole_apex"), learner.torch.device("cpu"), 0.3, lines.append,
                         rounds=3, deadline=0.0)  # fmt: skip
    assert calls == {"floor": 1, "loop": 1}
    calls.update(floor=0, loop=0)
    learner.bench_config(learner.config_path("cartpole_apex"), learner.torch.device("cpu"), 0.3, lines.append, rounds=3)
    assert calls == {"floor": 3, "loop": 3}
