"""``gearflow bench replay --device cuda``: the GPU-centric replay path, on a machine with CuPy and a GPU.

Workloads (sizes at ``--scale 1``; smaller scales shrink them for a smoke run):

* ``gather`` — the gather kernels reading straight out of registered, mapped
  host memory (zero-copy) against (a) a pinned ``cudaMemcpyAsync`` of the same
  bytes (the link's limit: ``ratio`` = fraction of it, target ≥ 0.85 for aligned
  rows, ≥ 0.75 for unaligned ones; rows also at other work-item sizes) and
  (b) the staging path, CPU ``np.take`` into pinned memory + H2D copy
  (target ≥ 2×). Transition rows and sequence windows, 16/4/1-byte aligned
  rows (:func:`gearflow.native.bench_cuda.bench_gather`).
* ``select`` — the device replay's sample of 256 over 10^6 and 10^7 priorities (one
  fused ``draw_items`` + ``finish_batch``) with the CPU ``PrioritizedSelector.sample(256)``
  as its floor (target: ratio <= 1), its write-back of 256 device priorities by key
  (no host sync; target <= 100 us at 10^6) with the CPU selector's update as floor, and a
  full chunk-sum pass (:func:`~gearflow.native.bench_cuda.bench_select`).
* ``table`` — ``Table(device="cuda")`` end to end: Atari-sized transitions
  (obs uint8[4,84,84] + next obs), batch 256, every sampled row verified
  (stamp column + obs byte pattern; every other sample taken while torch's
  stream is busy with a long kernel, the learner's case); then the batch-256 sample time at 10^6
  and 10^7 items, table ingest included in the setup, not the timing.

Every line is a ``gearflow bench`` record; a failed check is reported on
stderr and makes the exit status 1. Without CuPy or a GPU the command exits 2
with the one-line reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace

import numpy as np

from gearflow.bench import record
from gearflow.bench.common import random_steps
from gearflow.bench.replay import Emit, floor_gather, stamp_obs, timed, verify_stamps
from gearflow.errors import GearflowError
from gearflow.native import require_cupy
from gearflow.native.device_replay import resolve_replay_device


def _record(workload: str, metric: str, value: float, unit: str, floor: float | None = None) -> dict:
    return record("replay", workload, metric, value, unit, floor)


def _native_args(scale: float) -> argparse.Namespace:
    """Arguments of gearflow.native.bench_cuda's functions at ``scale``."""
    big = scale >= 1
    return argparse.Namespace(
        host_mib=512 if big else 64, batch=256, seq_batch=32, seq_len=80, partitions=8,
        repeats=20 if big else 5, sizes=[10**6, 10**7] if big else [10**5, 10**6], cpu_baseline=True,
    )  # fmt: skip


def gather(emit: Emit, cupy, scale: float, failures: list[str]) -> None:
    from gearflow.native.bench_cuda import OBS_ROW, bench_gather

    raw: list[dict] = []
    bench_gather(cupy, _native_args(scale), failures, emit=raw.append)
    by = {r["bench"]: r for r in raw}
    pinned = by.get("gather/pinned_memcpy", {}).get("GB/s")
    staging = by.get("gather/cpu_then_h2d", {}).get("GB/s")
    for r in raw:
        if r["bench"] == "hostmem/register":
            emit(_record("cuda_gather", f"register_{r['MiB']}MiB_ms", r["ms"], "ms"))
        elif r["bench"] == "gather/zero_copy":
            piece = "" if r.get("default_piece", True) else f"_piece{r['piece']}"
            name = f"zero_copy_{r['kind']}_{r['row_bytes']}B{piece}_GB_per_s"
            emit(_record("cuda_gather", name, r["GB/s"], "GB/s", pinned))  # ratio: fraction of the link
            if r["kind"] == "rows" and r["row_bytes"] == OBS_ROW and staging and not piece:
                emit(_record("cuda_gather", f"zero_copy_rows_{OBS_ROW}B_vs_staging_GB_per_s", r["GB/s"], "GB/s", staging))
        elif r["bench"] == "gather/stacks":  # frames read once per window: bytes over the link counted
            emit(_record("cuda_gather", "stacks_MB_read_per_batch", r["MB_read"], "MB"))
            emit(_record("cuda_gather", "stacks_MB_read_once_per_slot_would_be", r["MB_read_per_slot"], "MB"))
            emit(_record("cuda_gather", "stacks_read_GB_per_s", r["GB/s_read"], "GB/s", pinned))
            emit(_record("cuda_gather", "stacks_written_GB_per_s", r["GB/s_written"], "GB/s"))
    if pinned is not None:
        emit(_record("cuda_gather", "pinned_memcpy_GB_per_s", pinned, "GB/s"))
    if staging is not None:
        emit(_record("cuda_gather", "staging_cpu_gather_h2d_GB_per_s", staging, "GB/s"))


def select(emit: Emit, cupy, scale: float, failures: list[str]) -> None:
    """The device replay's sample and write-back of 256 at 10^6 and 10^7 slots, each beside the CPU
    selector's of the same size measured in the same run (the floor: ratio <= 1 is the target for
    the sample; the write-back's target is <= 100 us at 10^6), and the chunk-sum pass."""
    from gearflow.native.bench_cuda import bench_select

    raw: list[dict] = []
    bench_select(cupy, _native_args(scale), failures, emit=raw.append)
    for r in raw:
        n = r["N"]
        if r["bench"] == "select/device_sample":
            emit(_record("cuda_select", f"sample_us_at_{n}_items", r["us"], "us", r["cpu_us"]))
        elif r["bench"] == "select/device_update_by_key":
            emit(_record("cuda_select", f"update_us_at_{n}_items", r["us"], "us", r["cpu_us"]))
        elif r["bench"] == "select/sum_chunks":
            emit(_record("cuda_select", f"sum_chunks_gpu_us_at_{n}_items", r["us_gpu"], "us"))
        elif r["bench"] == "select/cpu_prioritized_selector":
            emit(_record("cuda_select", f"cpu_selector_sample_us_at_{n}_items", r["us"], "us"))
            emit(_record("cuda_select", f"cpu_selector_update_us_at_{n}_items", r["update_us"], "us"))


def _on_host(sample) -> SimpleNamespace:
    """What :func:`~gearflow.bench.replay.verify_stamps` reads of a batch of CUDA tensors, copied
    to the host (it compares with host tensors and reads the keys with ``.numpy()``)."""
    return SimpleNamespace(data={k: v.cpu() for k, v in sample.data.items()}, keys=sample.keys.cpu())


def table(emit: Emit, cupy, scale: float, failures: list[str], device: Callable | None = None) -> None:
    """``device(storage, kind, selector)``: the table's device sampler (default: a
    ``DeviceReplay`` on ``cupy``; the tests hand in the CuPy emulation's)."""
    import torch

    from gearflow.kinds.transition import Transition
    from gearflow.native.device_replay import DeviceReplay
    from gearflow.replay import (
        RateLimiter,
        SharedStorage,
        Table,
        TableSpec,
        Writer,
        make_selector,
    )

    device = device or partial(DeviceReplay, cupy=cupy)

    def make(spec: dict, steps: int) -> Table:
        storage = SharedStorage.create(TableSpec.parse(spec), 1, steps)
        try:
            sel = make_selector("prioritized", storage.items_per_partition, seed=0, alpha=0.6, beta=0.4)
            kind = Transition(next_columns=("obs",) if "obs" in spec else ())
            return Table(storage, kind, sel, RateLimiter(min_size_to_sample=1), num_buffers=1,
                         device=device(storage, kind, sel))  # fmt: skip
        except BaseException:
            storage.close()
            storage.unlink()
            raise

    # Atari transitions, every row checked (the W3 stamp pattern: obs bytes = stamp % 251 + 1)
    tiny = scale < 0.1  # a smoke run (the tests: the CuPy emulation runs the kernels on the CPU)
    steps = max(256 if tiny else 4096, int(20_000 * scale)) // 64 * 64
    spec = {"obs": "uint8[4,84,84]", "action": "int64", "reward": "float32", "done": "bool", "stamp": "int64"}
    t = make(spec, steps)
    try:
        writer = Writer(t.storage, [0])
        rng = np.random.default_rng(0)
        chunk = random_steps(t.storage.spec, 64, rng)
        for _ in range(steps // 64):
            idx = np.arange(int(writer.positions[0]), int(writer.positions[0]) + 64)
            stamp_obs(chunk, idx)  # every byte of each row says which step it is
            first = writer.extend(chunk)
            ends = first + np.arange(1, 65)
            ends = ends[ends - 4 >= writer.episode_starts()[0]]
            writer.create_items(rng.random(ends.size) + 0.01, 4, streams=0, ends=ends)
        t.scan()
        B = 16 if tiny else 256
        bad = 0
        for i in range(4 if tiny else 20):
            if i % 2 and torch.cuda.is_available():  # the learner's stream busy with a long kernel (~10 ms)
                torch.cuda._sleep(20_000_000)
            # one writer run: item seq s starts at step s (its 4 steps, the first 4 of the ring skipped)
            bad += verify_stamps(_on_host(t.sample(B)), [(0, 0)])
        emit(_record("cuda_table", "torn_or_corrupt_rows_returned", bad, "rows"))
        if bad:
            failures.append(f"Table(device='cuda'): {bad} sampled rows differ from what was written")
        min_s = 0.05 if tiny else max(0.5, 2.0 * scale)
        t_sample = timed(lambda: t.sample(B), min_s)
        rows = {"obs": B, "obs#next": B, "action": B, "reward": B, "done": B, "stamp": B}
        t_floor = floor_gather(t.storage.tensors, rows, steps, min_s, 0)
        batch_gb = B * (t.storage.spec.step_nbytes + t.storage.spec["obs"].nbytes) / 1e9
        # floor: the CPU index_select of the same rows into host memory (the CPU table's floor)
        emit(_record("cuda_table", "sample_GB_per_s", batch_gb / t_sample, "GB/s", batch_gb / t_floor))
        emit(_record("cuda_table", "sample_batches_per_s", 1 / t_sample, "batches/s", 1 / t_floor))
        s = t.sample(B)
        keys, prios = s.keys.clone(), torch.rand(B, dtype=torch.float64)
        t_update = timed(lambda: t.update_priorities(keys, prios), min_s)
        emit(_record("cuda_table", "priority_updates_per_s", B / t_update, "priorities/s"))
    finally:
        t.close()

    # sample cost at scale, through the table
    for n in [10**6, 10**7] if scale >= 1 else [10**3] if tiny else [10**4, 10**5]:
        chunk_n = min(n, 65536)
        steps = -(-n // chunk_n) * chunk_n
        t = make({"action": "int64", "reward": "float32"}, steps + 1)
        try:
            writer = Writer(t.storage, [0])
            rng = np.random.default_rng(0)
            chunk = random_steps(t.storage.spec, chunk_n, rng)
            start = time.perf_counter()
            for _ in range(steps // chunk_n):
                first = writer.extend(chunk)
                writer.create_items(rng.random(chunk_n) + 0.01, 1, streams=0, ends=first + np.arange(1, chunk_n + 1))
            t.scan()
            emit(_record("cuda_table", f"fill_and_ingest_s_at_{n}_items", time.perf_counter() - start, "s"))
            cost = min(timed(partial(t.sample, 16 if tiny else 256), max(0.2, 0.4 * scale), min_calls=5 if tiny else 50)
                       for _ in range(2 if tiny else 5))  # fmt: skip
            emit(_record("cuda_table", f"sample_us_at_{n}_items", cost * 1e6, "us"))
        finally:
            t.close()


WORKLOADS = {"gather": gather, "select": select, "table": table}


def run(args, wanted: list[str], emit: Emit) -> int:
    unknown = [w for w in wanted if w not in WORKLOADS]
    if unknown:
        raise GearflowError(f"unknown workload(s) {unknown} for --device cuda; choose from {', '.join(WORKLOADS)}")
    resolve_replay_device("cuda")  # CuPy + GPU + torch CUDA, or the one-line reason (exit 2)
    cupy = require_cupy("gearflow bench replay --device cuda")
    failures: list[str] = []
    for name in wanted or list(WORKLOADS):
        try:
            WORKLOADS[name](emit, cupy, args.scale, failures)
        except Exception as exc:  # noqa: BLE001 - report and go on: the other workloads still say something
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    for f in failures:
        print(f"gearflow bench replay --device cuda: FAILED: {f}", file=sys.stderr, flush=True)
    return 1 if failures else 0
