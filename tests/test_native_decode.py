"""The R2D2 transformer actor's one-token step in C (agents/_r2d2_decode.c, agents/r2d2_accel.py
``NativeOneTokenStep``) against its references: the eager :class:`OneTokenStep`, the learner's forward
over the whole context, and the TorchScript step it replaces; which step an agent acts with and why;
and bad input refused before anything is written. The actor-level checks (real EnvPool episodes with
resets, hops and a weight change) are tests/test_kv_cache.py's, which act with this step by default."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

_decode = pytest.importorskip("agents._r2d2_decode", reason="the C decode module is not built")

from agents import r2d2_accel
from agents.r2d2_accel import NativeOneTokenStep, OneTokenStep, native_one_token_step
from tests.test_kv_cache_step import forward_last
from tests.test_kv_cache_step import make as make_agent_and_network


def make(C: int = 8, layers: int = 2, d: int = 32, heads: int = 4, native: bool = True, obs_shape=(3,)):
    dtype = np.uint8 if len(obs_shape) == 3 else np.float32
    return make_agent_and_network(C, obs_shape, dtype, layers, d, heads, native)


@pytest.mark.parametrize("layers,d,heads", [(1, 32, 4), (3, 32, 4), (2, 24, 3)])
def test_native_step_equals_the_eager_step_and_the_forward(layers, d, heads):
    """Every env one step per call in shuffled order, rows of 1 to E envs, until the cache is full:
    the C step's Q-values and cache writes equal the eager step's, and the forward's over the
    same context."""
    C, E = 12, 5
    agent, net = make(C, layers, d, heads)
    native, eager = NativeOneTokenStep(net, C), OneTokenStep(net, C)
    rng = np.random.default_rng(0)
    episodes = rng.standard_normal((E, C, 3)).astype(np.float32)
    cache_a, cache_b = agent.make_kv_cache(E), agent.make_kv_cache(E)
    cache_a.kv.normal_()  # stale keys in every slot: a slot read before it is written would show
    cache_b.kv.copy_(cache_a.kv)
    with torch.inference_mode():
        for t in range(C):
            ids = rng.permutation(E)[: rng.integers(1, E + 1)] if t else rng.permutation(E)
            for e in ids[cache_a.length[ids] < t].tolist():  # envs a call skipped catch up, one step at a time
                while cache_a.length[e] < t:
                    s = int(cache_a.length[e])
                    native.values(episodes[[e], s : s + 1], cache_a.host_view(), np.array([e]), np.array([s]))
                    eager(torch.as_tensor(episodes[[e], s : s + 1]), cache_b.kv, torch.tensor([e]), torch.tensor([s]), s + 1)
                    cache_a.length[e] += 1
                    cache_b.length[e] += 1
            length = cache_a.length[ids].copy()
            qa = native.values(episodes[ids, t : t + 1], cache_a.host_view(), ids, length)
            qb = eager(torch.as_tensor(episodes[ids, t : t + 1]), cache_b.kv, torch.as_tensor(ids),
                       torch.as_tensor(length), t + 1).numpy()  # fmt: skip
            cache_a.length[ids] += 1
            cache_b.length[ids] += 1
            np.testing.assert_allclose(qa, qb, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(qa, forward_last(net, episodes[ids], np.full(len(ids), t + 1)),
                                       rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(cache_a.kv, cache_b.kv, rtol=1e-4, atol=1e-5)


def test_agents_act_with_the_native_step_unless_told_not_to():
    C = 6
    rng = np.random.default_rng(2)
    episodes = rng.standard_normal((2, C, 3)).astype(np.float32)
    values, net = {}, make(C)[1]
    for native in (True, False):
        agent = make(C, native=native)[0]  # the same network for both
        cache = agent.make_kv_cache(2)
        with torch.inference_mode():
            for t in range(C):
                out = agent.act_cached(net, cache, np.array([1, 0]), episodes[[1, 0], t : t + 1], np.ones(2), np.zeros(2))
        step = agent.one_token_step(net, C)
        assert agent.one_token_native is native and agent.one_token_compiled
        assert isinstance(step, NativeOneTokenStep) is native and isinstance(step, torch.jit.ScriptModule) is not native
        values[native] = out.values
    np.testing.assert_allclose(values[True], values[False], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(values[True], forward_last(net, episodes[[1, 0]], np.array([C, C])), rtol=1e-4, atol=1e-5)


def test_the_frame_torso_embeds_in_torch_then_steps_in_c():
    agent, net = make(4, d=16, heads=2, obs_shape=(4, 84, 84))
    native, eager = NativeOneTokenStep(net, 4), OneTokenStep(net, 4)
    assert not native.vector and native.in_dim == 0
    frames = np.random.default_rng(0).integers(0, 256, (2, 1, 4, 84, 84), dtype=np.uint8)
    cache_a, cache_b = agent.make_kv_cache(3), agent.make_kv_cache(3)
    ids, length = np.array([2, 0]), np.array([0, 0])
    with torch.inference_mode():
        qa = native.values(frames, cache_a.host_view(), ids, length)
        qb = eager(torch.as_tensor(frames), cache_b.kv, torch.as_tensor(ids), torch.as_tensor(length), 1).numpy()
    np.testing.assert_allclose(qa, qb, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache_a.kv, cache_b.kv, rtol=1e-4, atol=1e-5)


def test_in_place_weight_changes_reach_the_native_step():
    """The plan holds views of the parameters: a weight sync (a copy into them) reaches it."""
    C = 5
    agent, net = make(C)
    native = NativeOneTokenStep(net, C)
    episodes = np.random.default_rng(1).standard_normal((1, C, 3)).astype(np.float32)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    cache = agent.make_kv_cache(1)
    for t in range(C):
        q = native.values(episodes[:, t : t + 1], cache.host_view(), np.array([0]), np.array([t]))
        cache.length[0] += 1
    np.testing.assert_allclose(q, forward_last(net, episodes, np.array([C])), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change,why", [
    (lambda net: setattr(net.blocks[0].mlp, "1", nn.GELU(approximate="tanh")), "MLP is not Linear, GELU \\(exact\\), Linear"),
    (lambda net: net.double(), "parameters are not all float32"),
    (lambda net: setattr(net.blocks[1], "ln2", nn.LayerNorm(32, eps=1e-3)), "layer norms are not affine with one eps"),
])  # fmt: skip
def test_networks_the_c_step_cannot_run_act_with_torchscript_and_say_why(change, why, caplog):
    agent, net = make(6)
    change(net)
    with pytest.raises(ValueError, match=why):
        NativeOneTokenStep(net, 6)
    if next(net.parameters()).dtype != torch.float32:
        return  # the TorchScript step's own checks are tests/test_kv_cache_step.py's
    with caplog.at_level("INFO", logger="agents.r2d2_transformer"):
        agent.acting_modules(net, 6)
    assert not agent.one_token_native and agent.one_token_compiled
    said = [r.getMessage() for r in caplog.records if "acting with the TorchScript one-token step" in r.getMessage()]
    assert len(said) == 1 and re.search(why, said[0])  # the reason, in the log


def test_without_the_c_module_the_agent_says_so_and_acts_with_torchscript(monkeypatch):
    agent, net = make(6)
    monkeypatch.setattr(r2d2_accel, "_decode", None)
    native, why = native_one_token_step(net, 6, OneTokenStep(net, 6), (3,), np.float32)
    assert native is None and "agents._r2d2_decode is not built" in why
    agent.acting_modules(net, 6)
    assert not agent.one_token_native


def test_a_step_that_disagrees_with_the_reference_is_not_used():
    """``native_one_token_step`` keeps the C step only if it matches the reference on its trials."""
    _, net = make(6)

    def wrong(obs, kv, ids, length, used):
        return OneTokenStep(net, 6)(obs, kv, ids, length, used) + 0.01

    native, why = native_one_token_step(net, 6, wrong, (3,), np.float32)
    assert native is None and "differ from the TorchScript step's by 0.01" in why


def test_bad_input_is_refused_before_anything_is_written():
    agent, net = make(4)
    native = NativeOneTokenStep(net, 4)
    cache = agent.make_kv_cache(3)
    kv = cache.host_view()
    kv[:] = 7.0
    obs = np.zeros((2, 1, 3), np.float32)
    cases = [
        ([0, 3], [0, 0], np.int64, ValueError, "row 1: env 3 of 3"),
        ([0, 1], [0, 4], np.int64, ValueError, "row 1: env 1 of 3, slot 4 of 4"),
        ([1, 1], [0, 1], np.int64, ValueError, "env 1 appears twice"),
        ([0, 1], [0, 1], np.int32, TypeError, "ids and length must be int64"),
    ]
    for ids, length, dtype, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            _decode.step(native.plan, obs.reshape(2, 3), kv, np.array(ids, dtype), np.array(length),
                         np.empty((2, 3), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="kv must be \\(E, 2, 2, 4, S, 8\\) float32"):
        _decode.step(native.plan, obs.reshape(2, 3), kv[:, :1].copy(), np.array([0, 1]), np.array([0, 0]),
                     np.empty((2, 3), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="inp of 4 floats \\(want 6\\)"):
        _decode.step(native.plan, np.zeros(4, np.float32), kv, np.array([0, 1]), np.array([0, 0]),
                     np.empty((2, 3), np.float32))  # fmt: skip
    with pytest.raises(TypeError, match="must be float32"):
        _decode.step(native.plan, obs.reshape(2, 3).astype(np.float64), kv, np.array([0, 1]), np.array([0, 0]),
                     np.empty((2, 3), np.float32))  # fmt: skip
    assert (kv == 7.0).all()  # nothing written


def test_plan_checks_its_weights():
    _, net = make(4)
    native = NativeOneTokenStep(net, 4)
    with pytest.raises(ValueError, match="weights for 2 layers, expected"):
        _decode.plan((None, None), 2, 32, 4, 128, 3, 3, 1e-5)
    w = [np.zeros(3, np.float32)] * (2 + 12 + 5)
    with pytest.raises(ValueError, match="weight 0 \\(input weight\\) has 3 floats, expected 96"):
        _decode.plan(tuple(w), 1, 32, 4, 128, 3, 3, 1e-5)
    with pytest.raises(TypeError, match="weight 0 \\(input weight\\) must be float32"):
        _decode.plan((np.zeros(96), *w[1:]), 1, 32, 4, 128, 3, 3, 1e-5)
    assert native.plan is not None
