"""agents.apex_dqn: networks, double-Q n-step targets, PER-weighted learning, target copies."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from agents.apex_dqn import Agent, Config, NatureCNN, n_step_targets
from gearflow.agent import ActOutput, load_agent_class, make_agent
from gearflow.config import field_docs, load_config
from gearflow.envs import EnvSpec
from gearflow.errors import ConfigError
from gearflow.kinds.transition import Transition
from gearflow.replay import Sample, TableSpec

VEC = EnvSpec(obs_shape=(4,), obs_dtype=np.dtype(np.float32), num_actions=2)


def make(overrides=(), spec=VEC) -> Agent:
    cfg = load_config(None, ["run.seed=0", *overrides])
    return make_agent(cfg, spec, torch.device("cpu"))


def linear_net(agent: Agent, weight, bias):
    """A Q-network with no hidden layer and no dueling: Q(s) = W s + b, exactly."""
    net = agent.make_network()
    with torch.no_grad():
        net.q.weight.copy_(torch.tensor(weight, dtype=torch.float32))
        net.q.bias.copy_(torch.tensor(bias, dtype=torch.float32))
    return net


def batch(B=32, seed=0, obs_dim=4, A=2, disc=0.9) -> Sample:
    g = torch.Generator().manual_seed(seed)
    data = {
        "obs": torch.randn(B, obs_dim, generator=g),
        "action": torch.randint(0, A, (B,), generator=g),
        "ret": torch.randn(B, generator=g),
        "disc": torch.full((B,), disc),
        "version": torch.zeros(B, dtype=torch.int64),
        "next_obs": torch.randn(B, obs_dim, generator=g),
    }
    w = torch.rand(B, generator=g) * 0.5 + 0.5
    return Sample(
        data=data, keys=torch.arange(B), weights=w / w.max(), probabilities=torch.full((B,), 1 / B)
    )


def test_module_loads_by_import_path_and_documents_every_field():
    assert load_agent_class("agents.apex_dqn") is Agent
    docs = field_docs(Config)
    for name in Config.__dataclass_fields__:
        assert docs.get(name), f"Config.{name} has no docstring"
    source = inspect.getsource(inspect.getmodule(Agent)).splitlines()
    assert "arxiv.org/abs/1803.00933" in "\n".join(source[:3])  # the paper, at the top


def test_load_agent_class_errors_name_the_agent():
    with pytest.raises(ConfigError, match=r"agent.name='agents.no_such_agent'"):
        load_agent_class("agents.no_such_agent")
    with pytest.raises(ConfigError, match=r"agent.name='gearflow.errors'.*no Agent class"):
        load_agent_class("gearflow.errors")


def test_replay_columns_and_item_kind():
    agent = make()
    assert agent.replay_columns() == {
        "obs": "float32[4]",
        "action": "int64",
        "ret": "float32",
        "disc": "float32",
        "version": "int64",
    }
    spec = TableSpec.parse(agent.replay_columns())
    assert (
        spec["obs"].shape == (4,) and spec["ret"].shape == () and spec["action"].dtype == np.int64
    )
    assert agent.item_kind() == Transition(next_columns=("obs",))
    atari = make(["agent.network=nature_cnn"], EnvSpec((4, 84, 84), np.dtype(np.uint8), 6))
    assert atari.replay_columns()["obs"] == "uint8[4,84,84]"


def test_nature_cnn_forward_on_uint8_frames():
    agent = make(["agent.network=nature_cnn"], EnvSpec((4, 84, 84), np.dtype(np.uint8), 6))
    net = agent.make_network()
    assert isinstance(net.torso, NatureCNN)
    frames = torch.randint(0, 256, (5, 4, 84, 84), dtype=torch.uint8)
    q = net(frames)
    assert q.shape == (5, 6) and q.dtype == torch.float32 and torch.isfinite(q).all()
    # scaled by 1/255: the same frames as floats in [0, 1] through the convs give the same Q
    torch.testing.assert_close(
        net.torso.fc(net.torso.convs(frames.float() / 255)), net.torso(frames)
    )
    with pytest.raises(ConfigError, match="nature_cnn needs"):
        make(["agent.network=nature_cnn"])


def test_act_is_greedy_at_epsilon_zero_and_uniform_at_one():
    agent = make(["agent.hidden_sizes=[]", "agent.dueling=false"])
    net = linear_net(agent, [[1, 0, 0, 0], [0, 1, 0, 0]], [0, 0])
    obs = np.array([[1, 0, 0, 0], [0, 1, 0, 0], [2, 3, 0, 0]], dtype=np.float32)
    with torch.no_grad():
        out = agent.act(net, obs, np.zeros(3))
    assert isinstance(out, ActOutput)
    assert out.actions.dtype == np.int64 and out.actions.tolist() == [0, 1, 1]
    np.testing.assert_allclose(out.values, obs[:, :2])
    many = np.repeat(obs[:1], 2000, axis=0)
    with torch.no_grad():
        rand = agent.act(net, many, np.ones(2000), np.random.default_rng(0)).actions
    assert 0.45 < rand.mean() < 0.55


def test_double_q_target_on_a_hand_made_example():
    agent = make(["agent.hidden_sizes=[]", "agent.dueling=false"])
    # next_obs = e0: online Q = [1, 2] picks action 1; target Q = [5, 3] values it at 3
    online = linear_net(agent, [[1, 0, 0, 0], [2, 0, 0, 0]], [0, 0])
    target = linear_net(agent, [[5, 0, 0, 0], [3, 0, 0, 0]], [0, 0])
    next_obs = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]])
    ret, disc = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0])
    y = n_step_targets(online, target, next_obs, ret, disc, double=True)
    torch.testing.assert_close(y, torch.tensor([1.0 + 0.5 * 3, 2.0]))
    y_plain = n_step_targets(online, target, next_obs, ret, disc, double=False)
    torch.testing.assert_close(y_plain, torch.tensor([1.0 + 0.5 * 5, 2.0]))


def test_learn_priorities_are_the_td_errors_before_the_update():
    agent = make(
        ["agent.hidden_sizes=[]", "agent.dueling=false", "agent.target_update_period=1000"]
    )
    agent.setup_learner()
    agent.online.load_state_dict(
        linear_net(agent, [[1, 0, 0, 0], [2, 0, 0, 0]], [0, 0]).state_dict()
    )
    agent.target.load_state_dict(
        linear_net(agent, [[5, 0, 0, 0], [3, 0, 0, 0]], [0, 0]).state_dict()
    )
    data = {
        "obs": torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0]]),  # online Q: [1, 2], [2, 4]
        "action": torch.tensor([0, 1]),
        "ret": torch.tensor([1.0, -1.0]),
        "disc": torch.tensor([0.9, 0.0]),
        "version": torch.zeros(2, dtype=torch.int64),
        "next_obs": torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]]),  # double-Q bootstrap: 3
    }
    sample = Sample(data, torch.arange(2), torch.tensor([1.0, 0.5]), torch.full((2,), 0.5))
    metrics, prio = agent.learn(sample)
    # y = [1 + 0.9 * 3, -1 + 0] = [3.7, -1]; Q(s, a) = [1, 4]; |td| = [2.7, 5]
    torch.testing.assert_close(prio, torch.tensor([2.7, 5.0]))
    # Huber(δ=1) weighted by the IS weights: mean(1 * (2.7 - 0.5), 0.5 * (5 - 0.5))
    assert metrics["learner/loss"] == pytest.approx((2.2 + 0.5 * 4.5) / 2, rel=1e-5)
    assert metrics["learner/td_abs_mean"] == pytest.approx(3.85, rel=1e-5)
    assert metrics["learner/q_mean"] == pytest.approx(9 / 4, rel=1e-5)
    assert metrics["learner/updates"] == 1.0


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_learn_reduces_the_loss_on_a_fixed_batch(optimizer):
    torch.manual_seed(0)
    agent = make(
        [
            f"agent.optimizer={optimizer}",
            "agent.lr=3e-3",
            "agent.hidden_sizes=[64, 64]",
            "agent.target_update_period=100000",
        ]
    )
    agent.setup_learner()
    b = batch(B=64)
    losses = []
    for _ in range(200):
        metrics, prio = agent.learn(b)
        losses.append(metrics["learner/loss"])
        assert prio.shape == (64,) and (prio >= 0).all()
    assert set(metrics) == {
        "learner/loss",
        "learner/q_mean",
        "learner/td_abs_mean",
        "learner/grad_norm",
        "learner/updates",
    }
    assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:3])  # 0.003 / 0.07 over 20 seeds


def test_target_network_copied_every_k_updates():
    agent = make(["agent.target_update_period=3", "agent.lr=1e-2"])
    agent.setup_learner()
    b = batch()

    def same() -> bool:
        return all(
            torch.equal(p, q) for p, q in zip(agent.online.parameters(), agent.target.parameters())
        )

    assert same()  # the target starts as a copy
    seen = []
    for _ in range(7):
        agent.learn(b)
        seen.append(same())
    assert seen == [False, False, True, False, False, True, False]
    assert not any(p.requires_grad for p in agent.target.parameters())


def test_grad_norm_is_clipped():
    agent = make(["agent.max_grad_norm=1e-3", "agent.lr=1.0", "agent.optimizer=rmsprop"])
    agent.setup_learner()
    before = [p.detach().clone() for p in agent.online.parameters()]
    b = batch()
    b.data["ret"] *= 1000
    metrics, _ = agent.learn(b)
    assert metrics["learner/grad_norm"] > 1e-3  # reported before clipping
    assert all(torch.isfinite(p).all() for p in agent.online.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(before, agent.online.parameters()))


def test_state_dict_round_trip_continues_identically():
    a, b = make(["agent.target_update_period=2"]), make(["agent.target_update_period=2"])
    a.setup_learner()
    batch0, batch1 = batch(seed=1), batch(seed=2)
    a.learn(batch0)
    b.load_state_dict(a.state_dict())
    assert b.updates == 1
    ma, pa = a.learn(batch1)
    mb, pb = b.learn(batch1)
    assert ma == mb
    torch.testing.assert_close(pa, pb)
    assert a.learner_network() is a.online
