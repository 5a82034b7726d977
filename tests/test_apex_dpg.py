"""agents.apex_dpg: targets (n-step, twin min, smoothing clip), the IS-weighted critic loss and
its priorities, the policy step, target updates, the noise ladder, actor priorities through the
n-step adder — all on hand-made networks with values worked out by hand."""

from __future__ import annotations

import copy
import inspect
import math

import numpy as np
import pytest
import torch

from agents.apex_dpg import Agent, Config, n_step_targets
from gearflow.actors.base import actor_epsilon
from gearflow.agent import ActOutput, load_agent_class, make_agent
from gearflow.config import field_docs, load_config
from gearflow.envs import EnvSpec
from gearflow.errors import ConfigError
from gearflow.kinds.transition import Transition, TransitionAdder
from gearflow.replay import Sample, TableSpec
from gearflow.replay.writer import Writer


class Box:
    """The two attributes of a gymnasium Box the agent reads."""

    def __init__(self, low, high):
        self.low, self.high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self.shape = self.low.shape


PENDULUM = EnvSpec((3,), np.dtype(np.float32), None, Box([-2.0], [2.0]), "Pendulum-v1")
LINEAR = ["agent.hidden_sizes=[]"]  # μ(s) = tanh(W s + b), Q_j(s, u) = w_j · [s, u] + b_j: exact by hand


def make(overrides=(), spec=PENDULUM) -> Agent:
    cfg = load_config(None, ["run.seed=0", "agent.name=agents.apex_dpg", *overrides])
    return make_agent(cfg, spec, torch.device("cpu"))


def set_linear(net, policy_w, policy_b, critic_w, critic_b):
    """Hand-made weights of a ``hidden_sizes=[]`` network: policy (A, obs), (A,); critics (C, obs + A), (C,)."""
    with torch.no_grad():
        net.policy[0].weight.copy_(torch.tensor(policy_w, dtype=torch.float32))
        net.policy[0].bias.copy_(torch.tensor(policy_b, dtype=torch.float32))
        C = net.critics.num_critics  # one critic: the first of those given
        w = torch.tensor(critic_w, dtype=torch.float32)[:C]  # (C, in)
        net.critics.weights[0].copy_(w.unsqueeze(2))  # (C, in, 1)
        net.critics.biases[0].copy_(torch.tensor(critic_b, dtype=torch.float32)[:C].view(-1, 1, 1))
    return net


def sample(data, weights) -> Sample:
    B = len(weights)
    return Sample(data, torch.arange(B), torch.tensor(weights, dtype=torch.float32), torch.full((B,), 1.0 / B))


def test_module_loads_by_import_path_and_documents_every_field():
    assert load_agent_class("agents.apex_dpg") is Agent
    docs = field_docs(Config)
    for name in Config.__dataclass_fields__:
        assert docs.get(name), f"Config.{name} has no docstring"
    source = inspect.getsource(inspect.getmodule(Agent)).splitlines()
    assert "arxiv.org/abs/1803.00933" in "\n".join(source[:4])


def test_needs_a_bounded_box_and_reads_its_bounds():
    with pytest.raises(ConfigError, match="apex_dpg needs a bounded 1-D Box"):
        make(spec=EnvSpec((4,), np.dtype(np.float32), 2, None, "CartPole-v1"))
    with pytest.raises(ConfigError, match="bounded"):
        make(spec=EnvSpec((4,), np.dtype(np.float32), None, Box([-np.inf], [np.inf]), "x"))
    agent = make(spec=EnvSpec((5,), np.dtype(np.float32), None, Box([-1.0, 0.0], [3.0, 1.0]), "x"))
    assert agent.replay_columns() == {"obs": "float32[5]", "action": "float32[2]", "ret": "float32",
                                      "disc": "float32", "version": "int64"}  # fmt: skip
    assert agent.item_kind() == Transition(next_columns=("obs",))
    assert TableSpec.parse(agent.replay_columns())["action"].shape == (2,)
    np.testing.assert_allclose(agent.to_env(np.array([[-1.0, -1.0], [0.0, 0.5], [1.0, 1.0]])),
                               [[-1.0, 0.0], [1.0, 0.75], [3.0, 1.0]])  # fmt: skip
    np.testing.assert_allclose(agent.normalise(torch.tensor([[1.0, 0.75], [5.0, -1.0]])).numpy(),
                               [[0.0, 0.5], [1.0, -1.0]])  # clipped to the box  # fmt: skip


def test_targets_take_the_twin_minimum_and_clip_the_smoothing_noise():
    agent = make(LINEAR)
    net = agent.make_network()
    # μ'(s) = tanh(atanh 0.5) = 0.5 for every s; Q'_1 = 2u + s0, Q'_2 = 4u - 1 + s0
    set_linear(net, [[0, 0, 0]], [math.atanh(0.5)], [[1, 0, 0, 2], [1, 0, 0, 4]], [0, -1])
    next_obs = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0.0, 0, 0]])
    ret, disc = torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.5, 0.5, 0.0])
    # no smoothing: u = 0.5 → Q'_1 = 2, Q'_2 = 2 → y = 1 + 0.5·2 (row 3 terminated: y = ret)
    y = n_step_targets(net, next_obs, ret, disc, None, 0.5)
    torch.testing.assert_close(y, torch.tensor([2.0, 2.0, 2.0]))
    # noise +0.9 is clipped to +0.5 → u = 1.0: Q'_1 = 3, Q'_2 = 4 → min 3; noise −1.2 is clipped to
    # −0.5 → u = 0: Q'_1 = 1, Q'_2 = 0 → min 0 (unclipped, u = −0.7 would give −2.8)
    noise = torch.tensor([[0.9], [-1.2], [5.0]])
    y = n_step_targets(net, next_obs, ret, disc, noise, 0.5)
    torch.testing.assert_close(y, torch.tensor([1 + 0.5 * 3.0, 1 + 0.5 * 0.0, 2.0]))
    # a clip of 0.8 lets +0.9 through as 0.8; μ + 0.8 = 1.3 is clipped to the box, u = 1 (as above)
    y = n_step_targets(net, next_obs, ret, disc, torch.tensor([[0.9], [-0.8], [0.0]]), 0.8)
    # u = 1.0 → min(3, 4) = 3; u = -0.3 → Q'_1 = 0.4, Q'_2 = -1.2 + 1 - 1 = -1.2 → -1.2
    torch.testing.assert_close(y, torch.tensor([1 + 0.5 * 3.0, 1 + 0.5 * -1.2, 2.0]))
    assert y.dtype == torch.float32


def learner(overrides=()):
    agent = make([*LINEAR, "agent.target_noise=0", *overrides])
    agent.setup_learner()
    set_linear(agent.online, [[0, 0, 0]], [math.atanh(0.5)], [[1, 0, 0, 2], [1, 0, 0, 4]], [0, -1])
    agent.target.load_state_dict(agent.online.state_dict())
    return agent


def test_learn_priorities_and_the_is_weighted_critic_loss_on_a_hand_made_example():
    agent = learner(["agent.critic_lr=0", "agent.policy_lr=0"])  # nothing moves: the values are the update's
    data = {
        "obs": torch.tensor([[1.0, 0, 0], [0.0, 0, 0]]),
        "action": torch.tensor([[1.0], [-2.0]]),  # env units in [-2, 2]: u = 0.5, -1
        "ret": torch.tensor([1.0, -1.0]),
        "disc": torch.tensor([0.5, 0.0]),
        "version": torch.zeros(2, dtype=torch.int64),
        "next_obs": torch.tensor([[1.0, 0, 0], [1.0, 0, 0]]),  # bootstrap min(2, 2) = 2
    }
    metrics, prio = agent.learn(sample(data, [1.0, 0.5]))
    # y = [1 + 0.5·2, -1] = [2, -1]; Q_1(s, u) = [2·0.5 + 1, 2·-1 + 0] = [2, -2]; Q_2 = [4·0.5 - 1 + 1, -4 - 1] = [2, -5]
    # TD_1 = [0, 1], TD_2 = [0, 4]; priorities |TD_1| = [0, 1]
    torch.testing.assert_close(prio, torch.tensor([0.0, 1.0]))
    assert prio.dtype == torch.float32
    # loss = Σ_j mean_B(w · ½ TD_j²) = mean(0, 0.5·0.5·1) + mean(0, 0.5·0.5·16) = 0.125 + 2
    assert metrics["learner/critic_loss"] == pytest.approx(2.125, rel=1e-6)
    assert metrics["learner/td_abs_mean"] == pytest.approx(0.5, rel=1e-6)
    assert metrics["learner/q_mean"] == pytest.approx(0.0, abs=1e-6)
    huber = learner(["agent.critic_lr=0", "agent.policy_lr=0", "agent.huber_delta=1"])
    metrics, _ = huber.learn(sample(data, [1.0, 0.5]))
    # Huber(δ=1): ½·1² = 0.5 for TD 1, 4 - 0.5 = 3.5 for TD 4 → mean(0, 0.25) + mean(0, 1.75)
    assert metrics["learner/critic_loss"] == pytest.approx(0.125 + 0.875, rel=1e-6)
    single = learner(["agent.critic_lr=0", "agent.policy_lr=0", "agent.twin_critics=false"])
    metrics, prio = single.learn(sample(data, [1.0, 0.5]))
    torch.testing.assert_close(prio, torch.tensor([0.0, 1.0]))
    assert metrics["learner/critic_loss"] == pytest.approx(0.125, rel=1e-6)


def test_the_critic_step_follows_the_weighted_gradient_and_the_policy_ascends_q1():
    """One SGD-sized Adam step moves each weight by lr·sign(grad) (Adam's first step): the
    critic's signs come from the IS-weighted TD errors, the policy's from ∂Q₁/∂u = 2 > 0."""
    agent = learner(["agent.critic_lr=0.01", "agent.policy_lr=0.01", "agent.policy_delay=1"])
    data = {
        "obs": torch.tensor([[0.0, 0, 0]]), "action": torch.tensor([[2.0]]),  # u = 1: Q_1 = 2, Q_2 = 3
        "ret": torch.tensor([10.0]), "disc": torch.tensor([0.0]), "version": torch.zeros(1, dtype=torch.int64),
        "next_obs": torch.tensor([[0.0, 0, 0]]),
    }  # fmt: skip
    before = {k: v.clone() for k, v in agent.online.state_dict().items()}
    agent.learn(sample(data, [1.0]))
    after = agent.online.state_dict()
    # TD > 0 for both critics: Q grows, each weight with a nonzero input moves by +lr (u = 1, bias)
    dw = after["critics.weights.0"] - before["critics.weights.0"]  # (C, in, 1)
    torch.testing.assert_close(dw[:, 3, 0], torch.tensor([0.01, 0.01]))
    torch.testing.assert_close(dw[:, :3, 0], torch.zeros(2, 3))  # obs = 0: no gradient
    db = after["critics.biases.0"] - before["critics.biases.0"]
    torch.testing.assert_close(db.view(-1), torch.tensor([0.01, 0.01]))
    # the policy raises μ (∂Q₁/∂u > 0 after the critic step): its bias by +lr
    assert (after["policy.0.bias"] - before["policy.0.bias"]).item() == pytest.approx(0.01, rel=1e-4)


def test_the_preactivation_penalty_adds_to_the_policy_loss():
    data = {"obs": torch.zeros(2, 3), "action": torch.zeros(2, 1), "ret": torch.zeros(2), "disc": torch.zeros(2),
            "version": torch.zeros(2, dtype=torch.int64), "next_obs": torch.zeros(2, 3)}  # fmt: skip
    losses = {}
    for lam in (0.0, 0.1):
        agent = learner(["agent.critic_lr=0", "agent.policy_lr=0", "agent.policy_delay=1", f"agent.preact_l2={lam}"])
        metrics, _ = agent.learn(sample(data, [1.0, 1.0]))
        losses[lam] = metrics["learner/policy_loss"]
    # obs = 0: pre = atanh(0.5), μ = 0.5, Q_1 = 2·0.5 = 1 → −1; the penalty adds 0.1 · atanh(0.5)²
    assert losses[0.0] == pytest.approx(-1.0, rel=1e-6)
    assert losses[0.1] == pytest.approx(-1.0 + 0.1 * math.atanh(0.5) ** 2, rel=1e-6)


def test_policy_delay_and_polyak_targets():
    agent = learner(["agent.policy_delay=2", "agent.tau=0.25", "agent.critic_lr=0.01", "agent.policy_lr=0.01"])
    data = {"obs": torch.randn(8, 3), "action": torch.rand(8, 1) * 4 - 2, "ret": torch.randn(8),
            "disc": torch.full((8,), 0.9), "version": torch.zeros(8, dtype=torch.int64), "next_obs": torch.randn(8, 3)}  # fmt: skip
    policy0 = agent.online.policy[0].bias.clone()
    target0 = {k: v.clone() for k, v in agent.target.state_dict().items()}
    agent.learn(sample(data, [1.0] * 8))
    assert torch.equal(agent.online.policy[0].bias, policy0)  # update 1: critics only
    for k, v in agent.target.state_dict().items():
        assert torch.equal(v, target0[k]), k  # targets move with the policy
    agent.learn(sample(data, [1.0] * 8))
    assert not torch.equal(agent.online.policy[0].bias, policy0)  # update 2: the policy too
    online = agent.online.state_dict()
    for k, v in agent.target.state_dict().items():  # θ' = 0.75 θ'_0 + 0.25 θ
        torch.testing.assert_close(v, 0.75 * target0[k] + 0.25 * online[k])
    assert not any(p.requires_grad for p in agent.target.parameters())


def test_periodic_target_copies():
    agent = learner(["agent.target_update_period=3", "agent.policy_delay=1", "agent.critic_lr=0.01"])
    data = {"obs": torch.randn(8, 3), "action": torch.rand(8, 1) * 4 - 2, "ret": torch.randn(8),
            "disc": torch.full((8,), 0.9), "version": torch.zeros(8, dtype=torch.int64), "next_obs": torch.randn(8, 3)}  # fmt: skip
    seen = []
    for _ in range(7):
        agent.learn(sample(data, [1.0] * 8))
        seen.append(all(torch.equal(p, q) for p, q in zip(agent.online.parameters(), agent.target.parameters())))
    assert seen == [False, False, True, False, False, True, False]


def test_act_is_mu_at_sigma_zero_and_gives_the_priority_values():
    agent = make(LINEAR)
    net = set_linear(agent.make_network(), [[1, 0, 0]], [0], [[1, 0, 0, 2], [1, 0, 0, 4]], [0, -1])
    obs = np.array([[0.0, 0, 0], [math.atanh(0.5), 0, 0]], dtype=np.float32)
    with torch.no_grad():
        out = agent.act(net, obs, np.zeros(2))
    assert isinstance(out, ActOutput) and out.actions.dtype == np.float32 and out.actions.shape == (2, 1)
    np.testing.assert_allclose(out.actions, [[0.0], [1.0]], rtol=1e-6)  # 2 · tanh(s0)
    # Q_1(s, μ) = s0 + 2μ; V = min(Q_1, Q_2 = s0 + 4μ - 1): row 1 μ=0 → Q_1 0, V -1; row 2 μ=0.5 → 1.55, 1.55
    s0 = math.atanh(0.5)
    np.testing.assert_allclose(out.q_action, [0.0, s0 + 1.0], rtol=1e-6)
    np.testing.assert_allclose(out.q_bootstrap, [-1.0, s0 + 1.0], rtol=1e-6)
    assert out.priority_values()[0] is out.q_action and out.values is None


def test_act_noise_has_the_ladder_sigma_in_half_widths_and_stays_in_the_box():
    agent = make(LINEAR)
    net = set_linear(agent.make_network(), [[0, 0, 0]], [0], [[0, 0, 0, 1], [0, 0, 0, 1]], [0, 0])  # μ = 0, Q = u
    k = 20000
    sigma = np.where(np.arange(k) < k // 2, 0.1, 0.7)
    with torch.no_grad():
        out = agent.act(net, np.zeros((k, 3), np.float32), sigma, np.random.default_rng(0))
    a = out.actions[:, 0]
    assert a.min() >= -2.0 and a.max() <= 2.0
    assert np.std(a[: k // 2]) == pytest.approx(0.1 * 2.0, rel=0.03)  # σ · half-width (2)
    # σ = 0.7 half-widths: N(0, 1.4) clipped to ±2: 15.3% of draws at the bounds
    assert np.mean(np.abs(a[k // 2:]) == 2.0) == pytest.approx(2 * (1 - 0.9234), abs=0.01)
    np.testing.assert_allclose(out.q_action, a / 2.0, rtol=1e-5, atol=1e-6)  # Q_1 of the noisy action sent


def test_the_noise_ladder_of_the_actors():
    """The actors' ε ladder is DPG's σ ladder: env i of N explores with σ = 0.4^(1 + 7 i/(N−1))."""
    cfg = load_config(None, ["agent.name=agents.apex_dpg", "actor.num_actors=2", "env.num_envs=2",
                             "actor.epsilon=0.4", "actor.epsilon_alpha=7"])  # fmt: skip
    sigmas = np.concatenate([actor_epsilon(cfg, a, 2) for a in range(2)])
    np.testing.assert_allclose(sigmas, [0.4, 0.4 ** (1 + 7 / 3), 0.4 ** (1 + 14 / 3), 0.4**8])
    assert sigmas[-1] < 1e-3  # the greediest env (the greediest actor's last) is almost μ itself


def test_actor_priorities_through_the_n_step_adder(storage_factory):
    """|ret + disc · q_bootstrap(s_{t+n}) − q_action(s_t)|, with float actions (b, 2) in the rows."""
    st = storage_factory({"obs": "float32[1]", "action": "float32[2]", "ret": "float32", "disc": "float32",
                          "version": "int64"}, P=1, S=16)  # fmt: skip
    adder = TransitionAdder(Writer(st, np.arange(1), prefault=False), 1, 0.5)
    ids = np.array([0])
    for t in range(4):  # obs 0, 1, 2 then the terminal obs 3; reward 1 each step
        out = ActOutput(np.array([[t, -t]], np.float32), q_action=np.array([10.0 * t]), q_bootstrap=np.array([100.0 * t]))
        adder.add(ids, np.array([[float(t)]], np.float32), np.array([1.0 if t else 0.0]), np.array([t == 3]),
                  np.array([False]), None, out.actions, out.priority_values(), 0)  # fmt: skip
    adder.finish()
    # item 0: |1 + 0.5·100 − 0| = 51; item 1: |1 + 0.5·200 − 10| = 91; item 2 (terminated): |1 − 20| = 19
    np.testing.assert_allclose(st.item_priority[0, :3], [51.0, 91.0, 19.0])
    np.testing.assert_array_equal(st.columns["action"][:4], [[0, 0], [1, -1], [2, -2], [0, 0]])
    np.testing.assert_array_equal(st.columns["disc"][:3], [0.5, 0.5, 0.0])


def test_learner_and_actor_priorities_agree_when_the_target_is_the_online_network():
    """The actor's initial priority is the learner's |TD| on the same scale: with the targets
    equal to the online networks, no smoothing and greedy acting they are the same number."""
    agent = make(["agent.target_noise=0", "agent.hidden_sizes=[16]", "agent.critic_lr=0", "agent.policy_lr=0"])
    agent.setup_learner()
    g = np.random.default_rng(3)
    obs, next_obs = g.standard_normal((5, 3)).astype(np.float32), g.standard_normal((5, 3)).astype(np.float32)
    with torch.no_grad():
        now, later = agent.act(agent.online, obs, np.zeros(5)), agent.act(agent.online, next_obs, np.zeros(5))
    ret, disc = np.array([1.0, -2, 0.5, 3, 0], np.float32), np.array([0.9, 0.81, 0, 0.9, 0.5], np.float32)
    actor_prio = np.abs(ret + disc * later.q_bootstrap - now.q_action)
    data = {"obs": torch.from_numpy(obs), "action": torch.from_numpy(now.actions), "ret": torch.from_numpy(ret),
            "disc": torch.from_numpy(disc), "version": torch.zeros(5, dtype=torch.int64),
            "next_obs": torch.from_numpy(next_obs)}  # fmt: skip
    _, prio = agent.learn(sample(data, [1.0] * 5))
    np.testing.assert_allclose(prio.numpy(), actor_prio, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_keeps_targets_and_priorities_in_float32():
    agent = make(["agent.hidden_sizes=[32, 32]"])
    agent.setup_learner()
    data = {"obs": torch.randn(16, 3), "action": torch.rand(16, 1) * 4 - 2, "ret": torch.randn(16) * 100,
            "disc": torch.full((16,), 0.97), "version": torch.zeros(16, dtype=torch.int64), "next_obs": torch.randn(16, 3)}  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = n_step_targets(agent.target, data["next_obs"], data["ret"], data["disc"], None, 0.5)
        metrics, prio = agent.learn(sample(data, [1.0] * 16))
    assert y.dtype == torch.float32 and prio.dtype == torch.float32
    assert all(math.isfinite(v) for v in metrics.values())
    # the return is kept to float32 precision in the target (bf16 would round 100-ish values to 0.5)
    want = data["ret"] + data["disc"] * n_step_targets(agent.target, data["next_obs"], torch.zeros(16), torch.ones(16), None, 0.5)
    assert (y - data["ret"]).abs().max() < 50 and torch.allclose(y, want, atol=1.0)


def test_state_dict_round_trip_continues_identically():
    a, b = make(["agent.target_noise=0.2"]), make(["agent.target_noise=0.2"])
    a.setup_learner()
    data = {"obs": torch.randn(8, 3), "action": torch.rand(8, 1) * 4 - 2, "ret": torch.randn(8),
            "disc": torch.full((8,), 0.9), "version": torch.zeros(8, dtype=torch.int64), "next_obs": torch.randn(8, 3)}  # fmt: skip
    a.learn(sample(data, [1.0] * 8))
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a checkpoint would (Adam's load keeps the tensors it is given)
    for _ in range(3):  # the smoothing noise continues from the same generator state
        ma, pa = a.learn(sample(data, [1.0] * 8))
        mb, pb = b.learn(sample(data, [1.0] * 8))
        assert ma == mb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    assert a.learner_network() is a.online
