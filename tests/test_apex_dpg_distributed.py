"""agents.apex_dpg under data-parallel learners (real spawned gloo ranks, as tests/test_distributed.py):
two ranks learning from the halves of a global batch stay identical (two optimizers, the policy
stepped every ``policy_delay`` updates, Polyak targets) and equal one learner on the whole batch;
with target policy smoothing (each rank draws its own share's noise) they still stay identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_distributed import flat_params, free_port, spawn

from gearflow.bench.data_parallel import make_learner_agent, random_batch, share
from gearflow.distributed import DataParallel

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "pendulum_dpg.yaml")
GLOBAL_BATCH, STEPS = 64, 6
SMALL = ["agent.hidden_sizes=[32, 32]", "agent.policy_delay=2"]


def make_dpg(seed: int, smoothing: bool):
    overrides = [*SMALL, f"agent.target_noise={0.2 if smoothing else 0.0}"]
    return make_learner_agent(CONFIG, overrides, seed, "cpu")[1]


def every_param(agent) -> torch.Tensor:
    return torch.cat([flat_params(agent.online), flat_params(agent.target)])


def _learn_shares(rank, world, port, out: Path, smoothing: bool):
    agent = make_dpg(seed=100 + rank, smoothing=smoothing)  # different weights per rank: setup() makes them rank 0's
    parallel = DataParallel(rank, world, f"127.0.0.1:{port}", "auto", "cpu", timeout_s=240).init()
    try:
        parallel.setup(agent)
        record = {"initial": every_param(agent), "steps": [], "prio": []}
        for step in range(STEPS):
            _, prio = agent.learn(share(random_batch(agent, GLOBAL_BATCH, seed=step), rank, world))
            record["steps"].append(every_param(agent))
            record["prio"].append(prio.clone())
        record["optimizer_steps"] = [int(s["step"]) for opt in (agent.policy_optimizer, agent.critic_optimizer)
                                     for s in opt.state_dict()["state"].values()]  # fmt: skip
        torch.save(record, out / f"rank{rank}.pt")
    finally:
        parallel.close()


@pytest.mark.timeout(600)
def test_two_ranks_equal_one_learner_on_the_global_batch(tmp_path):
    spawn(_learn_shares, 2, free_port(), tmp_path, False)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert torch.equal(r0["initial"], r1["initial"])
    single = make_dpg(seed=100, smoothing=False)
    torch.testing.assert_close(every_param(single), r0["initial"], rtol=0, atol=0)
    for step in range(STEPS):
        batch = random_batch(single, GLOBAL_BATCH, seed=step)
        _, prio = single.learn(batch)
        assert torch.equal(r0["steps"][step], r1["steps"][step]), f"ranks differ after step {step + 1}"
        previous = r0["steps"][step - 1] if step else r0["initial"]
        assert (r0["steps"][step] - previous).abs().max() > 1e-6
        # Adam's step is lr · m/(√v + eps), up to lr = 1e-3 per weight: a weight whose gradient sums to
        # almost 0 may land 1e-6 apart from one summation order to the other (seen once at step 1)
        torch.testing.assert_close(r0["steps"][step], every_param(single), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"step {step + 1}: 2 ranks ≠ one learner: {m}")  # fmt: skip
        # each rank's priorities are its share's |TD| under the same weights as the single learner
        torch.testing.assert_close(torch.cat([r0["prio"][step], r1["prio"][step]]), prio, rtol=1e-5, atol=1e-5)
    # 6 critic steps, 3 policy steps, the same on both ranks (the averaging pairs step for step)
    assert r0["optimizer_steps"] == r1["optimizer_steps"]
    assert sorted(set(r0["optimizer_steps"])) == [STEPS // 2, STEPS]


@pytest.mark.timeout(600)
def test_ranks_stay_identical_with_target_smoothing(tmp_path):
    spawn(_learn_shares, 2, free_port(), tmp_path, True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for step in range(STEPS):
        assert torch.equal(r0["steps"][step], r1["steps"][step]), f"ranks differ after step {step + 1}"
