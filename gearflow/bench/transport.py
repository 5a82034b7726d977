"""``gearflow bench transport``: the TCP data plane against the same work without a network.

Workloads (each figure with its floor measured in the same run; the shard service runs in its
own process on loopback, :mod:`gearflow.transport.bench` does the measuring):

* ``insert`` — a TransitionAdder over 16 env streams (8 per recv, pre-made recvs, no env):
  ``ShippingWriter`` (the C adder, steps shipped to the shard) against the same adder writing
  shared memory; ``RemoteWriter`` against the numpy adder writing shared memory (the adder it runs).
* ``actor`` — the EnvPool CartPole Ape-X actor itself, through each remote writer, against
  the same actor writing shared memory.
* ``sample`` — ``RemoteSampler`` batches of 256 × 28 KiB rows against a raw TCP socket moving
  the same bytes per request, with ``transport.integrity`` on (the default: every frame
  MACed), off (rows straight out of the segment), and off with the rows gathered into the
  batch buffers before sending (``wire_min_row_bytes=None``), in the same rounds;
  ``integrity_cost``: 1 − on/off (the median of the rounds' ratios; on: the MAC over the rows'
  digests the shard keeps, :mod:`gearflow.transport.server.row_digests`), ``integrity_cost[fresh_rows]``
  (every draw's row digests computed afresh: every row drawn for the first time) and
  ``integrity_cost[rows_maced]`` (no row digests: the MAC reads the rows at every send); and over
  mutual TLS (``transport.tls``, integrity on) where the ``openssl`` command can make the certificates.
* ``latency`` — request latency of a sample, p50/p99, at batch 32 and 256, with the raw
  socket's round trip of the same bytes.
* ``--profile`` — instead of the workloads: where one ``sample`` round's time goes, integrity on and
  off, shard and learner side, per phase (the shard's handler, the frame send, the MAC update calls
  and their count, the receive, the trailer check, the torn rows' reseal, the caller's wait) and per
  thread (CPU ms per round): :func:`gearflow.transport.bench.sample_profile`.
* ``writeback`` — a learner's loop (a Prefetcher thread, a 10 ms learn step, the priorities
  written back) over two prioritized shards behind relays adding 10 ms of round trip: updates/s
  with the write-back not waiting for its replies (the default) against waiting for each.
"""

from __future__ import annotations

from collections.abc import Callable

from gearflow.bench import record
from gearflow.errors import GearflowError

WORKLOADS = ("insert", "actor", "sample", "latency", "writeback")


def add_arguments(parser) -> None:
    parser.add_argument("--profile", action="store_true",
                        help="transport: where a sample round's time goes, integrity on and off, per phase and "
                             "thread on both sides (instead of the workloads)")  # fmt: skip


def profile(args, emit: Callable[[dict], None]) -> int:
    """``--profile``: per variant, the round's wall ms, then per side each phase's calls, items, wall
    and CPU ms per round and each thread's CPU ms per round (``floor``: the same figure with
    integrity off, measured in the same run, where there is one)."""
    from gearflow.transport import bench as tb

    rows = {r["integrity"]: r for r in tb.sample_profile(rounds=max(10, int(40 * args.scale)))}
    on, off = rows[True], rows[False]
    emit(record("transport", "profile", "round_ms[integrity=true]", on["round_ms"], "ms", off["round_ms"]))
    for side in ("shard", "learner"):
        phases = sorted(set(on[side]["phases"]) | set(off[side]["phases"]))
        for phase in phases:
            a, b = on[side]["phases"].get(phase), off[side]["phases"].get(phase)
            for field, unit in (("cpu_ms", "ms"), ("wall_ms", "ms"), ("calls", "calls"), ("items", "items")):
                value = a[field] if a else 0.0
                emit(record("transport", "profile", f"{side}/{phase}.{field}[integrity=true]", value, unit,
                            b[field] if b and b[field] else None))  # fmt: skip
        for name in sorted(set(on[side]["threads"]) | set(off[side]["threads"])):
            emit(record("transport", "profile", f"{side}/thread[{name}].cpu_ms[integrity=true]",
                        on[side]["threads"].get(name, 0.0), "ms", off[side]["threads"].get(name) or None))  # fmt: skip
    return 0


def run(args, wanted: list[str], emit: Callable[[dict], None]) -> int:
    from gearflow.transport import bench as tb

    if getattr(args, "profile", False):
        return profile(args, emit)
    unknown = sorted(set(wanted) - set(WORKLOADS))
    if unknown:
        raise GearflowError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    todo = wanted or list(WORKLOADS)
    seconds = max(0.5, 2.0 * args.scale)

    def rec(workload, metric, value, unit, floor=None):
        emit(record("transport", workload, metric, value, unit, floor))

    if "insert" in todo:
        r = tb.insert(seconds)
        rec("insert", "steps_per_s[ShippingWriter,C adder]", r["shipping_steps_per_s"], "steps/s", r["local_steps_per_s"])
        rec("insert", "steps_per_s[RemoteWriter,numpy adder]", r["remote_steps_per_s"], "steps/s",
            r["local_numpy_adder_steps_per_s"])  # fmt: skip
    if "actor" in todo:
        r = tb.actor(steps=max(2000, int(20_000 * args.scale)))
        rec("actor", "env_steps_per_s[ShippingWriter]", r["shipping_writer_steps_per_s"], "steps/s", r["local_steps_per_s"])
        rec("actor", "env_steps_per_s[RemoteWriter]", r["remote_writer_steps_per_s"], "steps/s", r["local_steps_per_s"])
    if "sample" in todo:
        r = tb.sample(seconds)
        rec("sample", f"GB_per_s[batch={r['batch']}]", r["remote_gb_per_s"], "GB/s", r["raw_socket_gb_per_s"])
        rec("sample", f"GB_per_s[batch={r['batch']},integrity=false]", r["no_integrity_gb_per_s"], "GB/s",
            r["raw_socket_gb_per_s"])  # fmt: skip
        rec("sample", f"GB_per_s[batch={r['batch']},integrity=false,gathered]", r["gathered_gb_per_s"], "GB/s",
            r["raw_socket_gb_per_s"])  # fmt: skip
        rec("sample", f"integrity_cost[batch={r['batch']}]", r["integrity_cost"], "fraction")
        rec("sample", f"integrity_cost[batch={r['batch']},fresh_rows]", r["integrity_cost_fresh_rows"], "fraction")
        rec("sample", f"integrity_cost[batch={r['batch']},rows_maced]", r["integrity_cost_rows_maced"], "fraction")
        if "tls_gb_per_s" in r:
            rec("sample", f"GB_per_s[batch={r['batch']},tls]", r["tls_gb_per_s"], "GB/s", r["raw_socket_gb_per_s"])
            rec("sample", f"GB_per_s[batch={r['batch']},tls,tls_records=tls]", r["tls_records_gb_per_s"], "GB/s",
                r["raw_socket_gb_per_s"])  # fmt: skip
    if "latency" in todo:
        for r in tb.latency(seconds / 2):
            # floors are round-trip times: ratio = gearflow's time over the raw socket's
            rec("latency", f"p50_us[batch={r['batch']}]", r["p50_us"], "us", r["raw_socket_p50_us"])
            rec("latency", f"p99_us[batch={r['batch']}]", r["p99_us"], "us", r["raw_socket_p99_us"])
    if "writeback" in todo:
        r = tb.writeback(seconds)
        rec("writeback", f"updates_per_s[rtt={r['rtt_ms']:g}ms,learn={r['learn_ms']:g}ms]", r["updates_per_s"],
            "updates/s", r["waiting_updates_per_s"])  # fmt: skip
    return 0
