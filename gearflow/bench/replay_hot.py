"""``gearflow bench replay --workloads W5``: the calls a learner and an actor make every step.

Each figure has its floor measured in the same run:

* ``priority_updates`` — ``Table.update_priorities`` of a batch of 256 keys in a
  table of 100,000 items, against the sum-tree update it performs (the same
  leaves set to the same masses, ``PrioritizedSelector.tree.set``).
* ``insert_with_ingest`` — W1's steps (Atari frames, 3-step items, calls of 64
  steps) written *and* ingested by the table (``Table.scan`` after every call),
  against a plain slice copy of the same bytes.
* ``sequence_insert_with_ingest`` — 64-step trajectories (obs float32[128]) with
  their windows of 32 every 16 steps, written and ingested, against the copy.
* ``single_stream`` — Reverb's per-step loop: ``TrajectoryWriter.append`` then
  ``create_item`` of a 3-step item, small steps (CartPole-sized), against a plain
  per-step copy of the same columns into preallocated arrays.
* ``busy_core_sample`` — W1 batches sampled while another process holds a core:
  the table's measured thread choice against torch's default thread count.

Floors for inserts are slice copies into a /dev/shm mapping, as the table's columns
are (4 KiB shared pages); the same copy into numpy's own memory (transparent huge
pages) is reported beside it.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from gearflow.bench import record
from gearflow.bench.common import copy_floor, prioritized_table, random_steps
from gearflow.replay import (
    RateLimiter,
    SharedStorage,
    Table,
    TableSpec,
    TrajectoryWriter,
    Writer,
    make_selector,
)
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition

Emit = Callable[[dict], None]
W1_SPEC = {"obs": "uint8[4,84,84]", "action": "int64", "reward": "float32", "done": "bool"}
SMALL_SPEC = {"obs": "float32[4]", "action": "int64", "reward": "float32", "done": "bool"}


def _rec(metric: str, value: float, unit: str, floor: float | None = None) -> dict:
    return record("replay", "W5", metric, value, unit, floor)


def _best(fn: Callable[[], float], rounds: int = 5) -> float:
    """Best of ``rounds`` (timeit's rule: this machine's noise only ever adds time)."""
    return min(fn() for _ in range(rounds))


def _per_call(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


# ----------------------------------------------------------------------------- priorities


def priority_updates(emit: Emit, scale: float, seed: int) -> None:
    n, B = max(4096, int(100_000 * scale)), 256
    table = prioritized_table({"action": "int64"}, 1, n, Transition(next_columns=()), seed)
    try:
        w = Writer(table.storage, [0])
        w.extend({"action": np.arange(n)})
        w.create_items(np.random.default_rng(seed).random(n) + 0.01, 1, streams=0, ends=np.arange(1, n + 1))
        table.scan()
        rng = np.random.default_rng(seed)
        batches = [table.sample(B) for _ in range(16)]
        keys = [b.keys.clone() for b in batches]
        prios = [torch.from_numpy(rng.random(B) + 0.01) for _ in batches]  # float64, as a learner's |δ|
        tree, alpha = table.selector.tree, table.selector.alpha
        P, R = table.storage.num_partitions, table.storage.items_per_partition
        # the floors: the sum-tree update the call performs, on the same slots and priorities —
        # the tree's own update (p ** alpha into the leaves, ancestors changed), and, for
        # comparison with earlier figures, masses re-summed into every ancestor (SumTree.set)
        own = [((k.numpy() % P) * R + (k.numpy() // P) % R, p.numpy()) for k, p in zip(keys, prios)]
        resum = []
        for slots, p in own:
            u, idx = np.unique(slots, return_index=True)
            resum.append((u, p[idx] ** alpha))
        has_own = hasattr(tree, "set_priorities")  # gearflow before the incremental update had none
        calls = max(200, int(4000 * scale))
        i = [0]

        def update() -> None:
            j = i[0] = (i[0] + 1) % len(keys)
            table.update_priorities(keys[j], prios[j])

        def tree_own() -> None:
            j = i[0] = (i[0] + 1) % len(own)
            tree.set_priorities(own[j][0], own[j][1], alpha)

        def tree_resum() -> None:
            j = i[0] = (i[0] + 1) % len(resum)
            tree.set(*resum[j])

        t_update = _best(lambda: _per_call(update, calls))
        t_resum = _best(lambda: _per_call(tree_resum, calls))
        t_tree = _best(lambda: _per_call(tree_own, calls)) if has_own else t_resum
        emit(_rec("priority_update_calls_per_s", 1 / t_update, "calls/s", 1 / t_tree))
        emit(_rec("priority_update_us", t_update * 1e6, "us"))
        emit(_rec("sum_tree_update_us", t_tree * 1e6, "us"))
        emit(_rec("sum_tree_resum_update_us", t_resum * 1e6, "us"))
    finally:
        table.close()


# ----------------------------------------------------------------------------- inserts


def insert_with_ingest(emit: Emit, scale: float, seed: int) -> None:
    steps = max(2048, int(100_000 * scale)) // 64 * 64
    rng = np.random.default_rng(seed)
    table = prioritized_table(W1_SPEC, 1, steps, Transition(next_columns=("obs",)), seed)
    try:
        spec = table.storage.spec
        writer = Writer(table.storage, [0])
        chunk = random_steps(spec, 64, rng)
        prios = rng.random(64) + 0.01
        offsets = np.arange(1, 65)

        def fill() -> float:
            start = time.perf_counter()
            for _ in range(steps // 64):
                first = writer.extend(chunk)
                ends = first + offsets  # an item ends after each step (3 steps: none before step 3)
                if first < 3:
                    ends = ends[ends >= 3]
                writer.create_items(prios[: ends.size], 3, streams=0, ends=ends)
                table.scan()
            return time.perf_counter() - start

        fill()  # first lap: pages fault in
        t = _best(fill, 3)
        t_floor = _best(lambda: copy_floor(chunk, steps), 3)
        t_floor_np = _best(lambda: copy_floor(chunk, steps, shared=False), 3)
        emit(_rec("insert_with_ingest_steps_per_s", steps / t, "steps/s", steps / t_floor))
        emit(_rec("insert_with_ingest_vs_numpy_memory_steps_per_s", steps / t, "steps/s", steps / t_floor_np))
    finally:
        table.close()


def sequence_insert_with_ingest(emit: Emit, scale: float, seed: int) -> None:
    P, L, T, period = 4, 64, 32, 16
    steps = max(16384, int(262_144 * scale)) // L * L
    rng = np.random.default_rng(seed)
    kind = Sequence(length=T, period=period)
    table = prioritized_table({"obs": "float32[128]", "action": "int64", "reward": "float32"}, P, steps, kind, seed,
                   R=steps // period + 2)  # fmt: skip
    try:
        spec = table.storage.spec
        writer = Writer(table.storage, list(range(P)))
        chunk = random_steps(spec, L, rng)
        window_ends = np.arange(T, L + 1, period)  # 32, 48, 64
        prios = rng.random(window_ends.size) + 0.01

        def fill() -> float:
            start = time.perf_counter()
            for _ in range(steps // L):
                for p in range(P):
                    first = writer.extend(chunk, stream=p)
                    writer.create_items(prios, T, streams=p, ends=first + window_ends)
                    writer.end_episode(p)
                table.scan()
            return time.perf_counter() - start

        fill()
        t = _best(fill, 3)
        t_floor = _best(lambda: copy_floor(chunk, steps), 3) * P
        emit(_rec("sequence_insert_with_ingest_steps_per_s", P * steps / t, "steps/s", P * steps / t_floor))
    finally:
        table.close()


def single_stream(emit: Emit, scale: float, seed: int) -> None:
    steps = max(2000, int(50_000 * scale))
    rng = np.random.default_rng(seed)
    table = prioritized_table(SMALL_SPEC, 1, 4096, Transition(next_columns=("obs",)), seed)
    try:
        spec = table.storage.spec
        writer = TrajectoryWriter(table.storage, 0)
        data = random_steps(spec, 64, rng)
        rows = [{k: v[i] for k, v in data.items()} for i in range(64)]

        def loop() -> float:
            start = time.perf_counter()
            for i in range(steps):
                writer.append(rows[i % 64])
                if writer.episode_length >= 3:
                    writer.create_item(priority=1.0, num_steps=3)
            return time.perf_counter() - start

        def floor() -> float:
            dst = {k: np.ones((4096, *v.shape[1:]), dtype=v.dtype) for k, v in data.items()}
            start = time.perf_counter()
            for i in range(steps):
                r = rows[i % 64]
                for k, col in dst.items():
                    col[i % 4096] = r[k]
            return time.perf_counter() - start

        loop()
        t = _best(loop, 3)
        t_floor = _best(floor, 3)
        emit(_rec("single_stream_items_per_s", steps / t, "items/s", steps / t_floor))
        emit(_rec("single_stream_us_per_item", t / steps * 1e6, "us"))
    finally:
        table.close()


def _spin(seconds: float) -> None:
    """A process holding a core (an actor's env loop, in a real run)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gather_threads(emit: Emit, scale: float, seed: int) -> None:
    """W1 batches sampled while another process spins on a core: the table's own thread
    choice against torch's default (all its threads), in the same run."""
    import multiprocessing as mp

    import inspect

    if torch.get_num_threads() < 2 or "num_threads" not in inspect.signature(Table).parameters:
        return  # one core (nothing to choose), or a gearflow without the choice
    steps = max(2048, int(50_000 * scale)) // 64 * 64
    rng = np.random.default_rng(seed)
    tables = {}
    try:
        for name, threads in (("chosen", None), ("torch_default", torch.get_num_threads())):
            storage = SharedStorage.create(TableSpec.parse(W1_SPEC), 1, steps)
            selector = make_selector("prioritized", steps, seed=seed, alpha=0.6, beta=0.4)
            t = tables[name] = Table(storage, Transition(next_columns=("obs",)), selector,
                                     RateLimiter(min_size_to_sample=1), num_buffers=1, num_threads=threads)  # fmt: skip
            w = Writer(storage, [0])
            chunk = random_steps(storage.spec, 64, rng)
            for _ in range(steps // 64):
                first = w.extend(chunk)
                w.create_items(np.ones(64), 1, streams=0, ends=first + np.arange(1, 65))
            t.scan()
        seconds = max(1.0, 4.0 * scale)
        proc = mp.get_context("spawn").Process(target=_spin, args=(2 * seconds + 30,), daemon=True)
        proc.start()
        try:
            time.sleep(0.5)
            rate = {}
            for name, t in tables.items():
                calls, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    t.sample(256)
                    calls += 1
                rate[name] = calls / (time.perf_counter() - start)
        finally:
            proc.terminate()
            proc.join(timeout=10)
        emit(_rec("busy_core_sample_batches_per_s", rate["chosen"], "batches/s", rate["torch_default"]))
        emit(_rec("busy_core_gather_threads_chosen", tables["chosen"].gather_threads.chosen(256) or 0, "threads"))
    finally:
        for t in tables.values():
            t.close()


def w5(emit: Emit, scale: float, seed: int) -> None:
    for fn in (priority_updates, insert_with_ingest, sequence_insert_with_ingest, single_stream, gather_threads):
        fn(emit, scale, seed)
