"""Offline mode: D4RL-style HDF5 datasets into the replay table, their errors, and an
offline Decision Transformer through ``gearflow train`` whose loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow.agent import make_agent
from gearflow.config import load_config
from gearflow.envs import EnvSpec
from gearflow.errors import ConfigError
from gearflow.run.offline import load_dataset, split_episodes

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(Path(__file__).parent)


@pytest.fixture(autouse=True)
def helpers_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def dt_agent(T=500, extra=()):
    cfg = load_config(None, ["agent.name=agents.decision_transformer", "replay.item=episode",
                             f"replay.max_episode_length={T}", "agent.d_model=16", "agent.num_layers=1", *extra])  # fmt: skip
    return make_agent(cfg, EnvSpec((4,), np.dtype(np.float32), 2), torch.device("cpu"))


def hand_made(lengths_ends, obs_dim=4):
    """Flat arrays: episodes of the given (length, 'term'|'trunc'|'open') in order; obs[:, 0] = t,
    obs[:, 1] = episode, reward = 10·episode + t, action = t % 2."""
    rows = [(t, e, L, how) for e, (L, how) in enumerate(lengths_ends) for t in range(L)]
    obs = np.zeros((len(rows), obs_dim), np.float32)
    obs[:, 0] = [t for t, *_ in rows]
    obs[:, 1] = [e for _, e, *_ in rows]
    return {
        "observations": obs,
        "actions": np.array([t % 2 for t, *_ in rows], np.int64),
        "rewards": np.array([10 * e + t for t, e, *_ in rows], np.float32),
        "terminals": np.array([t == L - 1 and how == "term" for t, _, L, how in rows]),
        "timeouts": np.array([t == L - 1 and how == "trunc" for t, _, L, how in rows]),
    }


def test_split_episodes_at_terminals_and_timeouts():
    term = np.array([0, 0, 1, 0, 0, 0, 0, 1, 0], bool)
    tout = np.array([0, 0, 0, 0, 1, 0, 0, 0, 0], bool)
    assert split_episodes(term, tout) == [(0, 3), (3, 5), (5, 8), (8, 9)]  # the last one unfinished
    assert split_episodes(term[:8], tout[:8]) == [(0, 3), (3, 5), (5, 8)]
    assert split_episodes(np.zeros(4, bool), np.zeros(4, bool)) == [(0, 4)]


def test_dataset_episodes_become_items_with_their_steps(make_table, tmp_path):
    from helpers_offline import write_hdf5

    T = 6
    episodes = [(3, "term"), (9, "trunc"), (1, "term"), (5, "term"), (4, "open")]
    path = write_hdf5(tmp_path / "d.hdf5", hand_made(episodes))
    agent = dt_agent(T)
    table = make_table(spec=agent.replay_columns(), P=2, S=16, kind=agent.item_kind(), selector="max_heap")
    stats = load_dataset(path, table, agent, EnvSpec((4,), np.dtype(np.float32), 2))
    assert stats == {"steps": 22, "episodes": 5, "stored_steps": 19, "long_episodes": 1}
    assert table.size == 5
    d = table.sample(5).data  # max_heap: all five, highest return first
    got = []
    for b in range(5):
        n = int(d["length"][b])
        e = int(d["obs"][b, 0, 1])
        L = episodes[e][0]
        t = np.arange(L - min(L, T), L)  # the last min(L, T) steps (9 → 6)
        np.testing.assert_array_equal(d["obs"][b, :n, 0].numpy(), t)
        np.testing.assert_array_equal(d["timestep"][b, :n].numpy(), t)
        np.testing.assert_array_equal(d["reward"][b, :n].numpy(), 10 * e + t)
        np.testing.assert_array_equal(d["action"][b, :n].numpy(), t % 2)
        assert (d["obs"][b, n:] == 0).all()
        got.append((e, float(d["reward"][b, :n].sum())))
    assert sorted(e for e, _ in got) == [0, 1, 2, 3, 4]
    assert [r for _, r in got] == sorted((r for _, r in got), reverse=True)  # priority = item return


def test_dataset_errors_name_the_key_and_shapes(make_table, tmp_path):
    from helpers_offline import write_hdf5

    agent = dt_agent(8)
    spec = EnvSpec((4,), np.dtype(np.float32), 2)
    table = make_table(spec=agent.replay_columns(), P=2, S=16, kind=agent.item_kind())
    good = hand_made([(3, "term"), (4, "trunc")])

    def error(data=None, path=None, **kw):
        path = path or write_hdf5(tmp_path / f"bad{len(list(tmp_path.iterdir()))}.hdf5", data)
        with pytest.raises(ConfigError) as exc:
            load_dataset(path, kw.get("table", table), agent, spec)
        return str(exc.value)

    assert "dataset file not found" in error(path=tmp_path / "missing.hdf5")
    (tmp_path / "text.hdf5").write_text("not hdf5")
    assert "not a readable HDF5 file" in error(path=tmp_path / "text.hdf5")
    msg = error({k: v for k, v in good.items() if k != "timeouts"})
    assert "missing key(s) ['timeouts']" in msg and "observations" in msg
    msg = error({**good, "observations": np.zeros((7, 3), np.float32)})
    assert "'observations' has shape [7, 3]" in msg and "[N, 4]" in msg
    msg = error({**good, "actions": np.zeros((7, 2), np.int64)})
    assert "'actions' has shape [7, 2], expected [7]" in msg
    msg = error({**good, "rewards": np.zeros(6, np.float32)})
    assert "'rewards' has shape [6], expected [7]" in msg
    msg = error({**good, "next_observations": np.zeros((7, 5), np.float32)})
    assert "'next_observations' has shape [7, 5], expected [7, 4]" in msg
    assert "discrete actions [0, 2)" in error({**good, "actions": np.arange(7)})
    assert "NaN" in error({**good, "rewards": np.full(7, np.nan, np.float32)})
    assert "raise replay.capacity" in error(hand_made([(10, "term")] * 5))  # 5 × 8 tail steps > 2 × 16


@pytest.mark.slow
def test_offline_decision_transformer_loss_falls_through_gearflow_train(tmp_path):
    from helpers_offline import make_cartpole_dataset

    data = make_cartpole_dataset(tmp_path / "cartpole.hdf5", episodes=40, seed=0, noise=0.3)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearflow", "train", str(ROOT / "configs" / "cartpole_dt_offline.yaml"),
           f"run.dataset={data}", "run.max_updates=600", "run.max_seconds=0", "agent.d_model=32",
           "learner.batch_size=32", "run.log_every_s=0.5", f"run.dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "reached run.max_updates=600"
    assert summary["actor/episodes"] == 0 and summary["replay/size"] == 40  # no actors; the dataset's episodes
    assert "offline dataset" in proc.stderr and "Traceback" not in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["learner/updates"], r["learner/loss"]) for r in rows if "learner/loss" in r]
    assert len(losses) >= 5 and losses[0][0] < 200, losses
    first, last = np.mean([v for _, v in losses[:2]]), np.mean([v for _, v in losses[-3:]])
    assert last < first - 0.1, losses  # ln 2 ≈ 0.69 at the start; ~0.45 after 600 updates


def test_offline_config_errors_name_the_key(tmp_path):
    from helpers_offline import write_hdf5

    path = ROOT / "configs" / "cartpole_dt_offline.yaml"
    assert load_config(path).run.mode == "offline"
    with pytest.raises(ConfigError, match="run.max_env_steps=5: run.mode=offline takes no env steps"):
        load_config(path, ["run.dataset=x.hdf5", "run.max_env_steps=5"])
    # a missing file is named when the run wires its components, before any run directory exists
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gearflow", "train", str(path), f"run.dataset={tmp_path / 'nope.hdf5'}",
                           f"run.dir={run}"], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)  # fmt: skip
    assert proc.returncode == 2 and "dataset file not found" in proc.stderr and "nope.hdf5" in proc.stderr
    assert not run.exists()
    bad = write_hdf5(tmp_path / "bad.hdf5", {**hand_made([(3, "term")]), "observations": np.zeros((3, 2), np.float32)})
    proc = subprocess.run([sys.executable, "-m", "gearflow", "train", str(path), f"run.dataset={bad}", f"run.dir={run}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)  # fmt: skip
    assert proc.returncode == 2 and "'observations' has shape [3, 2]" in proc.stderr, proc.stderr[-2000:]


def test_minari_episode_groups_read_as_the_flat_layout(tmp_path):
    import h5py
    from helpers_offline import play_cartpole, write_hdf5

    from gearflow.run.offline import read_hdf5, split_episodes

    flat = play_cartpole(5, seed=3)
    spans = split_episodes(flat["terminals"], flat["timeouts"])
    path = tmp_path / "main_data.hdf5"
    with h5py.File(path, "w") as f:  # Minari: one group per episode, L + 1 observations
        for i, (a, b) in enumerate(spans):
            g = f.create_group(f"episode_{i}")
            g["observations"] = np.concatenate([flat["observations"][a:b], flat["next_observations"][b - 1 : b]])
            g["actions"] = flat["actions"][a:b]
            g["rewards"] = flat["rewards"][a:b]
            g["terminations"] = flat["terminals"][a:b]
            g["truncations"] = flat["timeouts"][a:b]
    got = read_hdf5(path)
    for k in ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations"):
        np.testing.assert_array_equal(got[k], flat[k], err_msg=k)
    assert read_hdf5(write_hdf5(tmp_path / "flat.hdf5", flat)).keys() == got.keys()

    with h5py.File(path, "a") as f:
        del f["episode_2/rewards"]
    with pytest.raises(ConfigError, match=r"Minari episode group 'episode_2' lacks \['rewards'\]"):
        read_hdf5(path)


def test_observations_that_do_not_convert_to_the_env_dtype_are_refused():
    from gearflow.run.offline import check_dataset
    from gearflow.replay import TableSpec

    frames = TableSpec.parse({"obs": "uint8[2]", "action": "int64"})

    def data(obs):
        n = len(obs)
        return {"observations": obs, "actions": np.zeros(n, np.int64), "rewards": np.zeros(n, np.float32),
                "terminals": np.zeros(n, bool), "timeouts": np.zeros(n, bool)}  # fmt: skip

    assert check_dataset(data(np.array([[1, 2], [3, 255]], np.float32)), "d.hdf5", frames, 2) == 2  # exact
    for bad in (np.array([[1.5, 2]], np.float32), np.array([[300, 2]], np.float32), np.array([[-1, 2]], np.int64)):
        with pytest.raises(ConfigError, match=r"'observations' are .* the env's observations are uint8"):
            check_dataset(data(bad), "d.hdf5", frames, 2)
    vectors = TableSpec.parse({"obs": "float32[2]", "action": "int64"})
    assert check_dataset(data(np.array([[0.1, 2]], np.float64)), "d.hdf5", vectors, 2) == 1
