"""The learner loop around ``agent.learn``: bf16 autocast, in-place compile, throughput metrics."""

from __future__ import annotations

import torch

from gearflow.config import load_config
from gearflow.runner import Runner
from gearflow.replay.storage import list_segments

from tests.test_apex_dqn import batch

TINY = ["replay.capacity=2000", "replay.min_size_to_sample=64", "learner.batch_size=32",
        "env.num_envs=2", "env.batch_size=2", "run.serial=true"]  # fmt: skip


def _runner(tmp_path, *overrides):
    cfg = load_config("configs/cartpole_apex.yaml", [*TINY, f"run.dir={tmp_path}", *overrides])
    runner = Runner(cfg)
    runner.connect_components()
    return runner


def _close(runner):
    runner.serial_actor.close()
    runner.table.close()
    runner.params.close()


def test_bf16_learn_step_updates_priorities_and_counts_samples(tmp_path):
    runner = _runner(tmp_path, "learner.bf16=true")
    try:
        while runner.table.size < 64:
            runner.serial_actor.step()
            runner.table.scan()
        sample = runner.table.sample(32)
        metrics = runner._learn_step(sample)
        assert torch.isfinite(torch.tensor(metrics["learner/loss"]))
        assert runner.progress.updates == 1 and runner.progress.samples == 32
        assert runner.progress.tokens == 32  # transitions: one step each
        row = runner.snapshot(metrics)
        assert row["learner/samples"] == 32 and row["learner/tokens"] == 32
    finally:
        _close(runner)


def test_bf16_autocast_really_runs_the_forward_in_bf16():
    from tests.test_apex_dqn import make

    agent = make()
    agent.setup_learner()
    seen = []
    agent.online.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, priorities = agent.learn(batch())
    assert torch.bfloat16 in seen
    assert priorities.float().isfinite().all()


def test_compile_is_applied_in_place_before_training(tmp_path):
    runner = _runner(tmp_path, "learner.compile=true")
    try:
        net = runner.agent.learner_network()
        assert net._compiled_call_impl is not None  # nn.Module.compile(): lazy, compiled on first call
        assert set(net.state_dict()) == set(runner.agent.make_network().state_dict())  # names unchanged
    finally:
        _close(runner)
    assert not [n for n, owner, _ in list_segments() if owner == __import__("os").getpid()]
