"""Online Decision Transformer: returns-to-go and hindsight relabelling, padding invariance
of the loss, the episode actor's rows and items (test envs, EnvPool CartPole, EnvPool
Pendulum with continuous actions), the Gaussian head, and a tiny run through ``gearflow train``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

from agents.decision_transformer import item_priority, returns_to_go, sample_windows
from gearflow.actors.process import make_actor
from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import EnvSpec, make_vec_env
from gearflow.kinds.episode import EpisodeActor
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).parent)
K, TARGET = 4, 100.0


@pytest.fixture(autouse=True)
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def config(extra=()):
    return load_config(None, [
        "agent.name=agents.decision_transformer", "agent.d_model=16", "agent.num_heads=2", "agent.num_layers=2",
        f"agent.context={K}", "agent.dropout=0.0", f"agent.target_return={TARGET}", "agent.rtg_scale=10",
        "replay.item=episode", "replay.max_episode_length=64", "actor.num_actors=1", "actor.epsilon=0.5",
        "replay.capacity=4096", "replay.min_size_to_sample=1", *extra,
    ])  # fmt: skip


def discrete_agent(cfg, obs_dim=3):
    return make_agent(cfg, EnvSpec((obs_dim,), np.dtype(np.float32), 2), torch.device("cpu"))


def continuous_agent(cfg, obs_dim=3, act_dim=2):
    space = gymnasium.spaces.Box(-2.0, 2.0, (act_dim,), np.float32)
    return make_agent(cfg, EnvSpec((obs_dim,), np.dtype(np.float32), None, space), torch.device("cpu"))


# --------------------------------------------------------------------------- returns-to-go


def test_returns_to_go_on_hand_made_rewards():
    reward = torch.tensor([[1.0, 0.0, 2.0, 5.0, 0.0], [3.0, -1.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[True] * 4 + [False], [True, True, False, False, False], [True] * 5])
    reward[0, 4] = 99.0  # garbage on padding is ignored
    expect = [[8.0, 7.0, 7.0, 5.0, 0.0], [2.0, -1.0, 0.0, 0.0, 0.0], [35.0, 28.0, 21.0, 14.0, 7.0]]
    assert returns_to_go(reward, mask).tolist() == expect


def episode_batch(rewards: list[list[float]], T: int = 8, obs_dim: int = 3, act=None):
    """An Episode-item batch like the table's gather: rows 0..L-1 valid, zero padding."""
    B = len(rewards)
    lengths = torch.tensor([len(r) for r in rewards])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    reward = torch.zeros(B, T)
    for b, r in enumerate(rewards):
        reward[b, : len(r)] = torch.tensor(r)
    g = torch.Generator().manual_seed(0)
    obs = torch.randn(B, T, obs_dim, generator=g) * mask[..., None]
    action = (torch.randint(2, (B, T), generator=g) if act is None else act(B, T, g)) * (
        mask if act is None else mask[..., None])  # fmt: skip
    timestep = (torch.arange(T)[None, :] + 10) * mask  # items that start at the episode's step 10
    return {"obs": obs, "action": action, "reward": reward, "timestep": timestep, "mask": mask, "length": lengths}


def test_hindsight_relabelling_uses_the_rewards_the_episode_got():
    """Whatever return the actor was conditioned on (100 here), training windows carry the
    returns-to-go of the stored rewards, from each window's first step to the episode's end."""
    data = episode_batch([[1.0, 2.0, 3.0, 4.0], [5.0, 0.0, 1.0, 0.0, 0.0, 2.0, 1.0, 1.0], [2.0]])
    w = sample_windows(data, K, starts=torch.tensor([1, 3, 0]))
    assert w["rtg"].tolist() == [[9.0, 7.0, 4.0, 0.0], [4.0, 4.0, 4.0, 2.0], [2.0, 0.0, 0.0, 0.0]]
    assert w["mask"].tolist() == [[True, True, True, False], [True] * 4, [True, False, False, False]]
    assert w["timestep"][0].tolist() == [11, 12, 13, 0] and w["timestep"][1].tolist() == [13, 14, 15, 16]
    torch.testing.assert_close(w["obs"][1], data["obs"][1, 3:7])
    assert (w["obs"][0, 3] == 0).all() and (w["obs"][2, 1:] == 0).all()  # padding zero-filled
    # random starts (ODT: uniform over the item's steps) stay inside each item
    for seed in range(20):
        w = sample_windows(data, K, torch.Generator().manual_seed(seed))
        first = w["timestep"][:, 0] - 10
        assert (first >= 0).all() and (first < data["length"]).all()
        ret = returns_to_go(data["reward"], data["mask"])
        assert w["rtg"][:, 0].tolist() == [ret[b, int(first[b])].item() for b in range(3)]


def test_priorities_are_the_item_return_or_length():
    ret, length = torch.tensor([10.0, -30.0, 0.5]), torch.tensor([3, 7, 1])
    assert item_priority(ret, length, "return", 0.0).tolist() == [10.0, 0.0, 0.5]  # never negative
    assert item_priority(ret, length, "return", 40.0).tolist() == [50.0, 10.0, 40.5]
    assert item_priority(ret, length, "length", 0.0).tolist() == [3.0, 7.0, 1.0]


# --------------------------------------------------------------------------- padding invariance


def _padded_copy(w: dict, extra: int, garbage: bool) -> dict:
    """``w`` with ``extra`` more masked steps, and (``garbage``) random values on every padded step."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for k, v in w.items():
        pad = torch.zeros(v.shape[0], extra, *v.shape[2:], dtype=v.dtype)
        out[k] = torch.cat([v, pad], dim=1)
    if garbage:
        pad = ~out["mask"]
        out["obs"][pad] = torch.randn(int(pad.sum()), out["obs"].shape[-1], generator=g) * 50
        out["rtg"][pad] = torch.randn(int(pad.sum()), generator=g) * 1000
        out["timestep"][pad] = torch.randint(0, 60, (int(pad.sum()),), generator=g)
        if out["action"].dtype == torch.int64:
            out["action"][pad] = torch.randint(0, 2, (int(pad.sum()),), generator=g)
        else:
            out["action"][pad] = torch.rand(int(pad.sum()), out["action"].shape[-1], generator=g) * 4 - 2
    return out


@pytest.mark.parametrize("actions", ["discrete", "continuous"])
def test_padding_does_not_change_the_loss(actions):
    cfg = config()
    if actions == "discrete":
        agent = discrete_agent(cfg)
        data = episode_batch([[1.0] * 8, [1.0] * 3, [2.0, 0.0], [1.0] * 6])
    else:
        agent = continuous_agent(cfg)
        data = episode_batch([[1.0] * 8, [1.0] * 3, [2.0, 0.0], [1.0] * 6],
                             act=lambda B, T, g: torch.rand(B, T, 2, generator=g) * 4 - 2)  # fmt: skip
    agent.setup_learner()
    w = sample_windows(data, K, starts=torch.tensor([2, 1, 0, 4]))  # windows padded by 0, 2, 2, 2 steps
    assert w["mask"].sum(1).tolist() == [4, 2, 2, 2]
    key = "learner/action_ce" if actions == "discrete" else "learner/nll"

    def loss_of(windows):
        torch.manual_seed(0)
        with torch.no_grad():
            loss, _, parts = agent.loss(windows)
        return loss.item(), parts[key].item()

    base = loss_of(w)
    assert np.isfinite(base[0])
    garbage = loss_of(_padded_copy(w, 0, garbage=True))
    assert garbage == pytest.approx(base, rel=1e-5, abs=1e-6)
    longer = loss_of(_padded_copy(w, 5, garbage=True))  # more padding: 3K → 3(K+5) tokens
    assert longer[1] == pytest.approx(base[1], rel=1e-5, abs=1e-6)
    if actions == "discrete":
        assert longer[0] == pytest.approx(base[0], rel=1e-5)
    # and a valid step does count: changing one changes the loss
    w2 = {k: v.clone() for k, v in w.items()}
    w2["rtg"][1, 0] += 50.0
    assert loss_of(w2)[1] != pytest.approx(base[1], rel=1e-5)


def test_continuous_head_learns_a_mapping_and_its_temperature_moves():
    """Behaviour cloning of a = 1.5·tanh(obs₀) through the tanh-Gaussian head: NLL falls and λ
    is updated toward the target entropy."""
    cfg = config(["agent.lr=0.003", "agent.warmup_updates=1", "agent.weight_decay=0.0"])
    agent = continuous_agent(cfg, act_dim=1)
    agent.setup_learner()
    g = torch.Generator().manual_seed(0)
    lam0 = agent.log_temperature.exp().item()

    def batch():
        data = episode_batch([[1.0] * 8] * 16, act=lambda B, T, g: torch.zeros(B, T, 1))
        data["obs"] = torch.randn(16, 8, 3, generator=g)
        data["action"] = 1.5 * torch.tanh(data["obs"][..., :1])
        from gearflow.replay.table import Sample

        return Sample(data, torch.arange(16), torch.ones(16), torch.ones(16, dtype=torch.float64))

    nll = [agent.learn(batch())[0]["learner/nll"] for _ in range(120)]
    assert np.mean(nll[-10:]) < np.mean(nll[:10]) - 1.0, (nll[:10], nll[-10:])
    assert agent.log_temperature.exp().item() != pytest.approx(lam0)
    # greedy actions follow the mapping, in env units
    obs = torch.randn(16, K, 3, generator=g).numpy()
    with torch.no_grad():  # as actors call it
        out = agent.act(agent.online.eval(), obs, np.zeros(16), np.random.default_rng(0), lengths=np.full(16, K),
                        rtg=np.tile(8.0 - np.arange(K, dtype=np.float32), (16, 1)),  # as in training:
                        actions=np.zeros((16, K, 1), np.float32), timesteps=np.tile(10 + np.arange(K), (16, 1)))
    assert out.actions.dtype == np.float32 and out.actions.shape == (16, 1)
    err = np.abs(out.actions[:, 0] - 1.5 * np.tanh(obs[:, -1, 0]))
    assert err.mean() < 0.2, err


# --------------------------------------------------------------------------- the episode actor


class Spy:
    """Wraps an agent and records every act call's context."""

    def __init__(self, agent):
        self._agent, self.calls = agent, []

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def act(self, network, obs, epsilon, rng=None, **ctx):
        self.calls.append({"obs": obs.copy(), **{k: v.copy() for k, v in ctx.items()}})
        return self._agent.act(network, obs, epsilon, rng, **ctx)


@pytest.mark.parametrize("env_kind", ["gymnasium", "async"])
def test_episode_actor_writes_the_episodes_the_env_produced(make_table, env_kind):
    """CountingEnv: obs [t, episode, env], reward t+1 for the action at step t. Every row,
    item, priority and acting context is checked against what the env did; T = 5 cuts the
    7-step episodes to their last 5 rows."""
    from helpers_envs import AsyncCountingVecEnv, expected_episode

    E, T = 4, 5
    # the spy sees the whole context in act (the cached actor's contexts: tests/test_kv_cache.py)
    cfg = config([f"env.num_envs={E}", "env.factory=helpers_envs:make", f"replay.max_episode_length={T}",
                  "agent.kv_cache=false"])  # fmt: skip
    env = make_vec_env(cfg.env, seed=0) if env_kind == "gymnasium" else AsyncCountingVecEnv(E, 2, seed=3)
    agent = Spy(discrete_agent(cfg))
    S = 1024
    table = make_table(spec=agent.replay_columns(), P=E, S=S, kind=agent.item_kind(), selector="max_heap")
    episodes = []
    actor = make_actor(cfg, 0, agent, env, table.storage, np.arange(E), None,
                       on_episode=lambda *a: episodes.append(a))  # fmt: skip
    assert isinstance(actor, EpisodeActor)
    actor.run(max_steps=E * 40)

    # contexts: the last min(t+1, K) steps of the episode; R̂ = target − rewards so far; a_<t
    assert len(agent.calls) > 20
    for call in agent.calls:
        for obs, n, rtg, act, ts in zip(call["obs"], call["lengths"], call["rtg"], call["actions"], call["timesteps"]):
            t = int(obs[n - 1, 0])
            assert n == min(t + 1, K)
            steps = np.arange(t - n + 1, t + 1)
            np.testing.assert_array_equal(obs[:n, 0], steps)
            np.testing.assert_array_equal(ts[:n], steps)
            np.testing.assert_allclose(rtg[:n], TARGET - steps * (steps + 1) / 2)  # Σ_{k ≤ s} k
            assert act[n - 1] == 0  # a_t is not known yet

    st, cols = table.storage, table.storage.columns
    finished = 0
    for p in range(E):
        rows = int(st.counters[p, COMMIT])
        expect, ep = [], 0
        while len(expect) < rows:
            L, _ = expected_episode(p, ep)
            expect += [(t, ep, L) for t in range(L)]
            ep += 1
        expect = expect[:rows]
        obs = cols["obs"][p * S : p * S + rows]
        np.testing.assert_array_equal(obs, np.array([(t, ep, p) for t, ep, _ in expect], np.float32))
        np.testing.assert_array_equal(cols["reward"][p * S : p * S + rows], [t + 1 for t, _, _ in expect])
        np.testing.assert_array_equal(cols["timestep"][p * S : p * S + rows], [t for t, _, _ in expect])
        if env_kind == "gymnasium":  # the actions stepped are the actions stored, in order
            stored = cols["action"][p * S : p * S + rows].tolist()
            assert stored == env._env.envs[p].actions[: len(stored)]
        # one item per finished episode: its last min(L, T) rows, priority = their return
        first_row = {}
        for r, (t, ep, L) in enumerate(expect):
            first_row.setdefault(ep, r)
        done_eps = [e for e in first_row if first_row[e] + expected_episode(p, e)[0] <= rows]
        assert int(st.counters[p, PUBLISHED]) == len(done_eps) == int(st.counters[p, EPISODES])
        for j, e in enumerate(done_eps):
            L = expected_episode(p, e)[0]
            n = min(L, T)
            assert int(st.item_length[p, j]) == n
            assert int(st.item_start[p, j]) == first_row[e] + L - n
            assert st.item_priority[p, j] == sum(range(L - n + 1, L + 1))
        finished += len(done_eps)
    assert actor.episodes == len(episodes) == finished > 10
    assert actor.long_episodes > 0  # the 7-step episodes
    assert sorted(ret for _, ret, _, _ in episodes) == sorted(
        L * (L + 1) / 2 for _, _, L, _ in episodes)  # on_episode: full return and length  # fmt: skip

    # the table's samples are these items; max_heap: the highest-return first
    sample = table.sample(8)
    d = sample.data
    for b in range(8):
        n = int(d["length"][b])
        ts = d["timestep"][b, :n].numpy()
        np.testing.assert_array_equal(d["obs"][b, :n, 0].numpy(), ts)
        np.testing.assert_array_equal(d["reward"][b, :n].numpy(), ts + 1)
        assert (d["reward"][b, n:] == 0).all()
    assert d["reward"].sum(1).tolist() == sorted(d["reward"].sum(1).tolist(), reverse=True)
    actor.close()


def test_episode_actor_on_envpool_cartpole_writes_whole_physical_episodes(make_table):
    """Real EnvPool: each item is a whole episode (length = return), consecutive rows obey
    CartPole's Euler step x' = x + 0.02·ẋ and the timestep counts from 0."""
    E = 8
    cfg = config(["env.id=CartPole-v1", f"env.num_envs={E}", "env.batch_size=4", "actor.epsilon=1.0",
                  "replay.max_episode_length=500"])  # fmt: skip
    env = make_vec_env(cfg.env, seed=0)
    agent = discrete_agent(cfg, obs_dim=4)
    table = make_table(spec=agent.replay_columns(), P=E, S=1024, kind=agent.item_kind())
    episodes = []
    with make_actor(cfg, 0, agent, env, table.storage, np.arange(E), None,
                    on_episode=lambda *a: episodes.append(a)) as actor:  # fmt: skip
        actor.run(max_steps=1500)
    assert len(episodes) > 20 and all(ret == length for _, ret, length, _ in episodes)
    d = table.sample(64).data
    for b in range(64):
        n = int(d["length"][b])
        x = d["obs"][b, :n].numpy()
        np.testing.assert_allclose(x[1:, 0], x[:-1, 0] + 0.02 * x[:-1, 1], atol=1e-5)
        np.testing.assert_allclose(x[1:, 2], x[:-1, 2] + 0.02 * x[:-1, 3], atol=1e-5)
        np.testing.assert_array_equal(d["timestep"][b, :n].numpy(), np.arange(n))
        assert (d["reward"][b, :n] == 1).all() and set(d["action"][b, :n].tolist()) <= {0, 1}
    assert {int(n) for n in d["length"]} <= {length for _, _, length, _ in episodes}


def test_episode_actor_on_envpool_pendulum_acts_with_continuous_actions(make_table):
    """Real EnvPool Pendulum-v1 (Box(-2, 2, (1,))): float actions within the bounds are stored
    and stepped; episodes are truncated at 200 steps; priority = return + offset, clipped at 0."""
    E = 4
    cfg = config(["env.id=Pendulum-v1", f"env.num_envs={E}", "env.batch_size=2", "actor.epsilon=1.0",
                  "replay.max_episode_length=200", "agent.return_offset=1500"])  # fmt: skip
    env = make_vec_env(cfg.env, seed=0)
    assert env.env_spec.num_actions is None
    agent = make_agent(cfg, env.env_spec, "cpu")
    assert agent.replay_columns()["action"] == "float32[1]"
    table = make_table(spec=agent.replay_columns(), P=E, S=512, kind=agent.item_kind())
    episodes = []
    with make_actor(cfg, 0, agent, env, table.storage, np.arange(E), None,
                    on_episode=lambda *a: episodes.append(a)) as actor:  # fmt: skip
        actor.run(max_steps=E * 210)
    assert len(episodes) == E and all(length == 200 for _, _, length, _ in episodes)
    st = table.storage
    for p in range(E):
        assert int(st.counters[p, PUBLISHED]) == 1 and int(st.item_length[p, 0]) == 200
        ret = float(st.columns["reward"][p * 512 : p * 512 + 200].sum(dtype=np.float64))
        assert st.item_priority[p, 0] == pytest.approx(max(0.0, ret + 1500), rel=1e-5)
        a = st.columns["action"][p * 512 : p * 512 + 200]
        assert a.shape == (200, 1) and (np.abs(a) <= 2.0).all() and a.std() > 0.1  # sampled, not constant
        obs = st.columns["obs"][p * 512 : p * 512 + 200]
        np.testing.assert_allclose(np.linalg.norm(obs[:, :2], axis=1), 1.0, atol=1e-5)  # (cos θ, sin θ)
    ep_returns = sorted(ret for _, ret, _, _ in episodes)
    assert ep_returns == pytest.approx(sorted(float(st.columns["reward"][p * 512 : p * 512 + 200].sum(dtype=np.float64))
                                              for p in range(E)), rel=1e-5)  # fmt: skip


def test_eval_epsilon_zero_is_greedy():
    cfg = config()
    agent = discrete_agent(cfg)
    net = agent.make_network().eval()
    obs = np.random.default_rng(0).normal(size=(32, K, 3)).astype(np.float32)
    ctx = {"lengths": np.full(32, K), "rtg": np.full((32, K), 50.0, np.float32),
           "actions": np.zeros((32, K), np.int64), "timesteps": np.tile(np.arange(K), (32, 1))}
    with torch.no_grad():
        greedy = [agent.act(net, obs, np.zeros(32), np.random.default_rng(s), **ctx).actions for s in range(3)]
        sampled = [agent.act(net, obs, np.ones(32), np.random.default_rng(s), **ctx).actions for s in range(3)]
    assert all((g == greedy[0]).all() for g in greedy)
    assert any((s != greedy[0]).any() for s in sampled)


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_train_cartpole_dt_end_to_end_then_eval(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearflow", "train", str(ROOT / "configs" / "cartpole_dt.yaml"),
           "run.max_env_steps=4000", "replay.min_size_to_sample=8", "learner.batch_size=16",
           "learner.publish_every=2", "actor.weight_sync_period=16", "env.num_envs=4", "env.batch_size=2",
           "agent.d_model=16", "agent.num_layers=1", "run.log_every_s=0.5", f"run.dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_env_steps=4000"
    assert summary["learner/updates"] > 0 and np.isfinite(summary["learner/loss"])
    assert summary["learner/weights_version"] > 1
    assert summary["actor/weights_version_min"] > 1, "an actor never loaded newer weights"
    assert summary["replay/size"] > 0 and summary["actor/episodes"] > 0
    assert "Traceback" not in proc.stderr
    ev = subprocess.run([sys.executable, "-m", "gearflow", "eval", str(run), "--episodes", "2"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["eval/episodes"] == 2 and result["eval/return_mean"] >= 8  # CartPole lasts ≥ 8 steps
