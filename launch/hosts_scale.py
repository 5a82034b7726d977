"""The scale model (``gearflow bench cluster``) against a real sharded run on emulated hosts.

Two ``gearflow serve`` nodes (one actor each) and a learner on three emulated hosts
(launch/hosts.py) train a config for ``--seconds`` per link setting; the learner's steady rate
(updates/s and env steps/s over the second half of its progress lines) is set beside
``cluster.model(figures, N=2, M=1, K=1, link, link_rtt_ms=<measured TCP round trip>,
cores=os.cpu_count())``. One JSON line per setting, then a markdown table on stderr::

    gearflow bench cluster --simulate --quick --config configs/cartpole_apex.yaml --save figs.json
    python launch/hosts_scale.py --figures figs.json --settings 0:0,200:2 --subnet 10.231.1.0/24

A setting is ``RATE_MBIT:DELAY_MS`` (0: unshaped / no relay): the rate is ``tc tbf`` on every
host's link, the delay a relay on the learner's host in front of each node (its measured round
trip, relay and link, is what the model is given). Needs root (launch/hosts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gearflow.bench import cluster
from launch.hosts import Hosts, rtt

PORT = 7000
TICK = os.sysconf("SC_CLK_TCK")
PROGRESS = re.compile(r"progress: steps (\d+) \S+ updates (\d+) ")


def _env() -> dict:
    return {**os.environ, "GEARFLOW_TOKEN": "hosts-scale-secret-0123",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip


def _run_gearflow(host, command: str, config: str, log: Path, *args: str) -> subprocess.Popen:
    return host.popen([sys.executable, "-m", "gearflow", command, config, *args], stdout=subprocess.PIPE,
                      stderr=open(log, "w"), text=True, cwd=ROOT, env=_env())  # fmt: skip


def cpu_seconds(hosts) -> float:
    """CPU seconds (user + system) used so far by every process on the hosts."""
    total = 0
    for host in hosts:
        for pid in host.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / TICK


def machine_cpu_seconds() -> float:
    """CPU seconds every process of this machine used so far (/proc/stat: all but idle and iowait)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


def run_setting(config: str, rate_mbit: float, delay_ms: float, seconds: float, subnet: str, name: str,
                out_dir: Path, cores: float) -> dict:  # fmt: skip
    """One sharded run on three fresh hosts; the learner's steady rates and the link's round trip."""
    shutil.rmtree(out_dir, ignore_errors=True)  # this script's own folder from an earlier run
    out_dir.mkdir(parents=True)
    with Hosts(3, subnet=subnet, name=name, rate_mbit=rate_mbit or None) as hosts:
        link = rtt(hosts, 2, 0, delay_ms=delay_ms, rounds=200)
        nodes = [_run_gearflow(hosts[i], "serve", config, out_dir / f"n{i}.err", "actor.num_actors=1",
                           f"actor.ladder_offset={i}", "actor.ladder_total=2", f"run.dir={out_dir / f'n{i}'}",
                           f"transport.host={hosts[i].address}", f"transport.port={PORT}")
                 for i in range(2)]  # fmt: skip
        addresses = [json.loads(n.stdout.readline())["serving"] for n in nodes]
        targets = [hosts.relay(2, a, delay_ms) if delay_ms > 0 else a for a in addresses]
        learner = hosts[2].popen([sys.executable, "-m", "gearflow", "train", config, f"run.dir={out_dir / 'learner'}",
                                  "run.progress=log", "run.log_every_s=1", f"run.max_seconds={seconds}", "run.stop_at_return=1000000",
                                  f"transport.shards=[{','.join(targets)}]"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())  # fmt: skip
        rows: list[tuple] = []  # (arrival, env steps, updates, the cluster's CPU s, the machine's CPU s)
        with open(out_dir / "learner.err", "w") as log:
            for line in learner.stderr:
                log.write(line)
                if m := PROGRESS.search(line):
                    rows.append((time.monotonic(), int(m[1]), int(m[2]), cpu_seconds(hosts), machine_cpu_seconds()))
        summary = json.loads(learner.stdout.read().strip().splitlines()[-1])
        learner.wait()
        for n in nodes:
            n.wait(timeout=120)
    live = [r for r in rows if r[2] > 0]
    half = live[len(live) // 2 :]
    (t0, x0, u0, c0, m0), (t1, x1, u1, c1, m1) = half[0], half[-1]
    others = max(0.0, (m1 - m0) - (c1 - c0)) / (t1 - t0)  # cores other jobs on this machine took
    return {"rate_mbit": rate_mbit, "delay_ms": delay_ms, "rtt_ms": link["rtt_ms_median"],
            "cluster_cores_used": (c1 - c0) / (t1 - t0), "cores_left_by_others": max(0.05, cores - others),
            "updates_per_s": (u1 - u0) / (t1 - t0), "env_steps_per_s": (x1 - x0) / (t1 - t0),
            "window_s": t1 - t0, "learner_rc": learner.returncode, "node_rcs": [n.returncode for n in nodes],
            "stop_reason": summary.get("stop_reason"), "updates": summary.get("learner/updates")}  # fmt: skip


def predict(fig: dict, rate_mbit: float, rtt_ms: float, cores: float) -> dict:
    link_gbps = rate_mbit / 1000 if rate_mbit else cluster.LINK_GBPS["tcp"]
    with_all = cluster.model(fig, 2, 1, 1, link_gbps, "tcp", link_rtt_ms=rtt_ms, cores=cores)
    before = cluster.model(fig, 2, 1, 1, link_gbps, "tcp")  # the model as it was: no RTT term, a core each
    return {"predicted_updates_per_s": with_all["updates_per_s"], "predicted_env_steps_per_s": with_all["env_steps_per_s"],
            "bottleneck": with_all["bottleneck"], "limits": with_all["limits"],
            "old_model_updates_per_s": before["updates_per_s"], "old_bottleneck": before["bottleneck"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--figures", required=True, help="figures JSON from gearflow bench cluster --simulate --save")
    p.add_argument("--config", default=str(ROOT / "configs" / "cartpole_apex.yaml"))
    p.add_argument("--settings", default="0:0,200:2", help="RATE_MBIT:DELAY_MS,... (0: unshaped / none)")
    p.add_argument("--rounds", type=int, default=1, help="runs per setting, alternating the settings")
    p.add_argument("--seconds", type=float, default=45.0, help="each run's run.max_seconds")
    p.add_argument("--subnet", default="10.231.0.0/24")
    p.add_argument("--name", default="gfs")
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 1))
    p.add_argument("--out", default="/tmp/gearflow-hosts-scale")
    p.add_argument("--rescore", default="", help="no runs: predict again for the measured lines of this file "
                   "(this script's stdout) with the model as it is now")  # fmt: skip
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hosts come down on the way out
    fig = cluster.load_figures(args.figures)
    settings = [tuple(float(v) for v in s.split(":")) for s in args.settings.split(",")]
    results = []
    measured = [json.loads(line) for line in Path(args.rescore).read_text().splitlines()] if args.rescore else None
    runs = measured or [(r, rate, delay) for r in range(args.rounds) for rate, delay in settings]
    for run in runs:
        if measured is None:
            r, rate, delay = run
            got = run_setting(args.config, rate, delay, args.seconds, args.subnet, args.name,
                              Path(args.out) / f"r{r}-{rate:g}-{delay:g}", args.cores)  # fmt: skip
        else:
            got, rate = dict(run), run["rate_mbit"]
        got.update(predict(fig, rate, got["rtt_ms"], args.cores))
        got["ratio"] = got["predicted_updates_per_s"] / got["updates_per_s"]
        # the machine is shared with other jobs: the cores they left the cluster
        got_cores = predict(fig, rate, got["rtt_ms"], got.get("cores_left_by_others", got["cluster_cores_used"]))
        got["predicted_updates_per_s_at_cores_got"] = got_cores["predicted_updates_per_s"]
        got["bottleneck_at_cores_got"] = got_cores["bottleneck"]
        got["ratio_at_cores_got"] = got_cores["predicted_updates_per_s"] / got["updates_per_s"]
        print(json.dumps(got), flush=True)
        results.append(got)
    print(f"| link | RTT (measured) | env steps/s | updates/s measured | cores the cluster got / other jobs left it "
          f"| predicted at the cores left (ratio, bottleneck) | predicted at {args.cores:g} cores (ratio, bottleneck) | old model |\n"
          "|---|---|---|---|---|---|---|---|", file=sys.stderr)  # fmt: skip
    for g in results:
        link = f"{g['rate_mbit']:g} Mbit/s" if g["rate_mbit"] else "unshaped"
        print(f"| {link} | {g['rtt_ms']:.2f} ms | {g['env_steps_per_s']:.0f} | {g['updates_per_s']:.1f} | "
              f"{g['cluster_cores_used']:.2f} / {g.get('cores_left_by_others', float('nan')):.2f} | "
              f"{g['predicted_updates_per_s_at_cores_got']:.1f} "
              f"({g['ratio_at_cores_got']:.2f}, {g['bottleneck_at_cores_got']}) | {g['predicted_updates_per_s']:.1f} "
              f"({g['ratio']:.2f}, {g['bottleneck']}) | {g['old_model_updates_per_s']:.0f} ({g['old_bottleneck']}) |",
              file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
