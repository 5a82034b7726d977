"""A learner's run files pulled into the driver's ``run.dir`` while the run goes on
(``launcher=ray``, a learner on a host that does not share the driver's disk).

The learner's end, :class:`FileStream`, scans its own run folder and names what the driver's
copy lacks as *deltas* ``(path, offset, bytes)``: offset 0 is a whole file (new, replaced or
rewritten), a larger offset the bytes a file grew by (``metrics.jsonl``, ``metrics.csv``,
``train.log`` only grow). A file that keeps its inode is taken to have grown only when the last
bytes sent before its old end are still there; otherwise it is sent whole. Checkpoints are
written to ``ckpt-N.tmp-PID`` and renamed, so a half-written one (a ``.tmp-`` path) is never sent.

The driver pulls (:class:`Puller`, every ``cluster.file_sync_s`` and once when the learners
end): each pull carries the serial of the last one the driver wrote, and only then does the
learner's idea of what the driver holds move on, so a pull that failed on the way (or that the
driver could not write) is sent again, whole or from the same offsets, the next time. The driver
process itself writes them (:class:`FileSink`), so they land in the ``run.dir`` *it* sees: the
user's machine, whatever Ray node or mount the roles run on.

:class:`FileSink` writes whole files through a temporary name and a rename, and a directory that
is new to it (a checkpoint) is staged and renamed into place once all its files are written, so
``gearflow eval RUN_DIR`` on the driver's machine never sees half a checkpoint; removed files
(rotated checkpoints) are removed, their empty folders too. A learner whose host dies has left
the driver everything up to its last pull (``cluster.file_sync_s`` before it at most).

Nothing here imports Ray: a :class:`Puller` pulls through any callable.

>>> import tempfile
>>> learner, driver = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
>>> _ = (learner / "metrics.jsonl").write_text('{"u": 1}\\n')
>>> puller = Puller(FileSink(driver), {0: FileStream(learner).pull}, period_s=10)
>>> puller.pull()
1
>>> (driver / "metrics.jsonl").read_text()
'{"u": 1}\\n'
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from gearflow.errors import GearflowError

log = logging.getLogger("gearflow.runner")

__all__ = ["FileSink", "FileStream", "Puller"]

Delta = tuple[str, int, bytes]  # (path relative to run.dir, offset, bytes): offset 0 writes the file anew
TAIL = 64  # bytes kept of each file's end as sent: an append is trusted only when they are still there
STAGE = ".tmp-sink"  # a directory new to the sink is written under its name + STAGE, then renamed


class BaseMissing(GearflowError):
    """An append reached the driver where its file is gone or shorter (removed by hand): the
    next pull asks for every file whole."""


class FileStream:
    """What the sink lacks of the files under ``root``: ``changes()`` → (deltas, removed, state);
    ``accept(state)`` once the sink holds them. ``prefix`` goes before every relative path (a
    data-parallel rank's ``learner-R/``); top-level entries starting with one of ``skip`` are
    left out (rank 0: the other ranks' folders, the shards' ``replay``)."""

    def __init__(self, root: str | Path, prefix: str = "", skip: tuple[str, ...] = ()):
        self.root, self.prefix, self.skip = Path(root), prefix, tuple(skip)
        self.sent: dict[str, tuple[int, int, int, bytes]] = {}  # rel -> (inode, size, mtime_ns, tail)
        self._serial = 0
        self._pending: tuple[int, dict] | None = None  # the last pull: (serial, state once written)

    def _wanted(self, rel: Path) -> bool:
        if self.skip and rel.parts[0].startswith(self.skip):
            return False
        return not any(".tmp-" in part for part in rel.parts)  # a checkpoint being written

    def changes(self) -> tuple[list[Delta], list[str], dict]:
        state: dict[str, tuple[int, int, int, bytes]] = {}
        deltas: list[Delta] = []
        if not self.root.is_dir():
            return deltas, [], state
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root)
            if not self._wanted(rel):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # removed while we scanned: the next scan names it removed
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key, old = rel.as_posix(), self.sent.get(rel.as_posix())
            if old is not None and old[:3] == (st.st_ino, st.st_size, st.st_mtime_ns):
                state[key] = old
                continue
            try:
                with open(p, "rb") as f:
                    offset = 0
                    if old is not None and old[0] == st.st_ino and st.st_size > old[1]:
                        tail = old[3]
                        f.seek(old[1] - len(tail))
                        offset = old[1] if f.read(len(tail)) == tail else 0
                    f.seek(offset)
                    data = f.read(max(st.st_size - offset, 0))
            except FileNotFoundError:
                continue
            end = offset + len(data)
            last = (old[3] if offset else b"") + data  # the file's bytes before `end`, as far as we know them
            state[key] = (st.st_ino, end, st.st_mtime_ns, last[-TAIL:])
            deltas.append((self.prefix + key, offset, data))
        removed = [self.prefix + rel for rel in self.sent if rel not in state]
        return deltas, removed, state

    def accept(self, state: dict) -> None:
        self.sent = state

    def pull(self, ack: int) -> tuple[int, list[Delta], list[str]]:
        """``(serial, deltas, removed)``: what the driver lacks, given that it wrote the pull
        numbered ``ack`` (0: none yet; negative: send every file whole). A pull it did not
        acknowledge is sent again."""
        if ack < 0:  # the driver's copy lost what an append builds on: everything goes whole
            self.accept({})
        elif self._pending is not None and ack == self._pending[0]:
            self.accept(self._pending[1])
        deltas, removed, state = self.changes()
        self._serial += 1
        self._pending = (self._serial, state)
        return self._serial, deltas, removed


class FileSink:
    """The driver's end: ``apply(deltas, removed)`` under ``run_dir`` (see the module docstring);
    ``stats()`` → files written and bytes received."""

    def __init__(self, run_dir: str | Path):
        self.root = Path(run_dir).resolve()
        self.files = self.bytes = 0

    def _path(self, rel: str) -> Path:
        path = (self.root / rel).resolve()
        if self.root not in path.parents:
            raise GearflowError(f"run file {rel!r} is outside the run directory {self.root}")
        return path

    def _new_dir(self, path: Path) -> Path | None:
        """The highest folder above ``path`` (below the root) that does not exist yet."""
        d = self.root
        for part in path.relative_to(self.root).parts[:-1]:
            d = d / part
            if not d.exists():
                return d
        return None

    def apply(self, deltas: list[Delta], removed: list[str]) -> int:
        staged: dict[Path, Path] = {}  # a new folder -> where its files are written first
        for rel, offset, data in deltas:
            path = self._path(rel)
            new = self._new_dir(path)
            if new is not None:
                if new not in staged:
                    staged[new] = new.with_name(new.name + STAGE)
                    shutil.rmtree(staged[new], ignore_errors=True)  # a push that failed half-way
                path = staged[new] / path.relative_to(new)
            path.parent.mkdir(parents=True, exist_ok=True)
            if offset == 0:
                tmp = path.with_name(path.name + STAGE)
                tmp.write_bytes(data)
                os.replace(tmp, path)
            else:  # the same bytes again after a failed pull; never a hole where the base is gone
                if not path.is_file() or path.stat().st_size < offset:
                    raise BaseMissing(f"run file {rel!r}: the driver's copy lacks the first {offset} bytes the "
                                      "learner appends to")  # fmt: skip
                with open(path, "r+b") as f:
                    f.seek(offset)
                    f.write(data)
            self.files += 1
            self.bytes += len(data)
        for new, stage in staged.items():
            stage.rename(new)
        for rel in removed:
            path = self._path(rel)
            path.unlink(missing_ok=True)
            for d in path.parents:  # its folders, once empty (a rotated checkpoint)
                if d == self.root or any(d.iterdir()):
                    break
                d.rmdir()
        return len(deltas)

    def stats(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes}


class Puller:
    """The driver's pulls: ``sources`` maps a learner's rank to its ``pull(ack)`` (a
    :meth:`FileStream.pull`, through Ray for a remote learner); ``pull()`` writes what each one
    lacks into ``sink``, ``due()`` says whether ``period_s`` has passed since the last one. A
    source that fails (a learner busy, or its host gone) is logged once and asked again next
    time; what the driver already holds stays."""

    def __init__(self, sink: FileSink, sources: dict[int, Callable[[int], tuple[int, list[Delta], list[str]]]],
                 period_s: float):
        self.sink, self.sources, self.period_s = sink, dict(sources), float(period_s)
        self.acks = dict.fromkeys(self.sources, 0)
        self.failing: dict[int, str] = {}  # rank -> the error of its last pull, while it fails
        self._last = time.monotonic()

    def due(self) -> bool:
        return bool(self.sources) and time.monotonic() - self._last >= self.period_s

    def pull(self) -> int:
        """One pull of every source; returns how many file writes it made."""
        self._last = time.monotonic()
        n = 0
        for rank, pull in self.sources.items():
            try:
                serial, deltas, removed = pull(self.acks[rank])
                n += self.sink.apply(deltas, removed)
            except BaseMissing as exc:
                log.warning("run files: %s; learner rank %d's files are sent whole next time", exc, rank)
                self.acks[rank] = -1
                continue
            except Exception as exc:  # noqa: BLE001 - the same changes come again next pull
                if rank not in self.failing:
                    log.warning("run files: learner rank %d's latest files did not reach %s (%s: %s); the driver "
                                "keeps what it has and asks again every %g s", rank, self.sink.root,
                                type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", self.period_s)  # fmt: skip
                self.failing[rank] = f"{type(exc).__name__}: {exc}"
                continue
            self.acks[rank] = serial
            if self.failing.pop(rank, None) is not None:
                log.info("run files: learner rank %d's files reach %s again", rank, self.sink.root)
        return n
