"""The benchmark suites run end to end (tiny sizes) and print well-formed JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"bench", "workload", "metric", "value", "unit", "floor", "ratio"}

pytestmark = pytest.mark.slow


def bench(*args: str) -> list[dict]:
    cmd = [sys.executable, "-m", "gearflow", "bench", *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    for row in rows:
        assert set(row) == FIELDS, row
        if row["floor"] is not None:
            assert row["ratio"] == pytest.approx(row["value"] / row["floor"])
    return rows


def test_bench_replay_all_workloads_smoke():
    rows = bench("replay", "--scale", "0.01")
    by = {(r["workload"], r["metric"]): r for r in rows}
    assert {w for w, _ in by} >= {"W1", "W2", "W3", "W4"}
    assert by[("W1", "sample_GB_per_s")]["value"] > 0
    assert by[("W1", "priority_updates_per_s")]["value"] > 0
    # the concurrency workload verifies every byte of every sampled row: none may be torn, and
    # the seqlock must have caught overwritten items (else the check proved nothing; the run
    # exits non-zero in either case)
    assert by[("W3", "torn_or_corrupt_rows_returned")]["value"] == 0
    assert by[("W3", "torn_items_detected_and_resampled")]["value"] > 0
    assert any(m.startswith("sample_cost_ratio") for w, m in by if w == "W4")
    # the per-step hot paths, each with its floor
    for metric in ("priority_update_calls_per_s", "insert_with_ingest_steps_per_s",
                   "sequence_insert_with_ingest_steps_per_s", "single_stream_items_per_s"):  # fmt: skip
        assert by[("W5", metric)]["value"] > 0 and by[("W5", metric)]["floor"] > 0, metric


def test_bench_keys_smoke_every_row_checked():
    rows = bench("keys", "--scale", "0.01", "--workloads", "transition_fifo_S2048")
    by = {r["metric"]: r["value"] for r in rows}
    assert by["rows_checked"] > 0 and by["bad_keys"] == 0 and by["torn_rows"] == 0


def test_bench_unknown_workload_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "gearflow", "bench", "replay", "--workloads", "W9"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2
    assert "unknown workload(s) ['W9']" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_actors_random_policy_against_bare_envpool():
    rows = bench("actors", "--workloads", "random", "--scale", "0.2")
    (row,) = rows
    assert row["workload"] == "random" and row["metric"].startswith("env_steps_per_s[CartPole-v1")
    assert row["value"] > 0 and row["floor"] > 0


def test_bench_actors_transformer_full_recompute_against_kv_cache():
    """Each context: the full recompute (the floor), the cached actor with ratio = cached / full,
    both policies' time per recv and the episode length, for the R2D2 and DT actors."""
    rows = bench("actors", "--workloads", "transformer,dt", "--scale", "0.05")
    for workload, contexts in (("transformer", (10, 40, 80)), ("dt", (10, 40))):
        mine = [r for r in rows if r["workload"] == workload]
        assert len(mine) == 5 * len(contexts)
        for C in contexts:
            at = [r for r in mine if f",context={C}" in r["metric"]]
            by = {r["metric"].split("[")[0] + ("/kv" if "kv_cache=true" in r["metric"] else ""): r for r in at}
            assert set(by) == {"env_steps_per_s", "env_steps_per_s/kv", "act_us_per_recv", "act_us_per_recv/kv",
                               "episode_length_mean"}  # fmt: skip
            full, cached = by["env_steps_per_s"], by["env_steps_per_s/kv"]
            assert full["floor"] is None and cached["floor"] == full["value"] > 0 and cached["value"] > 0
            assert by["act_us_per_recv"]["value"] > 0 and by["act_us_per_recv/kv"]["value"] > 0
            assert by["episode_length_mean"]["value"] >= 8  # CartPole episodes are at least 8 steps
