"""The R2D2 transformer actor's one-token step and context re-encode (agents/r2d2_accel.py
``OneTokenStep``, ``ContextEncode``): the TorchScript compilation against the eager module and against the learner's forward over the
same contexts, its in-place cache writes, batches that mix one-token rows with re-encodes, the
eager fallback; and the priorities actors compute in numpy against the learner's torch code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from agents.r2d2_accel import (
    ContextEncode,
    OneTokenStep,
    compile_context_encode,
    compile_one_token_step,
)
from agents.r2d2_transformer import TransformerQNetwork, loss_mask, priority_mix, sequence_td
from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import EnvSpec


def make(C: int = 8, obs_shape=(3,), dtype=np.float32, layers: int = 2, d: int = 32, heads: int = 4,
         native: bool = False):  # fmt: skip
    """An R2D2 agent and its network, weights moved far from the init. ``native=False``: the
    TorchScript steps (this file's); the C step is tests/test_native_decode.py's."""
    cfg = load_config(None, ["agent.name=agents.r2d2_transformer", f"agent.d_model={d}", f"agent.num_heads={heads}",
                             f"agent.num_layers={layers}", f"agent.context={C}", "replay.item=sequence",
                             f"agent.native_step={str(native).lower()}"])  # fmt: skip
    agent = make_agent(cfg, EnvSpec(tuple(obs_shape), np.dtype(dtype), 3), "cpu")
    net = agent.make_network().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights far from the init, so a wrong bias or slot would show
        for p in net.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return agent, net


def forward_last(net, episodes: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The learner's forward over each row's first ``lengths[r]`` steps: Q at the last one (k, A)."""
    with torch.inference_mode():
        q = net(torch.as_tensor(episodes))
    return q[np.arange(len(lengths)), lengths - 1].numpy()


@pytest.mark.parametrize("layers", [1, 3])
def test_compiled_step_equals_the_eager_step_and_the_forward(layers):
    C, E = 8, 5
    agent, net = make(C, layers=layers)
    step, compiled = compile_one_token_step(net, C, (3,), np.float32)
    assert compiled and isinstance(step, torch.jit.ScriptModule)
    eager = OneTokenStep(net, C)
    rng = np.random.default_rng(0)
    episodes = rng.standard_normal((E, C, 3)).astype(np.float32)
    cache_a, cache_b = agent.make_kv_cache(E), agent.make_kv_cache(E)
    with torch.inference_mode():
        for t in range(C):  # every env one step per call, in shuffled order; rows of 1 to E envs
            ids = rng.permutation(E)[: rng.integers(1, E + 1)] if t else np.arange(E)
            behind = ids[cache_a.length[ids] < t]  # envs a call skipped catch up first, one step at a time
            for e in behind.tolist():
                while cache_a.length[e] < t:
                    s = int(cache_a.length[e])
                    for cache, fn in ((cache_a, step), (cache_b, eager)):
                        fn(torch.as_tensor(episodes[[e], s : s + 1]), cache.kv, torch.tensor([e]), torch.tensor([s]), s + 1)
                        cache.length[e] += 1
            length = cache_a.length[ids]
            assert (length == t).all()
            args = (torch.as_tensor(ids), torch.as_tensor(length), t + 1)
            qa = step(torch.as_tensor(episodes[ids, t : t + 1]), cache_a.kv, *args)
            qb = eager(torch.as_tensor(episodes[ids, t : t + 1]), cache_b.kv, *args)
            cache_a.length[ids] += 1
            cache_b.length[ids] += 1
            torch.testing.assert_close(qa, qb, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(qa.numpy(), forward_last(net, episodes[ids], np.full(len(ids), t + 1)),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(cache_a.kv, cache_b.kv, rtol=1e-5, atol=1e-6)


def test_act_cached_mixes_one_token_rows_and_re_encodes_in_one_batch():
    """Rows with one new step take the compiled step, rows that (re-)encode several take ``extend``;
    each row's Q-values equal the forward over its own context, and the cache lengths advance."""
    C, E = 10, 4
    agent, net = make(C)
    cache = agent.make_kv_cache(E)
    rng = np.random.default_rng(3)
    episodes = rng.standard_normal((E, C, 3)).astype(np.float32)
    eps, ids = np.zeros(E), np.arange(E)
    with torch.inference_mode():
        agent.act_cached(net, cache, ids, episodes[:, :3], np.full(E, 3), eps, rng)  # 3 steps each
        cache.clear(np.array([1]))  # env 1 re-encodes (as after a hop), env 3 brings 2 new steps
        n_new = np.array([1, 5, 1, 2])
        length = cache.length.copy()
        obs = np.zeros((E, 5, 3), np.float32)
        for r in range(E):
            obs[r, : n_new[r]] = episodes[r, length[r] : length[r] + n_new[r]]
        out = agent.act_cached(net, cache, ids, obs, n_new, eps, rng)
    assert agent.one_token_compiled and agent.encode_compiled
    assert cache.length.tolist() == [4, 5, 4, 5]
    np.testing.assert_allclose(out.values, forward_last(net, episodes, cache.length), rtol=1e-4, atol=1e-5)
    assert out.actions.tolist() == out.values.argmax(1).tolist()  # ε = 0: greedy


def test_in_place_weight_changes_reach_the_compiled_step():
    """A weight sync copies into the parameters; the compiled step reads the very same tensors."""
    C = 6
    agent, net = make(C)
    cache = agent.make_kv_cache(2)
    rng = np.random.default_rng(0)
    episodes = rng.standard_normal((2, C, 3)).astype(np.float32)
    ids, eps = np.array([0, 1]), np.zeros(2)
    with torch.inference_mode():
        agent.act_cached(net, cache, ids, episodes[:, :1], np.ones(2), eps, rng)
        step = agent.one_token_step(net, C)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(-0.5)
        cache.clear()  # what the actor does on a new weights version
        for t in range(3):
            out = agent.act_cached(net, cache, ids, episodes[:, t : t + 1], np.ones(2), eps, rng)
    assert agent.one_token_step(net, C) is step  # kept, not rebuilt
    np.testing.assert_allclose(out.values, forward_last(net, episodes, np.array([3, 3])), rtol=1e-4, atol=1e-5)


def test_a_full_cache_is_refused_naming_the_env():
    agent, net = make(4)
    cache = agent.make_kv_cache(3)
    cache.length[:] = [1, 4, 2]
    with pytest.raises(ValueError, match="env 1: 4 cached \\+ 1 new tokens exceed the cache's 4 slots"):
        agent.act_cached(net, cache, np.array([2, 1]), np.zeros((2, 1, 3), np.float32), np.ones(2), np.zeros(2))


class PythonEmbedding(nn.Module):
    """A token embedding TorchScript cannot compile (it goes through numpy)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, obs):
        return self.linear(torch.as_tensor(np.asarray(obs, dtype=np.float32)).flatten(2))


def test_a_network_torchscript_cannot_compile_acts_with_the_eager_step():
    C = 6
    agent, net = make(C)
    net.embed = PythonEmbedding(net.embed.linear)
    cache = agent.make_kv_cache(2)
    rng = np.random.default_rng(0)
    episodes = rng.standard_normal((2, C, 3)).astype(np.float32)
    with torch.inference_mode():
        for t in range(C):
            out = agent.act_cached(net, cache, np.array([1, 0]), episodes[[1, 0], t : t + 1], np.ones(2), np.zeros(2), rng)
    assert not agent.one_token_compiled and type(agent.one_token_step(net, C)) is OneTokenStep
    assert not agent.encode_compiled and type(agent.acting_modules(net, C)[1]) is ContextEncode
    np.testing.assert_allclose(out.values, forward_last(net, episodes[[1, 0]], np.array([C, C])), rtol=1e-4, atol=1e-5)


def test_frame_torso_steps_compile():
    """The Nature-CNN torso's token is compiled too (tests/test_kv_cache.py checks its values)."""
    _, net = make(4, obs_shape=(4, 84, 84), dtype=np.uint8, d=16)
    for compile_ in (compile_one_token_step, compile_context_encode):
        module, compiled = compile_(net, 4, (4, 84, 84), np.uint8)
        assert compiled
        assert {p.data_ptr() for p in module.parameters()} == {p.data_ptr() for p in net.parameters()}


def test_compiled_context_encode_equals_the_forward_and_fills_the_cache():
    """Whole contexts of different lengths into empty caches: Q at each row's last step is the
    forward's, and the cache then continues with one-token steps exactly."""
    C, E = 8, 3
    agent, net = make(C)
    encode, compiled = compile_context_encode(net, C, (3,), np.float32)
    assert compiled and isinstance(encode, torch.jit.ScriptModule)
    rng = np.random.default_rng(5)
    episodes = rng.standard_normal((E, C, 3)).astype(np.float32)
    cache = agent.make_kv_cache(E)
    ids, n = np.array([2, 0, 1]), np.array([5, 1, 3])
    obs = episodes[ids, :5].copy()
    obs[1, 1:] = 99.0  # padding after a row's steps is never attended to
    obs[2, 3:] = -99.0
    with torch.inference_mode():
        q = encode(torch.as_tensor(obs), cache.kv, torch.as_tensor(ids), torch.as_tensor(n))
        cache.length[ids] = n
        np.testing.assert_allclose(q.numpy(), forward_last(net, episodes[ids], n), rtol=1e-4, atol=1e-5)
        step = agent.one_token_step(net, C)
        length = cache.length[ids]
        q = step(torch.as_tensor(episodes[ids, length][:, None]), cache.kv, torch.as_tensor(ids),
                 torch.as_tensor(length), int(length.max()) + 1)  # fmt: skip
    np.testing.assert_allclose(q.numpy(), forward_last(net, episodes[ids], n + 1), rtol=1e-4, atol=1e-5)


def test_other_networks_take_the_general_path():
    """A network that is not a TransformerQNetwork (a wrapper) is asked for ``extend`` only."""
    C = 5
    agent, net = make(C)

    class Wrapper:
        def __init__(self, module):
            self.module, self.calls = module, 0

        def extend(self, *args):
            self.calls += 1
            return self.module.extend(*args)

    wrapped = Wrapper(net)
    cache = agent.make_kv_cache(1)
    episodes = np.random.default_rng(0).standard_normal((1, C, 3)).astype(np.float32)
    with torch.inference_mode():
        for t in range(C):
            out = agent.act_cached(wrapped, cache, np.array([0]), episodes[:, t : t + 1], np.ones(1), np.zeros(1))
    assert wrapped.calls == C and agent._acting_held is None
    assert isinstance(net, TransformerQNetwork)
    np.testing.assert_allclose(out.values, forward_last(net, episodes, np.array([C])), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- actor priorities in numpy


def torch_priorities(agent, values, action, reward, discount, first, lengths) -> np.ndarray:
    """The learner's torch functions with the actor's one network as online and target."""
    q = torch.as_tensor(values, dtype=torch.float32)
    lengths_t = torch.as_tensor(lengths)
    td = sequence_td(q, q, q, torch.as_tensor(action), torch.as_tensor(reward), torch.as_tensor(discount),
                     lengths_t, agent.n_step, agent.gamma, agent.cfg.rescale_eps)  # fmt: skip
    mask = torch.arange(q.shape[1])[None, :] < lengths_t[:, None]
    valid = loss_mask(mask, torch.as_tensor(first), agent.kind.burn_in)
    return priority_mix(td.abs(), valid, agent.cfg.eta).numpy().astype(np.float64)


@pytest.mark.parametrize("seed", range(4))
def test_actor_priorities_equal_the_learners_torch_code(seed):
    """Windows of every length (1 .. T, tails of episodes), first-step windows (no burn-in),
    terminal discounts, large and tied Q-values, rewards of both signs."""
    cfg = load_config(None, ["agent.name=agents.r2d2_transformer", "replay.item=sequence", "replay.sequence_length=12",
                             "replay.sequence_period=6", "replay.burn_in=4", "actor.n_step=3", "actor.gamma=0.97"])  # fmt: skip
    agent = make_agent(cfg, EnvSpec((3,), np.dtype(np.float32), 4), "cpu")
    rng = np.random.default_rng(seed)
    k, T, A = 40, 12, 4
    values = (rng.standard_normal((k, T, A)) * rng.choice([0.1, 3.0, 50.0], (k, 1, 1))).astype(np.float32)
    values[:5, :, 1] = values[:5, :, 0]  # ties: argmax and max pick the same value
    action = rng.integers(0, A, (k, T))
    reward = (rng.standard_normal((k, T)) * 5).astype(np.float32)
    discount = (rng.random((k, T)) > 0.1).astype(np.float32)
    first = np.zeros((k, T), bool)
    first[rng.random(k) < 0.3, 0] = True
    lengths = rng.integers(1, T + 1, k)
    lengths[:3] = [1, 2, T]
    got = agent.initial_priorities(values, action, reward, discount, first, lengths)
    want = torch_priorities(agent, values, action, reward, discount, first, lengths)
    assert got.dtype == np.float64 and got.shape == (k,)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-5)  # float32 rounding (large |Q|)
    assert got[0] == 0 and (got[lengths > 1] > 0).any()  # a one-row window has no transition


# ----------------------------------------------------------------------------- Decision Transformer


def dt_make(C: int, env: str):
    cfg = load_config(None, ["agent.name=agents.decision_transformer", "agent.d_model=32", "agent.num_heads=2",
                             "agent.num_layers=2", f"agent.context={C}", "agent.target_return=100",
                             "agent.rtg_scale=20", "replay.item=episode", "replay.max_episode_length=200"])  # fmt: skip
    if env == "discrete":
        spec = EnvSpec((3,), np.dtype(np.float32), 4)
    else:
        import gymnasium

        spec = EnvSpec((3,), np.dtype(np.float32), None, gymnasium.spaces.Box(-2.0, 2.0, (2,), np.float32))
    agent = make_agent(cfg, spec, "cpu")
    net = agent.make_network().eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return agent, net


@pytest.mark.parametrize("env", ["discrete", "continuous"])
def test_dt_step_tokens_compiled_equals_a_full_recompute_in_mixed_batches(env):
    """Rows stepping one env step (compiled StepTokens) and rows re-encoding (extend) in one call: the
    head's output at s_t equals the network's forward over each row's context."""
    from agents.decision_transformer import StepTokens, compile_step_tokens

    C, E = 6, 3
    agent, net = dt_make(C, env)
    step, compiled = compile_step_tokens(net, 3 * C - 1, 3, agent.act_shape)
    assert compiled and not isinstance(step, StepTokens)
    rng = np.random.default_rng(4)
    obs = rng.standard_normal((E, C, 3)).astype(np.float32)
    rtg = (100 - np.cumsum(rng.random((E, C)), axis=1)).astype(np.float32)
    acts = (rng.integers(0, 4, (E, C)) if env == "discrete" else rng.uniform(-2, 2, (E, C, 2)).astype(np.float32))
    ts = np.arange(C)[None, :].repeat(E, 0) + np.array([[0], [7], [30]])
    cache = agent.make_kv_cache(E)
    outs = []
    spy = agent._choose
    agent._choose = lambda out, *a: (outs.append(out.clone()), spy(out, *a))[1]
    ids, eps = np.arange(E), np.zeros(E)
    with torch.inference_mode():
        for t in range(C):
            if t == 3:
                cache.clear(np.array([1]))  # env 1 re-encodes its whole context at step 3
            lengths = np.full(E, t + 1)
            agent.act_cached(net, cache, ids, obs, eps, rng, lengths=lengths, rtg=rtg, actions=acts, timesteps=ts)
            a = torch.as_tensor(acts[:, : t + 1])
            ref = net(torch.as_tensor(rtg[:, : t + 1]) / 20.0, torch.as_tensor(obs[:, : t + 1]),
                      a if env == "discrete" else agent._to_unit(a), torch.as_tensor(ts[:, : t + 1]))[:, t]  # fmt: skip
            torch.testing.assert_close(outs[-1], ref, rtol=1e-4, atol=2e-5)
    assert agent.step_compiled and cache.length.tolist() == [3 * C - 1] * E


def test_dt_in_training_mode_acts_with_extend():
    """Dropout would be live: the compiled step (eval only) is not used."""
    agent, net = dt_make(4, "discrete")
    net.train()
    cache = agent.make_kv_cache(1)
    z = np.zeros((1, 4, 3), np.float32)
    with torch.inference_mode():
        for t in range(3):
            agent.act_cached(net, cache, np.array([0]), z, np.zeros(1), lengths=np.array([t + 1]),
                             rtg=np.zeros((1, 4), np.float32), actions=np.zeros((1, 4), np.int64),
                             timesteps=np.arange(4)[None])  # fmt: skip
    assert agent._step_held is None and cache.length.tolist() == [8]
