"""``gearflow bench cluster --simulate``: a scale model of N nodes × M actors × K learners, built
from figures measured on this machine (or read from a file), that names the bottleneck at each size.

    gearflow bench cluster --simulate --config configs/pong_apex.yaml          # measure (~1-2 min), then model
    gearflow bench cluster --simulate --save figs.json --quick                  # a short measurement, kept
    gearflow bench cluster --simulate --from figs.json --link-gbps 25 --learners 1,2,4,8

It is a **model**, not a multi-node run: every modelled line says ``"model": true`` and the
summary carries the figures it came from. Each line is one JSON object: first the figures
(``"workload": "figures"``), then one line per ``(N, M, K)`` of the grid (``"workload": "model"``),
then ``"workload": "summary"``.

**Measured**: the figures below (``cluster_figures.py``: ``measure``; ``--quick`` shortens
every timing): one actor's env steps/s (a), a shard's insert rate (I), its sample time, a learn
step, a gloo all-reduce, the TCP shard service on loopback and the bytes of one item (c).

**Model** (``model()``; X = env steps/s of the cluster, U = global updates/s, one update = each
of the K learners learning ``b = B/K`` items and all-reducing gradients; ``ρ`` =
``replay.samples_per_insert``; ``L`` = the link in bytes/s, for ``tcp`` ``min(link,
transport_loopback_bytes_per_s)`` — one shard process cannot serve faster than it does on loopback):

* linear fits from the two-point figures: ``t_s(n) = s0 + s1·n`` (a shard's sample of n items),
  ``t_l(b) = l0 + l1·b`` (one learn step), ``t_ar(K) = 2(K−1)·α + 2(K−1)/K · G/min(L, β)`` (ring
  all-reduce of G gradient bytes; α, β from the two all-reduce figures; ``t_ar(1) = 0``);
* **actors**: ``X ≤ N·M·a`` (a node runs M actor processes at this machine's per-actor rate);
* **shard** (one process per node ingests its X/N steps and serves K·U requests of ``B/(K·N)``
  items): ``X/(N·I) + K·U·t_s(B/(K·N)) ≤ 1``;
* **network_shard** (a node sends what is sampled from it): ``U·B·c/N ≤ L``;
* **network_learner** (a learner fetches b items per update, ``p`` = ``learner.prefetch``
  requests in flight, τ = ``transport_request_latency_us``, R = ``--link-rtt-ms``):
  ``U ≤ 1 / ((τ + R)/p + b·c/L)``;
* **learner**: ``U ≤ 1 / max(t_l(b) + t_ar(K) + o, τ + R)``: after each learn step the learner
  writes the batch's priorities back without waiting (``RemoteSampler.update_priorities``);
  the next round is split once the reply is in, in the prefetching thread, so the round trip
  overlaps the next learn step and bounds the rate only where it is the longer of the two.
  ``o`` is what the learner's loop costs besides the learn step (``loop_overhead``: the batch's
  assembly, the write-back, publishing, the prefetch thread's share of the interpreter), from
  ``learner_loop_updates_per_s``: gearflow's own ``Prefetcher`` + ``Learner.learn_step`` over a
  shard on loopback, less ``t_l(B)``;
* **cpu** (only with ``--cores C``: every process shares C cores, e.g. an emulated cluster on one
  machine): ``X·(1/a + 1/I) + U·c_u ≤ C``, with ``c_u = K·(t_l(b) + o_cpu) + N·K·(t_s + 2τ)``
  the core-seconds of one update (learn steps, the rest of each learner loop's CPU, ``o_cpu`` =
  ``learner_loop_cpu_s − t_l(B)``, the shards' samples, a sample and a priority request per
  node and learner, τ of CPU each). Figures from before the loop was measured use ``o = 0`` and
  ``o_cpu = 1/S`` (the learner's side of one draw, S = ``transport_sample_batches_per_s``), which
  priced a loaded update at less than half its cost. Where the figures have S, ``network_learner`` is also
  capped at S (what one ``RemoteSampler`` drew on loopback, ``prefetch`` ahead). With ρ = 0 the actors and shards get their processes'
  share ``C·N(M+1)/(N(M+1)+K)`` and the updates what they leave.

With ``ρ > 0`` (Reverb's samples-per-insert limiter) the rates are tied, ``U·B = ρ·X``: each
stage's bound becomes a bound on X, X is the smallest, and that stage is the ``bottleneck``.
With ``ρ = 0`` (Ape-X: no limiter) actors and learners run apart: ``X = min(N·M·a, N·I)``
(actors or shard), and the learners take ``U`` = the smallest of their bounds, the shard's
being the time its ingest leaves, ``K·U·t_s ≤ 1 − X/(N·I)`` (``update_bottleneck``; the replay
ratio ``U·B/X`` is then an output).

``--learner-speedup F`` divides the learn step only: the all-reduce figure stays this machine's
gloo-on-loopback one (NCCL between GPUs is far faster; put your own in ``allreduce_s``).

What it leaves out, on purpose: weights to actors (a parameter fetch per
``actor.weight_sync_period`` steps), the priority updates' bytes (16 B per sampled item; their
round trip is in, overlapped), switch contention, stragglers. Without ``--cores`` a node is assumed to have
a core per actor and one for its shard; the per-actor rate is this machine's per-core rate.

Checked against real sharded runs on emulated hosts (``launch/hosts_scale.py``: two
``gearflow serve`` nodes and a learner in network namespaces, links shaped with ``tc tbf`` and
a delaying relay, the measured round trip given as ``--link-rtt-ms``, ``--cores`` = this
machine's): the table is in the README (cluster section).

**Ape-X** ran 360 actors feeding one learner: about 50 k Atari frames/s, i.e. 12.5 k env steps/s
at frame skip 4 (Horgan et al. 2018; ``--apex-env-steps-per-s``). The summary says how many
nodes bring that many env steps/s to one learner (K = 1) for each M, and what one learner here
does with them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gearflow.errors import GearflowError

Emit = Callable[[dict], None]
STAGES = ("actors", "shard", "network_shard", "network_learner", "learner")  # and "cpu" with --cores
LINK_GBPS = {"tcp": 10.0, "rdma": 100.0}
APEX_ACTORS = 360
APEX_ENV_STEPS_PER_S = 12_500.0  # 360 actors, ~50k Atari frames/s at frame skip 4 (Horgan et al. 2018)
SEARCH_NODES = 4096  # where the summary stops looking for a crossover
FIGURE_KEYS = (
    "actor_env_steps_per_s", "insert_steps_per_s", "shard_sample_s", "learn_s", "allreduce_s", "param_bytes",
    "item_bytes", "batch_size", "samples_per_insert", "prefetch", "transport_request_latency_us",
    "transport_loopback_bytes_per_s",
)  # fmt: skip  # what model() needs; a --from file must have each


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster suite's options (``gearflow bench cluster ...``)."""
    g = parser.add_argument_group("cluster (gearflow bench cluster --simulate)")
    g.add_argument("--simulate", action="store_true", help="cluster: model N nodes × M actors × K learners "
                   "from measured figures (the only mode: a real multi-node run is gearflow train launcher=ray)")  # fmt: skip
    g.add_argument("--quick", action="store_true", help="cluster: a short measurement (~10-30 s; for tests)")
    g.add_argument("--from", dest="from_file", default="", help="cluster: read the figures from this JSON file "
                   "(written by --save, or by hand for other machines) instead of measuring")  # fmt: skip
    g.add_argument("--save", default="", help="cluster: write the figures used to this JSON file")
    g.add_argument("--nodes", default="1,2,4,8,16,32", help="cluster: shard nodes N to model (comma-separated)")
    g.add_argument("--actors-per-node", default="4,16", help="cluster: actor processes per node M")
    g.add_argument("--learners", default="1,2,4", help="cluster: data-parallel learners K")
    g.add_argument("--transport-kind", choices=sorted(LINK_GBPS), default="tcp",
                   help="cluster: tcp (capped by the measured loopback byte rate too) or rdma")  # fmt: skip
    g.add_argument("--link-gbps", type=float, default=0.0, help="cluster: each machine's link in Gbit/s "
                   "(default 10 for tcp, 100 for rdma)")  # fmt: skip
    g.add_argument("--link-rtt-ms", type=float, default=0.0, help="cluster: the links' round trip in ms, "
                   "paid once per update (the priority write-back waits for every shard) and per sample request "
                   "(learner.prefetch in flight); 0: the loopback figure only")  # fmt: skip
    g.add_argument("--cores", type=float, default=0.0, help="cluster: cores every process of the cluster shares "
                   "(an emulated cluster on one machine: os.cpu_count()); 0: a core per process")  # fmt: skip
    g.add_argument("--samples-per-insert", type=float, default=-1.0,
                   help="cluster: ρ (default: the config's replay.samples_per_insert; 0 = no limiter)")  # fmt: skip
    g.add_argument("--learner-speedup", type=float, default=1.0,
                   help="cluster: what-if: a learn step this many times faster than the figure (e.g. a GPU)")  # fmt: skip
    g.add_argument("--apex-env-steps-per-s", type=float, default=APEX_ENV_STEPS_PER_S,
                   help="cluster: the data rate of Ape-X's 360 actors, env steps/s")  # fmt: skip


# ----------------------------------------------------------------------------- the model


def _fit(pairs) -> tuple[float, float]:
    """``(t0, t1)`` of ``t(x) = t0 + t1·x`` through two ``(x, t)`` points, both ≥ 0. Noise can make a
    measured slope or intercept negative: a negative slope becomes flat at the larger size's time, a
    negative intercept a line from 0 through the larger size's point."""
    (x1, y1), (x2, y2) = sorted((float(x), float(y)) for x, y in pairs)
    slope = (y2 - y1) / (x2 - x1) if x2 > x1 else 0.0
    t0 = y1 - slope * x1
    if slope < 0 or t0 < 0:
        return (y2, 0.0) if slope < 0 else (0.0, y2 / x2)
    return t0, slope


def link_bytes_per_s(fig: dict, link_gbps: float, kind: str) -> float:
    """L: the link's bytes/s; over TCP also capped by what one shard process served on loopback."""
    link = link_gbps * 1e9 / 8
    return min(link, float(fig["transport_loopback_bytes_per_s"])) if kind == "tcp" else link


def allreduce_s(fig: dict, K: int, L: float) -> float:
    """t_ar(K): ring all-reduce of the gradient bytes G among K learners, ``2(K−1)`` latency steps of α
    and ``2(K−1)/K · G`` bytes each way at ``min(L, β)`` (α, β: the two-rank loopback figures)."""
    if K <= 1:
        return 0.0
    (_, t_small), (G, t_G) = sorted(fig["allreduce_s"])
    alpha = max(float(t_small), 1e-9) / 2  # two ranks: 2 ring steps
    beta = G / max(float(t_G) - float(t_small), 1e-9)  # bytes/s of the loopback reduce
    return 2 * (K - 1) * alpha + 2 * (K - 1) / K * float(fig["param_bytes"]) / min(L, beta)


def loop_overhead(fig: dict) -> tuple[float, float]:
    """(seconds, core-seconds) one learner process spends per update besides its learn step: from
    ``learner_loop_updates_per_s`` and ``learner_loop_cpu_s`` (gearflow's learner loop over a
    shard on loopback) less the learn step at B. Figures without them: (0, the learner's side of
    one draw, 1 / ``transport_sample_batches_per_s``) as before they were measured. The loop is
    measured with a CPU agent: for a GPU learner (``learn_s`` from the device) the difference
    overstates the overhead; edit the two figures with your learner machine's loop."""
    l0, l1 = _fit(fig["learn_s"])
    t_learn = l0 + l1 * float(fig["batch_size"])
    if fig.get("learner_loop_updates_per_s") and fig.get("learner_loop_cpu_s"):
        return (max(0.0, 1.0 / float(fig["learner_loop_updates_per_s"]) - t_learn),
                max(0.0, float(fig["learner_loop_cpu_s"]) - t_learn))  # fmt: skip
    draw = 1.0 / float(fig["transport_sample_batches_per_s"]) if fig.get("transport_sample_batches_per_s") else 0.0
    return 0.0, draw


def cpu_s_per_update(fig: dict, N: int, K: int) -> float:
    """c_u: core-seconds one global update costs the cluster: K learn steps with their loops'
    own cost (:func:`loop_overhead`), and per learner and node one sample of ``B/(K·N)`` items and
    two requests (its sample and its priority update, τ each: a loopback request's latency is the
    CPU of its two ends)."""
    B = int(fig["batch_size"])
    l0, l1 = _fit(fig["learn_s"])
    s0, s1 = _fit(fig["shard_sample_s"])
    tau = float(fig["transport_request_latency_us"]) * 1e-6
    return K * (l0 + l1 * B / K + loop_overhead(fig)[1]) + N * K * (s0 + s1 * B / (K * N) + 2 * tau)


def model(fig: dict, N: int, M: int, K: int, link_gbps: float, kind: str = "tcp", rho: float | None = None,
          learner_speedup: float = 1.0, link_rtt_ms: float = 0.0, cores: float = 0.0) -> dict:  # fmt: skip
    """The modelled throughput of N nodes × M actors × K learners (formulas in the module docstring).

    ``limits`` holds each stage's bound in env steps/s (ρ > 0); with ρ = 0, ``limits`` bounds X
    (actors, shard) and ``update_limits`` bounds U in updates/s. ``learner_speedup`` divides the
    measured learn step (a what-if: a learner that many times faster, e.g. on a GPU).
    ``link_rtt_ms``: the links' round trip, one per update by the priority write-back (overlapping
    the next learn step) and per request by the samples (``p`` in flight). ``cores`` > 0: every process of the cluster
    shares that many cores (an emulated cluster on one machine), the ``cpu`` stage."""
    if min(N, M, K) < 1:
        raise GearflowError(f"nodes, actors per node and learners must be ≥ 1, got N={N}, M={M}, K={K}")
    B = int(fig["batch_size"])
    if B % K:
        raise GearflowError(f"learners={K}: the global batch learner.batch_size={B} must split evenly among them")
    rho = float(fig["samples_per_insert"] if rho is None else rho)
    a, I_, c = float(fig["actor_env_steps_per_s"]), float(fig["insert_steps_per_s"]), float(fig["item_bytes"])
    s0, s1 = _fit(fig["shard_sample_s"])
    l0, l1 = _fit(fig["learn_s"])
    L = link_bytes_per_s(fig, link_gbps, kind)
    tau, p = float(fig["transport_request_latency_us"]) * 1e-6, max(1, int(fig["prefetch"]))
    rtt = max(0.0, float(link_rtt_ms)) * 1e-3
    b = B / K
    t_s = s0 + s1 * B / (K * N)  # a shard's share of one learner's request
    t_round_trip = tau + rtt  # the priority write-back: its reply is read before the next round's split
    t_update = max((l0 + l1 * b) / learner_speedup + allreduce_s(fig, K, L) + loop_overhead(fig)[0],
                   t_round_trip)  # the write-back's round trip overlaps the next learn step
    u_net_learner = 1.0 / ((tau + rtt) / p + b * c / L)
    if fig.get("transport_sample_batches_per_s"):  # measured: what one RemoteSampler draws on loopback
        u_net_learner = min(u_net_learner, float(fig["transport_sample_batches_per_s"]))
    u_learner = 1.0 / t_update
    env_cpu = 1.0 / a + 1.0 / I_  # core-seconds of one env step: acting, then the shard's ingest
    c_u = cpu_s_per_update(fig, N, K) - K * (l0 + l1 * b) * (1 - 1 / learner_speedup)
    out: dict[str, Any] = {"bench": "cluster", "workload": "model", "model": True, "nodes": N, "actors_per_node": M,
                           "learners": K, "transport": kind, "link_gbps": link_gbps, "link_rtt_ms": float(link_rtt_ms),
                           "cores": float(cores), "samples_per_insert": rho, "learner_speedup": learner_speedup}  # fmt: skip
    if rho > 0:
        limits = {
            "actors": N * M * a,
            "shard": 1.0 / (1.0 / (N * I_) + rho * K * t_s / B),
            "network_shard": N * L / (rho * c),
            "network_learner": B * u_net_learner / rho,
            "learner": B * u_learner / rho,
        }
        if cores > 0:  # X·(1/a + 1/I) + U·c_u ≤ C with U = ρX/B
            limits["cpu"] = cores / (env_cpu + rho * c_u / B)
        bottleneck = min(limits, key=limits.get)
        X = limits[bottleneck]
        U = rho * X / B
        out.update(env_steps_per_s=X, updates_per_s=U, bottleneck=bottleneck, update_bottleneck=bottleneck,
                   limits=limits)  # fmt: skip
    else:
        limits = {"actors": N * M * a, "shard": N * I_}
        if cores > 0:  # the actors and shards get their processes' share of the cores
            limits["cpu"] = cores * N * (M + 1) / (N * (M + 1) + K) / env_cpu
        bottleneck = min(limits, key=limits.get)
        X = limits[bottleneck]
        left = max(0.0, 1.0 - X / (N * I_))  # the shard's time its ingest leaves
        update_limits = {
            "shard": left / (K * t_s) if left > 0 else 0.0,
            "network_shard": N * L / (B * c),
            "network_learner": u_net_learner,
            "learner": u_learner,
        }
        if cores > 0:  # what the env steps leave of the cores
            update_limits["cpu"] = max(0.0, cores - X * env_cpu) / c_u
        update_bottleneck = min(update_limits, key=update_limits.get)
        U = update_limits[update_bottleneck]
        out.update(env_steps_per_s=X, updates_per_s=U, bottleneck=bottleneck, update_bottleneck=update_bottleneck,
                   limits=limits, update_limits=update_limits, replay_ratio=U * B / X if X > 0 else None)  # fmt: skip
    out.update(
        samples_per_s=U * B,
        network_gbps_per_node=U * B * c / N * 8 / 1e9,
        network_gbps_per_learner=U * b * c * 8 / 1e9,
        shard_busy=X / (N * I_) + K * U * t_s,
        learner_update_s=t_update,
        allreduce_s=allreduce_s(fig, K, L),
        round_trip_s=t_round_trip,
        cpu_cores_used=X * env_cpu + U * c_u,
    )
    return out


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise GearflowError(f"--{what} {text!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise GearflowError(f"--{what} {text!r}: expected integers ≥ 1")
    return sorted(set(values))


def summarize(fig: dict, Ms: list[int], Ks: list[int], link_gbps: float, kind: str, rho: float,
              apex_rate: float, learner_speedup: float = 1.0, link_rtt_ms: float = 0.0, cores: float = 0.0) -> dict:  # fmt: skip
    """Where scaling stops for each (M, K): the last N (≤ 4096) at which the actors are still the
    bottleneck (below it env steps/s grow with N), the stage that takes over, and the ceiling;
    and the nodes that bring Ape-X's data rate (``apex_rate`` env steps/s) to one learner."""
    B = int(fig["batch_size"])
    stops, apex = [], []
    for M in Ms:
        for K in Ks:
            if B % K:
                continue
            rows = [model(fig, N, M, K, link_gbps, kind, rho, learner_speedup, link_rtt_ms, cores)
                    for N in range(1, SEARCH_NODES + 1)]  # fmt: skip
            actor_bound = [r["nodes"] for r in rows if r["bottleneck"] == "actors"]
            last = max(actor_bound) if actor_bound else 0
            after = rows[last] if last < SEARCH_NODES else None  # N = last + 1
            top = max(rows, key=lambda r: r["env_steps_per_s"])
            stops.append({"actors_per_node": M, "learners": K, "linear_until_nodes": last,
                          "then_bottleneck": None if after is None else after["bottleneck"],
                          "max_env_steps_per_s": top["env_steps_per_s"], "max_at_nodes": top["nodes"],
                          "updates_per_s_at_max": top["updates_per_s"],
                          "update_bottleneck_at_max": top["update_bottleneck"]})  # fmt: skip
            if K == 1:
                hit = next((r for r in rows if r["env_steps_per_s"] >= apex_rate), None)
                n360 = math.ceil(APEX_ACTORS / M)
                r360 = rows[n360 - 1] if n360 <= SEARCH_NODES else None
                apex.append({
                    "actors_per_node": M,
                    "nodes_for_apex_rate": None if hit is None else hit["nodes"],
                    "at_those_nodes": None if hit is None else {k: hit[k] for k in (
                        "env_steps_per_s", "updates_per_s", "samples_per_s", "bottleneck", "update_bottleneck",
                        "network_gbps_per_learner")},
                    "why_not": None if hit is not None else
                    f"capped at {top['env_steps_per_s']:.0f} env steps/s by {top['bottleneck']}",
                    "nodes_for_360_actor_processes": n360,
                    "at_360_actor_processes": None if r360 is None else {k: r360[k] for k in (
                        "env_steps_per_s", "updates_per_s", "bottleneck", "update_bottleneck")},
                })  # fmt: skip
    return {"bench": "cluster", "workload": "summary", "model": True, "transport": kind, "link_gbps": link_gbps,
            "link_rtt_ms": link_rtt_ms, "cores": cores, "samples_per_insert": rho, "learner_speedup": learner_speedup, "stops_scaling": stops,
            "apex": {"actors": APEX_ACTORS, "env_steps_per_s": apex_rate,
                     "actor_processes_at_this_rate": apex_rate / float(fig["actor_env_steps_per_s"]),
                     "one_learner": apex},
            "figures": fig}  # fmt: skip


# ----------------------------------------------------------------------------- measurements


def load_figures(path: str) -> dict:
    """Figures from a JSON file (``--save``'s, or written by hand); every key ``model()`` needs must be there."""
    try:
        fig = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GearflowError(f"--from {path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise GearflowError(f"--from {path}: not JSON ({exc})") from None
    if not isinstance(fig, dict):
        raise GearflowError(f"--from {path}: expected one JSON object of figures, got {type(fig).__name__}")
    missing = [k for k in FIGURE_KEYS if k not in fig]
    if missing:
        raise GearflowError(f"--from {path}: missing figure(s) {', '.join(missing)}")
    for k in ("shard_sample_s", "learn_s", "allreduce_s"):
        pairs = fig[k]
        if not (isinstance(pairs, list) and len(pairs) == 2 and all(isinstance(p, list) and len(p) == 2 for p in pairs)):
            raise GearflowError(f"--from {path}: {k} must be two [size, seconds] pairs, got {pairs!r}")
    return fig


# ----------------------------------------------------------------------------- CLI


def _table(lines: list[dict], out) -> None:
    print(f"{'N':>4} {'M':>4} {'K':>3} {'env steps/s':>12} {'updates/s':>10} {'Gbit/s/node':>11}  bottleneck", file=out)
    for r in lines:
        extra = "" if r["update_bottleneck"] == r["bottleneck"] else f" (updates: {r['update_bottleneck']})"
        print(f"{r['nodes']:>4} {r['actors_per_node']:>4} {r['learners']:>3} {r['env_steps_per_s']:>12,.0f} "
              f"{r['updates_per_s']:>10,.1f} {r['network_gbps_per_node']:>11.3f}  {r['bottleneck']}{extra}", file=out)  # fmt: skip


def run(args, wanted: list[str], emit: Emit) -> int:
    if not getattr(args, "simulate", False):
        raise GearflowError("bench cluster: only --simulate exists (a model of a cluster from this machine's figures); "
                            "a real multi-node run is gearflow train with launcher=ray")  # fmt: skip
    if wanted:
        raise GearflowError("bench cluster has no workloads to choose; use --nodes/--actors-per-node/--learners")
    Ns, Ms = _ints(args.nodes, "nodes"), _ints(args.actors_per_node, "actors-per-node")
    Ks = _ints(args.learners, "learners")
    kind = args.transport_kind
    link = float(args.link_gbps or LINK_GBPS[kind])
    if link <= 0:
        raise GearflowError(f"--link-gbps {args.link_gbps}: must be > 0")
    if args.from_file:
        fig = load_figures(args.from_file)
    else:  # here, not at import: the figures need torch and the replay, the CLI's parser neither
        from gearflow.bench.cluster_figures import measure

        fig = measure(args.config, args.quick, args.seed)
    if args.save:
        Path(args.save).write_text(json.dumps(fig, indent=1) + "\n")
    rho = float(fig["samples_per_insert"]) if args.samples_per_insert < 0 else float(args.samples_per_insert)
    B = int(fig["batch_size"])
    bad = [K for K in Ks if B % K]
    if bad:
        raise GearflowError(f"--learners {args.learners}: the global batch {B} does not split evenly among {bad}")

    def out(line: dict) -> None:
        print(json.dumps(line), flush=True)

    out({"bench": "cluster", "workload": "figures", "model": False, **fig})
    speedup = float(args.learner_speedup)
    if speedup <= 0:
        raise GearflowError(f"--learner-speedup {speedup}: must be > 0")
    rtt, cores = float(args.link_rtt_ms), float(args.cores)
    if rtt < 0 or cores < 0:
        raise GearflowError(f"--link-rtt-ms {rtt} / --cores {cores}: must be ≥ 0")
    lines = [model(fig, N, M, K, link, kind, rho, speedup, rtt, cores) for M in Ms for K in Ks for N in Ns]
    for line in lines:
        out(line)
    out(summarize(fig, Ms, Ks, link, kind, rho, float(args.apex_env_steps_per_s), speedup, rtt, cores))
    if not args.json:
        _table(lines, sys.stderr)
    return 0
