"""``gearflow bench replay --workloads W6``: Atari frames stored once, stacks gathered at sample time.

Two tables of the same steps, side by side in one run:

* *stacked copy* (today's layout): ``obs uint8[4,84,84]``, every step stores its whole stack;
* *frames*: ``obs uint8[4,84,84] stack=4``, every step stores its newest 84×84 frame (the
  actor's stacked observation sliced, ``obs[:, -1]``, no copy of the other three) and a
  one-byte offset in its episode; a sample gathers rows t-3..t of the item's episode.

Figures (each against the stacked-copy layout in the same run; the issue's targets):

* ``bytes_per_step`` — stored bytes per step (≤ 0.27 × today's), and ``ape_x_replay_GiB``,
  the segment of a 2 M-transition table (Ape-X's replay) in each layout;
* ``insert_steps_per_s`` — Ape-X inserts: chunks of 64 steps of one env (episodes of
  random length, a 4-step item per step), ``Writer.extend`` + ``create_items`` (≥ 3 ×);
  ``actor_insert_steps_per_s`` — the EnvPool actor's path, one ``Writer.append`` of 16
  streams per recv;
* ``sample_per_s`` — prioritized batches of 256 transitions (obs and next_obs), the
  learner's gather (≥ 0.8 ×).

:func:`check` is the stamp stress the tests run: a writer process writes frames that stamp
their own step, in episodes of known lengths, into small rings while this process samples;
every frame of every sampled stack is checked against the steps its first step's stamp and
its key name (a stack whose oldest frame was overwritten would show a later lap's stamp).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Callable

import numpy as np
import torch

from gearflow.bench import record
from gearflow.bench.common import prioritized_table
from gearflow.kinds.episode import Episode
from gearflow.kinds.sequence import Sequence
from gearflow.kinds.transition import Transition
from gearflow.replay import (
    RateLimiter,
    SharedStorage,
    Table,
    TableSpec,
    Writer,
    make_selector,
)
from gearflow.replay.rate_limiter import RateLimiterTimeout

Emit = Callable[[dict], None]
COPY_SPEC = {"obs": "uint8[4,84,84]", "action": "int64", "reward": "float32", "done": "bool"}
FRAME_SPEC = {**COPY_SPEC, "obs": "uint8[4,84,84] stack=4"}
APE_X_STEPS = 2_000_000  # transitions in Ape-X's Atari replay
N_STEP = 3


def _rec(metric: str, value: float, unit: str, floor: float | None = None) -> dict:
    return record("replay", "W6", metric, value, unit, floor)


def _table(spec: dict, P: int, S: int, seed: int) -> Table:
    # one gather thread for both layouts: on this shared 2-core box the measured choice of
    # GatherThreads follows the other processes' load and would differ between the two tables
    return prioritized_table(spec, P, S, Transition(next_columns=("obs",)), seed, num_threads=1)


def _episode_ends(steps: int, rng: np.random.Generator) -> np.ndarray:
    """Absolute ends of episodes (lengths 50..800, Pong-like with episodic life) over ``steps``."""
    lengths = rng.integers(50, 800, steps // 50 + 2)
    return np.cumsum(lengths)


def _plan(steps: int, n: int, first: int, ends: np.ndarray, rng) -> list[tuple]:
    """The calls of one lap of ``steps`` steps from absolute step ``first``: chunks of up to
    ``n`` steps cut at episode ends, each with the (n+1)-step items it completes (computed
    before the timing, so the figures are the writer's, not this loop's)."""
    plan, pos = [], first
    e = int(np.searchsorted(ends, pos, side="right"))
    ep0 = int(ends[e - 1]) if e else 0
    while pos < first + steps:
        m = min(n, first + steps - pos, int(ends[e]) - pos)
        item_ends = pos + np.arange(1, m + 1)
        item_ends = item_ends[item_ends - (N_STEP + 1) >= ep0]
        last = pos + m == ends[e]
        plan.append((m, rng.random(item_ends.size) + 0.01, item_ends, last))
        pos += m
        if last:
            ep0, e = pos, e + 1
    return plan


def _insert(writer: Writer, stacked: np.ndarray, other: dict, plan: list[tuple], frames: bool) -> float:
    """Write one lap of stream 0 (:func:`_plan`): ``extend`` + ``create_items`` per chunk,
    ``end_episode`` at episode ends; the frames layout writes ``stacked[:, -1]`` (a view of
    the actor's stacks). Seconds."""
    obs = stacked[:, -1] if frames else stacked  # (n, 84, 84) view, or (n, 4, 84, 84)
    cols = [{"obs": obs[:m], **{k: v[:m] for k, v in other.items()}} for m in range(len(stacked) + 1)]
    start = time.perf_counter()
    for m, prio, item_ends, last in plan:
        writer.extend(cols[m])
        writer.create_items(prio, N_STEP + 1, streams=0, ends=item_ends)
        if last:
            writer.end_episode(0)
    return time.perf_counter() - start


def _actor_insert(writer: Writer, stacked: np.ndarray, other: dict, recvs: int, frames: bool) -> float:
    """The EnvPool actor's row path: one ``append`` of all streams per recv. Seconds."""
    E = writer.num_streams
    obs = stacked[:E, -1] if frames else stacked[:E]
    row = {"obs": obs, **{k: v[:E] for k, v in other.items()}}
    start = time.perf_counter()
    for i in range(recvs):
        writer.append(row)
        if i % 500 == 499:
            writer.end_episode()
    return time.perf_counter() - start


def w6(emit: Emit, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    copy_spec, frame_spec = TableSpec.parse(COPY_SPEC), TableSpec.parse(FRAME_SPEC)
    # bytes per step, and the segment of an Ape-X-sized replay (2 M transitions, 1 partition)
    b_copy, b_frames = copy_spec.step_nbytes, frame_spec.step_nbytes + 1  # + the offset byte
    emit(_rec("bytes_per_step", b_frames, "B", b_copy))
    for name, spec in (("stacked_copy", copy_spec), ("frames", frame_spec)):
        emit(_rec(f"ape_x_replay_GiB_{name}", SharedStorage.segment_nbytes(spec, 1, APE_X_STEPS, APE_X_STEPS) / 2**30, "GiB"))

    S = max(4096, int(20_000 * scale))
    n = 64
    stacked = rng.integers(0, 255, (n, 4, 84, 84), dtype=np.uint8)  # what EnvPool returns: (n, 4, 84, 84)
    other = {"action": rng.integers(0, 6, n), "reward": rng.standard_normal(n).astype(np.float32),
             "done": np.zeros(n, bool)}  # fmt: skip
    ends = _episode_ends(4 * S, rng)
    tables = {"stacked_copy": _table(COPY_SPEC, 1, S, seed), "frames": _table(FRAME_SPEC, 1, S, seed)}
    try:
        writers = {k: Writer(t.storage, [0]) for k, t in tables.items()}
        secs: dict[str, list[float]] = {k: [] for k in tables}
        for lap in range(3):  # in turn, each layout's lap through its (warm) ring
            plan = _plan(S, n, lap * S, ends, rng)
            for k in tables:
                secs[k].append(_insert(writers[k], stacked, other, plan, k == "frames"))
        rate = {k: S / min(v) for k, v in secs.items()}
        emit(_rec("insert_steps_per_s", rate["frames"], "steps/s", rate["stacked_copy"]))
        for t in tables.values():
            t.scan()
        B = 256
        per = {}
        for _ in range(5):
            for k, t in tables.items():
                t.sample(B)  # warm
                calls, start = 0, time.perf_counter()
                while calls < 20 or time.perf_counter() - start < 0.5 * max(scale, 0.2):
                    t.sample(B)
                    calls += 1
                per.setdefault(k, []).append((time.perf_counter() - start) / calls)
        rate = {k: 1 / min(v) for k, v in per.items()}
        emit(_rec("sample_per_s", rate["frames"], "batches/s", rate["stacked_copy"]))
        emit(_rec("sample_frames_GB_per_s", rate["frames"] * B * 2 * 28224 / 1e9, "GB/s",
                  rate["stacked_copy"] * B * 2 * 28224 / 1e9))  # fmt: skip
    finally:
        for t in tables.values():
            t.close()
    E = 16
    tables = {"stacked_copy": _table(COPY_SPEC, E, 1024, seed), "frames": _table(FRAME_SPEC, E, 1024, seed)}
    try:
        big = rng.integers(0, 255, (E, 4, 84, 84), dtype=np.uint8)
        other_e = {"action": rng.integers(0, 6, E), "reward": np.zeros(E, np.float32), "done": np.zeros(E, bool)}
        writers = {k: Writer(t.storage, list(range(E))) for k, t in tables.items()}
        secs = {k: [] for k in tables}
        recvs = max(200, int(2000 * scale))
        for _ in range(3):
            for k in tables:
                secs[k].append(_actor_insert(writers[k], big, other_e, recvs, k == "frames"))
        rate = {k: recvs * E / min(v) for k, v in secs.items()}
        emit(_rec("actor_insert_steps_per_s", rate["frames"], "steps/s", rate["stacked_copy"]))
    finally:
        for t in tables.values():
            t.close()


# ---------------------------------------------------------------------- the stamp stress

FRAME = (32, 32)
STACK = 4
CYCLE = np.array([3 + e % 7 for e in range(7)])  # episode lengths of a cycle (3..9 steps): 42 steps
CYCLE_STEPS = int(CYCLE.sum())
_EP0 = np.r_[0, np.cumsum(CYCLE)[:-1]]  # first step of each episode in the cycle
OFFSET = np.concatenate([np.arange(L) for L in CYCLE])  # offset in its episode of each step of the cycle


def _kind(name: str):
    if name == "transition":
        return Transition(next_columns=("obs", "stamp"))
    if name == "sequence":
        return Sequence(length=6, period=3, burn_in=2)
    return Episode(max_episode_length=int(CYCLE.max()))


def _cycle_items(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(first steps, lengths) of the items of one cycle, in publish order."""
    starts, lengths = [], []
    kind = _kind(name)
    for e0, L in zip(_EP0.tolist(), CYCLE.tolist()):
        if name == "transition":  # a 4-step item (3-step return) at every step but the last
            for i in range(L - 1):
                starts.append(e0 + i)
                lengths.append(min(N_STEP + 1, L - i))
        elif name == "sequence":  # the WindowAdder's schedule
            for s in range(0, L, kind.period):
                m = min(kind.length, L - s)
                if m == kind.length or m > kind.burn_in or s == 0:
                    starts.append(e0 + s)
                    lengths.append(m)
        else:
            starts.append(e0)
            lengths.append(L)
    return np.array(starts), np.array(lengths)


def _frame_value(steps: np.ndarray) -> np.ndarray:
    return (steps % 251 + 1).astype(np.uint8)


def _stress_writer(name: str, kind_name: str, seconds: float, go, stop, out) -> None:
    """Write whole episodes (the cycle's lengths) into every partition, frames stamped."""
    torch.set_num_threads(1)
    storage = SharedStorage.attach(name)
    try:
        P = storage.num_partitions
        writer = Writer(storage, list(range(P)), insert_timeout_s=seconds + 30)
        starts, lengths = _cycle_items(kind_name)
        rng = np.random.default_rng(1)
        go.wait()
        begin, steps = time.perf_counter(), 0
        while not stop.is_set() and time.perf_counter() - begin < seconds:
            for p in range(P):
                base = int(writer.positions[p])  # a multiple of the cycle
                for e0, L in zip(_EP0.tolist(), CYCLE.tolist()):
                    t = base + e0 + np.arange(L)
                    writer.extend({"obs": np.broadcast_to(_frame_value(t)[:, None, None], (L, *FRAME)),
                                   "stamp": t}, stream=p)  # fmt: skip
                    mine = (starts >= e0) & (starts < e0 + L)
                    writer.create_items(rng.random(mine.sum()) + 0.01, lengths[mine], streams=p,
                                        ends=base + starts[mine] + lengths[mine])  # fmt: skip
                    writer.end_episode(p)
                steps += CYCLE_STEPS
        out.put(steps)
    finally:
        storage.close()


def _expected_frames(first: np.ndarray) -> np.ndarray:
    """Frame steps (…, STACK) of the stacks of steps ``first`` under the cycle's episodes."""
    back = np.arange(STACK - 1, -1, -1)
    depth = OFFSET[first % CYCLE_STEPS]
    return first[..., None] - np.minimum(back, depth[..., None])


def _check_batch(kind_name: str, P: int, starts: np.ndarray, sample) -> tuple[int, int]:
    """(rows whose first step is not the keyed item's, rows with a frame not of the stack's steps)."""
    keys = sample.keys.numpy()
    seq = keys // P
    want = (seq // starts.size) * CYCLE_STEPS + starts[seq % starts.size]
    stamp = sample.data["stamp"].numpy()
    obs = sample.data["obs"]
    if kind_name == "transition":
        bad_key = stamp != want
        torn = np.zeros(keys.size, bool)
        for col, steps in (("obs", stamp), ("next_obs", sample.data["next_stamp"].numpy())):
            pattern = torch.from_numpy(_frame_value(_expected_frames(steps)))  # (B, K)
            torn |= (sample.data[col] != pattern[..., None, None]).flatten(2).any(-1).any(-1).numpy()
        return int(bad_key.sum()), int(torn.sum())
    mask = sample.data["mask"].numpy()
    steps = want[:, None] + np.arange(stamp.shape[1])
    bad_key = ((stamp != steps) & mask).any(1)
    pattern = torch.from_numpy(_frame_value(_expected_frames(np.where(mask, stamp, 0))))  # (B, T, K)
    wrong = (obs != pattern[..., None, None]).flatten(3).any(-1).any(-1).numpy()  # (B, T)
    return int(bad_key.sum()), int((wrong & mask).any(1).sum())


def check(kind_name: str, seconds: float, steps: int = 256, partitions: int = 2, batch_size: int = 128,
          seed: int = 0, min_redraws: int = 0, trust_reach: bool = True, min_torn_stacks: int = 0,
          max_seconds: float | None = None, min_batches: int = 0, sample_timeout_s: float = 5.0) -> dict[str, int | float]:  # fmt: skip
    """Sample under a concurrent writer for ``seconds`` (on until ``min_redraws`` redraws,
    ``min_torn_stacks`` torn stacks and ``min_batches`` batches are seen, at most
    ``max_seconds``, default 3 × as long); counts of rows checked and wrong. ``trust_reach=False``
    puts back the rule without the stack's reach (first step ≥ RESERVE - S): the check must
    then find torn stacks (it is what proves the check can see them).

    The writer laps these tiny rings every millisecond or so: a sampler descheduled on a
    loaded machine can lose every redraw round of a sample for ``sample_timeout_s``, and the
    table then gives up with ``RateLimiterTimeout`` (as designed: it never returns torn rows).
    Such samples are counted (``gave_up``) and drawn again."""
    limit = 3 * seconds if max_seconds is None else max(float(max_seconds), seconds)
    spec = TableSpec.parse({"obs": f"uint8[{STACK},{FRAME[0]},{FRAME[1]}] stack={STACK}", "stamp": "int64"})
    storage = SharedStorage.create(spec, partitions, steps)
    P, R = storage.num_partitions, storage.items_per_partition
    selector = make_selector("prioritized", P * R, seed=seed, alpha=0.6, beta=0.4)
    table = Table(storage, _kind(kind_name), selector, RateLimiter(min_size_to_sample=1), num_buffers=1)
    if not trust_reach:
        table._S_trust = storage.steps_per_partition
    starts, _ = _cycle_items(kind_name)
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_stress_writer, args=(storage.name, kind_name, limit + 5, go, stop, out), daemon=True)
    rows = bad_keys = torn_rows = batches = gave_up = 0
    rng = np.random.default_rng(seed)
    try:
        proc.start()
        go.set()
        table.wait_until_ready(batch_size, timeout_s=60)
        begin = time.perf_counter()
        while proc.is_alive():
            elapsed = time.perf_counter() - begin
            if elapsed > limit or (elapsed > seconds and table.torn >= min_redraws and torn_rows >= min_torn_stacks
                                   and batches >= min_batches):  # fmt: skip
                break
            try:
                s = table.sample(batch_size, timeout_s=sample_timeout_s)
            except RateLimiterTimeout:
                gave_up += 1
                continue
            k, t = _check_batch(kind_name, P, starts, s)
            bad_keys, torn_rows, rows, batches = bad_keys + k, torn_rows + t, rows + batch_size, batches + 1
            table.update_priorities(s.keys, rng.random(batch_size) + 0.01)
        elapsed = time.perf_counter() - begin
        stop.set()
        written = out.get(timeout=limit + 60)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
        table.close()
    return {"rows_checked": rows, "bad_keys": bad_keys, "torn_stacks": torn_rows, "redrawn_items": table.torn,
            "batches": batches, "steps_written": written, "evictions": table.evictions, "seconds": elapsed,
            "gave_up": gave_up}  # fmt: skip
