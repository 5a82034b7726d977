"""``gearflow bench cluster --simulate``: the scale model's arithmetic on given figures (``--from``),
where its bottleneck switches, its JSON lines, and one quick real measurement through the CLI."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest

from gearflow.bench import cluster
from gearflow.errors import GearflowError
from tests.test_bench import ROOT

# Hand figures with round numbers, so each stage's bound can be worked out on paper:
#   t_l(b) = 0.002 + 6.25e-5·b → 0.01 s per update at B = 128 (the priority write-back's round trip
#   τ = 100 µs overlaps it): one learner does 100 updates/s, 12,800 items/s;
#   ρ = 1, so the learner bounds X at 12,800 env steps/s; an actor makes 1,000 steps/s.
FIG = {
    "actor_env_steps_per_s": 1000.0,
    "insert_steps_per_s": 1e6,
    "shard_sample_s": [[8, 1e-4], [128, 2e-4]],
    "learn_s": [[32, 0.004], [128, 0.01]],
    "allreduce_s": [[8, 1e-4], [1_000_000, 1e-3]],
    "param_bytes": 1_000_000,
    "item_bytes": 100,
    "batch_size": 128,
    "samples_per_insert": 1.0,
    "prefetch": 2,
    "transport_request_latency_us": 100.0,
    "transport_loopback_bytes_per_s": 2e9,
}


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gearflow", "bench", "cluster", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)  # fmt: skip


def assert_same(a: dict, b: dict) -> None:
    """Two model lines agree: the same keys, numbers equal to rounding (JSON round trip)."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, dict):
            assert_same(v, b[k])
        elif isinstance(v, float):
            assert v == pytest.approx(b[k], rel=1e-12), k
        else:
            assert v == b[k], k


def lines_of(proc: subprocess.CompletedProcess) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.fixture
def fig_file(tmp_path):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(FIG))
    return path


# ----------------------------------------------------------------------------- the model's arithmetic


def test_actor_bound_until_the_learner_takes_over():
    """M = 1: N actors make N·1000 steps/s until the learner's 12,800 (at N = 13)."""
    for N in range(1, 13):
        r = cluster.model(FIG, N, 1, 1, 10.0)
        assert r["bottleneck"] == "actors" and r["env_steps_per_s"] == pytest.approx(1000.0 * N)
    r = cluster.model(FIG, 13, 1, 1, 10.0)
    assert r["bottleneck"] == "learner"
    assert r["env_steps_per_s"] == pytest.approx(12_800.0)
    assert r["updates_per_s"] == pytest.approx(100.0)  # U·B = ρ·X
    assert r["limits"]["actors"] == pytest.approx(13_000.0)
    s = cluster.summarize(FIG, [1, 4], [1], 10.0, "tcp", 1.0, 5000.0)
    by_m = {row["actors_per_node"]: row for row in s["stops_scaling"]}
    assert by_m[1]["linear_until_nodes"] == 12 and by_m[1]["then_bottleneck"] == "learner"
    assert by_m[4]["linear_until_nodes"] == 3 and by_m[4]["then_bottleneck"] == "learner"  # 4 nodes: 16,000 > 12,800
    assert by_m[1]["max_env_steps_per_s"] == pytest.approx(12_800.0)
    # Ape-X's rate here set to 5,000 steps/s: 5 one-actor nodes, or 2 four-actor nodes
    apex = {row["actors_per_node"]: row for row in s["apex"]["one_learner"]}
    assert apex[1]["nodes_for_apex_rate"] == 5 and apex[4]["nodes_for_apex_rate"] == 2
    assert apex[4]["at_those_nodes"]["env_steps_per_s"] == pytest.approx(8000.0)
    assert apex[4]["nodes_for_360_actor_processes"] == 90 and apex[1]["nodes_for_360_actor_processes"] == 360
    assert apex[1]["at_360_actor_processes"]["bottleneck"] == "learner"
    assert s["apex"]["actor_processes_at_this_rate"] == pytest.approx(5.0)


def test_apex_rate_out_of_reach_says_why():
    s = cluster.summarize(FIG, [4], [1], 10.0, "tcp", 1.0, 50_000.0)
    (row,) = s["apex"]["one_learner"]
    assert row["nodes_for_apex_rate"] is None and row["at_those_nodes"] is None
    assert row["why_not"] == "capped at 12800 env steps/s by learner"


def test_network_bound_with_a_tiny_link():
    """1 Mbit/s: a learner fetches 128 items × 100 B per update at 125 kB/s (plus 100 µs / 2 in flight)."""
    r = cluster.model(FIG, 2, 4, 1, 0.001)
    assert r["bottleneck"] == "network_learner"
    u = 1 / (100e-6 / 2 + 128 * 100 / 125_000)
    assert r["updates_per_s"] == pytest.approx(u)
    assert r["env_steps_per_s"] == pytest.approx(u * 128)
    assert r["network_gbps_per_learner"] <= 0.001 * (1 + 1e-9)
    # one node serving two learners: the node's link is the narrower pipe (a small network, so the
    # all-reduce over that link stays cheap)
    r = cluster.model({**FIG, "param_bytes": 1000}, 1, 4, 2, 0.001)
    assert r["bottleneck"] == "network_shard"
    assert r["env_steps_per_s"] == pytest.approx(125_000 / 100)  # N·L/(ρ·c)
    assert r["network_gbps_per_node"] == pytest.approx(0.001)


def test_shard_bound_when_ingest_is_slow():
    slow = {**FIG, "insert_steps_per_s": 500.0}
    r = cluster.model(slow, 4, 4, 1, 10.0)
    assert r["bottleneck"] == "shard"
    t_s = 1e-4 + (2e-4 - 1e-4) / 120 * (128 / 4 - 8)  # the shard's share: 32 items
    assert r["env_steps_per_s"] == pytest.approx(1 / (1 / (4 * 500) + 1.0 * 1 * t_s / 128))
    assert r["shard_busy"] == pytest.approx(1.0)


def test_tcp_is_capped_by_loopback_rdma_by_the_link():
    assert cluster.link_bytes_per_s(FIG, 100.0, "tcp") == pytest.approx(2e9)  # loopback 2 GB/s < 12.5 GB/s
    assert cluster.link_bytes_per_s(FIG, 100.0, "rdma") == pytest.approx(12.5e9)
    assert cluster.link_bytes_per_s(FIG, 10.0, "tcp") == pytest.approx(1.25e9)
    tcp, rdma = (cluster.model(FIG, 1, 1, 1, 100.0, kind) for kind in ("tcp", "rdma"))
    assert rdma["limits"]["network_learner"] > tcp["limits"]["network_learner"]
    assert rdma["limits"]["actors"] == tcp["limits"]["actors"]


def test_allreduce_reproduces_its_own_figure_at_two_learners():
    """Ring all-reduce: at K = 2 the model's time is the measured two-rank time (when the link is
    wider than the loopback reduce); more learners cost more latency steps; one costs nothing."""
    L = 1e12
    assert cluster.allreduce_s(FIG, 1, L) == 0.0
    assert cluster.allreduce_s(FIG, 2, L) == pytest.approx(1e-3)
    assert cluster.allreduce_s(FIG, 4, L) > cluster.allreduce_s(FIG, 2, L)
    # a narrow link: 2(K−1)/K·G over the link
    assert cluster.allreduce_s(FIG, 2, 1e8) == pytest.approx(1e-4 + 1e6 / 1e8)
    r = cluster.model(FIG, 32, 16, 2, 10.0)
    assert r["learner_update_s"] == pytest.approx(0.002 + 6.25e-5 * 64 + cluster.allreduce_s(FIG, 2, 1.25e9))


def test_decoupled_without_a_limiter():
    """ρ = 0 (Ape-X): the actors fill the replay, the learner learns at its own pace."""
    r = cluster.model(FIG, 8, 4, 1, 10.0, rho=0.0)
    assert r["bottleneck"] == "actors" and r["env_steps_per_s"] == pytest.approx(32_000.0)
    assert r["update_bottleneck"] == "learner" and r["updates_per_s"] == pytest.approx(100.0)
    assert r["replay_ratio"] == pytest.approx(100 * 128 / 32_000)
    slow = {**FIG, "insert_steps_per_s": 2000.0}
    r = cluster.model(slow, 8, 4, 1, 10.0, rho=0.0)
    assert r["bottleneck"] == "shard" and r["env_steps_per_s"] == pytest.approx(16_000.0)
    assert r["update_bottleneck"] == "shard" and r["updates_per_s"] == 0.0  # ingest takes all its time


def test_learner_speedup_moves_the_crossover():
    base = cluster.summarize(FIG, [1], [1], 10.0, "tcp", 1.0, 5000.0)
    fast = cluster.summarize(FIG, [1], [1], 10.0, "tcp", 1.0, 5000.0, learner_speedup=2.0)
    assert base["stops_scaling"][0]["linear_until_nodes"] == 12
    # t_l = 0.00495 s + τ: 25,346 steps/s, so 25 one-actor nodes
    assert fast["stops_scaling"][0]["linear_until_nodes"] == 25
    assert fast["learner_speedup"] == 2.0


@pytest.mark.parametrize("rho", [1.0, 0.0])
def test_monotone_and_consistent_over_a_grid(rho):
    """More nodes or more actors never lower env steps/s; X is the smallest bound; no stage runs past
    its capacity (shard busy ≤ 1, link traffic ≤ link); with a limiter U·B = ρ·X."""
    Ns, Ms = [1, 2, 3, 4, 8, 16, 32, 64, 128], [1, 2, 4, 16]
    for K, link in itertools.product([1, 2, 4], [0.01, 1.0, 10.0]):
        L = cluster.link_bytes_per_s(FIG, link, "tcp")
        for M in Ms:
            xs = [cluster.model(FIG, N, M, K, link, rho=rho)["env_steps_per_s"] for N in Ns]
            assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(xs)), (K, link, M, xs)
        for N in Ns:
            xs = [cluster.model(FIG, N, M, K, link, rho=rho)["env_steps_per_s"] for M in Ms]
            assert all(b >= a * (1 - 1e-12) for a, b in itertools.pairwise(xs)), (K, link, N, xs)
            for M in Ms:
                r = cluster.model(FIG, N, M, K, link, rho=rho)
                assert r["env_steps_per_s"] == pytest.approx(min(r["limits"].values()))
                assert r["limits"][r["bottleneck"]] == r["env_steps_per_s"]
                assert r["shard_busy"] <= 1 + 1e-9
                assert r["network_gbps_per_node"] * 1e9 / 8 <= L * (1 + 1e-9)
                assert r["network_gbps_per_learner"] * 1e9 / 8 <= L * (1 + 1e-9)
                if rho > 0:
                    assert r["updates_per_s"] * 128 == pytest.approx(rho * r["env_steps_per_s"])
                else:
                    assert r["updates_per_s"] == pytest.approx(min(r["update_limits"].values()))


def test_fit_of_two_noisy_points():
    assert cluster._fit([[128, 0.01], [32, 0.004]]) == pytest.approx((0.002, 6.25e-5))  # either order
    # measured on a loaded machine: the small batch slower than the large one → flat at the large one's time
    assert cluster._fit([[32, 0.0056], [128, 0.0033]]) == pytest.approx((0.0033, 0.0))
    # a negative intercept → through 0 and the larger point
    assert cluster._fit([[8, 1e-5], [128, 1e-3]]) == pytest.approx((0.0, 1e-3 / 128))


def test_model_refuses_what_it_cannot_split():
    with pytest.raises(GearflowError, match="must split evenly"):
        cluster.model(FIG, 1, 1, 3, 10.0)
    with pytest.raises(GearflowError, match="must be ≥ 1"):
        cluster.model(FIG, 0, 1, 1, 10.0)


# ----------------------------------------------------------------------------- the CLI


def test_cli_from_file_json_lines(fig_file, tmp_path):
    saved = tmp_path / "saved.json"
    rows = lines_of(cli("--simulate", "--from", str(fig_file), "--save", str(saved), "--json",
                        "--nodes", "1,2,16", "--actors-per-node", "1,4", "--learners", "1,2",
                        "--apex-env-steps-per-s", "5000"))  # fmt: skip
    assert [r["workload"] for r in rows] == ["figures"] + ["model"] * 12 + ["summary"]
    assert all(r["bench"] == "cluster" for r in rows)
    head, models, summary = rows[0], rows[1:-1], rows[-1]
    assert head["model"] is False and head["actor_env_steps_per_s"] == 1000.0
    assert {(r["nodes"], r["actors_per_node"], r["learners"]) for r in models} == set(
        itertools.product([1, 2, 16], [1, 4], [1, 2]))
    for r in models:
        assert r["model"] is True and r["transport"] == "tcp" and r["link_gbps"] == 10.0
        assert r["bottleneck"] in cluster.STAGES and set(r["limits"]) == set(cluster.STAGES)
        assert_same(r, cluster.model(FIG, r["nodes"], r["actors_per_node"], r["learners"], 10.0))
    assert summary["model"] is True and summary["figures"] == FIG
    assert {(s["actors_per_node"], s["learners"]) for s in summary["stops_scaling"]} == {(1, 1), (1, 2), (4, 1), (4, 2)}
    assert json.loads(saved.read_text()) == FIG
    # --samples-per-insert overrides the figure's ρ; --transport-kind rdma defaults to 100 Gbit/s
    rows = lines_of(cli("--simulate", "--from", str(fig_file), "--json", "--nodes", "4", "--actors-per-node", "4",
                        "--learners", "1", "--samples-per-insert", "0", "--transport-kind", "rdma"))  # fmt: skip
    (r,) = rows[1:-1]
    assert r["samples_per_insert"] == 0.0 and r["link_gbps"] == 100.0 and r["transport"] == "rdma"
    assert "replay_ratio" in r and r["bottleneck"] == "actors"


def test_cli_table_goes_to_stderr(fig_file):
    proc = cli("--simulate", "--from", str(fig_file), "--nodes", "1,13", "--actors-per-node", "1", "--learners", "1")
    rows = lines_of(proc)  # stdout stays JSON lines without --json
    assert len(rows) == 4
    table = proc.stderr.splitlines()
    table = table[[line.split()[:3] for line in table].index(["N", "M", "K"]):]
    assert table[1].split()[-1] == "actors" and table[2].split()[-1] == "learner"


@pytest.mark.parametrize("args, message", [
    ((), "only --simulate exists"),
    (("--simulate", "--from", "/nonexistent/figs.json"), "--from /nonexistent/figs.json: no such file"),
    (("--simulate", "--nodes", "1,x"), "--nodes '1,x': expected comma-separated integers"),
    (("--simulate", "--learners", "0"), "--learners '0': expected integers ≥ 1"),
])  # fmt: skip
def test_cli_errors(args, message):
    proc = cli(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_cli_errors_on_figures(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({k: v for k, v in FIG.items() if k != "learn_s"}))
    proc = cli("--simulate", "--from", str(bad))
    assert proc.returncode == 2 and "missing figure(s) learn_s" in proc.stderr
    bad.write_text(json.dumps({**FIG, "learn_s": [[128, 0.01]]}))
    proc = cli("--simulate", "--from", str(bad))
    assert proc.returncode == 2 and "learn_s must be two [size, seconds] pairs" in proc.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps(FIG))
    proc = cli("--simulate", "--from", str(good), "--learners", "3")
    assert proc.returncode == 2 and "the global batch 128 does not split evenly among [3]" in proc.stderr


@pytest.mark.slow
def test_cli_quick_measurement(tmp_path):
    """A real (short) measurement of cartpole_apex: every figure measured and positive, the model
    lines built from them."""
    saved = tmp_path / "figs.json"
    proc = cli("--simulate", "--quick", "--json", "--save", str(saved), "--nodes", "1,8", "--actors-per-node", "2",
               "--learners", "1,2", timeout=180)  # fmt: skip
    rows = lines_of(proc)
    assert [r["workload"] for r in rows] == ["figures", "model", "model", "model", "model", "summary"]
    fig = json.loads(saved.read_text())
    assert rows[0] == {"bench": "cluster", "workload": "figures", "model": False, **fig}
    assert fig["env"] == "CartPole-v1" and fig["batch_size"] == 128 and fig["samples_per_insert"] == 8.0
    for key in ("actor_env_steps_per_s", "insert_steps_per_s", "transport_write_steps_per_s",
                "transport_sample_batches_per_s", "transport_request_latency_us", "transport_loopback_bytes_per_s",
                "learner_loop_updates_per_s", "learner_loop_cpu_s"):
        assert math.isfinite(fig[key]) and fig[key] > 0, key  # fmt: skip
    assert fig["item_bytes"] == 4 * 4 * 2 + 8 + 4 + 4 + 8 + 8 + 4 + 8  # obs, next_obs, action, ret, disc, version; key, weight, prob
    for key in ("shard_sample_s", "learn_s", "allreduce_s"):
        assert len(fig[key]) == 2 and all(t > 0 for _, t in fig[key]), key
    assert fig["param_bytes"] > 0 and fig["allreduce_s"][1][0] == fig["param_bytes"]
    for r in rows[1:-1]:
        assert_same(r, cluster.model(fig, r["nodes"], r["actors_per_node"], r["learners"], 10.0))
    assert rows[-1]["figures"] == fig


def test_link_round_trip_overlaps_the_learn_step_and_is_paid_per_request_in_flight():
    """The priority write-back does not wait (its reply is read before the next round's split):
    its round trip τ + R overlaps the next learn step, so the learner's update takes the longer of
    the two — R = 10 ms: τ + R = 10.1 ms > 10 ms learn → 99 updates/s; R = 5 ms: the learn step
    → 100 updates/s, as with no link at all. The samples pay (τ + R) per request with 2 in flight."""
    r = cluster.model(FIG, 20, 1, 1, 10.0, link_rtt_ms=10.0)
    assert r["bottleneck"] == "learner" and r["round_trip_s"] == pytest.approx(1e-4 + 0.01)
    assert r["updates_per_s"] == pytest.approx(1 / (1e-4 + 0.01))
    assert r["env_steps_per_s"] == pytest.approx(128 * r["updates_per_s"])  # ρ = 1
    assert r["limits"]["network_learner"] == pytest.approx(128 / ((1e-4 + 0.01) / 2 + 128 * 100 / 1.25e9))
    assert cluster.model(FIG, 20, 1, 1, 10.0, link_rtt_ms=5.0)["updates_per_s"] == pytest.approx(100.0)
    assert cluster.model(FIG, 20, 1, 1, 10.0)["updates_per_s"] == pytest.approx(100.0)  # R = 0


def test_shared_cores_bound_the_cluster():
    """C = 2 cores for 2 nodes × 4 actors + their shards + the learner: each env step costs
    1/a + 1/I core-seconds, each update c_u (the learn step, and per node its sample plus a
    sample and a priority request of τ each): X·(1/a + 1/I) + (ρX/B)·c_u = C."""
    t_s = 1e-4 + (2e-4 - 1e-4) / 120 * (64 - 8)  # each node's share: 64 items
    c_u = 0.01 + 2 * (t_s + 2 * 1e-4)
    assert cluster.cpu_s_per_update(FIG, 2, 1) == pytest.approx(c_u)
    r = cluster.model(FIG, 2, 4, 1, 10.0, cores=2.0)
    X = 2.0 / (1 / 1000 + 1 / 1e6 + c_u / 128)
    assert r["bottleneck"] == "cpu" and r["env_steps_per_s"] == pytest.approx(X)
    assert r["cpu_cores_used"] == pytest.approx(2.0)
    assert "cpu" not in cluster.model(FIG, 2, 4, 1, 10.0)["limits"]  # no --cores: a core per process
    # a measured RemoteSampler rate S: the learner's side of each draw costs 1/S, and caps its fetches
    drawn = {**FIG, "transport_sample_batches_per_s": 50.0}
    assert cluster.cpu_s_per_update(drawn, 2, 1) == pytest.approx(c_u + 1 / 50)
    assert cluster.model(drawn, 2, 4, 1, 10.0)["limits"]["network_learner"] == pytest.approx(50 * 128)
    free = cluster.model(FIG, 2, 4, 1, 10.0, cores=64.0)  # enough cores: the other bounds again
    assert free["bottleneck"] == "actors" and free["env_steps_per_s"] == pytest.approx(8000.0)
    # ρ = 0: the actors and shards get 10 of the 11 processes' share, the updates what is left
    r = cluster.model(FIG, 2, 4, 1, 10.0, rho=0.0, cores=2.0)
    assert r["bottleneck"] == "cpu" and r["env_steps_per_s"] == pytest.approx(2.0 * 10 / 11 / (1 / 1000 + 1 / 1e6))
    assert r["update_bottleneck"] == "cpu"
    assert r["updates_per_s"] == pytest.approx((2.0 - r["env_steps_per_s"] * (1 / 1000 + 1 / 1e6)) / c_u)


def test_the_learner_loops_own_cost_is_charged_beside_its_learn_step():
    """Measured learner-loop figures (gearflow's Prefetcher + learn_step over a shard on loopback):
    the loop's wall time beyond the learn step at B lengthens each update, its CPU beyond it is
    charged to the cores in place of 1/S; figures without them model as before."""
    looped = {**FIG, "transport_sample_batches_per_s": 50.0, "learner_loop_updates_per_s": 50.0,
              "learner_loop_cpu_s": 0.03}  # fmt: skip
    assert cluster.loop_overhead(looped) == pytest.approx((0.02 - 0.01, 0.03 - 0.01))
    assert cluster.loop_overhead({**FIG, "transport_sample_batches_per_s": 50.0}) == (0.0, 1 / 50)
    t_s = 1e-4 + (2e-4 - 1e-4) / 120 * (64 - 8)
    assert cluster.cpu_s_per_update(looped, 2, 1) == pytest.approx(0.03 + 2 * (t_s + 2 * 1e-4))
    r = cluster.model(looped, 2, 4, 1, 10.0, rho=0.0)  # the learner: learn step + the loop's rest
    assert r["update_limits"]["learner"] == pytest.approx(1 / 0.02)
    assert cluster.model(FIG, 2, 4, 1, 10.0, rho=0.0)["update_limits"]["learner"] == pytest.approx(1 / 0.01)


def test_cli_takes_the_round_trip_and_cores(fig_file):
    proc = cli("--simulate", "--from", str(fig_file), "--nodes", "2", "--actors-per-node", "4",
               "--learners", "1", "--link-rtt-ms", "10", "--cores", "2", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (row,) = [json.loads(line) for line in proc.stdout.splitlines() if '"workload": "model"' in line]
    assert row["link_rtt_ms"] == 10.0 and row["cores"] == 2.0 and "cpu" in row["limits"]
    bad = cli("--simulate", "--from", str(fig_file), "--link-rtt-ms", "-1")
    assert bad.returncode != 0 and "--link-rtt-ms -1.0" in bad.stderr
