"""A learner's run files pulled into the driver's run.dir (gearflow/roles/run_files.py):
the driver's copy equals the learner's after every pull, while a real ``gearflow train`` writes
them, and never holds half a checkpoint; a pull lost on the way is sent again. The Ray wiring is
tests/test_ray_launcher.py (a driver in its own mount) and tests/test_ray_hosts.py (across hosts)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gearflow.errors import GearflowError
from gearflow.roles.run_files import STAGE, FileSink, FileStream, Puller
from tests.test_train import CONFIG, ROOT, TINY


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.relative_to(root).parts[0].startswith(skip)}  # fmt: skip


def push(stream: FileStream, sink: FileSink) -> tuple[list, list]:
    deltas, removed, state = stream.changes()
    sink.apply(deltas, removed)
    stream.accept(state)
    return deltas, removed


def test_new_grown_rewritten_and_removed_files_reach_the_sink_as_they_are(tmp_path):
    src, dst = tmp_path / "learner", tmp_path / "driver"
    src.mkdir()
    dst.mkdir()
    stream, sink = FileStream(src), FileSink(str(dst))
    (src / "metrics.jsonl").write_text('{"a": 1}\n')
    (src / "checkpoints" / "ckpt-10").mkdir(parents=True)
    (src / "checkpoints" / "ckpt-10" / "learner.pt").write_bytes(os.urandom(5000))
    push(stream, sink)
    assert tree(dst) == tree(src)

    with open(src / "metrics.jsonl", "a") as f:  # grows: only the new bytes travel
        f.write('{"a": 2}\n')
    deltas, _ = push(stream, sink)
    assert deltas == [("metrics.jsonl", 9, b'{"a": 2}\n')]
    assert tree(dst) == tree(src)

    before = os.stat(src / "metrics.jsonl").st_ino
    with open(src / "metrics.jsonl", "r+") as f:  # rewritten in place, same inode, longer: sent whole
        f.write('{"b": 3}\n{"b": 4}\n{"b": 5}\n')
        f.truncate()
    assert os.stat(src / "metrics.jsonl").st_ino == before
    deltas, _ = push(stream, sink)
    assert [(rel, off) for rel, off, _ in deltas] == [("metrics.jsonl", 0)]
    assert tree(dst) == tree(src)

    deltas, removed = push(stream, sink)  # nothing changed: nothing sent
    assert deltas == removed == []

    # a checkpoint being written (.tmp-PID) is not sent; renamed into place, it is; the old one rotated away
    tmp = src / "checkpoints" / "ckpt-20.tmp-123"
    tmp.mkdir()
    (tmp / "learner.pt").write_bytes(b"half")
    deltas, _ = push(stream, sink)
    assert deltas == []
    (tmp / "learner.pt").write_bytes(os.urandom(3000))
    (tmp / "MANIFEST").write_text("x")
    tmp.rename(src / "checkpoints" / "ckpt-20")
    for p in (src / "checkpoints" / "ckpt-10").iterdir():
        p.unlink()
    (src / "checkpoints" / "ckpt-10").rmdir()
    push(stream, sink)
    assert tree(dst) == tree(src)
    assert sorted(p.name for p in (dst / "checkpoints").iterdir()) == ["ckpt-20"]  # ckpt-10's folder is gone too


def test_a_new_folder_appears_whole_or_not_at_all_and_a_failed_pull_is_sent_again(tmp_path):
    src, dst = tmp_path / "learner", tmp_path / "driver"
    (src / "checkpoints" / "ckpt-5").mkdir(parents=True)
    dst.mkdir()
    for name in ("learner.pt", "runner.json", "MANIFEST"):
        (src / "checkpoints" / "ckpt-5" / name).write_bytes(os.urandom(100))
    stream, sink = FileStream(src), FileSink(str(dst))
    deltas, removed, _ = stream.changes()
    with pytest.raises(GearflowError, match="outside the run directory"):  # fails after two of the files
        sink.apply([*deltas[:2], ("../escaped", 0, b"x")], removed)
    assert not (tmp_path / "escaped").exists()
    assert not (dst / "checkpoints").exists()  # a reader never sees the half-written checkpoint

    calls = []

    def lossy(ack):  # the first pull's reply is lost on the way to the driver
        calls.append(ack)
        got = stream.pull(ack)
        if len(calls) == 1:
            raise ConnectionError("reply lost")
        return got

    puller = Puller(sink, {0: lossy}, period_s=3600)
    assert puller.pull() == 0 and 0 in puller.failing
    assert puller.pull() == 3 and not puller.failing  # the same three files again: the lost pull was not acked
    assert calls == [0, 0]
    assert tree(dst) == tree(src)
    assert not [p for p in dst.rglob("*") if STAGE in p.name]  # no staging folder or file left
    with open(src / "checkpoints" / "ckpt-5" / "MANIFEST", "ab") as f:  # grows: only the new bytes
        f.write(b"more")
    assert puller.pull() == 1 and calls[-1] == 2 and tree(dst) == tree(src)


def test_an_append_whose_base_the_driver_lost_brings_every_file_whole(tmp_path):
    src, dst = tmp_path / "learner", tmp_path / "driver"
    src.mkdir()
    dst.mkdir()
    (src / "train.log").write_text("one\n")
    (src / "metrics.jsonl").write_text("{}\n")
    puller = Puller(FileSink(dst), {0: FileStream(src).pull}, period_s=3600)
    assert puller.pull() == 2
    (dst / "train.log").unlink()  # removed by hand on the driver's machine
    with open(src / "train.log", "a") as f:
        f.write("two\n")
    assert puller.pull() == 0 and puller.acks[0] == -1  # not a file of zeros and "two"
    assert not (dst / "train.log").exists()
    assert puller.pull() == 2 and tree(dst) == tree(src)


def test_a_real_run_pulled_while_it_trains_equals_its_own_folder(tmp_path):
    src, dst = tmp_path / "learner", tmp_path / "driver"
    dst.mkdir()
    # rank 0 leaves out the other ranks' folders and the shards' replay, as on Ray
    puller = Puller(FileSink(dst), {0: FileStream(src, skip=("learner-", "replay")).pull}, period_s=0.05)
    (src / "learner-1").mkdir(parents=True)
    (src / "learner-1" / "x").write_text("not rank 0's")
    proc = subprocess.Popen([sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={src}",
                             "run.max_env_steps=6000", "run.checkpoint_every=1s", "run.keep_checkpoints=2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    reader.start()
    pulls_while_running = 0
    while proc.poll() is None:  # the driver's loop: a pull, then wait for the run at most a period
        pulls_while_running += puller.pull() > 0
        try:
            proc.wait(timeout=puller.period_s)
        except subprocess.TimeoutExpired:
            pass
    reader.join()
    assert proc.returncode == 0, err[0][-3000:]
    puller.pull()
    assert pulls_while_running > 3  # its files arrived while the run went on, not once at the end
    assert tree(dst) == tree(src, skip=("learner-", "replay"))
    assert len(list((dst / "checkpoints").iterdir())) == 2  # rotated as the run's own
    rows = (dst / "metrics.jsonl").read_text().splitlines()
    assert len(rows) > 2
