"""The Ape-X actor on real EnvPool Pong writes only the newest frame of each step into a
stacked-frame table (``obs: uint8[4,84,84] stack=4``), and every sampled ``obs`` /
``next_obs`` is the stack EnvPool returned at that step: episode starts (EnvPool's reset
stack), truncated episodes, ring wrap-around."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gearflow.actors.process import make_actor
from gearflow.agent import make_agent
from gearflow.config import envpool_ids, load_config
from gearflow.envs import make_vec_env

pytestmark = pytest.mark.skipif("Pong-v5" not in envpool_ids(), reason="EnvPool with Atari Pong is not installed")


class Recording:
    """A VecEnv that keeps every observation each env returned, in order (the k-th obs of env
    e is step k of partition e: the Ape-X adder writes one row per received obs)."""

    def __init__(self, env):
        self.env = env
        self.seen: dict[int, list[np.ndarray]] = {}

    def recv(self):
        obs, reward, terminated, truncated, ids = self.env.recv()
        for o, e in zip(obs, ids.tolist()):
            self.seen.setdefault(int(e), []).append(o.copy())
        return obs, reward, terminated, truncated, ids

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_apex_actor_on_pong_stores_frames_that_rebuild_envpools_stacks(make_table):
    E, S = 4, 96
    cfg = load_config(
        None,
        [
            "env.id=Pong-v5", f"env.num_envs={E}", "env.batch_size=2", "env.kwargs.max_episode_steps=60",
            "actor.num_actors=1", "actor.epsilon=1.0", "actor.n_step=3",
            "agent.name=agents.apex_dqn", "agent.network=mlp", "agent.hidden_sizes=[16]", f"replay.capacity={E * S}", "replay.min_size_to_sample=64",
        ],
    )  # fmt: skip
    env = Recording(make_vec_env(cfg.env, seed=0))
    agent = make_agent(cfg, env.env_spec, torch.device("cpu"))
    columns = dict(agent.replay_columns())
    assert columns["obs"] == "uint8[4,84,84]"
    columns["obs"] += " stack=4"  # the same batches, one frame stored per step
    table = make_table(spec=columns, P=E, S=S, kind=agent.item_kind(), selector="uniform")
    assert table.storage.columns["obs"].shape == (E * S, 84, 84)
    actor = make_actor(cfg, 0, agent, env, table.storage, np.arange(E), None)
    checked = firsts = 0
    try:
        for _ in range(4):
            actor.run(max_steps=200)
            s = table.sample(64)
            keys = s.keys.numpy()
            P, R = table.storage.num_partitions, table.storage.items_per_partition
            slots = (keys % P) * R + (keys // P) % R
            start, length = table._slot_rec[slots, 0], table._slot_rec[slots, 2]
            for b, (e, t, n) in enumerate(zip((keys % P).tolist(), start.tolist(), length.tolist())):
                want, want_next = env.seen[e][t], env.seen[e][t + n - 1]
                np.testing.assert_array_equal(s.data["obs"][b].numpy(), want)
                np.testing.assert_array_equal(s.data["next_obs"][b].numpy(), want_next)
                firsts += bool((want == want[-1:]).all())  # a reset stack: the first frame 4 times
                checked += 1
    finally:
        actor.close()
    assert checked == 256
    assert firsts > 0, "no episode start was sampled"
    assert actor.episodes >= E  # truncated episodes: starts inside the run
    assert int(table.storage.counters[:, 0].max()) > S  # the rings wrapped


def test_dry_run_reports_the_frames_bytes_per_step_for_pong_apex():
    from pathlib import Path

    from gearflow.tools.dryrun import memory_plan, render

    root = Path(__file__).resolve().parents[1]
    frames = memory_plan(load_config(root / "configs" / "pong_apex.yaml", ["replay.frame_stack=true"]))
    stacks = memory_plan(load_config(root / "configs" / "pong_apex.yaml", ["replay.frame_stack=false"]))
    r, w = frames["replay"], stacks["replay"]
    assert r["columns"]["obs"] == "uint8[4,84,84] stack=4" and w["columns"]["obs"] == "uint8[4,84,84]"
    assert (r["bytes_per_step"], r["bytes_per_step_whole_stacks"], w["bytes_per_step"]) == (7081, 28248, 28248)
    assert r["segment_bytes"] <= 0.27 * w["segment_bytes"]
    assert frames["learner"]["batch_bytes"] == stacks["learner"]["batch_bytes"]  # the same batches
    assert "(whole stacks: 27.59 KiB)" in render(frames)
