"""Key/value-cached transformer actors (agents/kv_cache.py): the cache's attention rule by
hand, and the R2D2 and Decision Transformer actors on real EnvPool envs against a full
recompute over the context each step should have (computed here from what the env returned,
not from the actor's own buffers), over long episodes with resets, context hops and a
weight change."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from agents.kv_cache import KVCache, hop_length
from gearflow.actors.process import make_actor
from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import EnvSpec, make_vec_env
from gearflow.errors import ConfigError

try:
    from agents import _r2d2_decode as _decode
except ImportError:  # the C decode step is not built: the actors step with TorchScript
    _decode = None

# ----------------------------------------------------------------------------- the cache itself


def test_hop_length():
    assert [hop_length(c) for c in (1, 2, 10, 40, 41)] == [1, 1, 5, 20, 20]
    assert hop_length(40, 30) == 30 and hop_length(40, 99) == 40 and hop_length(8, 1) == 1


def test_attention_bias_cached_slots_then_causal_new_tokens():
    cache = KVCache(3, num_layers=1, num_heads=1, head_dim=2, slots=4)
    cache.length[:] = [2, 0, 3]
    ids, n_new = np.array([0, 1, 2]), np.array([2, 1, 1])
    allowed, dist = cache.attention_bias(ids, n_new, Tn=2)
    assert allowed.shape == dist.shape == (3, 2, 6)
    # env 0: slots 0, 1 cached; new tokens at positions 2, 3
    np.testing.assert_array_equal(allowed[0], [[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]])
    np.testing.assert_array_equal(dist[0], [[2, 1, 0, 0, 0, 0], [3, 2, 0, 0, 1, 0]])
    # env 1: nothing cached, one new token; its padding query also sees itself (no empty row)
    np.testing.assert_array_equal(allowed[1], [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]])
    # env 2: three cached, one new (the one-token fast path gives the same rule)
    np.testing.assert_array_equal(allowed[2, 0], [1, 1, 1, 0, 1, 0])
    a1, d1 = cache.attention_bias(np.array([2, 0]), np.array([1, 1]), Tn=1)
    np.testing.assert_array_equal(a1[:, 0], [[1, 1, 1, 0, 1], [1, 1, 0, 0, 1]])
    np.testing.assert_array_equal(d1[:, 0], [[3, 2, 1, 0, 0], [2, 1, 0, 0, 0]])


def test_append_writes_each_rows_new_tokens_after_its_cached_ones():
    cache = KVCache(3, num_layers=2, num_heads=1, head_dim=1, slots=4)
    cache.length[:] = [1, 0, 3]
    kv = torch.arange(3 * 2 * 2 * 1 * 3 * 1, dtype=torch.float32).view(3, 2, 2, 1, 3, 1)  # (k, L, 2, nh, Tn, hs)
    ids = np.array([2, 0, 1])
    with pytest.raises(ValueError, match="env 2: 3 cached \\+ 2 new tokens exceed the cache's 4 slots"):
        cache.attention_bias(ids, np.array([2, 3, 1]), 3)
    cache.append(ids, kv, np.array([1, 3, 2]))
    assert cache.length.tolist() == [4, 2, 4]
    torch.testing.assert_close(cache.kv[2, :, :, :, 3], kv[0, :, :, :, 0])
    torch.testing.assert_close(cache.kv[0, :, :, :, 1:4], kv[1])
    torch.testing.assert_close(cache.kv[1, :, :, :, 0:2], kv[2, :, :, :, 0:2])
    cache.clear(np.array([0]))
    assert cache.length.tolist() == [0, 2, 4]


# ----------------------------------------------------------------------------- actors on real envs


class RecordingEnv:
    """The real env; remembers what the last ``recv`` returned."""

    def __init__(self, env):
        self._env, self.last = env, None

    def __getattr__(self, name):
        return getattr(self._env, name)

    def recv(self):
        out = self._env.recv()
        self.last = tuple(np.array(x, copy=True) for x in out)
        return out


class Episodes:
    """Each env's current episode as the env returned it: observations, rewards (the reward
    that came with each obs), and the actions the actor sent."""

    def __init__(self, E: int):
        self.obs = [[] for _ in range(E)]
        self.reward = [[] for _ in range(E)]
        self.action = [[] for _ in range(E)]
        self.ended = np.ones(E, dtype=bool)  # the next obs of env e starts an episode
        self.longest = 0

    def see(self, last) -> np.ndarray:
        """Book one recv; returns the episode step t of each returned env."""
        obs, reward, term, trunc, ids = last
        t = np.zeros(len(ids), dtype=np.int64)
        for r, e in enumerate(ids.tolist()):
            if self.ended[e]:
                self.obs[e], self.reward[e], self.action[e] = [], [], []
            self.obs[e].append(obs[r])
            self.reward[e].append(float(reward[r]))
            t[r] = len(self.obs[e]) - 1
            self.longest = max(self.longest, len(self.obs[e]))
        self.ended[ids] = term | trunc
        return t


def context_start(t: np.ndarray, C: int, H: int) -> np.ndarray:
    """First step of the cached actor's context at episode step t: 0 until the context is
    full, then it hops by H: s = H·(⌊(t − C)/H⌋ + 1)."""
    return np.where(t < C, 0, H * ((t - C) // H + 1))


def r2d2_config(C: int, masked: bool, layers: int = 2):
    return load_config(None, [
        "agent.name=agents.r2d2_transformer", "agent.d_model=32", "agent.num_heads=4", f"agent.num_layers={layers}",
        f"agent.context={C}", "replay.item=sequence", "replay.sequence_length=16", "replay.sequence_period=8",
        "replay.burn_in=8", "env.id=CartPole-v1", "env.num_envs=8", "env.batch_size=4", "actor.num_actors=1",
        "actor.epsilon=0.9", "actor.epsilon_alpha=1.0",
        *(["env.obs_transform=gearflow.transforms:mask_velocity"] if masked else []),
    ])  # fmt: skip


def perturb(network, seed: int) -> None:
    """New weights, as a weight sync would load them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("masked", [False, True], ids=["cartpole", "masked"])
@pytest.mark.parametrize("C", [4, 10])
def test_r2d2_cached_actor_matches_a_full_recompute(C, masked):
    cfg = r2d2_config(C, masked)
    env = RecordingEnv(make_vec_env(cfg.env, seed=1))
    agent = make_agent(cfg, env.env_spec, "cpu")
    H = agent.context_hop()
    assert H == C // 2
    episodes, rows = Episodes(env.num_envs), []

    class Recorder:
        def __getattr__(self, name):
            return getattr(agent, name)

        def act_cached(self, network, cache, ids, obs_new, n_new, epsilon, rng=None):
            t = episodes.see(env.last)
            out = agent.act_cached(network, cache, ids, obs_new, n_new, epsilon, rng)
            for r, e in enumerate(ids.tolist()):
                s = int(context_start(t[r : r + 1], C, H)[0])
                rows.append((np.stack(episodes.obs[e][s : t[r] + 1]), out.values[r].copy(), int(t[r]), int(n_new[r]),
                             actor.version))  # fmt: skip
            return out

    actor = make_actor(cfg, 0, Recorder(), env, None, None, None)
    assert actor.cache is not None and actor.hop == H
    actor.run(max_steps=800)
    networks = [copy.deepcopy(actor.network), actor.network]  # by weights version
    perturb(actor.network, seed=5)  # a weight sync: the cache must not keep the old keys
    actor.version += 1
    before = len(rows)
    actor.run(max_steps=200)
    actor.close()

    assert agent.one_token_native or _decode is None  # the C one-token step, where it is built
    assert episodes.longest > 2 * C and actor.episodes > 20  # episodes longer than the context, many resets
    hops = [r for r in rows[:before] if r[2] >= C and r[3] > 1]
    assert len(hops) > 5 and all(n == t - int(context_start(np.array([t]), C, H)[0]) + 1 for _, _, t, n, _ in hops)
    assert all(n == 1 or t == 0 or t >= C for _, _, t, n, _ in rows[:before])  # no re-encode otherwise
    assert all(n > 1 or t == 0 for _, _, t, n, _ in rows[before : before + 4])  # after new weights: re-encode
    # the learner's forward over each context (left-aligned, padded: causal, so padding is never seen)
    values = np.stack([r[1] for r in rows])
    ref = np.zeros_like(values)
    with torch.no_grad():
        for version, net in enumerate(networks):
            sel = [i for i, r in enumerate(rows) if r[4] == version]
            n = np.array([len(rows[i][0]) for i in sel])
            obs = np.zeros((len(sel), C, *rows[0][0].shape[1:]), np.float32)
            for j, i in enumerate(sel):
                obs[j, : n[j]] = rows[i][0]
            ref[sel] = net(torch.as_tensor(obs))[np.arange(len(sel)), n - 1].numpy()
    np.testing.assert_allclose(values, ref, rtol=1e-4, atol=1e-5)
    clear = np.abs(ref[:, 0] - ref[:, 1]) > 1e-4
    assert (values.argmax(1) == ref.argmax(1))[clear].all()  # the same greedy actions


def dt_config(C: int, env_id: str, masked: bool = False):
    return load_config(None, [
        "agent.name=agents.decision_transformer", "agent.d_model=32", "agent.num_heads=2", "agent.num_layers=2",
        f"agent.context={C}", "agent.dropout=0.1", "agent.target_return=200", "agent.rtg_scale=50",
        "replay.item=episode", "replay.max_episode_length=500", f"env.id={env_id}", "env.num_envs=4",
        "env.batch_size=2", "actor.num_actors=1", "actor.epsilon=0.5", "actor.epsilon_alpha=1.0",
        *(["env.obs_transform=gearflow.transforms:mask_velocity"] if masked else []),
    ])  # fmt: skip


@pytest.mark.parametrize("env_id,masked", [("CartPole-v1", False), ("CartPole-v1", True), ("Pendulum-v1", False)],
                         ids=["cartpole", "masked", "pendulum"])  # fmt: skip
@pytest.mark.parametrize("C", [3, 12])
def test_decision_transformer_cached_actor_matches_a_full_recompute(C, env_id, masked):
    cfg = dt_config(C, env_id, masked)
    env = RecordingEnv(make_vec_env(cfg.env, seed=2))
    agent = make_agent(cfg, env.env_spec, "cpu")
    H = agent.context_hop()
    episodes, rows = Episodes(env.num_envs), []
    target, scale = float(cfg.agent.target_return), float(cfg.agent.rtg_scale)

    class Recorder:
        def __getattr__(self, name):
            return getattr(agent, name)

        def act_cached(self, network, cache, ids, obs, epsilon, rng=None, **ctx):
            head = {}
            choose = agent._choose

            def spy(out, *args):  # the head's output at s_t of every row, whichever path made it
                head["out"] = out
                return choose(out, *args)

            agent._choose = spy
            try:
                out = agent.act_cached(network, cache, ids, obs, epsilon, rng, **ctx)
            finally:
                del agent._choose
            for r, e in enumerate(ids.tolist()):
                t = len(episodes.obs[e]) - 1
                s = int(context_start(np.array([t]), C, H)[0])
                rewards = np.array(episodes.reward[e][1:], np.float64)  # the first obs comes with no reward
                rtg = target - np.concatenate([[0.0], np.cumsum(rewards)])  # R̂_0 .. R̂_t
                acts = np.array([*episodes.action[e][s:t], np.zeros_like(out.actions[r])])  # a_t not known yet
                rows.append((np.stack(episodes.obs[e][s : t + 1]), rtg[s : t + 1], acts, np.arange(s, t + 1),
                             head["out"][r].clone(), actor.version, t))  # fmt: skip
                episodes.action[e].append(out.actions[r].copy())
            return out

    class Booking(RecordingEnv):
        def recv(self):
            out = super().recv()
            episodes.see(self.last)  # done envs do not act, but their episode ends here
            return out

    env = Booking(env._env)
    actor = make_actor(cfg, 0, Recorder(), env, None, None, None)
    assert actor.cache is not None and actor.hop == H
    actor.run(max_steps=600)
    networks = [copy.deepcopy(actor.network), actor.network]  # by weights version
    perturb(actor.network, seed=7)
    actor.version += 1
    actor.run(max_steps=150)
    actor.close()
    assert agent.step_compiled  # one-step rows took the compiled StepTokens

    assert episodes.longest > C + H and actor.episodes >= (4 if env_id == "CartPole-v1" else 0)  # Pendulum: 200
    assert sum(1 for row in rows if row[-1] >= C and (row[-1] - C) % H == 0) > 5  # contexts hopped
    # the learner's forward over each context (left-aligned, padded: causal, so padding is never seen)
    out = torch.stack([r[4] for r in rows])
    ref = torch.zeros_like(out)
    with torch.no_grad():
        for version, net in enumerate(networks):
            sel = [i for i, r in enumerate(rows) if r[5] == version]
            n = np.array([len(rows[i][0]) for i in sel])
            pad = {k: np.zeros((len(sel), C, *x.shape[1:]), x.dtype) for k, x in zip(("obs", "rtg", "act", "t"), rows[0])}
            for j, i in enumerate(sel):
                for k, x in zip(pad, rows[i]):
                    pad[k][j, : n[j]] = x
            a = torch.as_tensor(pad["act"])
            if not agent.discrete:
                a = agent._to_unit(a)
            full = net(torch.as_tensor(pad["rtg"], dtype=torch.float32) / scale, torch.as_tensor(pad["obs"]), a,
                       torch.as_tensor(pad["t"]))  # fmt: skip
            ref[sel] = full[np.arange(len(sel)), n - 1]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=2e-5)


def test_actors_without_the_cache_keep_the_sliding_context():
    cfg = load_config(None, ["agent.name=agents.r2d2_transformer", "agent.kv_cache=false", "replay.item=sequence",
                             "env.id=CartPole-v1", "env.num_envs=4", "env.batch_size=2"])  # fmt: skip
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, "cpu")
    assert agent.make_kv_cache(4) is None
    with make_actor(cfg, 0, agent, env, None, None, None, epsilon=1.0) as actor:
        assert actor.cache is None and actor.hop == 1
        actor.run(max_steps=40)


def test_context_hop_errors_name_the_key():
    cfg = load_config(None, ["agent.name=agents.r2d2_transformer", "agent.context_hop=-1", "replay.item=sequence"])
    with pytest.raises(ConfigError, match="agent.context_hop=-1: must be ≥ 0"):
        make_agent(cfg, EnvSpec((4,), np.dtype(np.float32), 2), "cpu")
    cfg = load_config(None, ["agent.name=agents.decision_transformer", "agent.context_hop=-2", "replay.item=episode"])
    with pytest.raises(ConfigError, match="agent.context_hop=-2: must be ≥ 0"):
        make_agent(cfg, EnvSpec((4,), np.dtype(np.float32), 2), "cpu")


def test_r2d2_cached_cnn_torso_on_frames_matches_a_full_recompute():
    """The Nature-CNN token embedding (the paper configs' Atari agents): each frame is embedded
    once, when its step is new or re-encoded; Q-values equal the forward over the context."""
    C, H = 4, 2
    cfg = load_config(None, ["agent.name=agents.r2d2_transformer", "agent.d_model=16", "agent.num_heads=2",
                             f"agent.context={C}", f"agent.context_hop={H}", "replay.item=sequence"])  # fmt: skip
    agent = make_agent(cfg, EnvSpec((4, 84, 84), np.dtype(np.uint8), 3), "cpu")
    net = agent.make_network().eval()
    cache = agent.make_kv_cache(2)
    frames = np.random.default_rng(0).integers(0, 256, (2, 9, 4, 84, 84), dtype=np.uint8)  # 2 envs' episodes
    ids, eps, rng = np.array([1, 0]), np.zeros(2), np.random.default_rng(0)
    with torch.inference_mode():
        for t in range(9):
            s = int(context_start(np.array([t]), C, H)[0])
            if t == 0 or (t >= C and (t - C) % H == 0):
                cache.clear(ids)
                new = frames[ids, s : t + 1]  # the whole context re-encoded
            else:
                new = frames[ids, t : t + 1]
            out = agent.act_cached(net, cache, ids, new, np.full(2, new.shape[1]), eps, rng)
            ref = agent.act(net, frames[ids, s : t + 1], eps, rng)
            np.testing.assert_allclose(out.values, ref.values, rtol=1e-4, atol=1e-5)
            assert cache.length[ids].tolist() == [t - s + 1] * 2
    assert agent.one_token_native or _decode is None  # the CNN token in torch, then the C step
