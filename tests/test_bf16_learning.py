"""bf16 learns what fp32 learns: targets, TD errors and priorities of a bf16 learner step match fp32's.

Each agent's step runs twice from the same weights on the same batch: in fp32, and in bf16
two ways: under ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the whole ``learn``
(what the learner did before gearflow/precision.py) and with ``learner.bf16=true`` (the
agent's own autocast over its forward passes). The tolerances (Ape-X 0.01, R2D2 0.02) are
well above what the bf16 torso adds to an fp32 head (measured: Ape-X 0.0019, R2D2 0.0057 at
most) and well below what the whole-``learn`` autocast gave (Ape-X: targets 0.078, priorities
0.10 with Q near 10 and a mean |TD| of 0.39; R2D2: 0.86 for a mean |TD| of 0.40, h⁻¹ in bf16).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow.replay import Sample

TESTS = str(Path(__file__).parent)

HOW = ["autocast_around_learn", "learner.bf16"]


@pytest.fixture(autouse=True)
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def bf16_context(how: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if how == "autocast_around_learn" else contextlib.nullcontext()


def overrides(how: str) -> list[str]:
    return ["learner.bf16=true"] if how == "learner.bf16" else []


def record_dtypes(module: torch.nn.Module) -> list:
    """Output dtypes of every Linear/Conv2d in ``module``'s forward passes."""
    seen: list = []
    for m in module.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)):
            m.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    return seen


def record_step_autocast(optimizer: torch.optim.Optimizer) -> list:
    """Whether autocast was on at each ``optimizer.step``."""
    seen: list = []
    optimizer.register_step_pre_hook(lambda *a: seen.append(torch.is_autocast_enabled("cpu")))
    return seen


# --------------------------------------------------------------------------- Ape-X DQN


def apex_step(how: str | None):
    from agents.apex_dqn import n_step_targets
    from tests.test_apex_dqn import batch, make

    torch.manual_seed(0)  # the same initial weights in every run
    agent = make(["agent.hidden_sizes=[64,64]", *([] if how is None else overrides(how))])
    agent.setup_learner()
    with torch.no_grad():  # Q near 10, TD errors near 0.4: a learned Atari agent's scale
        agent.online.value.bias.fill_(10.0)
        agent.target.load_state_dict(agent.online.state_dict())
    b = batch(B=64)
    b.data["ret"] = b.data["ret"] * 0.3 + 1.0
    dtypes, steps = record_dtypes(agent.online), record_step_autocast(agent.optimizer)
    bf16 = {"bf16": agent.bf16} if hasattr(agent, "bf16") else {}  # (before gearflow/precision.py: no flag)
    with bf16_context(how) if how else contextlib.nullcontext():
        y = n_step_targets(agent.online, agent.target, b.data["next_obs"], b.data["ret"], b.data["disc"],
                           agent.cfg.double, **bf16)  # fmt: skip
        q = agent.online(b.data["obs"])
        _, priorities = agent.learn(b)
    q_sa = q.float().gather(1, b.data["action"][:, None]).squeeze(1)
    return {"targets": y.float(), "td": (y.float() - q_sa).detach(), "priorities": priorities.float()}, dtypes, steps


@pytest.mark.parametrize("how", HOW)
def test_apex_dqn_bf16_targets_td_errors_and_priorities_match_fp32(how):
    want, _, _ = apex_step(None)
    got, dtypes, steps = apex_step(how)
    assert torch.bfloat16 in dtypes  # the torso really ran in bf16
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err < 0.01, f"{name}: bf16 differs from fp32 by {err:.4f} (mean |TD| {want['td'].abs().mean():.3f})"
    if how == "learner.bf16":
        assert steps == [False]  # the optimizer step outside autocast


# --------------------------------------------------------------------------- R2D2 transformer


def r2d2_step(how: str | None):
    from tests import test_r2d2 as R

    torch.manual_seed(0)
    agent = R.agent_for(R.config([] if how is None else overrides(how)))
    agent.setup_learner()
    with torch.no_grad():  # rescaled Q near 2 (h⁻¹(2) = 7.95): what a learning R2D2 sees
        agent.online.head.bias.fill_(2.0)
        agent.target.load_state_dict(agent.online.state_dict())
    sample = R.batch(np.random.default_rng(0))
    dtypes, steps = record_dtypes(agent.online), record_step_autocast(agent.optimizer)
    with bf16_context(how) if how else contextlib.nullcontext():
        with torch.no_grad():
            _, td, valid, q = agent.loss(sample)
        _, priorities = agent.learn(sample)
    td = torch.where(valid, td.float(), torch.zeros(()))
    q_sa = q.float().gather(2, sample.data["action"][..., None]).squeeze(2)
    targets = torch.where(valid, td + q_sa, torch.zeros(()))
    return {"targets": targets, "td": td, "priorities": priorities.float()}, dtypes, steps


@pytest.mark.parametrize("how", HOW)
def test_r2d2_bf16_targets_td_errors_and_priorities_match_fp32(how):
    want, _, _ = r2d2_step(None)
    got, dtypes, steps = r2d2_step(how)
    assert torch.bfloat16 in dtypes
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err < 0.02, f"{name}: bf16 differs from fp32 by {err:.4f} (mean |TD| {want['td'].abs().mean():.3f})"
    if how == "learner.bf16":
        assert steps == [False]


# --------------------------------------------------------------------------- Decision Transformer


def dt_step(how: str | None, continuous: bool):
    from agents.decision_transformer import sample_windows
    from tests import test_decision_transformer as D

    cfg = D.config(["agent.target_return=500", *([] if how is None else overrides(how))])
    torch.manual_seed(0)
    agent = D.continuous_agent(cfg) if continuous else D.discrete_agent(cfg)
    agent.setup_learner()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in agent.online.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    act = (lambda B, T, g: torch.rand(B, T, 2, generator=g) * 3.98 - 1.99) if continuous else None
    data = D.episode_batch([[100.0] * 8, [0.5] * 5, [200.0, 1.0, 0.0]], act=act)
    sample = Sample(data, torch.arange(3), torch.ones(3), torch.full((3,), 1 / 3))
    dtypes, steps = record_dtypes(agent.online), record_step_autocast(agent.optimizer)
    with bf16_context(how) if how else contextlib.nullcontext():
        w = sample_windows(data, agent.cfg.context, starts=torch.zeros(3, dtype=torch.long))
        torch.manual_seed(1)  # the continuous loss's entropy sample
        with torch.no_grad():
            loss, _, _ = agent.loss(w)
        _, priorities = agent.learn(sample)
    return {"targets": w["rtg"].float(), "loss": loss.float(), "priorities": priorities.double()}, dtypes, steps


@pytest.mark.parametrize("continuous", [False, True], ids=["discrete", "continuous"])
@pytest.mark.parametrize("how", HOW)
def test_decision_transformer_bf16_targets_loss_and_priorities_match_fp32(how, continuous):
    """The DT's targets (hindsight returns-to-go) and priorities (item return) never go through
    the network: equal exactly. Its action loss within 1 %."""
    want, _, _ = dt_step(None, continuous)
    got, dtypes, steps = dt_step(how, continuous)
    assert torch.bfloat16 in dtypes
    assert torch.equal(got["targets"], want["targets"]) and torch.equal(got["priorities"], want["priorities"])
    assert got["loss"].item() == pytest.approx(want["loss"].item(), rel=0.01, abs=0.01)
    if how == "learner.bf16":
        assert steps == [False]


# --------------------------------------------------------------------------- Ape-X DPG


def record_matmul_dtypes() -> tuple[torch.overrides.TorchFunctionMode, list]:
    """Output dtypes of the critics' batched matmuls (``baddbmm``/``addmm``, not nn.Linear)."""
    seen: list = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.baddbmm, torch.addmm):
                seen.append(out.dtype)
            return out

    return Mode(), seen


def dpg_step(how: str | None):
    from agents.apex_dpg import n_step_targets
    from gearflow.precision import bf16_forward
    from tests.test_apex_dpg import make, sample

    torch.manual_seed(0)  # the same initial weights in every run
    agent = make(["agent.hidden_sizes=[64,64]", "agent.policy_delay=1", *([] if how is None else overrides(how))])
    agent.setup_learner()
    with torch.no_grad():  # Q near -100, Pendulum's scale (rewards down to -16, γ = 0.99)
        agent.online.critics.biases[-1].fill_(-100.0)
        agent.target.load_state_dict(agent.online.state_dict())
    g = torch.Generator().manual_seed(1)
    B = 64
    data = {"obs": torch.randn(B, 3, generator=g), "action": torch.rand(B, 1, generator=g) * 4 - 2,
            "ret": torch.randn(B, generator=g) * 5 - 10, "disc": torch.full((B,), 0.99 ** 3),
            "version": torch.zeros(B, dtype=torch.int64), "next_obs": torch.randn(B, 3, generator=g)}  # fmt: skip
    noise = (torch.randn(B, 1, generator=g) * 0.2)  # the targets' smoothing draw, the same in every run
    bf16 = getattr(agent, "bf16", False)  # (before the agent applied learner.bf16: no flag)
    dtypes = record_dtypes(agent.online)
    steps: list = []
    for opt in (agent.critic_optimizer, agent.policy_optimizer):
        opt.register_step_pre_hook(lambda *a: steps.append(torch.is_autocast_enabled("cpu")))
    mode, matmuls = record_matmul_dtypes()
    with bf16_context(how) if how else contextlib.nullcontext(), mode:
        kw = {"bf16": bf16} if bf16 else {}
        y = n_step_targets(agent.target, data["next_obs"], data["ret"], data["disc"], noise, 0.5, **kw)
        with bf16_forward("cpu", bf16), torch.no_grad():
            q1 = agent.online.critics.first(data["obs"], agent.normalise(data["action"]))
        _, priorities = agent.learn(sample(data, [1.0] * B))
    return {"targets": y.float(), "td": (y.float() - q1.float()), "priorities": priorities.float()}, dtypes, matmuls, steps


@pytest.mark.parametrize("how", HOW)
def test_apex_dpg_bf16_targets_td_errors_and_priorities_match_fp32(how):
    """Q near -100: measured 0.0011 (targets), 0.0009 (priorities) at most with the fp32 output
    layers; before agents/apex_dpg.py applied learner.bf16, autocast around ``learn`` gave 0.22
    (bf16 steps of 0.5 near 100) and ``learner.bf16=true`` learned in fp32 (no bf16 layer)."""
    want, _, _, _ = dpg_step(None)
    got, dtypes, matmuls, steps = dpg_step(how)
    assert torch.bfloat16 in dtypes, "the policy's hidden layers did not run in bf16"
    assert torch.bfloat16 in matmuls, "the critics' hidden layers did not run in bf16"
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err < 0.01, f"{name}: bf16 differs from fp32 by {err:.4f} (mean |TD| {want['td'].abs().mean():.3f})"
    if how == "learner.bf16":
        assert steps == [False, False]  # the critic's and the policy's steps outside autocast
