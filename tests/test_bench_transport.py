"""``gearflow bench transport`` runs end to end (tiny sizes): every figure has its floor."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from gearflow.transport import wire_io
from tests.test_bench import ROOT, bench

pytestmark = pytest.mark.slow


def test_bench_transport_smoke():
    rows = bench("transport", "--scale", "0.1")
    by = {(r["workload"], r["metric"]): r for r in rows}
    assert {w for w, _ in by} == {"insert", "actor", "sample", "latency", "writeback"}
    for key in [("insert", "steps_per_s[ShippingWriter,C adder]"), ("actor", "env_steps_per_s[ShippingWriter]"),
                ("sample", "GB_per_s[batch=256]"), ("latency", "p50_us[batch=32]"), ("latency", "p99_us[batch=256]"),
                ("writeback", "updates_per_s[rtt=10ms,learn=10ms]")]:  # fmt: skip
        row = by[key]
        assert row["value"] > 0 and row["floor"] > 0, row  # measured, and against a floor of the same run
    if shutil.which("openssl"):  # the TLS sampler, where certificates can be made
        tls = by[("sample", "GB_per_s[batch=256,tls]")]
        assert tls["value"] > 0 and tls["floor"] == by[("sample", "GB_per_s[batch=256]")]["floor"], tls


def test_bench_transport_unknown_workload():
    proc = subprocess.run([sys.executable, "-m", "gearflow", "bench", "transport", "--workloads", "nope"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "unknown workload(s) ['nope']" in proc.stderr


def test_bench_transport_profile_splits_a_round_by_phase_and_side():
    rows = bench("transport", "--profile", "--scale", "0.1")
    by = {r["metric"]: r for r in rows if r["workload"] == "profile"}
    assert by["round_ms[integrity=true]"]["value"] > 0 and by["round_ms[integrity=true]"]["floor"] > 0
    # both sides MAC with integrity on, and say how many update calls a round costs; off: none
    for side in ("shard", "learner"):
        assert by[f"{side}/mac.calls[integrity=true]"]["value"] >= 1, side
        assert by[f"{side}/mac.items[integrity=true]"]["value"] >= by[f"{side}/mac.calls[integrity=true]"]["value"]
        assert by[f"{side}/mac.cpu_ms[integrity=true]"]["floor"] is None  # nothing MACed with integrity off
    # the reply's bytes land through the loop or, a big block, the client's wire thread (MACed as they land)
    landed = sum(by.get(f"learner/{p}.items[integrity=true]", {"value": 0})["value"] for p in ("recv", "wire_recv"))
    assert by["shard/handler.calls[integrity=true]"]["value"] > 0.5 and landed > 1e6
    if wire_io.available():
        assert by["learner/wire_recv.calls[integrity=true]"]["value"] > 0.5
    assert any(m.startswith("learner/thread[") for m in by) and any(m.startswith("shard/thread[") for m in by)
