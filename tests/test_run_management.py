"""Run management: checkpoints and resume, metric sinks, progress display, plot and eval."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gearflow.run.checkpoint import RunCheckpoints, rng_states, set_rng_states
from gearflow.errors import GearflowError
from gearflow.run.metrics import MetricsLog, read_metrics
from gearflow.run.display import LiveDisplay, LogDisplay, log_line, make_display
from gearflow.replay.table_checkpoint import CheckpointError
from gearflow.replay.storage import COMMIT, PREFIX, PUBLISHED, RESERVE, SharedStorage, list_segments

from tests.test_train import CONFIG, ROOT, TINY, _alive, _children, _cmdline  # the same tiny CartPole run


# ------------------------------------------------------------------ RunCheckpoints


def _save(ckpts: RunCheckpoints, updates: int, value: float) -> Path:
    learner = {"agent": {"w": torch.full((4,), value)}, "rng": rng_states()}
    return ckpts.save(updates, learner, {"env_steps": updates * 10, "value": value})


def test_checkpoints_rotate_and_latest_is_newest(tmp_path):
    ckpts = RunCheckpoints(tmp_path / "checkpoints", keep=2)
    for u in (10, 20, 30):
        _save(ckpts, u, float(u))
    assert [p.name for p in ckpts.paths()] == ["ckpt-000000030", "ckpt-000000020"]
    found = ckpts.latest()
    assert found.path.name == "ckpt-000000030" and found.runner["value"] == 30.0
    assert torch.equal(found.learner["agent"]["w"], torch.full((4,), 30.0))
    assert found.replay_dir is None  # saved without a table


def test_same_update_count_saved_twice_replaces(tmp_path):
    ckpts = RunCheckpoints(tmp_path, keep=3)
    _save(ckpts, 5, 1.0)
    _save(ckpts, 5, 2.0)  # a final checkpoint right after a periodic one
    assert [p.name for p in ckpts.paths()] == ["ckpt-000000005"]
    assert ckpts.latest().runner["value"] == 2.0


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: (p / "learner.pt").write_bytes((p / "learner.pt").read_bytes()[:50]), "learner.pt is truncated"),
        (lambda p: (p / "runner.json").write_text('{"env_steps": 1, "value": 9.00}'), "runner.json is"),
        (lambda p: (p / "MANIFEST.json").unlink(), "no MANIFEST.json"),
        (lambda p: (p / "learner.pt").unlink(), "learner.pt is missing"),
    ],
    ids=["truncated", "corrupt", "no-manifest", "missing-file"],
)
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog, damage, words):
    ckpts = RunCheckpoints(tmp_path, keep=3)
    _save(ckpts, 1, 1.0)
    newest = _save(ckpts, 2, 2.0)
    damage(newest)
    with caplog.at_level("WARNING", logger="gearflow.checkpoint"):
        found = ckpts.latest()
    assert found.path.name == "ckpt-000000001" and found.runner["value"] == 1.0
    assert any(words in r.getMessage() and "trying the previous one" in r.getMessage() for r in caplog.records)
    refused = newest.with_name("ckpt-000000002.refused")
    assert refused.is_dir() and not newest.exists()  # kept for inspection, never loaded again
    with pytest.raises(CheckpointError, match=words):
        RunCheckpoints.load(refused)
    # the resumed run's next checkpoint (fewer updates than the refused one) survives rotation
    RunCheckpoints(tmp_path, keep=1).save(1, {"agent": {}, "rng": rng_states()}, {"value": 1.5})
    assert [p.name for p in ckpts.paths()] == ["ckpt-000000001"] and ckpts.latest().runner["value"] == 1.5


def test_no_usable_checkpoint_is_a_clear_error(tmp_path):
    ckpts = RunCheckpoints(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ckpts.latest()
    only = _save(ckpts, 1, 1.0)
    (only / "runner.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no usable checkpoint: .*runner.json is"):
        ckpts.latest()


def test_stale_tmp_directory_of_a_killed_save_is_ignored_and_removed(tmp_path):
    ckpts = RunCheckpoints(tmp_path)
    _save(ckpts, 1, 1.0)
    stale = tmp_path / "ckpt-000000009.tmp-99999"
    stale.mkdir()
    (stale / "learner.pt").write_bytes(b"half")
    assert ckpts.latest().path.name == "ckpt-000000001"
    _save(ckpts, 2, 2.0)
    assert not stale.exists()


def test_a_save_killed_while_replacing_a_checkpoint_leaves_the_old_one_findable(tmp_path):
    ckpts = RunCheckpoints(tmp_path, keep=3)
    _save(ckpts, 5, 1.0)
    (tmp_path / "ckpt-000000005").rename(tmp_path / "ckpt-000000005.old-4242")  # killed between the renames
    assert ckpts.latest().runner["value"] == 1.0
    _save(ckpts, 5, 2.0)  # the next save of that count replaces it and clears the old copy
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000005"]
    assert ckpts.latest().runner["value"] == 2.0


def test_readers_that_skip_the_replay_do_not_verify_it(tmp_path, make_table):
    table = make_table(P=2, S=64)
    ckpts = RunCheckpoints(tmp_path)
    path = ckpts.save(1, {"agent": {}, "rng": rng_states()}, {"value": 1.0}, table=table)
    column = next((path / "replay" / "columns").iterdir())
    column.write_bytes(column.read_bytes()[:-8])
    assert RunCheckpoints.load(path, replay=False).runner["value"] == 1.0  # gearflow eval
    with pytest.raises(CheckpointError, match="is truncated"):
        RunCheckpoints.load(path)  # a resume restores the replay: verified


def test_rng_states_round_trip():
    state = rng_states()
    a = (torch.rand(3), np.random.rand(3))
    set_rng_states(state)
    b = (torch.rand(3), np.random.rand(3))
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# ------------------------------------------------------------------ metric sinks


def test_metrics_log_writes_jsonl_csv_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsLog(tmp_path, tensorboard=True)
    sink.write({"actor/env_steps": 100, "replay/size": 50, "stop_reason": "x"})
    sink.write({"actor/env_steps": 200, "replay/size": 90, "learner/loss": 0.5})  # a new column
    sink.close()
    assert [r["actor/env_steps"] for r in read_metrics(tmp_path)] == [100, 200]
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "actor/env_steps,replay/size,learner/loss"  # widened, strings left out
    assert lines[1:] == ["100,50,", "200,90,0.5"]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("replay/size")] == [(100, 50.0), (200, 90.0)]
    assert [(e.step, e.value) for e in acc.Scalars("learner/loss")] == [(200, 0.5)]


def test_metrics_log_takes_numpy_and_torch_scalars(tmp_path):
    sink = MetricsLog(tmp_path, tensorboard=False)
    sink.write({"actor/env_steps": np.int64(10), "learner/loss": np.float32(0.25), "learner/q": torch.tensor(1.5)})
    sink.close()
    assert read_metrics(tmp_path) == [{"actor/env_steps": 10, "learner/loss": 0.25, "learner/q": 1.5}]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1] == "10,0.25,1.5"


def test_metrics_log_resume_truncates_to_the_checkpoint(tmp_path):
    sink = MetricsLog(tmp_path, tensorboard=False)
    sink.write({"actor/env_steps": 100, "learner/updates": 1})
    offsets = sink.offsets()
    sink.write({"actor/env_steps": 200, "learner/updates": 2, "learner/loss": 1.0})  # after the checkpoint
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"actor/env_steps": 3')  # torn last line of a SIGKILLed run
    sink = MetricsLog(tmp_path, tensorboard=False, resume_from=(offsets, 100))
    sink.write({"actor/env_steps": 150, "learner/updates": 2})
    sink.close()
    assert [r["actor/env_steps"] for r in read_metrics(tmp_path)] == [100, 150]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "actor/env_steps,learner/updates", "100,1", "150,2"]  # fmt: skip


def test_read_metrics_of_a_non_run_directory(tmp_path):
    with pytest.raises(GearflowError, match="no metrics.jsonl"):
        read_metrics(tmp_path)


# ------------------------------------------------------------------ progress display


ROW = {"actor/env_steps": 12345, "actor/env_steps_per_s": 987.6, "learner/updates": 321,
       "learner/updates_per_s": 12.34, "replay/size": 5000, "replay/fill": 0.25,
       "actor/return_last100": 101.25, "actor/return_last100_greediest": 150.0,
       "actor/policy_lag": 3, "learner/wait_fraction": 0.031, "time/elapsed_s": 61.0}  # fmt: skip


def test_log_line_and_display_choice():
    assert log_line(ROW) == (
        "steps 12345 (988/s) updates 321 (12.3/s) replay 5000 return100 101.2 greediest 150.0 lag 3.0 wait 3%"
    )
    assert isinstance(make_display("auto", stream=io.StringIO()), LogDisplay)  # not a TTY: log lines

    class Tty(io.StringIO):
        def isatty(self):
            return True

    display = make_display("auto", max_env_steps=100000, stream=Tty())
    try:
        assert isinstance(display, LiveDisplay)
    finally:
        display.close()
    assert isinstance(make_display("log", stream=Tty()), LogDisplay)


def test_live_panel_shows_the_figures():
    from rich.console import Console

    display = LiveDisplay(max_env_steps=50000)
    display.close()
    console = Console(file=io.StringIO(), width=100)
    console.print(display.render(ROW))
    text = console.file.getvalue()
    for needle in ("12,345", "988", "12.3", "5,000", "25%", "101.2", "150.0", "3%", "61 s", "of 50,000 steps"):
        assert needle in text, (needle, text)


# ------------------------------------------------------------------ end to end (CLI)


def _cli(*args: str, timeout: float = 480) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gearflow", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def _wait_for_checkpoints(run: Path, proc: subprocess.Popen, count: int, timeout: float = 480) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(RunCheckpoints(run / "checkpoints").paths()) >= count and (run / "metrics.jsonl").exists():
            return
        if proc.poll() is not None:
            pytest.fail(f"the run exited early: {proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    pytest.fail("no periodic checkpoints appeared in time")


def _wait_until(done, proc: subprocess.Popen | None, what: str, timeout: float = 480) -> None:
    """Poll ``done()``; the timeout only keeps a broken run from hanging the suite."""
    deadline = time.monotonic() + timeout
    while not done():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _replay_items(checkpoint: Path) -> int:
    with np.load(checkpoint / "replay" / "table.npz") as t:
        return int(t["slot_live"].sum())


def _table_segment(pid: int) -> SharedStorage:
    """The replay segment of the run ``pid``, attached: the mapping outlives the run's unlink."""
    (name,) = [n for n, owner, _ in list_segments() if owner == pid and not n.startswith(f"{PREFIX}_params_")]
    return SharedStorage.attach(name)


def _committed_items(st: SharedStorage) -> tuple[int, int]:
    """(items, steps) the writers committed and the ring still holds, counted from the segment's
    own counters and records (not from the table or a checkpoint): per partition, of the last
    R published item records, those whose first step is not older than ``RESERVE - S``."""
    S, R = st.steps_per_partition, st.items_per_partition
    items = 0
    for p in range(st.num_partitions):
        published, reserve = int(st.counters[p, PUBLISHED]), int(st.counters[p, RESERVE])
        seqs = np.arange(max(0, published - R), published)
        items += int((st.item_start[p, seqs % R] >= reserve - S).sum())
    return items, int(st.counters[:, COMMIT].sum())


def _assert_continuous(rows: list[dict]) -> None:
    for key in ("actor/env_steps", "learner/updates", "time/elapsed_s", "actor/episodes"):
        values = [r[key] for r in rows]
        assert all(b >= a for a, b in zip(values, values[1:])), (key, values)


@pytest.mark.slow
@pytest.mark.timeout(900)  # several `gearflow` runs in a row; their waits are on files and exits
def test_sigterm_writes_a_checkpoint_and_resume_continues(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={run}",
           "run.max_env_steps=0", "run.max_seconds=900", "run.checkpoint_every=40"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    segment = None
    try:
        _wait_for_checkpoints(run, proc, 2)
        segment = _table_segment(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
        # the run has exited: its actors were stopped and joined, so these counters are final
        committed, committed_steps = _committed_items(segment)
    finally:
        if segment is not None:
            segment.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM: stopped and checkpointed, not finished
    first = json.loads(out.strip().splitlines()[-1])
    assert first["stop_reason"] == "stopped by signal" and first["stop_signal"] == "SIGTERM"
    final = Path(first["checkpoint"])  # SIGTERM wrote a final checkpoint
    assert final == RunCheckpoints(run / "checkpoints").paths()[0]
    saved = json.loads((final / "runner.json").read_text())
    # every item the actors committed before the stop is in the final checkpoint
    assert committed > 0 and _replay_items(final) == committed
    assert saved["env_steps"] == committed_steps
    assert saved["progress"]["updates"] == first["learner/updates"]
    lines_before = (run / "metrics.jsonl").read_text().splitlines()
    rows_before = len(read_metrics(run))

    resumed = _cli("train", "--resume", str(run), f"run.max_env_steps={saved['env_steps'] + 1500}",
                   "run.max_seconds=0")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {final}" in resumed.stderr
    # ... and in the resumed run's table
    assert f"replay restored: {committed} items, {committed_steps} env steps" in resumed.stderr
    second = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert second["actor/env_steps"] >= saved["env_steps"] + 1500
    assert second["learner/updates"] > first["learner/updates"]
    assert second["learner/weights_version"] > first["learner/weights_version"]
    assert second["replay/inserts"] > first["replay/inserts"]
    assert second["actor/episodes"] > first["actor/episodes"]
    rows = read_metrics(run)
    # the first run's rows are kept as they were but for its summary row; the resumed run's follow
    assert (run / "metrics.jsonl").read_text().splitlines()[: rows_before - 1] == lines_before[:-1]
    assert len(rows) >= rows_before
    _assert_continuous(rows)
    # the first run's final summary row was dropped on resume (no step appears twice); the
    # resumed run's own summary ends the file
    assert [r.get("stop_reason") for r in rows if "stop_reason" in r] == [second["stop_reason"]]
    rows_before -= 1
    after = rows[rows_before]  # the first row of the resumed run continues the counters
    assert after["learner/updates"] >= saved["progress"]["updates"]
    assert after["time/elapsed_s"] >= saved["progress"]["elapsed_s"]
    assert not [n for n, owner, _ in list_segments() if owner == proc.pid]


@pytest.mark.slow
@pytest.mark.timeout(900)  # several `gearflow` runs in a row; their waits are on files and exits
def test_sigkill_then_resume_from_the_last_periodic_checkpoint(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "gearflow", "train", CONFIG, *TINY, f"run.dir={run}",
           "run.max_env_steps=0", "run.max_seconds=900", "run.checkpoint_every=40"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    actors: list[int] = []
    try:
        _wait_for_checkpoints(run, proc, 3)
        # a metrics row past the newest checkpoint: the resume has rows to drop
        newest = RunCheckpoints(run / "checkpoints").paths()[0]
        offset = json.loads((newest / "runner.json").read_text())["metric_offsets"]["metrics.jsonl"]
        _wait_until(lambda: (run / "metrics.jsonl").stat().st_size > offset, proc, "a metrics row after a checkpoint")
        actors = [c for c in _children(proc.pid) if "resource_tracker" not in _cmdline(c)]
        assert actors
        proc.kill()  # no cleanup, no final checkpoint
        proc.wait(timeout=30)
        # the orphaned actors notice the dead learner and exit
        _wait_until(lambda: not any(_alive(a) for a in actors), None, "the orphaned actors to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        for a in actors:
            if _alive(a):
                os.kill(a, signal.SIGKILL)
    latest = RunCheckpoints(run / "checkpoints").paths()[0]
    saved = json.loads((latest / "runner.json").read_text())
    items = _replay_items(latest)

    resumed = _cli("train", "--resume", str(run), f"run.max_env_steps={saved['env_steps'] + 1000}",
                   "run.max_seconds=0")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {latest}" in resumed.stderr
    assert f"replay restored: {items} items" in resumed.stderr
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["learner/updates"] > saved["progress"]["updates"]
    rows = read_metrics(run)
    _assert_continuous(rows)  # rows written after the checkpoint were dropped, none repeated
    assert not [n for n, owner, _ in list_segments() if owner == proc.pid], "the killed run's segments were not collected"


@pytest.mark.slow
@pytest.mark.timeout(900)  # several `gearflow` runs in a row; their waits are on files and exits
def test_resume_with_a_corrupt_latest_checkpoint_uses_the_previous_one(tmp_path):
    run = tmp_path / "run"
    r = _cli("train", CONFIG, *TINY, f"run.dir={run}", "run.max_env_steps=1500", "run.checkpoint_every=30")
    assert r.returncode == 0, r.stderr[-3000:]
    newest, previous = RunCheckpoints(run / "checkpoints").paths()[:2]
    col = next((newest / "replay" / "columns").iterdir())
    col.write_bytes(col.read_bytes()[:-100])
    resumed = _cli("train", "--resume", str(run), "run.max_env_steps=2000")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "is truncated" in resumed.stderr and "trying the previous one" in resumed.stderr
    assert f"resuming from {previous}" in resumed.stderr

    # what a resume cannot change is refused with the key named, and nothing is left behind
    for override, words in [
        ("replay.selector=uniform", "cannot resume: replay.selector='uniform', but the checkpoint's table was filled with the 'prioritized' selector"),
        ("agent.hidden_sizes=[32]", "learner that does not fit the config's agent"),
        ("replay.capacity=40000", "cannot resume: the checkpoint's replay has (partitions, steps, items)"),
    ]:  # fmt: skip
        r = _cli("train", "--resume", str(run), override)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (override, r.stderr[-2000:])
    r = _cli("train", CONFIG, *TINY, f"run.dir={run}", "run.max_env_steps=100")
    assert r.returncode == 2 and "already holds a run" in r.stderr and f"--resume {run}" in r.stderr

    # eval and plot of the same run
    ev = _cli("eval", str(run), "--episodes", "3")
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["eval/episodes"] == 3 and result["eval/return_min"] >= 8  # CartPole: ≥ 8 steps
    assert result["eval/return_min"] <= result["eval/return_mean"] <= result["eval/return_max"]
    older = RunCheckpoints(run / "checkpoints").paths()[-1]
    ev = _cli("eval", str(run), "--episodes", "2", "--checkpoint", str(older))
    assert ev.returncode == 0 and json.loads(ev.stdout.strip().splitlines()[-1])["checkpoint"] == str(older)
    out = tmp_path / "curves.png"
    pl = _cli("plot", str(run), str(run), "-o", str(out))
    assert pl.returncode == 0, pl.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_cli_argument_errors(tmp_path):
    r = _cli("train")
    assert r.returncode == 2 and "give a CONFIG file, or --resume RUN_DIR" in r.stderr
    r = _cli("train", CONFIG, "--resume", str(tmp_path))
    assert r.returncode == 2 and "not both" in r.stderr
    r = _cli("train", "--resume", str(tmp_path))
    assert r.returncode == 2 and "no config.yaml there" in r.stderr
    r = _cli("eval", str(tmp_path))
    assert r.returncode == 2 and "not a gearflow run directory" in r.stderr
    r = _cli("plot", str(tmp_path))
    assert r.returncode == 2 and "no metrics.jsonl" in r.stderr
    for cmd in (["train", "--resume", str(tmp_path)], ["eval", str(tmp_path)]):
        assert "Traceback" not in _cli(*cmd).stderr


def test_eval_video_of_cartpole(tmp_path):
    pytest.importorskip("imageio")
    pytest.importorskip("pygame")
    run = tmp_path / "run"
    r = _cli("train", CONFIG, *TINY, f"run.dir={run}", "run.max_env_steps=600", "actor.num_actors=1",
             "run.checkpoint_every=0s")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / "checkpoints").exists()
    ev = _cli("eval", str(run))
    assert ev.returncode == 2 and "no checkpoint" in ev.stderr  # checkpoints were off
    r = _cli("train", CONFIG, *TINY, f"run.dir={run}2", "run.max_env_steps=600", "actor.num_actors=1")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "episode.mp4"
    ev = _cli("eval", f"{run}2", "--episodes", "1", "--video", str(out))
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    import imageio.v2 as imageio

    reader = imageio.get_reader(out)
    frames = reader.count_frames()
    reader.close()
    # one greedy episode: as many frames as steps (+ the reset frame), at least CartPole's minimum
    assert frames >= 8 and result["video"] == str(out)


def test_live_panel_keeps_progress_lines_out_of_the_terminal_but_in_the_log_file(tmp_path):
    import logging

    from gearflow.log import setup_logging

    setup_logging(0)
    terminal = logging.StreamHandler(io.StringIO())
    file_log = logging.FileHandler(tmp_path / "train.log")
    root = logging.getLogger()
    root.addHandler(terminal)
    root.addHandler(file_log)
    try:
        display = LiveDisplay(max_env_steps=100)
        try:
            display.update(ROW)
            logging.getLogger("gearflow.runner").info("checkpoint written")  # other lines still show
        finally:
            display.close()
        LogDisplay().update(ROW)  # after the panel: progress lines reach the terminal again
    finally:
        root.removeHandler(terminal)
        root.removeHandler(file_log)
        file_log.close()
    shown = terminal.stream.getvalue()
    assert shown.count("steps 12345") == 1 and "checkpoint written" in shown
    assert (tmp_path / "train.log").read_text().count("steps 12345") == 2
