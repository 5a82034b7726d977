"""Fault matrix (issue 12): each row drives one fault through the real ``gearflow``
command (a subprocess, or ``gearflow.cli.main`` in this process where only the error
path runs) or the library, and checks the exit code, the message, the files on disk,
the segments in shared memory and the counters after a resume.

Rows that need a small or read-only file system mount a tmpfs (root only; skipped,
never faked, elsewhere) and point gearflow at it with ``GEARFLOW_SHM_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow import cli
from gearflow.run.checkpoint import RunCheckpoints, load_learner, rng_states
from gearflow.params import ParameterStore
from gearflow.replay import storage as storage_mod
from gearflow.replay.table_checkpoint import CheckpointError, verify_checkpoint, write_manifest
from gearflow.replay.spec import TableSpec
from gearflow.replay.storage import (
    H_BOOT_ID,
    H_OWNER,
    H_RUN_TAG,
    H_START_TIME,
    SHM_DIR,
    WRITER_PID,
    PartitionOwned,
    SharedMemoryError,
    SharedStorage,
    gc_segments,
    run_tag,
)
from gearflow.replay.writer import Writer
from tests.conftest import seg_prefix, shm_name
from tests.test_train import CONFIG, ROOT, TINY

SERIAL = [*TINY, "run.serial=true", "replay.min_size_to_sample=100", "learner.batch_size=16"]


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gearflow", *args], capture_output=True, text=True, check=False,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})  # fmt: skip


def _error_line(stderr: str, traceback_logged: bool = False) -> str:
    """The one line a failed command prints (log lines before it are allowed, a traceback is not,
    except the actor's own, logged with ``traceback_logged``)."""
    assert traceback_logged or "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def _summary(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


needs_mount = pytest.mark.skipif(not _can_mount(), reason="mounting a tmpfs needs root")


@contextlib.contextmanager
def tmpfs(path: Path, size: int | str):
    """A real tmpfs of ``size`` mounted at ``path`` for the block."""
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount(path: Path, mode: str, timeout: float = 30.0) -> None:
    """Remount ``path``; a read-only remount is refused (busy) while a file there is open for
    writing — the run's checkpoint writer, for a moment — so it is retried until it takes."""
    deadline = time.monotonic() + timeout
    while True:
        r = subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True, text=True)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"mount -o remount,{mode} {path} kept failing: {r.stderr.strip()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A finished tiny serial run with several checkpoints (each test copies it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    r = _cli("train", CONFIG, *SERIAL, f"run.dir={run}", "run.max_env_steps=250", "replay.min_size_to_sample=50",
             "run.checkpoint_every=10")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(RunCheckpoints(run / "checkpoints").paths()) >= 2
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


# ------------------------------------------------------------------ row 1: pickle payload


class Payload:
    """Unpickling this runs ``exec``: it writes ``marker`` (a real payload, not a mock)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def _plant_payload(checkpoint: Path, marker: Path) -> None:
    """What an attacker with write access to the run directory does: a payload in learner.pt,
    and a manifest rewritten to match, so no size or CRC check can notice."""
    learner = load_learner(checkpoint / "learner.pt")
    learner["agent"]["extra"] = Payload(marker)
    with open(checkpoint / "learner.pt", "wb") as f:
        torch.save(learner, f)
    extra = ["replay/MANIFEST.json"] if (checkpoint / "replay").is_dir() else []
    write_manifest(checkpoint, subdirs=False, extra=extra)


def test_payload_is_real(tmp_path):
    """The payload does run when unpickled the way gearflow did before (weights_only=False):
    so the tests below, which see it not run, prove the loader refuses it."""
    ckpt = RunCheckpoints(tmp_path / "c").save(1, {"agent": {"w": torch.ones(2)}, "rng": rng_states()}, {})
    marker = tmp_path / "marker"
    _plant_payload(ckpt, marker)
    torch.load(ckpt / "learner.pt", weights_only=False)
    assert marker.read_text() == "payload ran"


def test_checkpoint_payload_never_runs_in_eval_or_resume(trained_run, tmp_path):
    run = _copy(trained_run, tmp_path)
    newest, previous = RunCheckpoints(run / "checkpoints").paths()[:2]
    marker = tmp_path / "PWNED"
    _plant_payload(newest, marker)
    prev_state = json.loads((previous / "runner.json").read_text())

    ev = _cli("eval", str(run), "--episodes", "1", "--checkpoint", str(newest))
    assert ev.returncode == 2
    line = _error_line(ev.stderr)
    assert "learner.pt holds a pickled object that is not a tensor (global: GLOBAL exec)" in line, line
    assert not marker.exists()

    resumed = _cli("train", "--resume", str(run), f"run.max_env_steps={prev_state['env_steps'] + 100}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not marker.exists(), "the payload ran"
    assert "checkpoint refused" in resumed.stderr and "GLOBAL exec" in resumed.stderr
    assert f"resuming from {previous}" in resumed.stderr
    assert newest.with_name(newest.name + ".refused").is_dir()  # kept for inspection
    summary = _summary(resumed)
    assert summary["learner/updates"] >= prev_state["progress"]["updates"]
    assert summary["actor/env_steps"] >= prev_state["env_steps"] + 100


# ------------------------------------------------------------------ row 2: /dev/shm nearly full


@needs_mount
def test_shm_too_small_is_one_line_before_the_first_step(tmp_path):
    shm = tmp_path / "shm"
    run = tmp_path / "run"
    with tmpfs(shm, "512k"):
        r = _cli("train", CONFIG, *TINY, f"run.dir={run}", "run.max_env_steps=1000", env={"GEARFLOW_SHM_DIR": str(shm)})
        assert r.returncode == 2
        line = _error_line(r.stderr)
        assert re.search(rf"the replay table needs \d+ bytes \(1\.\d MiB\) of shared memory; {shm} has 524288 bytes \(512\.0 KiB\) free", line), line
        table_bytes = int(line.split("needs ")[1].split(" bytes")[0])
        assert not list(shm.iterdir()) and not run.exists()
    # room for the table but not the parameter store: the store fails at creation, not with SIGBUS
    with tmpfs(shm, table_bytes + 8192):
        r = _cli("train", CONFIG, *TINY, f"run.dir={run}", "run.max_env_steps=1000", env={"GEARFLOW_SHM_DIR": str(shm)})
        assert r.returncode == 2
        line = _error_line(r.stderr)
        assert re.search(r"the parameter store needs \d+ bytes .* has \d+ bytes .* free", line), line
        assert not list(shm.iterdir()) and not run.exists()  # the table made first is removed too


@needs_mount
def test_every_segment_reserves_its_pages(tmp_path, monkeypatch):
    """A store created in a tmpfs that has room for its size is fully backed: the whole
    tmpfs usage grows by its size at creation (sparse creation would show ~0)."""
    shm = tmp_path / "shm"
    with tmpfs(shm, "8m"):
        monkeypatch.setattr(storage_mod, "SHM_DIR", shm)
        model = torch.nn.Linear(256, 1024)  # ~1 MiB per slot
        before = shutil.disk_usage(shm).used
        store = ParameterStore.create(model)
        try:
            assert shutil.disk_usage(shm).used - before >= store.nbytes
            filler = shm / "filler"
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, storage_mod.shm_free_bytes() - store.nbytes // 2)
            with pytest.raises(SharedMemoryError, match=r"the parameter store needs \d+ bytes .* has \d+ bytes"):
                ParameterStore.create(model)
            assert sorted(p.name for p in shm.iterdir()) == sorted([store.name, "filler"])
        finally:
            store.close()


# ------------------------------------------------------------------ row 3: actors exhaust their restarts


EXPLODING_ENV = """
import gymnasium

class Exploding(gymnasium.Wrapper):
    def __init__(self, env, fail_after):
        super().__init__(env)
        self.fail_after, self.steps = int(fail_after), 0

    def step(self, action):
        self.steps += 1
        if self.fail_after and self.steps >= self.fail_after:
            raise RuntimeError(f"env exploded after {self.steps} steps")
        return self.env.step(action)

def make(num_envs, seed, fail_after=0):
    fns = [lambda: Exploding(gymnasium.make("CartPole-v1"), fail_after) for _ in range(num_envs)]
    return gymnasium.vector.SyncVectorEnv(fns, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP)
"""


def test_actor_restarts_exhausted_checkpoint_and_resume(tmp_path):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "exploding_env.py").write_text(EXPLODING_ENV)
    env = {"PYTHONPATH": str(mods)}
    run = tmp_path / "run"
    r = _cli("train", CONFIG, *TINY, f"run.dir={run}", "actor.num_actors=1", "actor.max_restarts=1",
             "env.factory=exploding_env:make", "env.batch_size=4", "env.kwargs.fail_after=150", "replay.min_size_to_sample=100",
             "run.max_env_steps=100000", "run.checkpoint_every=1h", env=env)  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    assert "actor 0 raised:" in r.stderr  # its traceback is in the log; the error is one line
    line = _error_line(r.stderr, traceback_logged=True)
    assert "actor 0 died (exit code 1) and was already restarted 1 times (actor.max_restarts=1)" in line, line
    assert "its last error: RuntimeError: env exploded after 150 steps" in line, line
    assert f"continue with gearflow train --resume {run}" in line, line
    final = RunCheckpoints(run / "checkpoints").paths()[0]
    assert f"final checkpoint {final}" in line
    saved = json.loads((final / "runner.json").read_text())
    assert saved["env_steps"] > 0 and (final / "replay").is_dir()
    assert json.loads((run / "summary.json").read_text())["stop_reason"].startswith("actor failed: actor 0 died")

    # a leftover of this run (a killed earlier attempt) and one of another run: resume removes only its own
    spec = TableSpec.parse({"x": "float32"})
    mine = SharedStorage.create(spec, 1, 4, name=shm_name("mine"), run_tag=run_tag(run))
    other = SharedStorage.create(spec, 1, 4, name=shm_name("other"), run_tag=run_tag(tmp_path / "elsewhere"))
    for seg in (mine, other):
        seg.header[H_OWNER] = _dead_pid()
        seg.close()
    try:
        resumed = _cli("train", "--resume", str(run), "env.kwargs.fail_after=0",
                       f"run.max_env_steps={saved['env_steps'] + 400}", env=env)  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert not (SHM_DIR / mine.name).exists() and (SHM_DIR / other.name).exists()
    finally:
        for seg in (mine, other):
            seg.unlink()
    summary = _summary(resumed)
    assert summary["actor/env_steps"] >= saved["env_steps"] + 400
    assert summary["learner/updates"] >= saved["progress"]["updates"]
    assert summary["replay/inserts"] >= 1


# ------------------------------------------------------------------ row 4: disk full / read-only checkpoint


@needs_mount
@pytest.mark.parametrize("free_kib", [0, 20, 44, 68, 92])
def test_a_checkpoint_that_fills_the_disk_is_an_oserror_and_leaves_nothing(tmp_path, free_kib):
    """Whichever byte of learner.pt finds the disk full — none written, or a part (torch's zip
    writer then fails again while closing, as a RuntimeError) — the save raises an OSError (what
    the learner treats as "not written, training goes on"), removes its partial files and keeps
    the checkpoint before it."""
    with tmpfs(tmp_path / "d", "1m") as d:
        ck = RunCheckpoints(d / "checkpoints")
        first = ck.save(1, {"agent": {"w": torch.ones(4)}, "rng": rng_states()}, {"updates": 1})
        filler = d / "filler"
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(d).free - free_kib * 1024)
        with pytest.raises(OSError):
            ck.save(2, {"agent": {"w": torch.zeros(64 * 1024)}, "rng": rng_states()}, {"updates": 2})  # 256 KiB
        assert ck.paths() == [first] and sorted(p.name for p in (d / "checkpoints").iterdir()) == [first.name]
        assert RunCheckpoints.load(first).runner == {"updates": 1}


@needs_mount
def test_periodic_checkpoint_on_a_full_then_read_only_disk(tmp_path):
    run = tmp_path / "run"
    ckdir = run / "checkpoints"
    with tmpfs(ckdir, "64m"):
        cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *SERIAL, f"run.dir={run}",
               "run.max_env_steps=0", "run.max_seconds=150", "run.checkpoint_every=15"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = run / "train.log"

        def wait(what, ok, timeout=60):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    pytest.fail(f"the run exited while waiting for {what}: {proc.communicate()[1][-3000:]}")
                if ok():
                    return
                time.sleep(0.1)
            pytest.fail(f"timed out waiting for {what}")

        def failures() -> int:
            return log.read_text().count("not written") if log.exists() else 0

        try:
            wait("a first checkpoint", lambda: RunCheckpoints(ckdir).paths())
            first = RunCheckpoints(ckdir).paths()[0]
            filler = ckdir / "filler"

            def full() -> bool:  # topped up while waiting: a rotation that frees space is filled again
                with open(filler, "ab") as f, contextlib.suppress(OSError):  # ENOSPC: the run took it first
                    free = shutil.disk_usage(ckdir).free
                    if free > 0:
                        os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, free)
                return failures() >= 1

            wait("a checkpoint failing on a full disk", full)
            filler.unlink()
            _remount(ckdir, "ro")  # read-only
            # the full disk may have failed several periods already: wait for the read-only failure itself
            wait("a checkpoint failing on a read-only disk", lambda: "Read-only file system" in log.read_text())
            _remount(ckdir, "rw")
            newest = RunCheckpoints(ckdir).paths()[0]
            wait("the next period's checkpoint", lambda: RunCheckpoints(ckdir).paths()[0] != newest)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 143, err[-3000:]  # stopped by SIGTERM, checkpointed
        text = log.read_text()
        assert "No space left on device" in text and "Read-only file system" in text
        assert "training continues, the previous checkpoints are intact, the next period retries" in text
        assert not list(ckdir.glob("*.tmp-*")), "a failed checkpoint was left behind"
        for path in RunCheckpoints(ckdir).paths():  # every checkpoint left verifies, the first one included
            RunCheckpoints.load(path)
        assert first.exists() or len(RunCheckpoints(ckdir).paths()) == 3  # rotated out only by newer ones
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["stop_signal"] == "SIGTERM" and Path(summary["checkpoint"]).is_dir()


@needs_mount
def test_a_final_checkpoint_on_a_full_disk_is_one_line_and_exit_4(tmp_path):
    """The run ends but its final checkpoint cannot be written (the checkpoints' disk is full):
    `gearflow train` says so in one line naming what --resume would continue from, writes the
    summary with the error, and exits 4 — not a traceback, not 0."""
    run = tmp_path / "run"
    ckdir = run / "checkpoints"
    with tmpfs(ckdir, "1m"):
        with open(ckdir / "filler", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(ckdir).free)
        cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *SERIAL, f"run.dir={run}",
               "run.max_env_steps=400", "run.checkpoint_every=1h"]  # fmt: skip
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
        assert r.returncode == 4, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert ("gearflow train: error: the final checkpoint could not be written ([Errno 28] No space left on device"
                in r.stderr and "no earlier checkpoint of this run exists" in r.stderr), r.stderr[-2000:]
        assert RunCheckpoints(ckdir).paths() == [] and not list(ckdir.glob("*.tmp-*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "reached run.max_env_steps=400" and "No space left" in summary["checkpoint_error"]


# ------------------------------------------------------------------ rows 5 and 10: missing replay, bad manifests


def _two_checkpoints(tmp_path, make_table) -> tuple[RunCheckpoints, Path, Path]:
    table = make_table(P=2, S=64)
    ckpts = RunCheckpoints(tmp_path / "checkpoints")
    older = ckpts.save(1, {"agent": {"w": torch.ones(2)}, "rng": rng_states()}, {"value": 1}, table=table)
    newer = ckpts.save(2, {"agent": {"w": torch.ones(2)}, "rng": rng_states()}, {"value": 2}, table=table)
    return ckpts, older, newer


def test_missing_replay_folder_refuses_the_checkpoint(tmp_path, make_table, caplog):
    ckpts, older, newer = _two_checkpoints(tmp_path, make_table)
    assert "replay/MANIFEST.json" in json.loads((newer / "MANIFEST.json").read_text())
    shutil.rmtree(newer / "replay")
    with caplog.at_level("WARNING", logger="gearflow.checkpoint"):
        found = ckpts.latest()
    assert found.path == older and found.replay_dir == older / "replay"
    assert any("replay/MANIFEST.json is missing" in r.getMessage() for r in caplog.records)
    assert newer.with_name(newer.name + ".refused").is_dir()


@pytest.mark.parametrize("manifest", ["{}", "[]", "null", '{"learner.pt": 3}', '{"../x": {"bytes": 1, "crc32": 1}}'])
def test_a_manifest_that_is_not_a_file_list_is_corrupt(tmp_path, make_table, manifest, caplog):
    ckpts, older, newer = _two_checkpoints(tmp_path, make_table)
    (newer / "MANIFEST.json").write_text(manifest)
    with caplog.at_level("WARNING", logger="gearflow.checkpoint"):
        found = ckpts.latest()
    assert found.path == older and found.runner["value"] == 1
    assert any("MANIFEST.json is corrupt" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointError, match="MANIFEST.json is corrupt"):
        RunCheckpoints.load(newer.with_name(newer.name + ".refused"))
    # the same for the replay's own manifest (which the run's manifest also covers)
    (older / "replay" / "MANIFEST.json").write_text(manifest)
    with pytest.raises(CheckpointError, match="MANIFEST.json is corrupt"):
        verify_checkpoint(older / "replay")
    with pytest.raises(CheckpointError, match="no usable checkpoint: .*replay/MANIFEST.json is"):
        ckpts.latest()


# ------------------------------------------------------------------ row 6: gc across PID namespaces


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_gc_removes_only_provably_dead_owners(storage_factory):
    prefix = seg_prefix() + "ident"
    spec = TableSpec.parse({"x": "float32"})
    live = storage_factory(spec, P=1, S=4, name=f"{prefix}_live")
    dead = storage_factory(spec, P=1, S=4, name=f"{prefix}_dead")
    dead.header[H_OWNER] = _dead_pid()
    reused = storage_factory(spec, P=1, S=4, name=f"{prefix}_reused")
    reused.header[H_OWNER] = os.getppid()  # a live process, but not the one that made the segment
    reused.header[H_START_TIME] += 1
    rebooted = storage_factory(spec, P=1, S=4, name=f"{prefix}_rebooted")
    rebooted.header[H_BOOT_ID] += 1
    legacy = storage_factory(spec, P=1, S=4, name=f"{prefix}_legacy")
    legacy.header[H_OWNER] = _dead_pid()
    legacy.header[12:16] = 0  # written by a gearflow that recorded only the pid
    removed = {n for n, _ in gc_segments(prefix)}
    assert removed == {dead.name, reused.name, rebooted.name}
    assert (SHM_DIR / live.name).exists() and (SHM_DIR / legacy.name).exists()
    # the resume gc: only one run's segments
    a = storage_factory(spec, P=1, S=4, name=f"{prefix}_run_a")
    b = storage_factory(spec, P=1, S=4, name=f"{prefix}_run_b")
    for seg, tag in ((a, 11), (b, 22)):
        seg.header[H_RUN_TAG], seg.header[H_OWNER] = tag, _dead_pid()
    assert [n for n, _ in gc_segments(prefix, run=11)] == [a.name]
    assert (SHM_DIR / b.name).exists()


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_gc_from_another_pid_namespace_keeps_live_segments(storage_factory):
    """``gearflow replay gc`` run in a new PID namespace (a container sharing /dev/shm): the
    live owner's PID does not exist there, yet its segment is kept; a dead one still goes."""
    prefix = seg_prefix() + "ns"
    spec = TableSpec.parse({"x": "float32"})
    live = storage_factory(spec, P=1, S=4, name=f"{prefix}_live")
    params = ParameterStore.create(torch.nn.Linear(2, 2), name=f"{prefix}_params")
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "gearflow", "replay", "gc", "--prefix", prefix]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
        if r.returncode != 0 and "unshare" in r.stderr:
            pytest.skip(f"cannot make a PID namespace here: {r.stderr.strip()}")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "removed 0 segment(s)" in r.stdout, r.stdout
        assert f"kept {SHM_DIR}/{live.name} (owner pid {os.getpid()} of another PID namespace" in r.stdout, r.stdout
        assert (SHM_DIR / live.name).exists() and (SHM_DIR / params.name).exists()
        # in this namespace, the owner is provably dead once its process is gone
        params.header[H_OWNER] = _dead_pid()
        r = subprocess.run([sys.executable, "-m", "gearflow", "replay", "gc", "--prefix", prefix],
                           capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)  # fmt: skip
        assert f"removed {SHM_DIR}/{params.name}" in r.stdout and "removed 1 segment(s)" in r.stdout, r.stdout
        assert (SHM_DIR / live.name).exists()
    finally:
        params.close()


# ------------------------------------------------------------------ row 7: a second writer on a live partition


def test_second_writer_on_a_live_partition_is_refused_and_a_dead_one_is_taken_over(storage_factory):
    spec = TableSpec.parse({"x": "float32"})
    st = storage_factory(spec, P=2, S=16)
    code = textwrap.dedent(f"""
        import sys, numpy as np
        from gearflow.replay.storage import SharedStorage
        from gearflow.replay.writer import Writer
        st = SharedStorage.attach({st.name!r})
        w = Writer(st, [1])
        w.append({{"x": np.zeros(1, np.float32)}})
        w.append({{"x": np.ones(1, np.float32)}})
        print("ready", flush=True)
        sys.stdin.read()  # alive until the test closes stdin
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(PartitionOwned, match=rf"partition 1 of {st.name} already has a live writer \(pid {proc.pid}\)"):
            Writer(st, [0, 1], prefault=False)
        assert st.counters[0, WRITER_PID] == 0  # refused before touching any partition
        Writer(st, [0], prefault=False)  # another partition is free
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    w = Writer(st, [1], prefault=False)  # the owner is dead: a restarted actor takes over
    assert w.positions.tolist() == [2]  # and continues after the dead writer's last step


# ------------------------------------------------------------------ rows 8 and 9: bad input, one line, exit 2


def _main(capsys, *argv: str) -> tuple[int, str]:
    """``gearflow ARGV`` in this process (only the error path runs: no actor starts), with what
    ``train`` changes process-wide put back afterwards."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    threads, switch = torch.get_num_threads(), sys.getswitchinterval()
    try:
        code = cli.main(list(argv))
    finally:
        for h in [h for h in root.handlers if h not in handlers]:  # bound to capsys's stream
            root.removeHandler(h)
        root.setLevel(level)
        torch.set_num_threads(threads)
        sys.setswitchinterval(switch)
    return code, _error_line(capsys.readouterr().err)


@pytest.mark.parametrize("capacity", ["1e12", "1e30"])
def test_huge_capacity_is_one_line_and_leaves_nothing(tmp_path, capsys, capacity):
    before = {p.name for p in SHM_DIR.iterdir()}
    code, line = _main(capsys, "train", CONFIG, f"replay.capacity={capacity}", f"run.dir={tmp_path / 'run'}")
    assert code == 2
    assert re.search(r"the replay table needs \d+ bytes \(.*\) of shared memory; .* has \d+ bytes \(.*\) free$", line), line
    assert not (tmp_path / "run").exists()
    # nothing of ours, not even a 0-byte file that gc could not see (other sessions' runs come and go)
    new = {p.name for p in SHM_DIR.iterdir()} - before
    assert not [n for n in new if n.startswith(f"{storage_mod.PREFIX}_{os.getpid()}_")], new


def test_run_dir_under_a_file_is_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, line = _main(capsys, "train", CONFIG, *TINY, f"run.dir={afile / 'run'}")
    assert code == 2 and f"{afile} is a file, not a directory" in line, line
    assert afile.read_text() == "x"


@needs_mount
def test_run_dir_on_a_read_only_file_system_is_one_line(tmp_path, capsys):
    ro = tmp_path / "ro"
    with tmpfs(ro, "1m"):
        _remount(ro, "ro")
        code, line = _main(capsys, "train", CONFIG, *TINY, f"run.dir={ro / 'runs' / 'x'}")
        assert code == 2 and f"{ro} is on a read-only file system" in line, line
        assert not list(ro.iterdir())


def test_agent_module_that_raises_on_import_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "exploding_agent.py").write_text("raise RuntimeError('agent exploded at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, line = _main(capsys, "train", CONFIG, "agent.name=exploding_agent", f"run.dir={tmp_path / 'run'}")
    assert code == 2
    assert "importing agent module 'exploding_agent' raised RuntimeError: agent exploded at import" in line, line
    assert not (tmp_path / "run").exists()


def test_min_size_to_sample_above_capacity_is_a_config_error(tmp_path, capsys):
    code, line = _main(capsys, "train", CONFIG, "replay.capacity=20000", "replay.min_size_to_sample=30000",
                       f"run.dir={tmp_path / 'run'}")  # fmt: skip
    assert code == 2
    assert "replay.min_size_to_sample=30000: is larger than replay.capacity (20000)" in line, line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ RNG states round-trip without pickles


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    import random

    ckpts = RunCheckpoints(tmp_path)
    path = ckpts.save(1, {"agent": {}, "rng": rng_states()}, {})
    want = (torch.rand(3), np.random.rand(3), random.random())
    from gearflow.run.checkpoint import set_rng_states

    set_rng_states(load_learner(path / "learner.pt")["rng"])
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


def test_a_checkpoint_written_before_rng_states_were_tensors_still_loads(tmp_path):
    """Nothing already stored is lost: numpy's RNG state pickled as an ndarray (the old format)
    is the one non-tensor global still allowed, and restores the same draws."""
    import random

    from gearflow.run.checkpoint import set_rng_states

    legacy = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    ckpt = RunCheckpoints(tmp_path).save(1, {"agent": {"w": torch.ones(2)}, "rng": legacy}, {"value": 1})
    want = (np.random.rand(3), random.random())
    found = RunCheckpoints(tmp_path).latest()
    assert found.path == ckpt
    set_rng_states(found.learner["rng"])
    assert np.array_equal(np.random.rand(3), want[0]) and random.random() == want[1]
