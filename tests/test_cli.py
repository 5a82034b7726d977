"""The ``gearflow`` command line: help, config errors, ``config --explain``, ``info``, verbosity."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agents import apex_dqn
from gearflow import cli
from gearflow.config import GROUPS, GearflowConfig, field_docs, load_config

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = "configs/cartpole_apex.yaml"  # relative to ROOT, as a user types it


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "gearflow", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch):
    """cli.main() configures the root logger and GEARFLOW_VERBOSITY; undo that per test."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("GEARFLOW_VERBOSITY", os.environ.get("GEARFLOW_VERBOSITY", "0"))
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# ----------------------------------------------------------------------- help


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the top level and every (nested) sub-command."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _expected_in_help(parser: argparse.ArgumentParser) -> list[str]:
    expected = []
    for action in parser._actions:
        if action.option_strings:
            expected += action.option_strings
        elif isinstance(action, argparse._SubParsersAction):
            expected += list(action.choices)
        elif action.metavar:
            expected.append(action.metavar)
        elif action.choices:
            expected += [str(c) for c in action.choices]
        else:
            expected.append(action.dest)
    return expected


PARSERS = list(_parsers(cli.build_parser()))


def test_every_sub_command_is_covered():
    commands = {path for path, _ in PARSERS}
    assert {(), ("train",), ("config",), ("info",), ("bench",), ("replay",), ("replay", "gc")} <= commands


@pytest.mark.parametrize("path,parser", PARSERS, ids=[" ".join(p) or "gearflow" for p, _ in PARSERS])
def test_help_lists_every_option(capsys, path, parser):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*path, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(('gearflow', *path))}")
    for item in _expected_in_help(parser):
        assert item in out, f"{item!r} missing from `gearflow {' '.join(path)} --help`"


def test_help_through_the_module_entry_point():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for item in _expected_in_help(cli.build_parser()):
        assert item in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_parser_imports_no_torch():
    """Every `gearflow ...` builds the whole parser first: a command that needs no torch (--help,
    tls init, a config error) must not pay its ~1.5 s import (bench cluster's figures once did)."""
    code = "import sys; from gearflow.cli import build_parser; build_parser(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'envpool') or m.startswith('gearflow.replay')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout[:500] + proc.stderr


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


# --------------------------------------------------------------------- config


def test_config_error_exits_2_without_traceback():
    proc = run_cli("config", CARTPOLE, "replay.capacity=-1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("gearflow config: error: override 'replay.capacity=-1': replay.capacity=-1:")
    assert "must be a positive number of steps" in err
    assert proc.stdout == ""


def test_train_config_error_exits_2_before_anything_starts():
    proc = run_cli("train", CARTPOLE, "replay.capacity=-1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().startswith(
        "gearflow train: error: override 'replay.capacity=-1': replay.capacity=-1:"
    ), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "args,words",
    [
        (["config", "configs/does_not_exist.yaml"], "configs/does_not_exist.yaml: config file not found"),
        (["config", CARTPOLE, "replay.capacityy=5"], "did you mean 'capacity'?"),
        (["config", CARTPOLE, "replay.capacity"], "expected KEY=VALUE"),
        (["config", CARTPOLE, "agent.name=no_such_agent_mod"], "agent.name: cannot import"),
        (["train", CARTPOLE, "learner.batch_size=0"], "learner.batch_size=0: must be ≥ 1"),
    ],
)
def test_user_errors_exit_2_in_process(capsys, args, words):
    assert cli.main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"gearflow {args[0]}: error: ")
    assert words in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_config_prints_the_resolved_yaml(capsys):
    assert cli.main(["config", CARTPOLE, "replay.capacity=2e5", "run.seed=3"]) == 0
    printed = OmegaConf.to_container(OmegaConf.create(capsys.readouterr().out))
    expected = OmegaConf.to_container(load_config(CARTPOLE, ["replay.capacity=2e5", "run.seed=3"]))
    assert printed == expected
    assert printed["replay"]["capacity"] == 200000


def test_config_explain_prints_groups_and_docs(capsys):
    assert cli.main(["config", CARTPOLE, "--explain"]) == 0
    out = capsys.readouterr().out
    classes = {**GROUPS, "agent": apex_dqn.Config}
    for group, cls in classes.items():
        assert re.search(rf"^{group}:  # {re.escape(field_docs(GearflowConfig)[group])}$", out, re.M), group
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            line = re.search(rf"^  {f.name}: .*# (.*)$", out, re.M)
            assert line, f"{group}.{f.name} missing"
            assert docs[f.name] in out, f"{group}.{f.name} doc missing"
    assert re.search(r"^  name: agents\.apex_dqn .*# Import path of the agent module", out, re.M)
    assert re.search(r"^  capacity: 100000 .*# Total steps held in host memory", out, re.M)


# ----------------------------------------------------------------------- info

ROW = re.compile(r"^(?P<name>\S.*?)\s{2,}(?P<usable>yes|no)\s+(?P<detail>.*)$")


def _rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines()[2:]:
        m = ROW.match(line)
        assert m, f"not a table row: {line!r}"
        rows[m["name"]] = (m["usable"], m["detail"].strip())
    return rows


def _pyverbs_importable() -> bool:
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        return False
    return True


def test_info_through_the_module_entry_point():
    import torch

    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout.startswith("component")
    rows = _rows(proc.stdout)
    for name in ("torch", "envpool", "gymnasium", "omegaconf", "uvloop"):
        usable, detail = rows[name]
        assert usable == "yes" and re.match(r"\d+\.\d+", detail), (name, usable, detail)
    for name in ("cuda (torch)", "cupy", "nvcc", "pyverbs (rdma)"):
        assert name in rows
        assert rows[name][1], f"{name} row has no version or reason"
    if not torch.cuda.is_available():
        assert rows["cuda (torch)"][0] == "no"
        assert rows["cupy"][0] == "no"
    if not _pyverbs_importable():
        usable, detail = rows["pyverbs (rdma)"]
        assert usable == "no"
        assert "not importable" in detail and "python3-pyverbs" in detail


def test_info_without_cuda_cupy_nvcc_or_pyverbs(capsys, monkeypatch):
    import shutil

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cupy", "pyverbs", "pyverbs.device"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: None)
    assert cli.main(["info"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    rows = _rows(captured.out)
    usable, detail = rows["cuda (torch)"]
    assert usable == "no" and ("CPU-only build" in detail or "no CUDA device" in detail), detail
    usable, detail = rows["cupy"]
    assert usable == "no" and "not installed" in detail and "gearflow[gpu]" in detail, detail
    assert rows["nvcc"] == ("no", "nvcc not on PATH")
    usable, detail = rows["pyverbs (rdma)"]
    assert usable == "no" and "not importable" in detail and "apt-get install python3-pyverbs" in detail


def test_info_when_pyverbs_has_no_device(capsys, monkeypatch):
    import types

    device = types.ModuleType("pyverbs.device")
    device.get_device_list = lambda: []
    monkeypatch.setitem(sys.modules, "pyverbs", types.ModuleType("pyverbs"))
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)
    assert cli.main(["info"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["pyverbs (rdma)"] == ("no", "pyverbs imports but there is no RDMA device")


# ------------------------------------------------------------------ verbosity


@pytest.mark.parametrize(
    "argv,level",
    [
        (["-q", "config", CARTPOLE], logging.WARNING),
        (["config", CARTPOLE, "-q"], logging.WARNING),
        (["--quiet", "config", CARTPOLE], logging.WARNING),
        (["-v", "config", CARTPOLE], logging.DEBUG),
        (["config", CARTPOLE, "-v"], logging.DEBUG),
        (["config", "--verbose", CARTPOLE, "run.seed=1"], logging.DEBUG),
        (["config", CARTPOLE], logging.INFO),
        (["-q", "info"], logging.WARNING),
        (["info", "-v"], logging.DEBUG),
    ],
)
def test_verbosity_before_or_after_the_sub_command(capsys, argv, level):
    assert cli.main(argv) == 0
    assert logging.getLogger().level == level
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("flag,attr", [("-q", "quiet"), ("-v", "verbose")])
def test_verbosity_flags_parse_in_both_positions(flag, attr):
    parser = cli.build_parser()
    before = parser.parse_args([flag, "config", CARTPOLE])
    after = parser.parse_args(["config", CARTPOLE, flag])
    neither = parser.parse_args(["config", CARTPOLE])
    assert getattr(before, attr) is True and getattr(after, attr) is True
    assert getattr(neither, attr) is False
    assert after.overrides == [] and before.overrides == []
