"""The learner loop around ``agent.learn``: bf16, in-place compile, throughput metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gearflow.config import load_config
from gearflow.topology.learn import Runner
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
        table, sel = runner.table, runner.table.selector
        keys = sample.keys.numpy().copy()  # the batch's buffers are reused by later samples
        P, R = table.storage.num_partitions, table.storage.items_per_partition
        slots = (keys % P) * R + (keys // P) % R
        before = sel.tree.leaves[slots].copy()  # masses p ** alpha as the actors wrote them
        learned = []
        learn = runner.agent.learn

        def recording_learn(batch):
            assert not torch.is_autocast_enabled("cpu")  # the agent autocasts its forward passes only
            metrics, priorities = learn(batch)
            learned.append(priorities.detach().float().double().numpy().copy())
            return metrics, priorities

        runner.agent.learn = recording_learn
        metrics = runner.learner.learn_step(sample)
        assert torch.isfinite(torch.as_tensor(metrics["learner/loss"]))
        # the table now holds the agent's priorities for exactly the sampled items
        (prios,) = learned
        assert prios.shape == (32,) and (prios > 0).all()
        want = dict(zip(slots.tolist(), prios ** sel.alpha))  # a key drawn twice: its last value
        np.testing.assert_allclose(sel.tree.leaves[list(want)], list(want.values()), rtol=1e-12)
        assert not np.allclose(sel.tree.leaves[slots], before)  # they changed
        assert sel.tree.total == pytest.approx(sel.tree.leaves.sum())
        assert runner.progress.updates == 1 and runner.progress.samples == 32
        assert runner.progress.tokens == 32  # transitions: one step each
        row = runner.learner.snapshot(metrics)
        assert row["learner/samples"] == 32 and row["learner/tokens"] == 32
    finally:
        _close(runner)


def test_bf16_autocast_really_runs_the_forward_in_bf16():
    """learner.bf16: the torso in bf16; Q-values, priorities and the optimizer step in fp32
    (more in tests/test_bf16_learning.py)."""
    from tests.test_apex_dqn import make

    agent = make(["learner.bf16=true"])
    agent.setup_learner()
    seen, q_dtypes, step_autocast = [], [], []
    agent.online.torso.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    agent.online.register_forward_hook(lambda m, i, o: q_dtypes.append(o.dtype))
    agent.optimizer.register_step_pre_hook(lambda *a: step_autocast.append(torch.is_autocast_enabled("cpu")))
    _, priorities = agent.learn(batch())
    assert torch.bfloat16 in seen and set(q_dtypes) == {torch.float32}
    assert priorities.dtype == torch.float32 and priorities.isfinite().all()
    assert step_autocast == [False]


def test_bf16_with_an_agent_that_does_not_apply_it_is_said(caplog):
    """The learner no longer autocasts agent.learn: an agent without the bf16 pattern
    (docs/custom_agent.md) learns in fp32, and the learner says so once, at start."""
    from types import SimpleNamespace

    from gearflow.learner import Learner, Progress

    cfg = load_config(None, ["learner.bf16=true"])
    with caplog.at_level("WARNING", logger="gearflow.runner"):
        Learner(cfg.learner, SimpleNamespace(), None, None, Progress(), run=cfg.run, env_steps=lambda: 0, actor_version=lambda: 0)
    assert "does not say it runs its forward passes in bf16" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="gearflow.runner"):
        Learner(cfg.learner, SimpleNamespace(bf16=True), None, None, Progress(), run=cfg.run, env_steps=lambda: 0, actor_version=lambda: 0)
    assert "bf16" not in caplog.text


def test_compile_is_applied_in_place_before_training(tmp_path):
    runner = _runner(tmp_path, "learner.compile=true")
    try:
        net = runner.agent.learner_network()
        assert net._compiled_call_impl is not None  # nn.Module.compile(): lazy, compiled on first call
        assert set(net.state_dict()) == set(runner.agent.make_network().state_dict())  # names unchanged
    finally:
        _close(runner)
    assert not [n for n, owner, _ in list_segments() if owner == __import__("os").getpid()]


def test_policy_lag_counts_only_actors_that_have_acted():
    """An actor process still starting (0 env steps, weights version 0) is not the oldest policy."""
    from gearflow.learner import Progress

    p = Progress()
    assert p.actor_weights_version() == -1
    p.actor_counters[0] = {"actor/env_steps": 4000, "actor/weight_version": 7}
    p.actor_counters[1] = {"actor/env_steps": 0, "actor/weight_version": 0}
    assert p.actor_weights_version() == 7
    p.actor_counters[1] = {"actor/env_steps": 16, "actor/weight_version": 5}
    assert p.actor_weights_version() == 5


def test_the_stop_rule_reads_the_greediest_actor_that_is_acting():
    """``run.stop_at_return`` reads the highest-index actor that reported lately (``ACTING_S``):
    a greedier actor that went quiet (held by a starved node's rate limiter, dead, restarting)
    is passed over, and read again once it reports; the metric reads the same actor."""
    import time
    from types import SimpleNamespace

    from gearflow.learner import ACTING_S, Learner, Progress

    p = Progress()
    for _ in range(100):
        p.add_episode(0, 480.0)  # acting now, and good
        p.add_episode(1, 10.0)  # the greediest index
    cfg = load_config(None, ["run.stop_at_return=475"])
    learner = Learner(cfg.learner, SimpleNamespace(), None, None, p, run=cfg.run, env_steps=lambda: 0,
                      actor_version=lambda: 0)  # fmt: skip
    assert learner.done() == "" and p.greediest() == 1  # both acting: actor 1 is the one read
    now = time.monotonic()
    p.saw(1, now - 2 * ACTING_S)  # actor 1 stalled: nothing from it for twice the window
    assert p.greediest(now) == 0 and p.greediest_return(now) == 480.0
    assert learner.done() == "reached run.stop_at_return=475.0"
    from gearflow.reports import fold_report

    fold_report(p, {"type": "counters", "actor": 1, "actor/env_steps": 5})  # a report from it: acting again
    assert p.greediest() == 1 and learner.done() == ""
    p.seen.clear()  # nobody acting (a resumed run before the first reports): no stop, the metric the last one's
    assert p.greediest() is None and learner.done() == "" and p.greediest_return() == 10.0
