"""The Ape-X actor: ε ladder, n-step rows and items, initial priorities, weight sync, process."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow.actors import epsilon_ladder
from gearflow.actors.base import env_seed
from gearflow.actors.process import make_actor, run_actor_process
from gearflow.agent import make_agent
from gearflow.config import load_config, to_yaml
from gearflow.envs import make_vec_env
from gearflow.params import ParameterStore
from gearflow.replay.storage import COMMIT, EPISODES, PUBLISHED

TESTS = str(Path(__file__).parent)
N_STEP, GAMMA = 3, 0.9


@pytest.fixture(autouse=True)
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


# --------------------------------------------------------------------------- ε ladder


def test_epsilon_ladder_matches_the_formula():
    np.testing.assert_allclose(epsilon_ladder(1, 0.4, 7.0), [0.4])
    np.testing.assert_allclose(epsilon_ladder(2, 0.4, 7.0), [0.4, 0.4**8])
    lad = epsilon_ladder(16, 0.4, 7.0)
    np.testing.assert_allclose(lad, [0.4 ** (1 + 7.0 * i / 15) for i in range(16)])
    assert lad[0] == pytest.approx(0.4) and lad[-1] == pytest.approx(0.4**8)
    assert (np.diff(lad) < 0).all()
    np.testing.assert_allclose(epsilon_ladder(5, 1.0, 7.0), np.ones(5))  # ε = 1: all random


# --------------------------------------------------------------------------- helpers


def config(num_envs=4, batch_size=0, n_step=N_STEP, gamma=GAMMA, epsilon=0.5, extra=()):
    return load_config(None, [
        "env.factory=helpers_envs:make", f"env.num_envs={num_envs}", f"env.batch_size={batch_size}",
        "actor.num_actors=2", f"actor.n_step={n_step}", f"actor.gamma={gamma}",
        f"actor.epsilon={epsilon}", "actor.epsilon_alpha=1.0", "actor.weight_sync_period=8",
        "agent.hidden_sizes=[]", "agent.dueling=false", "replay.capacity=4096", *extra,
    ])  # fmt: skip


def counting_agent(cfg):
    from gearflow.envs import EnvSpec

    agent = make_agent(cfg, EnvSpec((3,), np.dtype(np.float32), 2), torch.device("cpu"))
    net = agent.make_network()
    with torch.no_grad():  # Q(s, 0) = t, Q(s, 1) = 0.5 t + 1 for obs s = [t, episode, env]
        net.q.weight.copy_(torch.tensor([[1.0, 0, 0], [0.5, 0, 0]]))
        net.q.bias.copy_(torch.tensor([0.0, 1.0]))
    return agent, net


def q_of(obs: np.ndarray) -> np.ndarray:
    t = obs[..., 0].astype(np.float64)
    return np.stack([t, 0.5 * t + 1.0], axis=-1)


def read_items(storage, parts):
    """Every published item of ``parts`` as (partition, start, length, priority), gathered rows."""
    out = []
    for p in parts:
        m = int(storage.counters[p, PUBLISHED])
        assert m <= storage.items_per_partition  # the test keeps every record
        for j in range(m):
            out.append(
                (
                    p,
                    int(storage.item_start[p, j]),
                    int(storage.item_length[p, j]),
                    float(storage.item_priority[p, j]),
                )
            )
    return out


def expected_item(obs_first, n, gamma):
    """What the item of the step with observation [t, episode, env] must hold."""
    from helpers_envs import expected_episode

    t, ep, i = (int(x) for x in obs_first)
    L, how = expected_episode(i, ep)
    last = min(t + n, L)
    ret = sum(gamma**k * (t + k + 1) for k in range(last - t))
    disc = 0.0 if (last == L and how == "term") else gamma ** (last - t)
    return ret, disc, np.array([last, ep, i], dtype=np.float32), last - t + 1


def run_actor(make_table, cfg, env, steps, actor_index=1, param_source=None, on_episode=None):
    agent, net = counting_agent(cfg)
    E = cfg.env.num_envs
    table = make_table(spec=agent.replay_columns(), P=E, S=1024, kind=agent.item_kind())
    actor = make_actor(cfg, actor_index, agent, env, table.storage, np.arange(E), param_source, network=net,
                       on_episode=on_episode)  # fmt: skip
    done = actor.run(max_steps=steps)
    return actor, table, done


def check_every_item(storage, E, n, gamma):
    """Rows are the episodes in order; each step of a finished episode has one correct item."""
    from helpers_envs import expected_episode

    cols = storage.columns
    S = storage.steps_per_partition
    checked = 0
    for p in range(E):
        rows = int(storage.counters[p, COMMIT])
        assert rows < S  # no ring wrap in this test
        obs = cols["obs"][p * S : p * S + rows]
        # rows: episode 0 steps 0..L0 (final obs included), episode 1 steps 0..L1, ...
        expect, ep = [], 0
        while len(expect) < rows:
            L, _ = expected_episode(p, ep)
            expect += [(t, ep, p) for t in range(L + 1)]
            ep += 1
        np.testing.assert_array_equal(obs, np.array(expect[:rows], dtype=np.float32))
        finished = {e for (t, e, _) in expect[:rows] if t == expected_episode(p, e)[0]}
        seen = set()
        for part, start, length, prio in read_items(storage, [p]):
            r0, r1 = p * S + start, p * S + start + length - 1
            first = cols["obs"][r0]
            ret, disc, next_obs, exp_len = expected_item(first, n, gamma)
            assert length == exp_len, (first, length)
            np.testing.assert_array_equal(cols["obs"][r1], next_obs)  # next_obs row
            assert cols["ret"][r0] == pytest.approx(ret, rel=1e-6), first
            assert cols["disc"][r0] == pytest.approx(disc, rel=1e-6), first
            # Ape-X initial priority from the actor's own Q-values
            a = int(cols["action"][r0])
            expected_prio = abs(ret + disc * q_of(next_obs).max() - q_of(first)[a])
            assert prio == pytest.approx(expected_prio, rel=1e-5), first
            key = (int(first[1]), int(first[0]))
            assert key not in seen
            seen.add(key)
            checked += 1
        for ep in finished:  # every step of a finished episode has its item
            L, _ = expected_episode(p, ep)
            assert {(ep, t) for t in range(L)} <= seen, (p, ep)
        assert storage.counters[p, EPISODES] == len(finished)  # the writer closed each episode
        # final rows: action 0, ret 0, disc 0, and never the first row of an item
        final = np.flatnonzero([t == expected_episode(p, e)[0] for (t, e, _) in expect[:rows]])
        assert (cols["action"][p * S + final] == 0).all()
        assert (cols["ret"][p * S + final] == 0).all() and (cols["disc"][p * S + final] == 0).all()
    return checked


# --------------------------------------------------------------------------- n-step items


@pytest.mark.parametrize("n", [1, 3])
def test_n_step_items_with_the_gymnasium_adapter(make_table, n):
    cfg = config(n_step=n)
    env = make_vec_env(cfg.env, seed=0)
    episodes = []
    actor, table, done = run_actor(
        make_table, cfg, env, steps=4 * 60, on_episode=lambda *a: episodes.append(a)
    )
    actor.close()
    assert done == actor.env_steps == 240
    checked = check_every_item(table.storage, 4, n, GAMMA)
    assert checked == actor.items > 100
    # episode callback: global env index (actor 1 of 2 × 4 envs), return 1 + 2 + ... + L
    from helpers_envs import expected_episode

    assert actor.episodes == len(episodes) > 20
    ladder = epsilon_ladder(8, 0.5, 1.0)
    counts = {}
    for env_index, ret, length, eps in episodes:
        e = env_index - 4
        k = counts.get(e, 0)
        counts[e] = k + 1
        assert length == expected_episode(e, k)[0]
        assert ret == length * (length + 1) / 2
        assert eps == pytest.approx(ladder[env_index])


def test_n_step_items_with_async_batches(make_table):
    """batch_size < num_envs: envs arrive in random subsets and orders (EnvPool's interleaving)."""
    from helpers_envs import AsyncCountingVecEnv

    cfg = config(num_envs=6, batch_size=3, extra=["replay.capacity=8192"])
    env = AsyncCountingVecEnv(6, batch_size=3, seed=2)
    actor, table, _ = run_actor(make_table, cfg, env, steps=3 * 150)
    actor.close()
    assert env.closed
    assert check_every_item(table.storage, 6, N_STEP, GAMMA) == actor.items > 100
    # the action column holds the actions the envs were stepped with, in order
    S, cols = table.storage.steps_per_partition, table.storage.columns
    for p, sub in enumerate(env.envs):
        rows = int(table.storage.counters[p, COMMIT])
        obs = cols["obs"][p * S : p * S + rows]
        acted = cols["action"][p * S : p * S + rows]
        from helpers_envs import expected_episode

        not_final = [int(t) != expected_episode(p, int(e))[0] for t, e, _ in obs]
        assert acted[not_final].tolist() == sub.actions[: int(np.sum(not_final))]


def test_greedy_actions_follow_the_q_values(make_table):
    cfg = config(epsilon=0.0)
    env = make_vec_env(cfg.env, seed=0)
    actor, table, _ = run_actor(make_table, cfg, env, steps=80)
    actor.close()
    assert (actor.epsilon == 0).all()
    S, cols = table.storage.steps_per_partition, table.storage.columns
    for part, start, length, _ in read_items(table.storage, range(4)):
        t = cols["obs"][part * S + start][0]
        assert cols["action"][part * S + start] == (1 if t < 2 else 0)  # argmax of [t, t/2 + 1]


def test_table_samples_match_the_items(make_table):
    cfg = config()
    env = make_vec_env(cfg.env, seed=0)
    actor, table, _ = run_actor(make_table, cfg, env, steps=200)
    actor.close()
    batch = table.sample(64)
    d = batch.data
    for j in range(64):
        ret, disc, next_obs, _ = expected_item(d["obs"][j].numpy(), N_STEP, GAMMA)
        np.testing.assert_array_equal(d["next_obs"][j].numpy(), next_obs)
        assert float(d["ret"][j]) == pytest.approx(ret, rel=1e-6)
        assert float(d["disc"][j]) == pytest.approx(disc, rel=1e-6)


# --------------------------------------------------------------------------- weights


def test_weight_sync_records_the_version_acted_with(make_table):
    cfg = config(extra=["actor.weight_sync_period=8"])
    agent, net = counting_agent(cfg)
    table = make_table(spec=agent.replay_columns(), P=4, S=1024, kind=agent.item_kind())
    store = ParameterStore.create(net)
    try:
        env = make_vec_env(cfg.env, seed=0)
        actor = make_actor(cfg, 0, agent, env, table.storage, np.arange(4), store, network=net)
        actor.run(max_steps=40)
        assert actor.version == 0  # nothing published: load_into returned None, never blocked
        newer = agent.make_network()
        newer.load_state_dict(net.state_dict())
        with torch.no_grad():
            newer.q.bias.add_(10.0)
        assert store.publish(newer) == 1
        steps_at_publish = actor.env_steps
        actor.run(max_steps=40)
        actor.close()
        assert actor.version == 1
        torch.testing.assert_close(net.q.bias, newer.q.bias)
        from gearflow.actors.policy import TracedPolicy

        assert isinstance(actor.policy, TracedPolicy)  # it acted with the trace, on the new weights
        x = torch.randn(5, 3)
        with torch.no_grad():
            assert torch.equal(actor.policy(x), net(x)) and torch.equal(actor.policy(x), newer(x))
        S, cols = table.storage.steps_per_partition, table.storage.columns
        for p in range(4):
            rows = int(table.storage.counters[p, COMMIT])
            versions = cols["version"][p * S : p * S + rows]
            assert versions[0] == 0 and versions[-1] == 1
            assert (np.diff(versions) >= 0).all()  # rows in order of acting
        assert steps_at_publish < actor.env_steps
    finally:
        store.close()


# --------------------------------------------------------------------------- EnvPool


def test_envpool_cartpole_actor_writes_consistent_items(make_table):
    cfg = load_config(
        None,
        [
            "env.id=CartPole-v1",
            "env.num_envs=8",
            "env.batch_size=4",
            "actor.num_actors=1",
            "actor.epsilon=1.0",
            "replay.capacity=4096",
        ],
    )
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, torch.device("cpu"))
    table = make_table(spec=agent.replay_columns(), P=8, S=512, kind=agent.item_kind())
    episodes = []
    actor = make_actor(cfg, 0, agent, env, table.storage, np.arange(8), None, on_episode=lambda *a: episodes.append(a))
    actor.run(max_steps=2000)
    actor.close()
    assert actor.env_steps == 2000 and len(episodes) == actor.episodes > 20
    assert all(1 <= length <= 500 and ret == length for _, ret, length, _ in episodes)
    st, S = table.storage, 512
    items = read_items(st, range(8))
    assert len(items) == actor.items
    cols = st.columns
    for p, start, length, prio in items:
        r0 = p * S + start
        assert 2 <= length <= N_STEP + 1 and prio >= 0
        k = length - 1
        assert cols["ret"][r0] == pytest.approx(sum(0.99**j for j in range(k)), rel=1e-5)
        assert cols["disc"][r0] in (0.0, pytest.approx(0.99**k, rel=1e-5))
        if (
            k == N_STEP and cols["disc"][r0] > 0
        ):  # a full window inside one episode: Euler x' = x + 0.02 ẋ
            x = cols["obs"][[p * S + start + j for j in range(length)]]
            np.testing.assert_allclose(x[1:, 0], x[:-1, 0] + 0.02 * x[:-1, 1], atol=1e-5)


# --------------------------------------------------------------------------- process


def test_run_actor_process_under_spawn(make_table):
    cfg = load_config(
        None,
        [
            "env.id=CartPole-v1",
            "env.num_envs=4",
            "env.batch_size=2",
            "actor.num_actors=2",
            "actor.weight_sync_period=16",
            "replay.capacity=8192",
            "run.log_every_s=0.2",
        ],
    )
    env = make_vec_env(cfg.env, seed=0)
    agent = make_agent(cfg, env.env_spec, torch.device("cpu"))
    env.close()
    table = make_table(spec=agent.replay_columns(), P=8, S=1024, kind=agent.item_kind())
    net = agent.make_network()
    store = ParameterStore.create(net)
    store.publish(net)
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(
        target=run_actor_process,
        args=(to_yaml(cfg), 1, table.storage.name, np.arange(4, 8), store.name, q, stop),
    )
    msgs = []
    try:
        proc.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                msgs.append(q.get(timeout=0.2))
            except queue.Empty:
                pass
            if any(m["type"] == "episode" for m in msgs) and any(
                m["type"] == "counters" for m in msgs
            ):
                break
        stop.set()
        proc.join(20)
        while True:
            try:
                msgs.append(q.get(timeout=0.2))
            except queue.Empty:
                break
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        store.close()
    assert proc.exitcode == 0, [m for m in msgs if m["type"] == "error"]
    episodes = [m for m in msgs if m["type"] == "episode"]
    counters = [m for m in msgs if m["type"] == "counters"]
    assert episodes and counters
    assert all(4 <= m["env"] < 8 and m["actor"] == 1 for m in episodes)
    last = counters[-1]
    assert last["actor/weight_version"] == 1 and last["actor/env_steps"] > 0
    st = table.storage
    assert (
        st.counters[:4, PUBLISHED].sum() == 0
        and st.counters[4:, PUBLISHED].sum() == last["actor/items"]
    )
    batch = table.sample(16)
    assert (batch.data["version"] == 1).all()


def test_actor_rejects_a_table_that_does_not_fit(make_table):
    cfg = config()
    agent, net = counting_agent(cfg)
    table = make_table(spec=agent.replay_columns(), P=4, S=64, kind=agent.item_kind())
    env = make_vec_env(cfg.env, seed=0)
    try:
        with pytest.raises(ValueError, match="3 partitions for 4 envs"):
            make_actor(cfg, 0, agent, env, table.storage, np.arange(3), None)
        other = make_table(spec={**agent.replay_columns(), "obs": "float32[5]"}, P=4, S=64)
        with pytest.raises(ValueError, match=r"env observations are float32\[3\].*float32\[5\]"):
            make_actor(cfg, 0, agent, env, other.storage, np.arange(4), None)
        small = make_table(spec=agent.replay_columns(), P=4, S=7)
        with pytest.raises(ValueError, match="too small for n_step=3; need at least 8"):
            make_actor(cfg, 0, agent, env, small.storage, np.arange(4), None)
    finally:
        env.close()


def test_run_actor_process_reports_errors_through_the_queue():
    cfg = config()
    q, stop = queue.Queue(), mp.get_context("spawn").Event()
    threads = torch.get_num_threads()
    try:
        with pytest.raises(FileNotFoundError, match="no shared-memory table named 'gearflow_nope'"):
            run_actor_process(to_yaml(cfg), 0, "gearflow_nope", np.arange(4), None, q, stop)
    finally:
        torch.set_num_threads(threads)
    msg = q.get_nowait()
    assert msg["type"] == "error" and msg["actor"] == 0 and "FileNotFoundError" in msg["error"]


# --------------------------------------------------------------------------- the writer seam


class RecordingWriter:
    """The writer interface (gearflow.replay.protocols.WriterLike) over Python lists: every
    call is recorded, rows are kept per stream, nothing is shared or rate-limited."""

    def __init__(self, spec, num_streams, steps_per_stream=1024):
        from gearflow.replay.spec import TableSpec

        self.spec = TableSpec.parse(spec)
        self.num_streams, self.steps_per_stream = num_streams, steps_per_stream
        self.insert_timeout_s, self.abort = 60.0, None
        self.rows = [[] for _ in range(num_streams)]  # per stream: dict of one row each
        self._episode_start = np.zeros(num_streams, dtype=np.int64)
        self.calls = []  # (method, details)

    @property
    def positions(self):
        return np.array([len(r) for r in self.rows], dtype=np.int64)

    def episode_lengths(self, streams=None):
        s = np.arange(self.num_streams) if streams is None else np.asarray(streams).reshape(-1)
        return self.positions[s] - self._episode_start[s]

    def append(self, steps, streams=None):
        s = np.arange(self.num_streams) if streams is None else np.asarray(streams).reshape(-1)
        pos = self.positions[s]
        for j, stream in enumerate(s.tolist()):
            self.rows[stream].append({k: np.array(v[j]) for k, v in steps.items()})
        self.calls.append(("append", s.tolist()))
        return pos

    def extend(self, steps, stream=0):
        k = len(next(iter(steps.values())))
        for j in range(k):
            self.rows[stream].append({c: np.array(v[j]) for c, v in steps.items()})
        self.calls.append(("extend", (int(stream), k)))
        return len(self.rows[stream])

    def create_items(self, priorities, num_steps, streams=None, ends=None, *, expired="raise"):
        items = list(zip(np.asarray(streams).tolist(), np.asarray(num_steps).tolist(), np.asarray(ends).tolist(),
                         np.asarray(priorities, dtype=np.float64).tolist()))  # fmt: skip
        for stream, length, end, _ in items:  # an item never reaches into a closed episode or the future
            assert self._episode_start[stream] <= end - length and end <= len(self.rows[stream])
        self.calls.append(("create_items", items))

    def end_episode(self, streams=None):
        s = np.asarray(streams).reshape(-1)
        self._episode_start[s] = self.positions[s]
        self.calls.append(("end_episode", s.tolist()))

    def flush(self):
        self.calls.append(("flush", None))


def test_actor_writes_through_an_injected_writer():
    """An Ape-X actor against a recording writer: the rows, items and episode ends it gets are
    the n-step transitions of the env's episodes (the same checks as the shared-memory table's)."""
    from helpers_envs import expected_episode

    from gearflow.kinds.transition import Actor
    from gearflow.replay.protocols import WriterLike

    cfg = config(n_step=N_STEP)
    agent, net = counting_agent(cfg)
    env = make_vec_env(cfg.env, seed=0)
    writer = RecordingWriter(agent.replay_columns(), 4)
    assert isinstance(writer, WriterLike)
    episodes = []
    with Actor(env, agent, writer, None, 0.5, cfg=cfg.actor, env_cfg=cfg.env, actor_index=1, seed=env_seed(cfg, 1), network=net,
               on_episode=lambda *a: episodes.append(a)) as actor:  # fmt: skip
        assert actor.run(max_steps=240) == 240
    methods = {m for m, _ in writer.calls}
    assert methods == {"append", "extend", "create_items", "end_episode", "flush"}
    items = [it for m, d in writer.calls if m == "create_items" for it in d]
    assert len(items) == actor.items > 100
    for stream, length, end, prio in items:
        first, last = writer.rows[stream][end - length], writer.rows[stream][end - 1]
        ret, disc, next_obs, exp_len = expected_item(first["obs"], N_STEP, GAMMA)
        assert length == exp_len
        np.testing.assert_array_equal(last["obs"], next_obs)
        assert float(first["ret"]) == pytest.approx(ret, rel=1e-6)
        assert float(first["disc"]) == pytest.approx(disc, rel=1e-6)
        assert prio == pytest.approx(abs(ret + disc * q_of(next_obs).max() - q_of(first["obs"])[first["action"]]),
                                     rel=1e-5)  # fmt: skip
    ends = [s for m, d in writer.calls if m == "end_episode" for s in d]
    assert len(ends) == len(episodes) == actor.episodes > 20
    for e in range(4):  # rows: each env's episodes in order, final observation included
        obs = np.array([r["obs"] for r in writer.rows[e]])
        expect, ep = [], 0
        while len(expect) < len(obs):
            L, _ = expected_episode(e, ep)
            expect += [(t, ep, e) for t in range(L + 1)]
            ep += 1
        np.testing.assert_array_equal(obs, np.array(expect[: len(obs)], dtype=np.float32))


def test_actor_without_a_writer_only_acts():
    """Evaluation: no writer, ε given (greedy), episodes reported, nothing written."""
    from gearflow.kinds.transition import Actor
    from helpers_envs import expected_episode

    cfg = config()
    agent, net = counting_agent(cfg)
    env = make_vec_env(cfg.env, seed=0)
    episodes = []
    with Actor(env, agent, None, None, 0.0, cfg=cfg.actor, env_cfg=cfg.env, seed=env_seed(cfg, 0), network=net,
               on_episode=lambda *a: episodes.append(a)) as actor:  # fmt: skip
        actor.run(max_steps=200)
    assert actor.items == 0 and actor.adder is None and (actor.epsilon == 0).all()
    assert len(episodes) == actor.episodes > 10
    counts = {}
    for env_index, ret, length, eps in episodes:
        k = counts[env_index] = counts.get(env_index, -1) + 1
        assert length == expected_episode(env_index, k)[0]
        assert eps == 0.0 and ret == length * (length + 1) / 2


def test_an_actor_reads_its_own_group_and_refuses_the_whole_config():
    """An actor gets the run's ``actor`` group (n-step and γ from it reach its adder); handed the
    whole run config it raises a TypeError naming what to pass, before it touches the env."""
    from gearflow.kinds.transition import Actor

    cfg = config(n_step=N_STEP)
    agent, net = counting_agent(cfg)
    env = make_vec_env(cfg.env, seed=0)
    with pytest.raises(TypeError, match=r"cfg=cfg\.actor.*not the whole run config"):
        Actor(env, agent, None, None, 0.0, cfg=cfg, network=net)
    writer = RecordingWriter(agent.replay_columns(), 4)
    with Actor(env, agent, writer, None, 0.0, cfg=cfg.actor, env_cfg=cfg.env, network=net) as actor:
        assert (actor.adder.n, actor.adder.gamma) == (N_STEP, float(cfg.actor.gamma))


def test_stop_while_the_last_flush_waits_on_the_rate_limiter(make_table):
    """A stop that arrives while the final flush is held by the rate limiter ends the run
    quietly (shutdown, not an actor error): the held items are dropped, episodes are closed."""
    import threading

    from gearflow.replay import RateLimiter

    cfg = config()
    agent, net = counting_agent(cfg)
    E = cfg.env.num_envs
    table = make_table(spec=agent.replay_columns(), P=E, S=1024, kind=agent.item_kind(),
                       limiter=RateLimiter(1, samples_per_insert=1.0, error_buffer=1.0))  # fmt: skip
    env = make_vec_env(cfg.env, seed=0)
    actor = make_actor(cfg, 1, agent, env, table.storage, np.arange(E), None, network=net)
    actor.adder.flush_every = 10**9  # every item waits for the final flush
    stop = threading.Event()
    timer = threading.Timer(0.5, stop.set)
    timer.start()
    try:
        t0 = time.monotonic()
        done = actor.run(stop, max_steps=12)  # no env ends twice: the first flush is the last
        waited = time.monotonic() - t0
    finally:
        timer.cancel()
        actor.close()
    assert done == 12 and stop.is_set() and 0.4 < waited < 5.0  # it waited for the stop
    assert int(table.storage.counters[:, PUBLISHED].sum()) == 0  # 2 allowed, more held: all dropped
    assert int(table.storage.counters[:, EPISODES].sum()) == actor.episodes > 0


# --------------------------------------------------------------------------- the C paths' references


def test_episode_statistics_in_c_match_the_reference():
    """_hotpath.episode_stats against ActorBase._count_episodes over random batches."""
    from types import SimpleNamespace

    from gearflow.actors.base import ActorBase

    hot = pytest.importorskip("gearflow.replay._hotpath", reason="the C module is not built")
    E, rng = 6, np.random.default_rng(0)
    ref, nat = ({"ret": np.zeros(E), "len": np.zeros(E, np.int64), "new": np.ones(E, bool)} for _ in range(2))
    ns = SimpleNamespace(_episode_return=ref["ret"], _episode_length=ref["len"], _new_episode=ref["new"])
    total = 0
    for _ in range(300):
        ids = rng.choice(E, size=rng.integers(1, E + 1), replace=False).astype(np.int64)
        reward = rng.standard_normal(ids.size).astype(np.float32)
        term, trunc = rng.random(ids.size) < 0.1, rng.random(ids.size) < 0.05
        a = ActorBase._count_episodes(ns, ids, reward, term, trunc)
        b = hot.episode_stats(ids, reward, term, trunc, nat["ret"], nat["len"], nat["new"])
        assert a == b == int((term | trunc).sum())
        total += b
        for d in (ref, nat):  # the caller zeroes the ended episodes
            done = ids[term | trunc]
            d["ret"][done], d["len"][done] = 0.0, 0
        for k in ref:
            np.testing.assert_array_equal(ref[k], nat[k])
    assert total > 20
    with pytest.raises(ValueError, match=r"env id 9 out of range \[0, 6\)"):
        hot.episode_stats(np.array([9]), np.zeros(1, np.float32), np.zeros(1, bool), np.zeros(1, bool),
                          nat["ret"], nat["len"], nat["new"])  # fmt: skip


def test_traced_policy_computes_what_the_network_computes():
    """The trace acts like the module at every batch size, follows in-place weight changes,
    forwards attributes; modules whose trace would differ (randomness) or that cannot be
    traced are used as they are."""
    from gearflow.actors.policy import TracedPolicy, traced_policy
    from gearflow.envs import EnvSpec

    cfg = load_config(Path(TESTS).parent / "configs" / "cartpole_apex.yaml", [])  # the dueling MLP
    agent = make_agent(cfg, EnvSpec((4,), np.dtype(np.float32), 2), torch.device("cpu"))
    net = agent.make_network().eval()
    policy = traced_policy(net, (4,), np.float32, batch=4)
    assert isinstance(policy, TracedPolicy) and policy.shares_parameters()
    assert policy.training is False and policy.module is net  # attributes are the module's
    with torch.no_grad():
        for b in (1, 4, 17):
            x = torch.randn(b, 4)
            assert torch.equal(policy(x), net(x))
        for p in net.parameters():
            p.mul_(-0.5)  # a weight sync copies in place
        x = torch.randn(4, 4)
        assert torch.equal(policy(x), net(x))
    obs = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    with torch.no_grad():
        acted = agent.act(policy, obs, np.zeros(4), np.random.default_rng(1))
        eager = agent.act(net, obs, np.zeros(4), np.random.default_rng(1))
    np.testing.assert_array_equal(acted.actions, eager.actions)
    np.testing.assert_array_equal(acted.values, eager.values)

    noisy = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Dropout(0.5)).train()
    assert traced_policy(noisy, (4,), np.float32, batch=4) is noisy  # its trace differs run to run

    class DictOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 2)

        def forward(self, x):
            return {"q": self.l(x)}

    odd = DictOut()
    assert traced_policy(odd, (4,), np.float32, batch=4) is odd
    assert traced_policy(torch.nn.Identity(), (4,), np.float32, batch=4).__class__ is torch.nn.Identity
