"""``run.dry_run=true``: hand-computed figures for known models, the paper configs' sizes,
and the CLI path (JSON out; no run directory, no shared memory, nothing allocated)."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow.config import envpool_ids, load_config
from gearflow.envs import EnvSpec
from gearflow.replay.storage import SHM_DIR
from gearflow.tools.dryrun import memory_plan, render

ROOT = Path(__file__).resolve().parents[1]
PAPER = sorted((ROOT / "configs" / "paper").glob("*.yaml"))
F32 = 4


def transformer_params(obs_dim: int, A: int, d: int, L: int, m: int) -> int:
    """agents.r2d2_transformer.TransformerQNetwork, counted by hand."""
    embed = obs_dim * d + d
    block = (
        2 * 2 * d  # ln1, ln2 (weight + bias)
        + d * 3 * d + 3 * d  # qkv
        + d * d + d  # proj
        + d * m * d + m * d + m * d * d + d  # mlp: d → m·d → d
    )
    return embed + L * block + 2 * d + d * A + A  # final LayerNorm, Q head


def r2d2_cfg(*extra: str):
    return load_config(ROOT / "configs" / "cartpole_masked_r2d2.yaml", [
        "agent.d_model=32", "agent.num_layers=3", "agent.num_heads=4", "agent.mlp_ratio=2",
        "learner.batch_size=8", "replay.sequence_length=10", "replay.sequence_period=5",
        "replay.burn_in=2", "replay.capacity=16000", *extra])  # fmt: skip


def test_r2d2_transformer_figures_match_hand_counts():
    spec = EnvSpec(obs_shape=(2,), obs_dtype=np.dtype("float32"), num_actions=3)
    plan = memory_plan(r2d2_cfg(), env_spec=spec)
    le, r = plan["learner"], plan["replay"]
    n = transformer_params(obs_dim=2, A=3, d=32, L=3, m=2)
    assert n == 2 * 32 + 32 + 3 * (4 * 32 + 4 * 32 * 32 + 4 * 32 + 4 * 32 * 32 + 3 * 32) + 64 + 32 * 3 + 3
    assert le["parameters"] == le["trainable_parameters"] == n
    assert le["parameter_bytes"] == le["gradient_bytes"] == n * F32
    # Adam: exp_avg + exp_avg_sq per parameter, plus one fp32 `step` scalar per parameter tensor
    tensors = 2 + 3 * 12 + 2 + 2
    assert le["optimizer"] == "Adam"
    assert le["optimizer_state_bytes"] == 2 * n * F32 + tensors * F32
    assert le["buffer_bytes"] == 4 * F32  # ALiBi slopes, one per head
    assert le["other_networks"] == "target" and le["other_network_bytes"] == n * F32 + 4 * F32
    # Korthikanti et al. 2022 reference: L·B·T·(34·d + 5·heads·T) bytes
    assert le["tokens_per_batch"] == 8 * 10
    assert le["activation_bytes_16bit_reference"] == 3 * 8 * 10 * (34 * 32 + 5 * 4 * 10)
    # replay: obs float32[2] + action int64 + reward, discount float32 + first bool + version int64
    assert r["bytes_per_step"] == 8 + 8 + 4 + 4 + 1 + 8
    assert (r["partitions"], r["steps_per_partition"]) == (16, 1000)
    assert r["bytes_at_capacity"] == 16_000 * 33
    assert r["segment_bytes"] >= r["bytes_at_capacity"]
    # batch: window columns (B, T, ...) + mask, length, and the table's buffers hold prefetch + 2 of them
    assert le["batch_bytes"] >= 8 * 10 * 33
    assert r["batch_buffer_bytes"] == (2 + 2) * le["batch_bytes"]
    assert le["total_bytes"] == sum(le[k] for k in (
        "parameter_bytes", "buffer_bytes", "gradient_bytes", "optimizer_state_bytes",
        "other_network_bytes", "batch_bytes", "activation_bytes"))  # fmt: skip


def test_transformer_activations_scale_with_the_batch():
    spec = EnvSpec(obs_shape=(2,), obs_dtype=np.dtype("float32"), num_actions=3)
    small = memory_plan(r2d2_cfg("learner.batch_size=4"), env_spec=spec)["learner"]["activation_bytes"]
    large = memory_plan(r2d2_cfg("learner.batch_size=12"), env_spec=spec)["learner"]["activation_bytes"]
    assert small > 0 and large == 3 * small


def test_apex_mlp_figures_match_hand_counts():
    cfg = load_config(ROOT / "configs" / "cartpole_apex.yaml",
                      ["agent.hidden_sizes=[256,256]", "learner.batch_size=64"])  # fmt: skip
    spec = EnvSpec(obs_shape=(4,), obs_dtype=np.dtype("float32"), num_actions=2)
    plan = memory_plan(cfg, env_spec=spec)
    le, r = plan["learner"], plan["replay"]
    n = (4 * 256 + 256) + (256 * 256 + 256) + (256 + 1) + (256 * 2 + 2)  # torso, value, advantage
    assert le["parameters"] == n == 67_843
    assert le["parameter_bytes"] == le["gradient_bytes"] == le["other_network_bytes"] == n * F32
    assert le["optimizer_state_bytes"] == 2 * n * F32 + 8 * F32  # Adam; 4 Linear layers = 8 tensors
    # autograd keeps the input and each ReLU output for backward; plus the Q-values
    assert le["activation_bytes"] == 64 * (4 + 256 + 256 + 2) * F32
    assert "activation_bytes_16bit_reference" not in le
    assert r["bytes_per_step"] == 16 + 8 + 4 + 4 + 8  # obs, action, ret, disc, version
    assert r["items_per_partition"] == r["steps_per_partition"]  # transitions: one item per step
    assert plan["actors"]["total_bytes"] == cfg.actor.num_actors * n * F32
    table = render(plan)
    assert "67,843" in table and "Adam" in table and "replay at capacity" in table


def test_an_agent_can_give_its_own_activation_estimate(tmp_path, monkeypatch):
    (tmp_path / "estimating_agent.py").write_text(
        "from agents.apex_dqn import Config, Agent as Base\n"
        "class Agent(Base):\n"
        "    def memory_estimate(self, batch_size):\n"
        "        return {'activation_bytes': 1000 * batch_size, 'activation_method': 'by hand'}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(ROOT / "configs" / "cartpole_apex.yaml", ["agent.name=estimating_agent"])
    spec = EnvSpec(obs_shape=(4,), obs_dtype=np.dtype("float32"), num_actions=2)
    le = memory_plan(cfg, env_spec=spec)["learner"]
    assert le["activation_bytes"] == 1000 * cfg.learner.batch_size
    assert le["activation_method"] == "by hand"


def _paper_size(path: Path) -> float:
    m = re.search(r"_(\d+(?:\.\d+)?)([mb])$", path.stem)
    assert m, f"{path.name}: name the size, e.g. gato_80m.yaml or gato_1.2b.yaml"
    return float(m.group(1)) * {"m": 1e6, "b": 1e9}[m.group(2)]


@pytest.mark.skipif("Pong-v5" not in envpool_ids(), reason="EnvPool with Atari Pong is not installed")
@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_paper_config_parameter_count_matches_its_name(path):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    plan = memory_plan(load_config(path))
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    size = _paper_size(path)
    params = plan["learner"]["parameters"]
    assert abs(params - size) <= 0.15 * size, f"{path.name}: {params:,} parameters"
    assert plan["agent"] == "agents.r2d2_transformer" and plan["env"] == "Pong-v5"
    # built on the meta device: the learner (params, target, grads, Adam) was never allocated
    assert grown * 1024 < 0.5 * plan["learner"]["parameter_bytes"] + 300 * 2**20
    header = path.read_text().split("\nenv:")[0]
    assert f"{params:,}" in header, f"{path.name}: header does not state the dry-run parameter count"


def test_paper_configs_exist():
    assert len(PAPER) >= 4


@pytest.mark.slow
def test_cli_dry_run_prints_json_and_creates_nothing(tmp_path):
    shm_before = {p.name for p in SHM_DIR.glob("gearflow*")}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearflow", "train", str(ROOT / "configs" / "cartpole_apex.yaml"),
           "run.dry_run=true", f"run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    plan = json.loads(lines[-1])
    assert plan["dry_run"] is True and plan["agent"] == "agents.apex_dqn"
    n = (4 * 128 + 128) + (128 * 128 + 128) + (128 + 1) + (128 * 2 + 2)  # hidden_sizes [128, 128]
    assert plan["learner"]["parameters"] == n
    assert any(line.startswith("parameters") for line in lines[:-1]), "no readable table"
    assert not run_dir.exists() and not (tmp_path / "runs").exists()
    assert list(tmp_path.iterdir()) == []
    new = {p.name for p in SHM_DIR.glob("gearflow*")} - shm_before
    assert not [s for s in new if s.startswith(f"gearflow_{proc.pid}_")], new
    assert "Traceback" not in stderr


class _Torch211:
    """``torch`` as torch 2.11's ``torch/optim/adam.py`` calls it: ``torch.tensor(0.0, dtype=...)``
    for Adam's step counter without ``device="cpu"``, so under ``with torch.device("meta")`` the
    counter lands on the meta device and the step's ``.item()`` on it raises."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, device=None, **kwargs):
        return torch.tensor(data, *args, **kwargs)  # the device context's: meta in the dry run


def test_dry_run_plans_with_an_adam_that_makes_its_step_counter_on_the_meta_device(monkeypatch):
    """The H200's torch 2.11: "Tensor.item() cannot be called on meta tensors" from Adam's first
    step on meta parameters took the whole gato_80m plan with it. The counter is moved to the host
    and the step retried: the figures equal those of this torch's Adam."""
    adam = sys.modules[torch.optim.Adam.__module__]  # torch.optim.adam (the attribute is shadowed)
    spec = EnvSpec(obs_shape=(2,), obs_dtype=np.dtype("float32"), num_actions=3)
    want = memory_plan(r2d2_cfg(), env_spec=spec)["learner"]
    monkeypatch.setattr(adam, "torch", _Torch211())
    with torch.device("meta"):  # the patch reproduces 2.11's failure
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.zeros(3)
        opt = torch.optim.Adam([p])
        with pytest.raises(RuntimeError, match="meta"):
            opt.step()
        assert opt.state[p]["step"].is_meta
    got = memory_plan(r2d2_cfg(), env_spec=spec)["learner"]
    assert got["optimizer"] == "Adam" and got["optimizer_state_bytes"] == want["optimizer_state_bytes"] > 0
    assert got["total_bytes"] == want["total_bytes"]


def test_an_optimizer_that_cannot_step_on_meta_is_named_not_fatal(monkeypatch):
    def broken_step(self, closure=None):
        raise NotImplementedError("no meta kernel for this optimizer")

    monkeypatch.setattr(torch.optim.Adam, "step", broken_step)
    spec = EnvSpec(obs_shape=(2,), obs_dtype=np.dtype("float32"), num_actions=3)
    plan = memory_plan(r2d2_cfg(), env_spec=spec)
    le = plan["learner"]
    assert le["optimizer_state_bytes"] is None and "Adam.step() on the meta device failed" in le["optimizer_method"]
    assert le["parameters"] > 0 and le["total_bytes"] > 0  # the rest of the plan stands
    assert "n/a" in render(plan)
