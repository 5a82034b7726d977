"""R2D2 with a transformer: value rescaling, priorities, burn-in/padding invariance,
the sequence actor's windows, and a tiny run through ``gearflow train``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agents.r2d2_transformer import (
    inverse_value_rescale,
    priority_mix,
    sequence_td,
    value_rescale,
)
from gearflow.actors import actor_class_for
from gearflow.kinds.transition import Actor
from gearflow.actors.process import make_actor
from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import EnvSpec, make_vec_env
from gearflow.errors import ConfigError
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED
from gearflow.replay.table import Sample
from gearflow.kinds.sequence import SequenceActor
from gearflow.transforms import mask_velocity

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).parent)
GAMMA, N = 0.9, 3
T, PERIOD, BURN_IN, CONTEXT = 6, 3, 2, 4


@pytest.fixture(autouse=True)
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def config(extra=()):
    return load_config(None, [
        "agent.name=agents.r2d2_transformer", "agent.d_model=16", "agent.num_heads=2", "agent.num_layers=1",
        f"agent.context={CONTEXT}", "replay.item=sequence", f"replay.sequence_length={T}",
        f"replay.sequence_period={PERIOD}", f"replay.burn_in={BURN_IN}", f"actor.n_step={N}",
        f"actor.gamma={GAMMA}", "actor.num_actors=1", "actor.epsilon=0.5", "replay.capacity=4096", *extra,
    ])  # fmt: skip


def agent_for(cfg, obs_dim=3):
    return make_agent(cfg, EnvSpec((obs_dim,), np.dtype(np.float32), 2), torch.device("cpu"))


# --------------------------------------------------------------------------- value rescaling


def test_value_rescaling_and_its_inverse():
    x = torch.cat([torch.linspace(-1000, 1000, 2001, dtype=torch.float64), torch.tensor([0.0, 1e-4, -3.0, 1e5])])
    h = value_rescale(x)
    np.testing.assert_allclose(inverse_value_rescale(h).numpy(), x.numpy(), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(value_rescale(inverse_value_rescale(x)).numpy(), x.numpy(), rtol=1e-9, atol=1e-9)
    assert value_rescale(torch.tensor(3.0)).item() == pytest.approx(1.0 + 3e-3)  # √4 − 1 + εx
    assert value_rescale(torch.tensor(-8.0)).item() == pytest.approx(-2.0 - 8e-3)
    assert (torch.diff(h[:2001]) > 0).all() and h[x == 0].abs().max() == 0  # monotone, h(0) = 0
    np.testing.assert_allclose(value_rescale(-x).numpy(), -h.numpy())


def test_priority_mix_is_eta_max_plus_one_minus_eta_mean_over_valid_steps():
    td = torch.tensor([[1.0, 3.0, 100.0, 2.0], [0.5, 0.5, 0.5, 0.5], [7.0, 7.0, 7.0, 7.0]])
    valid = torch.tensor([[True, True, False, True], [True, False, False, False], [False] * 4])
    p = priority_mix(td, valid, 0.9)
    assert p[0].item() == pytest.approx(0.9 * 3.0 + 0.1 * 2.0)  # the masked 100 is ignored
    assert p[1].item() == pytest.approx(0.5)
    assert p[2].item() == 0.0  # no loss step: priority 0


# --------------------------------------------------------------------------- TD targets


def reference_td(q, action, reward, discount, length, n, gamma, eps=1e-3):
    """Per step, by hand: n-step return truncated at the window's last row, double Q with
    online = target (the actor's case)."""
    Tn = len(reward)
    out = np.full(Tn, np.nan)
    h = lambda v: np.sign(v) * (np.sqrt(abs(v) + 1) - 1) + eps * v
    hinv = lambda v: float(inverse_value_rescale(torch.tensor(v, dtype=torch.float64), eps))
    for i in range(length - 1):
        g, scale, m = 0.0, 1.0, 0
        while m < n and i + m < length - 1:
            g += scale * reward[i + m]
            scale *= gamma * discount[i + m]
            m += 1
        j = i + m
        y = h(g + scale * hinv(q[j].max()))
        out[i] = y - q[i, action[i]]
    return out


def test_sequence_td_matches_a_step_by_step_reference():
    rng = np.random.default_rng(0)
    B, Tn, A = 5, 9, 3
    q = rng.normal(size=(B, Tn, A)).astype(np.float32) * 3
    action = rng.integers(A, size=(B, Tn))
    reward = rng.normal(size=(B, Tn)).astype(np.float32)
    discount = np.ones((B, Tn), np.float32)
    discount[1, 4] = 0.0  # a termination inside a window
    lengths = np.array([9, 6, 2, 9, 5])
    qt = torch.tensor(q)
    td = sequence_td(qt, qt, qt, torch.tensor(action), torch.tensor(reward), torch.tensor(discount),
                     torch.tensor(lengths), N, GAMMA, 1e-3).numpy()  # fmt: skip
    for b in range(B):
        ref = reference_td(q[b].astype(np.float64), action[b], reward[b], discount[b], lengths[b], N, GAMMA)
        L = lengths[b] - 1
        np.testing.assert_allclose(td[b, :L], ref[:L], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- invariance


def batch(rng, B=4, length=(T, T, 4, 5), first=(False, False, False, True), obs_dim=3):
    lengths = np.array(length)
    mask = np.arange(T)[None, :] < lengths[:, None]
    data = {
        "obs": torch.tensor(rng.normal(size=(B, T, obs_dim)).astype(np.float32)),
        "action": torch.tensor(rng.integers(2, size=(B, T))),
        "reward": torch.tensor(rng.normal(size=(B, T)).astype(np.float32)),
        "discount": torch.tensor((rng.random((B, T)) > 0.1).astype(np.float32)),
        "first": torch.zeros(B, T, dtype=torch.bool),
        "version": torch.zeros(B, T, dtype=torch.int64),
        "mask": torch.tensor(mask),
        "length": torch.tensor(lengths),
    }
    data["first"][:, 0] = torch.tensor(first)
    for k in ("obs", "action", "reward", "discount"):  # the table zero-fills padding
        data[k][~data["mask"]] = 0
    return Sample(data, torch.arange(B), torch.tensor([1.0, 0.5, 0.8, 0.3]), torch.ones(B, dtype=torch.float64))


def loss_of(agent, sample):
    with torch.no_grad():
        loss, td, valid, _ = agent.loss(sample)
    return loss.item(), td, valid


def test_padding_and_burn_in_do_not_change_the_loss_on_the_unmasked_part():
    agent = agent_for(config())
    agent.setup_learner()
    agent.target.load_state_dict({k: v + 0.01 for k, v in agent.online.state_dict().items()})  # online ≠ target
    rng = np.random.default_rng(1)
    base = batch(rng)
    loss0, td0, valid = loss_of(agent, base)
    # which steps get a loss: past the burn-in with a next row; a window starting an episode has no burn-in
    expect = np.zeros((4, T), bool)
    expect[0, BURN_IN : T - 1] = expect[1, BURN_IN : T - 1] = True
    expect[2, BURN_IN:3] = True
    expect[3, 0:4] = True
    np.testing.assert_array_equal(valid.numpy(), expect)

    pad = ~base.data["mask"]
    changed = {k: v.clone() for k, v in base.data.items()}  # padded steps: any contents
    changed["obs"][pad] = torch.tensor(rng.normal(size=(int(pad.sum()), 3)).astype(np.float32)) * 50
    changed["action"][pad] = 1
    changed["reward"][pad] = 1e3
    changed["discount"][pad] = 1.0
    loss1, td1, _ = loss_of(agent, Sample(changed, base.keys, base.weights, base.probabilities))
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    np.testing.assert_allclose(td1[valid].numpy(), td0[valid].numpy(), rtol=1e-5, atol=1e-6)

    burn = torch.zeros(4, T, dtype=torch.bool)
    burn[:3, :BURN_IN] = True  # the windows with a burn-in: its loss contributions are changed
    changed = {k: v.clone() for k, v in base.data.items()}
    changed["action"][burn] = 1 - changed["action"][burn]
    changed["reward"][burn] = 1e3
    changed["discount"][burn] = 1 - changed["discount"][burn]
    loss2, td2, _ = loss_of(agent, Sample(changed, base.keys, base.weights, base.probabilities))
    assert loss2 == pytest.approx(loss0, rel=1e-6)
    np.testing.assert_allclose(td2[valid].numpy(), td0[valid].numpy(), rtol=1e-5, atol=1e-6)

    # the burn-in is context: its observations do change the loss, and so do loss-step rewards
    changed = {k: v.clone() for k, v in base.data.items()}
    changed["obs"][burn] += 1.0
    assert loss_of(agent, Sample(changed, base.keys, base.weights, base.probabilities))[0] != pytest.approx(loss0)
    changed = {k: v.clone() for k, v in base.data.items()}
    changed["reward"][0, BURN_IN] += 5.0
    assert loss_of(agent, Sample(changed, base.keys, base.weights, base.probabilities))[0] != pytest.approx(loss0)


def test_learn_returns_window_priorities_and_updates_the_target_every_k():
    cfg = config(["agent.target_update_period=2"])
    agent = agent_for(cfg)
    agent.setup_learner()
    sample = batch(np.random.default_rng(2))
    _, td, valid = loss_of(agent, sample)
    metrics, prio = agent.learn(sample)
    np.testing.assert_allclose(prio.numpy(), priority_mix(td.abs(), valid, 0.9).numpy(), rtol=1e-5)
    assert np.isfinite(metrics["learner/loss"]) and metrics["learner/updates"] == 1
    assert any((a != b).any() for a, b in zip(agent.online.parameters(), agent.target.parameters()))
    agent.learn(sample)
    assert all((a == b).all() for a, b in zip(agent.online.parameters(), agent.target.parameters()))


# --------------------------------------------------------------------------- sequence actor


def q_of(obs: np.ndarray) -> np.ndarray:
    """Known Q-values from an observation [t, episode, env] (the spy replaces the network's)."""
    t = obs[..., 0].astype(np.float32)
    return np.stack([0.1 * t, 1.0 - 0.05 * t], axis=-1)


class Spy:
    """The real agent, recording each context it acts on and reporting ``q_of`` as Q-values."""

    def __init__(self, agent):
        self._agent, self.calls = agent, []

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def act(self, network, obs, epsilon, rng=None, lengths=None):
        out = self._agent.act(network, obs, epsilon, rng, lengths=lengths)
        self.calls.append((obs.copy(), lengths.copy()))
        out.values = q_of(obs[np.arange(len(obs)), lengths - 1])
        return out

    def act_cached(self, network, cache, ids, obs_new, n_new, epsilon, rng=None):
        out = self._agent.act_cached(network, cache, ids, obs_new, n_new, epsilon, rng)
        self.calls.append(None)  # the cached actor's contexts: tests/test_kv_cache.py
        out.values = q_of(obs_new[np.arange(len(ids)), n_new - 1])  # the newest step of each context
        return out


def expected_windows(rows: int) -> list[tuple[int, int]]:
    """(start, length) of the windows of an episode of ``rows`` rows (final obs included)."""
    out = []
    for s in range(0, rows, PERIOD):
        n = min(T, rows - s)
        if n == T or n > BURN_IN or s == 0:
            out.append((s, n))
    return out


@pytest.mark.parametrize("kv_cache", [False, True], ids=["recompute", "kv_cache"])
@pytest.mark.parametrize("env_kind", ["gymnasium", "async"])
def test_sequence_actor_writes_the_windows_the_env_produced(make_table, env_kind, kv_cache):
    from helpers_envs import AsyncCountingVecEnv, expected_episode

    E = 4
    cfg = config([f"env.num_envs={E}", "env.factory=helpers_envs:make", f"agent.kv_cache={str(kv_cache).lower()}"])
    env = make_vec_env(cfg.env, seed=0) if env_kind == "gymnasium" else AsyncCountingVecEnv(E, 2, seed=3)
    agent = Spy(agent_for(cfg))
    S = 1024
    table = make_table(spec=agent.replay_columns(), P=E, S=S, kind=agent.item_kind())
    episodes = []
    actor = make_actor(cfg, 0, agent, env, table.storage, np.arange(E), None,
                       on_episode=lambda *a: episodes.append(a))  # fmt: skip
    assert isinstance(actor, SequenceActor)
    actor.run(max_steps=E * 40)
    st, cols = table.storage, table.storage.columns

    # contexts: each env's last min(t+1, C) observations of its episode, ending with this obs
    assert len(agent.calls) >= 40 and (actor.cache is not None) == kv_cache
    for ctx, lengths in [c for c in agent.calls if c is not None]:
        for c, n in zip(ctx, lengths):
            t, ep, e = c[n - 1]
            assert n == min(int(t) + 1, CONTEXT)
            np.testing.assert_array_equal(c[:n, 0], np.arange(t - n + 1, t + 1))
            assert (c[:n, 1] == ep).all() and (c[:n, 2] == e).all()

    finished = 0
    for p in range(E):
        rows = int(st.counters[p, COMMIT])
        obs = cols["obs"][p * S : p * S + rows]
        # the rows are the episodes in order, each with its final observation as a row
        expect, ep = [], 0
        while len(expect) < rows:
            L, how = expected_episode(p, ep)
            expect += [(t, ep, p, L, how) for t in range(L + 1)]
            ep += 1
        expect = expect[:rows]
        np.testing.assert_array_equal(obs, np.array([x[:3] for x in expect], np.float32))
        for r, (t, ep, _, L, how) in enumerate(expect):
            row = {k: cols[k][p * S + r] for k in ("action", "reward", "discount", "first")}
            assert row["first"] == (t == 0)
            if t == L:  # the final observation: no action, no reward, no continuation
                assert row["action"] == 0 and row["reward"] == 0 and row["discount"] == 0
            else:
                assert row["reward"] == t + 1  # CountingEnv: reward t+1 for reaching t+1
                assert row["discount"] == (0.0 if (t + 1 == L and how == "term") else 1.0)
        if env_kind == "gymnasium":  # the actions stepped are the actions stored, in order
            stored = [int(cols["action"][p * S + r]) for r, x in enumerate(expect) if x[0] < x[3]]
            assert stored == env._env.envs[p].actions[: len(stored)]
        # item records: exactly the schedule's windows of every finished episode
        episode_row = {}
        for r, x in enumerate(expect):
            episode_row.setdefault(x[1], r)
        done_eps = [e for e in episode_row if episode_row[e] + expected_episode(p, e)[0] + 1 <= rows]
        n_items = int(st.counters[p, PUBLISHED])
        got = set()
        for j in range(n_items):
            start, length = int(st.item_start[p, j]), int(st.item_length[p, j])
            t0, ep = int(obs[start, 0]), int(obs[start, 1])
            got.add((ep, t0, length))
            values = np.zeros((1, T, 2), np.float32)
            values[0, :length] = q_of(obs[start : start + length])
            action, reward, discount, first = (
                np.pad(cols[c][p * S + start : p * S + start + length], (0, T - length))[None]
                for c in ("action", "reward", "discount", "first")
            )
            prio = agent.initial_priorities(values, action, reward, discount, first, np.array([length]))
            assert st.item_priority[p, j] == pytest.approx(prio[0], rel=1e-5), (p, ep, t0)
        want = {(e, s, n) for e in done_eps for s, n in expected_windows(expected_episode(p, e)[0] + 1)}
        assert want <= got and all(e in done_eps or n == T for e, _, n in got - want)
        assert st.counters[p, EPISODES] == len(done_eps)
        finished += len(done_eps)
    assert actor.episodes == len(episodes) == finished > 10

    # sampled windows (table gather: padding zero-filled, mask, length) equal the stored rows
    sample = table.sample(64)
    d = sample.data
    for b in range(64):
        n = int(d["length"][b])
        t0, ep, e = (int(v) for v in d["obs"][b, 0])
        L, how = expected_episode(e, ep)
        np.testing.assert_array_equal(d["obs"][b, :n, 0].numpy(), np.arange(t0, t0 + n))
        assert t0 % PERIOD == 0 and (t0 + n == L + 1 or n == T)
        assert d["mask"][b].tolist() == [i < n for i in range(T)]
        assert (d["obs"][b, n:] == 0).all() and (d["reward"][b, n:] == 0).all()
        np.testing.assert_array_equal(d["reward"][b, :n].numpy(), [0.0 if t == L else t + 1 for t in range(t0, t0 + n)])
    actor.close()


def test_sequence_actor_on_envpool_cartpole_writes_physical_windows(make_table):
    """Real EnvPool: inside every sampled window consecutive rows obey CartPole's Euler step
    x' = x + 0.02·ẋ (so rows are consecutive steps of one episode), rewards are 1 and only the
    last transition of a terminated episode has discount 0."""
    E = 8
    cfg = config(["env.id=CartPole-v1", f"env.num_envs={E}", "env.batch_size=4", "actor.epsilon=1.0",
                  "replay.sequence_length=16", "replay.sequence_period=8", "replay.burn_in=4"])  # fmt: skip
    env = make_vec_env(cfg.env, seed=0)
    agent = agent_for(cfg, obs_dim=4)
    table = make_table(spec=agent.replay_columns(), P=E, S=512, kind=agent.item_kind())
    episodes = []
    with make_actor(cfg, 0, agent, env, table.storage, np.arange(E), None,
                    on_episode=lambda *a: episodes.append(a)) as actor:  # fmt: skip
        actor.run(max_steps=1500)
    assert len(episodes) > 20 and all(ret == length for _, ret, length, _ in episodes)
    d = table.sample(128).data
    for b in range(128):
        n = int(d["length"][b])
        x = d["obs"][b, :n].numpy()
        np.testing.assert_allclose(x[1:, 0], x[:-1, 0] + 0.02 * x[:-1, 1], atol=1e-5)
        np.testing.assert_allclose(x[1:, 2], x[:-1, 2] + 0.02 * x[:-1, 3], atol=1e-5)
        final = n < 16  # a tail window ends with the episode's final observation
        r, disc = d["reward"][b, :n].numpy(), d["discount"][b, :n].numpy()
        assert (r[: n - 1] == 1).all() and (disc[: n - 2] == 1).all()
        if final:
            assert r[n - 1] == 0 and disc[n - 1] == 0 and d["action"][b, n - 1] == 0
            assert disc[n - 2] == 0  # random CartPole episodes end by termination, not at 500


def test_actor_class_follows_the_item_kind():
    assert actor_class_for(agent_for(config())) is SequenceActor
    apex = load_config(None, [])
    assert actor_class_for(make_agent(apex, EnvSpec((2,), np.dtype(np.float32), 2), "cpu")) is Actor


def test_masked_cartpole_has_positions_only():
    cfg = load_config(str(ROOT / "configs" / "cartpole_masked_r2d2.yaml"), ["env.num_envs=2", "env.batch_size=2"])
    env = make_vec_env(cfg.env, seed=0)
    try:
        env.async_reset()
        obs = env.recv()[0]
        assert env.obs_shape == (2,) and obs.shape == (2, 2)
    finally:
        env.close()
    raw = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(mask_velocity(raw), [[0, 2], [4, 6]])


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["processes", "serial"])
def test_train_masked_cartpole_r2d2_end_to_end(tmp_path, mode):
    # processes: samples-per-insert 1 ties the actors to the learner, so on a loaded machine
    # they cannot finish the run before the learner has published; serial: one thread does both
    # serial: one update per recv, so fewer steps keep it as short; weights every 64 steps, as the
    # KV-cached actor re-encodes its contexts after each new version (every 16 steps doubled the
    # run's time and timed out next to a CPU hog)
    steps, pace = (3000, ["replay.samples_per_insert=1", "replay.error_buffer=64", "actor.weight_sync_period=16"]
                   ) if mode == "processes" else (
        1000, ["run.serial=true", "replay.samples_per_insert=0", "actor.weight_sync_period=64"])  # fmt: skip
    cmd = [sys.executable, "-m", "gearflow", "train", str(ROOT / "configs" / "cartpole_masked_r2d2.yaml"),
           f"run.max_env_steps={steps}", "replay.min_size_to_sample=16", *pace,
           "learner.batch_size=8", "learner.publish_every=2",
           "env.num_envs=4", "env.batch_size=2", "agent.d_model=16", "agent.num_layers=1",
           "run.log_every_s=0.5", f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == f"reached run.max_env_steps={steps}"
    assert summary["learner/updates"] > 0 and np.isfinite(summary["learner/loss"])
    assert summary["learner/weights_version"] > 1
    assert summary["actor/weights_version_min"] > 1, "an actor never loaded newer weights"
    assert summary["replay/size"] > 0 and summary["actor/episodes"] > 0
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- image observations


def test_cnn_torso_for_frames_acts_and_learns():
    from agents.r2d2_transformer import FrameEmbedding

    cfg = config()
    spec = EnvSpec((4, 84, 84), np.dtype(np.uint8), 6)
    agent = make_agent(cfg, spec, torch.device("cpu"))
    assert agent.replay_columns()["obs"] == "uint8[4,84,84]"
    agent.setup_learner()
    assert isinstance(agent.online.embed, FrameEmbedding)  # torso=auto: a CNN for (C, H, W)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, size=(3, CONTEXT, 4, 84, 84), dtype=np.uint8)  # (k, C, 4, 84, 84)
    with torch.no_grad():  # as the actor calls it
        out = agent.act(agent.online, frames, np.zeros(3), rng, lengths=np.array([CONTEXT, 2, 1]))
    assert out.actions.shape == (3,) and out.values.shape == (3, 6)
    # context beyond a row's length is never attended to: changing it leaves its values unchanged
    frames2 = frames.copy()
    frames2[2, 1:] = 0
    with torch.no_grad():
        out2 = agent.act(agent.online, frames2, np.zeros(3), rng, lengths=np.array([CONTEXT, 2, 1]))
    np.testing.assert_allclose(out2.values[2], out.values[2], rtol=1e-5, atol=1e-6)
    sample = batch(rng)
    sample.data["obs"] = torch.tensor(rng.integers(0, 255, size=(4, T, 4, 84, 84), dtype=np.uint8))
    sample.data["action"] = torch.tensor(rng.integers(6, size=(4, T)))
    before = [p.detach().clone() for p in agent.online.embed.parameters()]
    metrics, priorities = agent.learn(sample)
    assert np.isfinite(metrics["learner/loss"]) and priorities.shape == (4,)
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.online.embed.parameters())), "the CNN did not learn"


def test_torso_errors_name_the_problem():
    with pytest.raises(ConfigError, match="agent.torso='rnn': must be one of auto, linear, cnn"):
        agent_for(config(["agent.torso=rnn"]))
    with pytest.raises(ConfigError, match=r"agent.torso=cnn needs image observations \(C, H, W\)"):
        agent_for(config(["agent.torso=cnn"]))
