"""Metric sinks of a run: ``metrics.jsonl``, ``metrics.csv`` and TensorBoard event files.

Every row is one dict of namespaced scalars (``actor/…``, ``learner/…``,
``replay/…``, ``time/…``), written to all sinks with the env step count as the
step. A resumed run truncates the files back to the checkpoint's offsets and
purges the TensorBoard events after the last row kept (TensorBoard gets one point per
step and key: a key at a step already drawn is left out there), so the curves continue without a gap,
a repeat or a reset; each resume is noted in ``resumes.jsonl`` for ``gearflow plot``::

    sink = MetricsLog(run_dir, tensorboard=True)
    sink.write({"actor/env_steps": 4000, "learner/loss": 0.3, ...})
    offsets = sink.offsets()            # stored in the checkpoint
    ...
    sink = MetricsLog(run_dir, tensorboard=True, resume_from=(offsets, env_steps))
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from gearflow.errors import GearflowError

STEP_KEY = "actor/env_steps"
RESUMES = "resumes.jsonl"  # one line per resume: where the plot marks it


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (a torn last line, from a killed run, is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of a run's ``metrics.jsonl`` (a torn last line, from a killed run, is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise GearflowError(f"{run_dir}: no metrics.jsonl (is this a gearflow run directory?)")
    return _json_lines(path)


def read_resumes(run_dir: str | Path) -> list[dict[str, Any]]:
    """Where a run was resumed: ``row`` (index of the first row written after the resume),
    ``actor/env_steps`` and ``time/elapsed_s`` there (``resumes.jsonl``; none: never resumed)."""
    path = Path(run_dir) / RESUMES
    return _json_lines(path) if path.is_file() else []


def note_resume(run_dir: Path, rows: list[dict[str, Any]], env_steps: int) -> None:
    """Append this resume to ``resumes.jsonl``, dropping resumes of rows the truncation removed."""
    kept = [r for r in read_resumes(run_dir) if int(r.get("row", 0)) < len(rows)]
    elapsed = next((r["time/elapsed_s"] for r in reversed(rows) if "time/elapsed_s" in r), 0.0)
    kept.append({"row": len(rows), STEP_KEY: env_steps, "time/elapsed_s": elapsed})
    (Path(run_dir) / RESUMES).write_text("".join(json.dumps(r) + "\n" for r in kept))


def _plain(value: Any) -> Any:
    """numpy scalars and one-element tensors (what agents' metrics often are) as Python numbers."""
    if isinstance(value, np.generic):
        return value.item()
    numel = getattr(value, "numel", None)  # a torch tensor
    if callable(numel) and numel() == 1:
        return value.item()
    return value


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsLog:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True,
                 resume_from: tuple[dict[str, int], int] | None = None):  # fmt: skip
        self.dir = Path(run_dir)
        self.jsonl_path, self.csv_path = self.dir / "metrics.jsonl", self.dir / "metrics.csv"
        self._columns: list[str] = []
        rows: list[dict[str, Any]] = []
        # TensorBoard gets one point per step and key, none repeated after a resume: the last step each
        # key got (the eval role's rows come at the earlier step of the weights they evaluated)
        self._tb_step = -1  # every key's floor: the last step of the rows kept at a resume
        self._tb_last: dict[str, int] = {}
        if resume_from is not None:  # back to the checkpoint's rows; the CSV is rebuilt from them
            offsets, _ = resume_from
            if self.jsonl_path.exists():
                with open(self.jsonl_path, "r+b") as f:
                    f.truncate(min(int(offsets.get(self.jsonl_path.name, 0)), self.jsonl_path.stat().st_size))
                rows = read_metrics(self.dir)
            self._tb_step = max((int(r.get(STEP_KEY, 0)) for r in rows), default=-1)
            note_resume(self.dir, rows, int(resume_from[1]))
        elif self.csv_path.exists() and self.csv_path.stat().st_size:
            with open(self.csv_path, newline="") as f:
                self._columns = next(csv.reader(f), [])
        self._jsonl = open(self.jsonl_path, "a")
        self._csv = open(self.csv_path, "w" if resume_from is not None else "a", newline="")
        for row in rows:
            self._write_csv(_scalars(row))
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise GearflowError(
                    f"run.tensorboard=true needs the tensorboard package ({exc}); "
                    "pip install tensorboard, or set run.tensorboard=false"
                ) from None
            # events after the last row kept (the dropped summary row's among them) are purged
            purge = self._tb_step + 1 if resume_from is not None else None
            self._tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        row = {k: _plain(v) for k, v in row.items()}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        scalars = _scalars(row)
        self._write_csv(scalars)
        step = int(row.get(STEP_KEY, 0))
        if self._tb is not None:  # a key at a step already drawn is not drawn twice
            drawn = False
            for key, value in scalars.items():
                if math.isfinite(value) and key != STEP_KEY and step > self._tb_last.get(key, self._tb_step):
                    self._tb_last[key] = step
                    self._tb.add_scalar(key, value, step)
                    drawn = True
            if drawn:
                self._tb.flush()

    def _write_csv(self, scalars: dict[str, float]) -> None:
        new = [k for k in scalars if k not in self._columns]
        if new:  # a metric appeared (the first update's loss): rewrite with the wider header
            self._columns += new
            rows = []
            if self.csv_path.stat().st_size:
                self._csv.flush()
                with open(self.csv_path, newline="") as f:
                    rows = list(csv.DictReader(f))
            buf = io.StringIO()
            writer = csv.DictWriter(buf, self._columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
            self._csv.close()
            self.csv_path.write_text(buf.getvalue())
            self._csv = open(self.csv_path, "a", newline="")
        csv.DictWriter(self._csv, self._columns, restval="").writerow(scalars)
        self._csv.flush()

    def offsets(self) -> dict[str, int]:
        """Bytes written so far to ``metrics.jsonl`` (stored in checkpoints)."""
        self._jsonl.flush()
        return {self.jsonl_path.name: self.jsonl_path.stat().st_size}

    def close(self) -> None:
        self._jsonl.close()
        self._csv.close()
        if self._tb is not None:
            self._tb.close()
