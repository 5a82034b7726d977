"""Run checkpoints: the learner, the runner's counters and the replay table, in one directory.

    ckpts = RunCheckpoints(run_dir / "checkpoints", keep=3)
    ckpts.save(updates=1200, learner=agent.state_dict(), runner={"env_steps": ...}, table=table)
    found = ckpts.latest()            # newest checkpoint that verifies; a corrupt one is skipped
    found.learner, found.runner, found.replay_dir

Layout (written to ``ckpt-<updates>.tmp-<pid>`` first, then renamed, so a reader
sees a whole checkpoint or none; a SIGKILL mid-write leaves only a ``.tmp``
directory, which is ignored and removed by the next save)::

    checkpoints/ckpt-000001200/
        learner.pt      agent.state_dict() (networks, optimizer, counters) and RNG states:
                        tensors, numbers, strings, lists and dicts only
        runner.json     env steps, updates, episodes, elapsed seconds, weights version,
                        recent returns, metric-file offsets, annealed β
        replay/         the table (gearflow.replay.table_checkpoint, with its own manifest)
        MANIFEST.json   size and CRC-32 of learner.pt, runner.json and replay/MANIFEST.json
                        (so a missing replay/ is a corrupt checkpoint); written last

``learner.pt`` is read with ``torch.load(weights_only=True)``: a file that holds any
other pickled object (one that would run code when unpickled) is refused like a corrupt
checkpoint, without running it.

Only the newest ``keep`` complete checkpoints are kept. A checkpoint that fails
verification when loading is renamed ``ckpt-<updates>.refused`` (kept for
inspection, never loaded or counted again).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gearflow.run.private import private_dir, redacted
from gearflow.replay.table_checkpoint import (
    CheckpointError,
    check_manifest,
    read_json_object,
    save_checkpoint,
    verify_checkpoint,
    write_manifest,
)

log = logging.getLogger("gearflow.checkpoint")

_NAME = re.compile(r"^ckpt-(\d+)(\.old-\d+)?$")  # .old-<pid>: replaced by a save that did not finish


def rng_states() -> dict[str, Any]:
    """Every global RNG the learner draws from (torch, numpy's legacy global, Python's), as
    tensors and numbers only: what ``torch.load(weights_only=True)`` reads back."""
    _, key, pos, has_gauss, gauss = np.random.get_state()
    version, words, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "python": {"version": int(version), "state": torch.tensor(words, dtype=torch.int64), "gauss": py_gauss},
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n, py = state["numpy"], state["python"]
    if isinstance(n, dict):
        np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))  # fmt: skip
        random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss"]))
    else:  # written before the RNG states were tensors: numpy's state tuple, Python's as is
        np.random.set_state(n)
        random.setstate(py)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Checkpoints written before the RNG states were tensors hold numpy's as an ndarray: these are
# the only globals (beyond tensors) that ``torch.load(weights_only=True)`` is allowed here.
_np_core = getattr(np, "_core", None) or np.core
_LEGACY_SAFE = [_np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
_UNPICKLER_PROBLEM = re.compile(r"Unsupported (global: GLOBAL [\w.]+|operand \d+|class [\w.]+)")


def load_learner(path: Path) -> dict[str, Any]:
    """``learner.pt`` read without running code: :class:`CheckpointError` if it holds anything but
    tensors, numbers, strings, lists and dicts (a pickled object's code never runs)."""
    try:
        with torch.serialization.safe_globals(_LEGACY_SAFE):
            learner = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        m = _UNPICKLER_PROBLEM.search(str(exc))
        lines = str(exc).strip().splitlines() or ["?"]
        what = m.group(1) if m else lines[-1].strip()[:200]
        raise CheckpointError(
            f"{path.parent}: {path.name} holds a pickled object that is not a tensor ({what}); refused "
            "without loading it (it could run code): a checkpoint from someone you do not trust?"
        ) from None
    if not isinstance(learner, dict) or not isinstance(learner.get("agent"), dict) or "rng" not in learner:
        raise CheckpointError(f"{path.parent}: {path.name} does not hold a learner state (agent and rng)")
    return learner


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


def _save_torch(obj: Any, f) -> None:
    """``torch.save(obj, f)``, where a failed write (a full disk) is an :class:`OSError`: torch's
    zip writer reports one as a ``RuntimeError`` when the file's buffer took part of a record
    ("unexpected pos ..."), raised while closing, over the ``OSError`` that caused it."""
    try:
        torch.save(obj, f)
    except RuntimeError as exc:
        seen: BaseException | None = exc
        while seen is not None and not isinstance(seen, OSError):
            seen = seen.__cause__ or seen.__context__
        if seen is None:
            raise
        raise OSError(seen.errno, f"{seen.strerror or seen} (writing {getattr(f, 'name', 'learner.pt')})") from exc


class RunCheckpoints:
    """The ``checkpoints`` directory of a run: atomic saves, rotation, newest-valid loading."""

    def __init__(self, directory: str | Path, keep: int = 3, config=None):
        self.dir, self.keep = Path(directory), int(keep)
        # the run's config (a DictConfig): each save records it, redacted, in runner.json's
        # "config" (read at save time: what the run holds then), which a resume and eval rebuild from
        self.config = config

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
        private_dir(self.dir)  # 0700, and each checkpoint in it too
        for stale in self.dir.glob("ckpt-*.tmp-*"):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.dir.glob("ckpt-*.old-*"):  # superseded, once its replacement is in place
            if old.with_name(old.name.split(".old-")[0]).exists():
                shutil.rmtree(old, ignore_errors=True)
        path = self.dir / f"ckpt-{int(updates):09d}"
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.mkdir(mode=0o700)
        try:
            with open(tmp / "learner.pt", "wb") as f:  # a full disk is an OSError (a path: RuntimeError)
                _save_torch(learner, f)
            if self.config is not None and "config" not in runner:
                from gearflow.config import to_yaml

                runner = {**runner, "config": to_yaml(redacted(self.config))}  # never the secret
            (tmp / "runner.json").write_text(json.dumps(runner, indent=1))
            extra = []
            if table is not None:
                save_checkpoint(table, tmp / "replay")
                extra = ["replay/MANIFEST.json"]  # the replay is part of this checkpoint: missing = corrupt
            write_manifest(tmp, subdirs=False, extra=extra)
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
        check_manifest(path, "checkpoint", required=("learner.pt", "runner.json"))
        if replay and (path / "replay").is_dir():
            verify_checkpoint(path / "replay")
        runner = read_json_object(path, "runner.json")
        try:
            learner = load_learner(path / "learner.pt")
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable file makes the checkpoint unusable
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{path}: learner.pt cannot be read: {first}") from None
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
