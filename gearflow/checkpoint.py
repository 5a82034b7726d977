"""Run checkpoints: the learner, the runner's counters and the replay table, in one directory.

    ckpts = RunCheckpoints(run_dir / "checkpoints", keep=3)
    ckpts.save(updates=1200, learner=agent.state_dict(), runner={"env_steps": ...}, table=table)
    found = ckpts.latest()            # newest checkpoint that verifies; a corrupt one is skipped
    found.learner, found.runner, found.replay_dir

Layout (written to ``ckpt-<updates>.tmp-<pid>`` first, then renamed, so a reader
sees a whole checkpoint or none; a SIGKILL mid-write leaves only a ``.tmp``
directory, which is ignored and removed by the next save)::

    checkpoints/ckpt-000001200/
        learner.pt      agent.state_dict() (networks, optimizer, counters) and RNG states
        runner.json     env steps, updates, episodes, elapsed seconds, weights version,
                        recent returns, metric-file offsets, annealed β
        replay/         the table (gearflow.replay.checkpoint, with its own manifest)
        MANIFEST.json   size and CRC-32 of learner.pt and runner.json; written last

Only the newest ``keep`` complete checkpoints are kept. A checkpoint that fails
verification when loading is renamed ``ckpt-<updates>.refused`` (kept for
inspection, never loaded or counted again).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gearflow.replay.checkpoint import CheckpointError, check_manifest, save_checkpoint, verify_checkpoint, write_manifest

log = logging.getLogger("gearflow.checkpoint")

_NAME = re.compile(r"^ckpt-(\d+)(\.old-\d+)?$")  # .old-<pid>: replaced by a save that did not finish


def rng_states() -> dict[str, Any]:
    """Every global RNG the learner draws from (torch, numpy's legacy global, Python's)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Checkpoint:
    """A verified checkpoint, loaded."""

    path: Path
    learner: dict[str, Any]
    runner: dict[str, Any]

    @property
    def replay_dir(self) -> Path | None:
        d = self.path / "replay"
        return d if d.is_dir() else None


class RunCheckpoints:
    """The ``checkpoints`` directory of a run: atomic saves, rotation, newest-valid loading."""

    def __init__(self, directory: str | Path, keep: int = 3):
        self.dir, self.keep = Path(directory), int(keep)

    def paths(self) -> list[Path]:
        """Complete-looking checkpoint directories, newest (most updates) first."""
        if not self.dir.is_dir():
            return []
        found: dict[int, Path] = {}
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (m.group(2) is None or int(m.group(1)) not in found):
                found[int(m.group(1))] = p  # the finished save wins over an .old- copy
        return [found[n] for n in sorted(found, reverse=True)]

    def save(self, updates: int, learner: dict[str, Any], runner: dict[str, Any], table=None) -> Path:
        """Write one checkpoint (``table=None``: without the replay); returns its path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob("ckpt-*.tmp-*"):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.dir.glob("ckpt-*.old-*"):  # superseded, once its replacement is in place
            if old.with_name(old.name.split(".old-")[0]).exists():
                shutil.rmtree(old, ignore_errors=True)
        path = self.dir / f"ckpt-{int(updates):09d}"
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.mkdir()
        try:
            torch.save(learner, tmp / "learner.pt")
            (tmp / "runner.json").write_text(json.dumps(runner, indent=1))
            if table is not None:
                save_checkpoint(table, tmp / "replay")
            write_manifest(tmp, subdirs=False)
            old = path.with_name(f"{path.name}.old-{os.getpid()}")
            if path.exists():  # the same update count saved twice (a final save after a periodic one)
                path.rename(old)  # until the new one is in place, a crash leaves the old one findable
            tmp.rename(path)
            for superseded in self.dir.glob(f"{path.name}.old-*"):  # ours, or one a killed save left
                shutil.rmtree(superseded, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.paths()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    @staticmethod
    def load(path: str | Path, replay: bool = True) -> Checkpoint:
        """Verify and load one checkpoint; :class:`CheckpointError` naming what is wrong.
        ``replay=False``: the replay is not verified (a reader that does not restore it)."""
        path = Path(path)
        check_manifest(path, "checkpoint")
        if replay and (path / "replay").is_dir():
            verify_checkpoint(path / "replay")
        try:
            runner = json.loads((path / "runner.json").read_text())
            learner = torch.load(path / "learner.pt", map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001 - any unreadable file makes the checkpoint unusable
            raise CheckpointError(f"{path}: cannot be read: {exc}") from None
        return Checkpoint(path, learner, runner)

    def latest(self, replay: bool = True) -> Checkpoint:
        """The newest checkpoint that verifies; a corrupt or truncated one is skipped (with a
        warning naming why) in favour of the previous one. ``replay=False``: see :meth:`load`."""
        problems = []
        for path in self.paths():
            try:
                return self.load(path, replay=replay)
            except CheckpointError as exc:
                # moved aside (kept for inspection): rotation by update count must never keep it
                # over the checkpoints the resumed run writes next
                aside = path.with_name(f"{path.name}.refused")
                shutil.rmtree(aside, ignore_errors=True)
                path.rename(aside)
                log.warning("checkpoint refused (moved to %s), trying the previous one: %s", aside.name, exc)
                problems.append(str(exc))
        if not problems:
            raise CheckpointError(f"{self.dir}: no checkpoint (was the run started with run.checkpoint_every=0?)")
        raise CheckpointError(f"{self.dir}: no usable checkpoint: " + "; ".join(problems))
