"""make_vec_env: EnvPool's async semantics on both backends, obs transforms, errors."""

from __future__ import annotations

from pathlib import Path

import gymnasium
import numpy as np
import pytest
from omegaconf import OmegaConf

from gearflow.config import EnvConfig
from gearflow.envs import EnvSpec, make_vec_env
from gearflow.errors import ConfigError

TESTS = str(Path(__file__).parent)


@pytest.fixture(autouse=True)
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def env_cfg(**kw) -> EnvConfig:
    return OmegaConf.structured(EnvConfig(**kw))


def run_constant(env, action: int, recvs: int):
    """Per env: list of (obs, reward, terminated, truncated) in the order recv returned them."""
    env.async_reset()
    per_env: dict[int, list] = {}
    for _ in range(recvs):
        obs, rew, term, trunc, ids = env.recv()
        assert obs.shape[0] == rew.shape[0] == term.shape[0] == trunc.shape[0] == ids.shape[0]
        assert rew.dtype == np.float32 and term.dtype == bool and trunc.dtype == bool
        for j, i in enumerate(ids.tolist()):
            per_env.setdefault(i, []).append(
                (obs[j].copy(), float(rew[j]), bool(term[j]), bool(trunc[j]))
            )
        env.send(np.full(len(ids), action, dtype=np.int64), ids)
    return per_env


def check_cartpole_semantics(per_env, max_steps: int):
    """Final obs then the reset obs (reward 0); the final obs continues its episode."""
    ends = 0
    for steps in per_env.values():
        assert steps[0][1] == 0.0 and not (
            steps[0][2] or steps[0][3]
        )  # first obs after async_reset
        for k in range(1, len(steps)):
            obs, rew, term, trunc = steps[k]
            prev = steps[k - 1]
            if prev[2] or prev[3]:  # previous recv ended the episode: this is the reset obs
                assert rew == 0.0 and not (term or trunc)
                assert np.abs(obs).max() <= 0.05  # CartPole's initial state distribution
            else:
                assert rew == 1.0
                # Euler step x' = x + 0.02 x_dot: the final obs is the episode's next state
                np.testing.assert_allclose(obs[0], prev[0][0] + 0.02 * prev[0][1], atol=1e-5)
            if term or trunc:
                ends += 1
                if term:
                    x, theta = obs[0], obs[2]
                    assert abs(x) > 2.4 or abs(theta) > 0.2094
    assert ends > 0
    return ends


def flags_per_env(per_env):
    return {i: [(r, te, tr) for _, r, te, tr in steps] for i, steps in per_env.items()}


def test_envpool_cartpole_final_obs_then_reset_obs():
    with make_vec_env(env_cfg(id="CartPole-v1", num_envs=4, batch_size=2), seed=0) as env:
        assert env.backend == "envpool"
        assert (env.num_envs, env.batch_size) == (4, 2)
        assert env.obs_shape == (4,) and env.obs_dtype == np.float32 and env.num_actions == 2
        per_env = run_constant(env, action=1, recvs=120)  # always push right: terminates
    assert set(per_env) == {0, 1, 2, 3}
    check_cartpole_semantics(per_env, max_steps=500)
    assert any(te for steps in per_env.values() for _, _, te, _ in steps)


@pytest.mark.parametrize("backend", ["envpool", "gymnasium"])
def test_truncation_is_identical_across_backends(backend):
    cfg = env_cfg(
        id="CartPole-v1", num_envs=2, batch_size=2, backend=backend, kwargs={"max_episode_steps": 4}
    )
    with make_vec_env(cfg, seed=3) as env:
        assert env.backend == backend
        per_env = run_constant(env, action=0, recvs=12)  # alternating actions never needed: 4 steps
    check_cartpole_semantics(per_env, max_steps=4)
    episode = [(0.0, False, False)] + [(1.0, False, False)] * 3 + [(1.0, False, True)]
    expected = (episode * 3)[:12]
    assert flags_per_env(per_env) == {0: expected, 1: expected}


def test_gymnasium_cartpole_terminates_like_envpool():
    cfg = env_cfg(id="CartPole-v1", num_envs=3, backend="gymnasium", batch_size=1)
    with make_vec_env(cfg, seed=0) as env:
        assert env.batch_size == 3  # the adapter always returns every env
        per_env = run_constant(env, action=1, recvs=40)
    check_cartpole_semantics(per_env, max_steps=500)


def expected_counting(num_envs: int, recvs: int):
    from helpers_envs import expected_episode

    out = {}
    for i in range(num_envs):
        seq, ep, t = [], 0, 0
        seq.append(((0, 0, i), 0.0, False, False))
        while len(seq) < recvs:
            L, how = expected_episode(i, ep)
            if t == L:  # the recv after the final obs: the next episode's first obs
                ep, t = ep + 1, 0
                seq.append(((0, ep, i), 0.0, False, False))
                continue
            t += 1
            seq.append(((t, ep, i), float(t), t == L and how == "term", t == L and how == "trunc"))
        out[i] = seq[:recvs]
    return out


@pytest.mark.parametrize("how", ["factory", "gymnasium_id"])
def test_gymnasium_adapter_on_the_counting_env(how):
    if how == "factory":
        cfg = env_cfg(factory="helpers_envs:make", num_envs=3)
    else:
        env_id = "GearflowCounting-v0"
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point="helpers_envs:CountingEnv")
        cfg = env_cfg(id=env_id, backend="gymnasium", num_envs=3)
    recvs = 30
    with make_vec_env(cfg, seed=0) as env:
        assert env.backend == "gymnasium" and env.batch_size == 3 and env.num_actions == 2
        per_env = run_constant(env, action=1, recvs=recvs)
    got = {
        i: [(tuple(o.astype(int).tolist()), r, te, tr) for o, r, te, tr in s]
        for i, s in per_env.items()
    }
    exp = expected_counting(3, recvs)
    if how == "gymnasium_id":  # gymnasium.make gives every sub-env the same env_index 0
        exp = {
            i: [((o[0], o[1], 0), *rest) for o, *rest in expected_counting(1, recvs)[0]]
            for i in range(3)
        }
    assert got == exp


def test_async_test_env_matches_the_gymnasium_adapter():
    """The AsyncCountingVecEnv used by the actor tests follows the same semantics."""
    from helpers_envs import AsyncCountingVecEnv

    env = AsyncCountingVecEnv(3, batch_size=2, seed=1)
    per_env = run_constant(env, action=1, recvs=45)
    exp = expected_counting(3, 45)
    for i, steps in per_env.items():
        got = [(tuple(o.astype(int).tolist()), r, te, tr) for o, r, te, tr in steps]
        assert got == exp[i][: len(got)]


def test_batch_size_zero_means_half():
    with make_vec_env(env_cfg(num_envs=5, batch_size=0), seed=0) as env:
        assert env.batch_size == 2
    with make_vec_env(env_cfg(num_envs=1, batch_size=0), seed=0) as env:
        assert env.batch_size == 1


@pytest.mark.parametrize("backend", ["envpool", "gymnasium"])
def test_obs_transform_masks_velocities(backend):
    cfg = env_cfg(
        id="CartPole-v1",
        num_envs=4,
        batch_size=4,
        backend=backend,
        obs_transform="helpers_envs:keep_positions",
    )
    with make_vec_env(cfg, seed=0) as env:
        assert env.obs_shape == (2,) and env.obs_dtype == np.float32
        assert env.single_observation_space.shape == (4,)  # the backend's own space
        spec = env.env_spec
        assert isinstance(spec, EnvSpec) and spec.obs_shape == (2,) and spec.num_actions == 2
        env.async_reset()
        for _ in range(6):
            obs, _, _, _, ids = env.recv()
            assert obs.shape == (len(ids), 2)
            env.send(np.zeros(len(ids), dtype=np.int64), ids)


def test_unknown_id_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"env.id='CartPoel-v1'.*CartPole-v1"):
        make_vec_env(env_cfg(id="CartPoel-v1"), seed=0)
    with pytest.raises(ConfigError, match="unknown EnvPool task id"):
        make_vec_env(env_cfg(id="GearflowNope-v0", backend="envpool"), seed=0)


@pytest.mark.parametrize(
    "key, path, match",
    [
        (
            "factory",
            "no_such_module_xyz:make",
            r"env.factory='no_such_module_xyz:make': cannot import module 'no_such_module_xyz'",
        ),
        ("factory", "helpers_envs:nope", r"module 'helpers_envs' has no attribute 'nope'"),
        ("factory", "helpers_envs.make", r"expected an import path 'module:function'"),
        ("obs_transform", "helpers_envs:missing", r"env.obs_transform='helpers_envs:missing'"),
        ("obs_transform", "helpers_envs:not_batched", r"must map a batch"),
        ("factory", "helpers_envs:make_same_step", r"needs AutoresetMode.NEXT_STEP"),
    ],
)
def test_bad_import_paths_are_named(key, path, match):
    with pytest.raises(ConfigError, match=match):
        make_vec_env(env_cfg(**{key: path}), seed=0)


def test_non_discrete_action_space_is_named_for_dqn():
    import torch

    from gearflow.agent import make_agent
    from gearflow.config import load_config

    with make_vec_env(env_cfg(id="Pendulum-v1", num_envs=2), seed=0) as env:
        assert env.num_actions is None
        spec = env.env_spec
    cfg = load_config(None, ["env.id=Pendulum-v1"])
    with pytest.raises(
        ConfigError, match=r"apex_dqn needs a discrete action space.*Pendulum-v1.*Box"
    ):
        make_agent(cfg, spec, torch.device("cpu"))


def _envpool(env_id, fast, num_envs=4, batch_size=2, seed=5, **kw):
    import envpool

    from gearflow.envs import EnvPoolVecEnv

    raw = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size, seed=seed, **kw)
    return EnvPoolVecEnv(raw, env_id, fast=fast)


@pytest.mark.parametrize("action", [0, 1])
def test_envpool_fast_path_steps_exactly_like_envpools_own_api(action):
    """recv/send straight on EnvPool's C++ (fast) and through its Python layer give each env
    the same observations, rewards and flags, bit for bit (terminations and truncations)."""
    runs = []
    for fast in (True, False):
        with _envpool("CartPole-v1", fast, max_episode_steps=9) as env:
            assert env.fast is fast
            runs.append(run_constant(env, action=action, recvs=200))
    fast_run, own_run = runs
    assert set(fast_run) == set(own_run) == {0, 1, 2, 3}
    for i in fast_run:
        n = min(len(fast_run[i]), len(own_run[i]))
        assert n > 60
        for (o1, r1, te1, tr1), (o2, r2, te2, tr2) in zip(fast_run[i][:n], own_run[i][:n]):
            assert o1.tobytes() == o2.tobytes() and (r1, te1, tr1) == (r2, te2, tr2)
    flags = [f for steps in fast_run.values() for f in steps]
    assert any(te for _, _, te, _ in flags) and any(tr for _, _, _, tr in flags)


def test_envpool_fast_path_layouts():
    """Atari (obs, several info keys) takes the fast path; a send with one action too few is a
    clear error, not a C++ read past the array."""
    with _envpool("Pong-v5", True, num_envs=2, batch_size=2) as env:
        assert env.fast
        env.async_reset()
        obs, rew, term, trunc, ids = env.recv()
        assert obs.shape == (2, 4, 84, 84) and obs.dtype == np.uint8 and ids.dtype == np.int32
        with pytest.raises(ValueError, match=r"one action per env id: actions \(1,\), env_ids \(2,\)"):
            env.send(np.zeros(1, np.int64), ids)
        env.send(np.zeros(2, np.int64), ids)
        assert env.recv()[0].shape == (2, 4, 84, 84)


def test_deepmind_control_first_observations_have_reward_zero():
    """EnvPool's DeepMind Control tasks leave a first observation's reward unwritten (the last
    step's, or garbage up to 4e36 on CartpoleSwingup-v1's very first recv): an actor added it to
    the episode's return (WalkerWalk: a 100-episode mean of 1.5e27). make_vec_env's envs give 0
    there, as for every other backend; the rewards of real steps are untouched."""
    cfg = env_cfg(id="WalkerWalk-v1", num_envs=4, batch_size=4, seed=3,
                  obs_transform="gearflow.transforms:flatten_float32")  # fmt: skip
    env = make_vec_env(cfg, seed=3)
    try:
        rng = np.random.default_rng(0)
        stepped = []
        for _ in range(2):  # the second async_reset: the buffer then holds the last step's rewards
            env.async_reset()
            obs, rew, term, trunc, ids = env.recv()
            assert sorted(ids.tolist()) == [0, 1, 2, 3] and obs.shape == (4, 24)
            assert rew.tolist() == [0.0] * 4, f"first observations' rewards {rew.tolist()}"
            for _ in range(30):
                env.send(rng.uniform(-1, 1, (len(ids), 6)).astype(np.float32), ids)
                obs, rew, term, trunc, ids = env.recv()
                stepped.append(rew.copy())
        assert np.abs(np.concatenate(stepped)).max() > 0.01  # real steps: the rewards that went stale
    finally:
        env.close()
