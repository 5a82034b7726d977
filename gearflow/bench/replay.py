"""``gearflow bench replay``: the replay core against the plainest code doing the same work.

Workloads (sizes at ``--scale 1``):

* ``W1`` transitions — step = obs uint8[4,84,84], action int64, reward float32,
  done bool; 100,000 steps; 3-step items; inserts in chunks of 64; prioritized
  batches of 256 (obs and next obs); priority updates of 256.
* ``W2`` sequences — step = obs float32[128], action, reward; 1,000,000 steps;
  windows of 32 (period 16); prioritized batches of 64.
* ``W3`` concurrency — a writer process inserts W1 steps while this process
  samples, for a bounded time; both rates against their solo rates, and every
  byte of every sampled row is checked against the steps its item's key names:
  zero torn rows, and at least one overwritten item caught and redrawn (else
  the run fails: the check proved nothing).
* ``W4`` scale — cost of a batch-256 prioritized sample at 10^5, 10^6, 10^7 items.
* ``W6`` stacked frames — one 84×84 frame stored per step against the whole stack
  (``gearflow/bench/replay_stack.py``): bytes, inserts, samples.

``--device cuda`` runs the GPU workloads instead (``gearflow/bench/replay_cuda.py``).

Floors are measured in the same run on the same machine: a plain slice copy of
the same bytes into a preallocated array (inserts) and ``torch.index_select``
of the same number of rows from a preallocated array into a preallocated
output (samples; the faster of one thread and all of torch's). ``ratio`` = gearflow / floor (1.0 = no overhead).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Callable

import numpy as np
import torch

from gearflow.bench import record, replay_hot, replay_stack
from gearflow.bench.common import copy_floor, prioritized_table, random_steps
from gearflow.errors import GearflowError
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay import (
    SharedStorage,
    Table,
    Writer,
)

Emit = Callable[[dict], None]
W1_SPEC = {"obs": "uint8[4,84,84]", "action": "int64", "reward": "float32", "done": "bool"}
W3_SPEC = {**W1_SPEC, "stamp": "int64"}


def _record(workload: str, metric: str, value: float, unit: str, floor: float | None = None) -> dict:
    return record("replay", workload, metric, value, unit, floor)


def timed(fn: Callable[[], object], min_seconds: float, min_calls: int = 5) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def _emit_rotating(emit: Emit, workload: str, table: Table, B: int, batch_gb: float, t_floor: float, min_s: float) -> None:
    """The same sampling with 3 rotating output buffers (what a prefetching learner uses):
    the floor keeps writing one buffer, so this ratio includes the colder output cache."""
    table.num_buffers = 3
    t = timed(lambda: table.sample(B), min_s)
    emit(_record(workload, "sample_GB_per_s_3_rotating_buffers", batch_gb / t, "GB/s", batch_gb / t_floor))
    table.num_buffers = 1


def _fill_transitions(writer: Writer, chunk: dict, steps: int, n_step: int, rng) -> float:
    """Insert ``steps`` steps in chunks with one (n+1)-step item per step; returns seconds."""
    n = len(next(iter(chunk.values())))
    start = time.perf_counter()
    for _ in range(steps // n):
        first = writer.extend(chunk)
        ends = first + np.arange(1, n + 1)
        ends = ends[ends - (n_step + 1) >= writer.episode_starts()[0]]
        writer.create_items(rng.random(ends.size) + 0.01, n_step + 1, streams=0, ends=ends)
    return time.perf_counter() - start


def floor_gather(sources: dict[str, torch.Tensor], rows_per_column: dict[str, int], capacity: int, min_s: float, seed: int) -> float:
    """Seconds per batch for index_select of the same rows-per-column into preallocated outputs."""
    gen = torch.Generator().manual_seed(seed)
    outs = {k: torch.empty((n, *sources[k.split("#")[0]].shape[1:]), dtype=sources[k.split("#")[0]].dtype)
            for k, n in rows_per_column.items()}  # fmt: skip
    pool = [torch.randint(0, capacity, (max(rows_per_column.values()),), generator=gen) for _ in range(64)]
    i = 0

    def gather() -> None:
        nonlocal i
        idx = pool[i % len(pool)]
        i += 1
        for k, out in outs.items():
            rows = idx[: out.shape[0]]
            if k.endswith("#next"):  # the bootstrap rows of a transition: other rows, 3 steps on
                rows = (rows + 3) % capacity
            torch.index_select(sources[k.split("#")[0]], 0, rows, out=out)

    # the faster of one thread and all of torch's: next to another busy process torch's
    # split gather can stall on a descheduled thread, and a floor should be the best case
    threads = torch.get_num_threads()
    try:
        costs = []
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            costs.append(timed(gather, min_s))
    finally:
        torch.set_num_threads(threads)
    return min(costs)


# ----------------------------------------------------------------------------- W1


def w1(emit: Emit, scale: float, seed: int) -> None:
    steps = max(2048, int(100_000 * scale)) // 64 * 64
    rng = np.random.default_rng(seed)
    table = prioritized_table(W1_SPEC, 1, steps, Transition(next_columns=("obs",)), seed)
    try:
        spec = table.storage.spec
        writer = Writer(table.storage, [0])
        chunk = random_steps(spec, 64, rng)
        _fill_transitions(writer, chunk, steps, 3, rng)  # first lap: pages fault in
        table.scan()
        # steady state (the ring overwrites), best of 3 on both sides
        t_insert = min(_fill_transitions(writer, chunk, steps, 3, rng) for _ in range(3))
        t_floor = min(copy_floor(chunk, steps, shared=False) for _ in range(3))
        gb = steps * spec.step_nbytes / 1e9
        emit(_record("W1", "insert_GB_per_s", gb / t_insert, "GB/s", gb / t_floor))
        emit(_record("W1", "insert_steps_per_s", steps / t_insert, "steps/s", steps / t_floor))

        table.scan()
        B = 256
        min_s = max(0.5, 2.0 * scale)
        t_sample = timed(lambda: table.sample(B), min_s)
        rows = {"obs": B, "obs#next": B, "action": B, "reward": B, "done": B}
        t_gather = floor_gather(table.storage.tensors, rows, steps, min_s, seed)
        batch_gb = B * (spec.step_nbytes + spec["obs"].nbytes) / 1e9
        emit(_record("W1", "sample_GB_per_s", batch_gb / t_sample, "GB/s", batch_gb / t_gather))
        emit(_record("W1", "sample_batches_per_s", 1 / t_sample, "batches/s", 1 / t_gather))
        _emit_rotating(emit, "W1", table, B, batch_gb, t_gather, min_s)

        sample = table.sample(B)
        keys = sample.keys.clone()
        prios = torch.rand(B, dtype=torch.float64)
        t_update = timed(lambda: table.update_priorities(keys, prios), min_s)
        emit(_record("W1", "priority_updates_per_s", B / t_update, "priorities/s"))
    finally:
        table.close()


# ----------------------------------------------------------------------------- W2


def w2(emit: Emit, scale: float, seed: int) -> None:
    P = 4
    steps = max(16384, int(1_000_000 * scale)) // P // 4096 * 4096
    T, period = 32, 16
    rng = np.random.default_rng(seed)
    spec_d = {"obs": "float32[128]", "action": "int64", "reward": "float32"}
    kind = Sequence(length=T, period=period, burn_in=0)
    table = prioritized_table(spec_d, P, steps, kind, seed, R=steps // period + 1)
    try:
        spec = table.storage.spec
        writer = Writer(table.storage, list(range(P)))

        def fill(n: int) -> float:
            """Insert every partition's ring in calls of ``n`` steps, each call one whole
            episode with a window ending every ``period`` steps from step T on."""
            chunk = random_steps(spec, n, rng)
            window_ends = np.arange(T, n + 1, period)
            prios = rng.random(window_ends.size) + 0.01
            start = time.perf_counter()
            for p in range(P):
                for _ in range(steps // n):
                    first = writer.extend(chunk, stream=p)
                    writer.create_items(prios, T, streams=p, ends=first + window_ends)
                    writer.end_episode(p)
            return time.perf_counter() - start

        fill(4096)  # first lap: pages fault in
        gb = P * steps * spec.step_nbytes / 1e9
        # 4,096 steps (2.1 MB) per call: about W1's 1.8 MB per 64-frame call
        for n, metric in ((4096, "insert_GB_per_s"), (1024, "insert_GB_per_s_1024_step_calls")):
            # best of 3 on both sides: this machine's noise only ever adds time
            chunk = random_steps(spec, n, rng)
            t_floor = min(copy_floor(chunk, steps, shared=False) for _ in range(3)) * P
            t_fill = min(fill(n) for _ in range(3))
            emit(_record("W2", metric, gb / t_fill, "GB/s", gb / t_floor))
        # (1,024-step calls: the per-call overhead shows against 0.5 MB copies)

        table.scan()
        B = 64
        min_s = max(0.5, 2.0 * scale)
        t_sample = timed(lambda: table.sample(B), min_s)
        rows = {name: B * T for name in spec.names}
        t_gather = floor_gather(table.storage.tensors, rows, P * steps, min_s, seed)
        batch_gb = B * T * spec.step_nbytes / 1e9
        emit(_record("W2", "sample_GB_per_s", batch_gb / t_sample, "GB/s", batch_gb / t_gather))
        emit(_record("W2", "sample_batches_per_s", 1 / t_sample, "batches/s", 1 / t_gather))
        _emit_rotating(emit, "W2", table, B, batch_gb, t_gather, min_s)
    finally:
        table.close()


# ----------------------------------------------------------------------------- W3


def stamp_obs(chunk: dict[str, np.ndarray], steps: np.ndarray) -> None:
    """Make every byte of each row say which step it is: obs (uint8[4,84,84]) viewed as int64
    words, each word = the step; ``stamp`` and ``action`` = the step; ``reward`` = step mod
    2^16 (exact in float32); ``done`` = step mod 3 == 0."""
    n = steps.size
    chunk["obs"].reshape(n, -1).view(np.int64)[:] = steps[:, None]  # (n, 3528) words
    chunk["stamp"][:] = steps
    chunk["action"][:] = steps
    chunk["reward"][:] = (steps % 65536).astype(np.float32)
    chunk["done"][:] = steps % 3 == 0


def _w3_writer(name: str, seconds: float, go, stop, q) -> None:
    """Writer process: inserts stamped W1 steps with 4-step items, for at least ``seconds``
    and until ``stop`` is set. Reports ``("base", first step, first item seq)`` (item ``seq``
    then starts at step ``first step + seq - first item seq``) and, at the end, its rate."""
    torch.set_num_threads(1)
    storage = SharedStorage.attach(name)
    try:
        writer = Writer(storage, [0], insert_timeout_s=seconds + 30)
        pos0 = int(writer.positions[0])
        q.put(("base", pos0, int(storage.total_inserts())))
        rng = np.random.default_rng(1)
        chunk = random_steps(storage.spec, 64, rng)

        def insert() -> None:
            pos = int(writer.positions[0])
            stamp_obs(chunk, np.arange(pos, pos + 64, dtype=np.int64))
            first = writer.extend(chunk)
            ends = first + np.arange(1, 65)
            ends = ends[ends - 4 >= writer.episode_starts()[0]]  # the first item starts at pos0
            writer.create_items(rng.random(ends.size) + 0.01, 4, streams=0, ends=ends)

        for _ in range(storage.steps_per_partition // 64 + 1):
            insert()  # one untimed lap: this process's page tables fill in
        go.wait()
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds or not stop.is_set():
            insert()
            steps += 64
        q.put(("rate", steps / (time.perf_counter() - start), None))
    finally:
        storage.close()


def verify_stamps(sample, bases: list[tuple[int, int]]) -> int:
    """Rows of a W3 batch that are not exactly what its item's steps hold, every byte of
    every column compared. ``bases``: (first item seq, first step) of each writer run, in
    order; the item's first step comes from its key, not from the row."""
    d = sample.data
    seq = sample.keys.numpy()  # one partition: key = seq
    seqs0 = np.array([b[0] for b in bases])
    run = np.searchsorted(seqs0, seq, side="right") - 1
    first = torch.from_numpy(np.array([b[1] for b in bases])[run] + seq - seqs0[run])  # (B,)
    B = first.shape[0]
    obs = d["obs"].reshape(B, -1).view(torch.int64)  # (B, 3528) words, each = the step
    nxt = d["next_obs"].reshape(B, -1).view(torch.int64)  # the item's last step: first + 3
    bad = (obs != first[:, None]).any(1) | (nxt != (first + 3)[:, None]).any(1)
    bad |= (d["stamp"] != first) | (d["action"] != first)
    bad |= d["reward"] != (first % 65536).float()
    bad |= d["done"] != (first % 3 == 0)
    return int(bad.sum())


def w3(emit: Emit, scale: float, seed: int) -> None:
    """Raises (after emitting its records) when a torn or wrong row was returned, or when no
    torn item was detected and redrawn: then the check proved nothing."""
    steps = max(4096, int(100_000 * scale)) // 64 * 64
    seconds = max(1.5, 5.0 * scale)
    # A batch's gather must take a small part of one lap of the ring: once a sampler slowed
    # by load cannot redraw its torn rows within a lap, every redraw is torn again and the
    # sample times out. 256 rows are ~2/3 of a lap of the smallest (4,096-step) ring at full
    # speed, so a small ring draws fewer rows (at most one per 64 steps held).
    batch = min(256, steps // 64)
    table = prioritized_table(W3_SPEC, 1, steps, Transition(next_columns=("obs",)), seed)
    ctx = mp.get_context("spawn")
    procs = []
    # The writer process holds one core: the sampler gathers on one thread, as the
    # runner's learner does next to its actors (an OpenMP team waiting on a busy
    # core stalls every gather), in both phases so the ratio compares like with like.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    try:
        rates: dict[str, float] = {}
        bases: list[tuple[int, int]] = []
        for phase in ("writer_solo", "concurrent"):
            go, stop, q = ctx.Event(), ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=_w3_writer, args=(table.storage.name, seconds, go, stop, q), daemon=True)
            proc.start()
            procs.append(proc)
            _, pos0, seq0 = q.get(timeout=120)
            bases.append((seq0, pos0))
            if phase == "concurrent":
                table.wait_until_ready(batch, timeout_s=60)
            else:
                stop.set()  # solo: the writer runs ``seconds``
            go.set()
            if phase == "concurrent":
                # sample for ``seconds``, and on until the seqlock has caught at least one
                # item overwritten mid-gather (a loaded machine may starve the writer for a while)
                samples, bad, start = 0, 0, time.perf_counter()
                while proc.is_alive():
                    s = table.sample(batch)
                    bad += verify_stamps(s, bases)
                    samples += 1
                    elapsed = time.perf_counter() - start
                    if elapsed >= seconds and (table.torn > 0 or elapsed >= seconds + 120):
                        if not stop.is_set():
                            rates["sampler_concurrent"] = samples / elapsed
                        stop.set()
                rates.setdefault("sampler_concurrent", samples / (time.perf_counter() - start))  # writer died early
                rates["torn_rows"] = bad
            rates[phase] = q.get(timeout=seconds + 180)[1]
            proc.join(timeout=30)
            table.scan()
            if phase == "writer_solo":
                samples, bad, start = 0, 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    s = table.sample(batch)
                    bad += verify_stamps(s, bases)
                    samples += 1
                rates["sampler_solo"] = samples / (time.perf_counter() - start)
                rates["torn_rows_solo"] = bad
        torn_rows = rates["torn_rows"] + rates["torn_rows_solo"]
        emit(_record("W3", "writer_steps_per_s", rates["concurrent"], "steps/s", rates["writer_solo"]))
        emit(_record("W3", "sampler_batches_per_s", rates["sampler_concurrent"], "batches/s", rates["sampler_solo"]))
        emit(_record("W3", "torn_or_corrupt_rows_returned", torn_rows, "rows"))
        emit(_record("W3", "torn_items_detected_and_resampled", table.torn, "items"))
        if torn_rows:
            raise GearflowError(f"W3: {torn_rows} sampled rows did not hold their item's steps (torn reads returned)")
        if not table.torn:
            raise GearflowError(
                "W3: no overwritten item was detected and redrawn while the writer ran, so the "
                "torn-read check proved nothing (ring too large for the write rate?)"
            )
    finally:
        torch.set_num_threads(threads)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
        table.close()


# ----------------------------------------------------------------------------- W4


def w4(emit: Emit, scale: float, seed: int) -> None:
    sizes = [10**5, 10**6, 10**7]
    if scale < 1:
        sizes = [max(10**3, int(s * scale)) for s in sizes]
    costs = {}
    for n in sizes:
        chunk_n = min(n, 65536)
        steps = -(-n // chunk_n) * chunk_n
        table = prioritized_table({"action": "int64", "reward": "float32"}, 1, steps + 1, Transition(next_columns=()), seed)
        try:
            writer = Writer(table.storage, [0])
            rng = np.random.default_rng(seed)
            chunk = random_steps(table.storage.spec, chunk_n, rng)
            for _ in range(steps // chunk_n):
                first = writer.extend(chunk)
                writer.create_items(rng.random(chunk_n) + 0.01, 1, streams=0, ends=first + np.arange(1, chunk_n + 1))
            table.scan()
            # best of 5 rounds (timeit's rule): the machine's noise only ever adds time
            t = min(timed(lambda: table.sample(256), max(0.2, 0.4 * scale), min_calls=50) for _ in range(5))
            costs[n] = t
            emit(_record("W4", f"sample_us_at_{n}_items", t * 1e6, "us"))
        finally:
            table.close()
    lo, hi = sizes[0], sizes[-1]
    emit(_record("W4", f"sample_cost_ratio_{hi}_vs_{lo}", costs[hi] / costs[lo], "x"))


def w5(emit: Emit, scale: float, seed: int) -> None:
    """The per-step hot paths (gearflow/bench/replay_hot.py)."""
    replay_hot.w5(emit, scale, seed)


WORKLOADS = {"W1": w1, "W2": w2, "W3": w3, "W4": w4, "W5": w5, "W6": replay_stack.w6}


def run(args, wanted: list[str], emit: Emit) -> int:
    """The CPU workloads (``--device cuda`` is dispatched to :mod:`gearflow.bench.replay_cuda` by
    :func:`gearflow.bench.main`, which imports this module's helpers: not the other way round)."""
    unknown = [w for w in wanted if w not in WORKLOADS]
    if unknown:
        raise GearflowError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    for name in wanted or list(WORKLOADS):
        WORKLOADS[name](emit, args.scale, args.seed)
    return 0

