"""CUDA micro-benchmarks of the GPU-centric replay path: ``python -m gearflow.native.bench_cuda``.

Prints one JSON object per measurement:

* ``gather/zero_copy``   — the gather kernels reading rows straight out of
  registered, mapped host memory into device memory (transitions: B rows;
  sequences: B windows of T steps), for 16-, 4- and 1-byte-aligned row widths
  (the last two: the any-alignment variant); rows also at the work-item sizes of
  ``PIECE_SWEEP`` beside the default (``gather.PIECE``), to choose it on a GPU.
* ``gather/stacks`` — the stacked-frame kernel (one 84x84 frame stored per step, K = 4
  stacks of R2D2's 80-step windows rebuilt at sample time) with the bytes it reads over
  the host link counted: each frame once per window (``MB_read``: the distinct frames its
  stacks hold, ``gather.stack_frames_read``) against once per slot (``MB_read_per_slot``,
  K times: the kernel before), and GB/s of stacks written.
* ``gather/pinned_memcpy`` — ``cudaMemcpyAsync`` of the same number of bytes,
  contiguous, from the same pinned host memory: what the link moves at best.
* ``gather/cpu_then_h2d`` — the CPU path: ``np.take`` of the same rows into a
  pinned staging buffer, then ``cudaMemcpyAsync`` to the device.
* ``select/*`` — the device replay's selection over a priority vector of N slots
  (10^6 and 10^7): a sample of 256 (``draw_items``: chunk scan, search, records,
  uniforms made in the kernel; ``finish_batch``: keys, IS weights, status), a
  write-back of 256 device priorities by key (``mark_updates`` + ``apply_updates``
  + chunk re-sums: no host sync), a full chunk-sum pass; and the CPU
  ``PrioritizedSelector``'s sample and update of 256 (the floors).

GB/s are bytes gathered per second of GPU time between CUDA events (median of
the repeats); selection times are host wall time per call including Python
launch overhead, after the stream drained. Needs CuPy and a GPU; nothing is
installed. Every gather is checked against numpy once before it is timed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from gearflow.native import require_cupy
from gearflow.native.cuda_backend import dptr
from gearflow.native.gather import CudaGather, gather_stacks, stack_frames_read
from gearflow.native.hostmem import register_host
from gearflow.native.select import CudaSelect, num_chunks

OBS_ROW = 4 * 84 * 84  # an Atari frame stack, uint8: 28224 bytes = 1764 * 16
PIECE_SWEEP = (2048, 4096, 16384, 32768)  # the rows gather's work-item sizes measured beside the default (8 KiB)
FRAME = 84 * 84  # one stored frame of a stacked column: 7056 bytes = 441 * 16


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def gpu_ms(cupy: Any, stream: Any, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median GPU milliseconds of ``fn`` (queued on ``stream``), between events."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def wall_us(stream: Any, fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    """Host microseconds per call of ``fn`` over ``repeats`` calls, the stream drained at the end."""
    for _ in range(warmup):
        fn()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    stream.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e6


def bench_gather(cupy: Any, args: argparse.Namespace, failures: list[str], emit: Callable[[dict], None] = emit) -> None:
    runtime = cupy.cuda.runtime
    h2d = getattr(runtime, "memcpyHostToDevice", 1)
    stream = cupy.cuda.Stream(non_blocking=True)
    nbytes = args.host_mib * 2**20
    mm = mmap.mmap(-1, nbytes)  # anonymous, page-aligned: stands in for a replay segment
    host = np.frombuffer(mm, dtype=np.uint8)
    host.view(np.uint64)[:] = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    t0 = time.perf_counter()
    reg = register_host(cupy, int(host.ctypes.data), nbytes)
    emit({"bench": "hostmem/register", "MiB": args.host_mib, "ms": round((time.perf_counter() - t0) * 1e3, 2)})
    gather = CudaGather(cupy)
    rng = np.random.default_rng(0)
    try:
        with stream:
            for row_bytes in (OBS_ROW, OBS_ROW + 4, OBS_ROW + 1):
                num_rows = nbytes // row_bytes
                column = host[: num_rows * row_bytes].reshape(num_rows, row_bytes)
                # transitions: B rows
                rows = rng.integers(0, num_rows, size=args.batch).astype(np.int64)
                rows_d = cupy.asarray(rows)
                out = cupy.empty((args.batch, row_bytes), dtype=cupy.uint8)
                for piece in (None, *PIECE_SWEEP):  # the default piece first (the figure), then the sweep
                    out[...] = 0
                    plan = gather.gather_rows(reg.device_ptr, row_bytes, rows_d, out, num_rows=num_rows, piece=piece)
                    stream.synchronize()
                    if not np.array_equal(out.get(), column[rows]):
                        failures.append(f"gather_rows row_bytes={row_bytes} piece={plan.piece}: kernel != numpy")
                    run = partial(gather.gather_rows, reg.device_ptr, row_bytes, rows_d, out, num_rows=num_rows,
                                  piece=piece)  # fmt: skip
                    ms = gpu_ms(cupy, stream, run, args.repeats)
                    moved = args.batch * row_bytes
                    emit({"bench": "gather/zero_copy", "kind": "rows", "row_bytes": row_bytes, "batch": args.batch,
                          "kernel": plan.kernel, "piece": plan.piece, "default_piece": piece is None,
                          "MB": round(moved / 1e6, 2), "GB/s": round(moved / ms / 1e6, 2)})
                # sequences: B windows of T steps, P partitions of S steps, random starts (some wrap)
                S = num_rows // args.partitions
                B, T = args.seq_batch, args.seq_len
                parts = rng.integers(0, args.partitions, size=B).astype(np.int64)
                starts = rng.integers(0, 10 * S, size=B).astype(np.int64)
                lengths = np.full(B, T, dtype=np.int32)
                lengths[::4] = T // 2  # some padded items
                pd, sd, ld = (cupy.asarray(a) for a in (parts, starts, lengths))
                win = cupy.empty((B, T, row_bytes), dtype=cupy.uint8)
                mask = cupy.empty((B, T), dtype=cupy.bool_)
                plan = gather.gather_windows(reg.device_ptr, row_bytes, S, pd, sd, ld, T, win, mask,
                                             num_rows=args.partitions * S)
                stream.synchronize()
                steps = np.arange(T)
                ref_rows = parts[:, None] * S + (starts[:, None] + steps) % S
                ref = np.where((steps < lengths[:, None])[..., None], column[ref_rows], 0)
                if not np.array_equal(win.get(), ref):
                    failures.append(f"gather_windows row_bytes={row_bytes}: kernel != numpy")
                run = partial(gather.gather_windows, reg.device_ptr, row_bytes, S, pd, sd, ld, T, win, mask,
                              num_rows=args.partitions * S)
                ms = gpu_ms(cupy, stream, run, args.repeats)
                moved = int(lengths.sum()) * row_bytes  # padding is written, not read
                emit({"bench": "gather/zero_copy", "kind": "windows", "row_bytes": row_bytes, "batch": B,
                      "T": T, "kernel": plan.kernel, "piece": plan.piece, "default_piece": True,
                      "MB": round(moved / 1e6, 2), "GB/s": round(moved / ms / 1e6, 2)})

            bench_stacks(cupy, gather, stream, host, reg, args, rng, failures, emit)

            # floors for the transition batch of the Atari row width
            moved = args.batch * OBS_ROW
            dev = cupy.empty(moved, dtype=cupy.uint8)
            run = partial(runtime.memcpyAsync, dev.data.ptr, reg.host_ptr, moved, h2d, stream.ptr)
            ms = gpu_ms(cupy, stream, run, args.repeats)
            emit({"bench": "gather/pinned_memcpy", "MB": round(moved / 1e6, 2), "GB/s": round(moved / ms / 1e6, 2)})
            num_rows = nbytes // OBS_ROW
            column = host[: num_rows * OBS_ROW].reshape(num_rows, OBS_ROW)
            rows = rng.integers(0, num_rows, size=args.batch).astype(np.int64)
            pinned = cupy.cuda.alloc_pinned_memory(moved)
            staging = np.frombuffer(pinned, dtype=np.uint8, count=moved).reshape(args.batch, OBS_ROW)

            def cpu_then_h2d() -> None:
                np.take(column, rows, axis=0, out=staging)
                runtime.memcpyAsync(dev.data.ptr, staging.ctypes.data, moved, h2d, stream.ptr)

            us = wall_us(stream, cpu_then_h2d, args.repeats)
            emit({"bench": "gather/cpu_then_h2d", "MB": round(moved / 1e6, 2),
                  "GB/s": round(moved / us / 1e3, 2), "us": round(us, 1)})
            stream.synchronize()
    finally:
        stream.synchronize()
        reg.close()  # before the mapping can go away
        del host
        try:
            mm.close()
        except BufferError:  # a numpy view of it is still referenced: freed with it
            pass


def bench_stacks(cupy: Any, gather: CudaGather, stream: Any, host: np.ndarray, reg: Any, args: argparse.Namespace,
                 rng: np.random.Generator, failures: list[str], emit: Callable[[dict], None]) -> None:
    """The stacked-frame gather of ``args.seq_batch`` windows of ``args.seq_len`` steps, K = 4, from
    ``host`` (registered): frames in the front, the step offsets (episodes of 27..1000 steps) in
    the last P * S bytes; checked against the numpy reference, timed, bytes read counted."""
    K, P, B, T = 4, args.partitions, args.seq_batch, args.seq_len
    S = (host.nbytes // (FRAME + 1)) // P
    offsets = host[host.nbytes - P * S:]  # uint8[P * S]: each step's offset in its episode (capped)
    ends = np.cumsum(rng.integers(27, 1000, size=P * S // 27 + 1))
    ep_start = np.concatenate([[0], ends])[np.searchsorted(ends, np.arange(P * S), side="right")]
    offsets[:] = np.minimum(np.arange(P * S) - ep_start, 255).astype(np.uint8)
    column = host[: P * S * FRAME].reshape(P * S, FRAME)
    parts = rng.integers(0, P, size=B).astype(np.int64)
    starts = rng.integers(0, 10 * S, size=B).astype(np.int64)
    lengths = np.full(B, T, dtype=np.int32)
    lengths[::4] = T // 2
    pd, sd, ld = (cupy.asarray(a) for a in (parts, starts, lengths))
    out = cupy.empty((B, T, K, FRAME), dtype=cupy.uint8)
    off_ptr = reg.device_ptr + (host.nbytes - P * S)
    run = partial(gather.gather_stacks, reg.device_ptr, FRAME, S, K, off_ptr, pd, sd, ld, T, out, num_rows=P * S)
    plan = run()
    stream.synchronize()
    ref = np.empty((B, T, K, FRAME), np.uint8)
    gather_stacks(column, FRAME, S, K, offsets, parts, starts, lengths, T, ref)
    if not np.array_equal(out.get(), ref):
        failures.append("gather_stacks: kernel != numpy")
    ms = gpu_ms(cupy, stream, run, args.repeats)
    read = stack_frames_read(offsets, parts, starts, lengths, S, K) * FRAME
    per_slot = int(lengths.sum()) * K * FRAME
    written = per_slot  # every valid slot is written
    emit({"bench": "gather/stacks", "K": K, "batch": B, "T": T, "kernel": plan.kernel,
          "MB_read": round(read / 1e6, 2), "MB_read_per_slot": round(per_slot / 1e6, 2),
          "read_ratio": round(per_slot / max(read, 1), 2), "MB_written": round(written / 1e6, 2),
          "GB/s_read": round(read / ms / 1e6, 2), "GB/s_written": round(written / ms / 1e6, 2)})


class ReplayVectors:
    """A device replay's vectors and descriptors without a table (select.cu's gf_replay/gf_draw):
    ``n`` slots of ``P`` partitions with masses ``random ** 3`` (every 7th 0), all live, records
    whose keys follow the slot rule, a batch of ``B`` rows; counters and the status word in
    mapped pinned memory (zeros: nothing is torn). What ``DeviceReplay`` launches per sample
    (``draw_items`` + ``finish_batch``) and per write-back (``update_by_key``), timed alone."""

    def __init__(self, cupy: Any, sel: CudaSelect, n: int, B: int, P: int = 8) -> None:
        from gearflow.native.hostmem import MappedArea
        from gearflow.native.select import DRAW_FIELDS, REPLAY_FIELDS, descriptor

        cp, R = cupy, n // P
        self.n, self.B, self.P, self.R, self.NC, self.sel = P * R, B, P, R, num_chunks(P * R), sel
        n = self.n
        rng = np.random.default_rng(0)
        m = rng.random(n) ** 3
        m[::7] = 0.0
        self.masses = cp.asarray(m)
        self.live = cp.ones(n, dtype=cp.float64)
        self.sums, self.live_sums = sel.sum_chunks(self.masses), sel.sum_chunks(self.live)
        self.seq = cp.arange(n, dtype=cp.int64) % R  # slot p * R + seq % R holds item seq of partition p
        self.start = cp.zeros(n, dtype=cp.int64)
        self.length = cp.ones(n, dtype=cp.int32)
        self.winner, self.prio_status = cp.zeros(n, dtype=cp.uint64), cp.zeros(2, dtype=cp.uint64)
        self.counters, self.status = MappedArea(cp, P * 64), MappedArea(cp, 64)
        self.desc = descriptor(cp, REPLAY_FIELDS, {
            "masses": self.masses, "sums": self.sums, "live": self.live, "live_sums": self.live_sums,
            "start": self.start, "seq": self.seq, "length": self.length, "winner": self.winner,
            "prio_status": self.prio_status, "counters": self.counters.device_ptr, "N": n, "NC": self.NC,
            "P": P, "R": R, "counter_fields": 8, "reserve_field": 0, "trusted_steps": 1})  # fmt: skip
        self.draw = {"slots": cp.zeros(B, dtype=cp.int64), "probs": cp.zeros(B, dtype=cp.float64),
                     "parts": cp.zeros(B, dtype=cp.int64), "starts": cp.zeros(B, dtype=cp.int64),
                     "seqs": cp.zeros(B, dtype=cp.int64), "lengths": cp.zeros(B, dtype=cp.int32),
                     "keys": cp.zeros(B, dtype=cp.int64), "weights": cp.zeros(B, dtype=cp.float32),
                     "probabilities": cp.zeros(B, dtype=cp.float64), "flags": cp.zeros(B, dtype=cp.uint8)}  # fmt: skip
        self.draw_desc = descriptor(cp, DRAW_FIELDS, {**self.draw, "status": self.status.device_ptr})
        self.d, self.dd = dptr(self.desc), dptr(self.draw_desc)
        slots = rng.integers(0, n, size=B)
        self.keys = cp.asarray((slots % R) * P + slots // R)  # int64 (B,): the keys of B live items
        self.prios = cp.asarray(rng.random(B).astype(np.float32))
        self.scratch = cp.zeros(B, dtype=cp.int64)
        self.counter = self.tag = 0

    def sample(self) -> None:
        """One batch's draw and finish (the sample's kernels but the gather)."""
        self.counter += 1
        self.sel.draw_items(self.d, self.dd, self.B, seed=1, counter=self.counter)
        self.sel.finish_batch(self.d, self.dd, self.B, self.n, 0.4)

    def update(self) -> None:
        """One write-back of B device priorities by key (mark, apply, chunk re-sums)."""
        self.tag += 1
        self.sel.update_by_key(self.d, dptr(self.keys), dptr(self.prios), self.B, True, self.tag << 32, 0.6,
                               dptr(self.scratch), dptr(self.masses), self.n, dptr(self.sums), self.NC)  # fmt: skip

    def close(self) -> None:
        self.counters.close()
        self.status.close()


def bench_select(cupy: Any, args: argparse.Namespace, failures: list[str], emit: Callable[[dict], None] = emit) -> None:
    """Per size: the device replay's sample (fused draw + finish) and write-back by key of a
    batch of ``args.batch`` (256), against the CPU ``PrioritizedSelector``'s sample and update of the same sizes
    (the floors: the issue's targets are sample <= the CPU selector's, update <= 100 us at 10^6);
    and the full chunk-sum pass. Every sample is checked once (no dead or zero-mass slot drawn,
    weights max 1, keys by the slot rule) and every write-back (the masses it wrote)."""
    from gearflow.replay.selectors import make_selector

    stream = cupy.cuda.Stream(non_blocking=True)
    sel = CudaSelect(cupy)
    B = args.batch
    reps = args.repeats * 5
    for n in args.sizes:
        cpu = make_selector("prioritized", n, seed=0, alpha=0.6, beta=0.4)
        cpu.insert(np.arange(n), np.random.default_rng(0).random(n), np.arange(n))
        t0 = time.perf_counter()
        for _ in range(reps):
            cpu.sample(B)
        cpu_sample = (time.perf_counter() - t0) / reps * 1e6
        upd_slots, upd_prios = np.random.default_rng(1).integers(0, n, B), np.random.default_rng(1).random(B)
        t0 = time.perf_counter()
        for _ in range(reps):
            cpu.update_known(upd_slots, upd_prios)
        cpu_update = (time.perf_counter() - t0) / reps * 1e6
        emit({"bench": "select/cpu_prioritized_selector", "N": n, "batch": B, "us": round(cpu_sample, 1),
              "update_us": round(cpu_update, 1)})  # fmt: skip
        with stream:
            v = ReplayVectors(cupy, sel, n, B)
            try:
                v.sample()
                stream.synchronize()
                get = cupy.asnumpy
                slots, w, masses, keys = get(v.draw["slots"]), get(v.draw["weights"]), get(v.masses), get(v.draw["keys"])
                if (slots < 0).any() or (masses[slots] == 0).any() or abs(float(w.max()) - 1) > 1e-6:
                    failures.append(f"draw_items N={v.n}: a zero-mass or missing slot was drawn, or weights not max 1")
                if not np.array_equal(keys, (slots % v.R) * v.P + slots // v.R):
                    failures.append(f"finish_batch N={v.n}: keys are not the drawn slots' items")
                us = wall_us(stream, v.sample, reps)
                emit({"bench": "select/device_sample", "N": v.n, "batch": B, "us": round(us, 1),
                      "cpu_us": round(cpu_sample, 1),
                      "note": "draw_items (chunk scan + search + records, uniforms in the kernel) + finish_batch"})
                v.update()
                stream.synchronize()
                keys, prios = get(v.keys), get(v.prios).astype(np.float64)
                last = {int((k % v.P) * v.R + (k // v.P) % v.R): p for k, p in zip(keys.tolist(), prios.tolist())}
                at = np.array(list(last), dtype=np.int64)
                want = np.array(list(last.values())) ** 0.6
                if not np.allclose(get(v.masses)[at], want, rtol=1e-6):
                    failures.append(f"update_by_key N={v.n}: the masses written are not p ** alpha of the last entries")
                us = wall_us(stream, v.update, reps)
                emit({"bench": "select/device_update_by_key", "N": v.n, "batch": B, "us": round(us, 1),
                      "cpu_us": round(cpu_update, 1), "note": "mark_updates + apply_updates_f32 + chunk_sums"})
                ms = gpu_ms(cupy, stream, partial(sel.sum_chunks, v.masses, v.sums), args.repeats)
                emit({"bench": "select/sum_chunks", "N": v.n, "chunks": v.NC, "us_gpu": round(ms * 1e3, 1)})
            finally:
                stream.synchronize()
                v.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gearflow.native.bench_cuda", description=__doc__.split("\n")[0])
    parser.add_argument("--host-mib", type=int, default=512, help="registered host memory (MiB)")
    parser.add_argument("--batch", type=int, default=256, help="transition batch (rows)")
    parser.add_argument("--seq-batch", type=int, default=32, help="sequence batch (windows)")
    parser.add_argument("--seq-len", type=int, default=80, help="window length T")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")], default=[10**6, 10**7],
                        help="priority vector sizes, comma-separated (default 1e6,1e7)")
    parser.add_argument("--no-cpu-baseline", dest="cpu_baseline", action="store_false")
    args = parser.parse_args(argv)
    cupy = require_cupy("gearflow.native.bench_cuda")
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else str(dev["name"])
    emit({"bench": "device", "name": name, "cupy": cupy.__version__,
          "runtime": cupy.cuda.runtime.runtimeGetVersion(), "driver": cupy.cuda.runtime.driverGetVersion()})
    failures: list[str] = []
    for part in (bench_gather, bench_select):
        try:
            part(cupy, args, failures)
        except Exception as exc:  # noqa: BLE001 - report and go on: the other half still says something
            failures.append(f"{part.__name__}: {type(exc).__name__}: {exc}")
    for f in failures:
        emit({"bench": "FAILED", "detail": f})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
