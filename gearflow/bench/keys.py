"""``gearflow bench keys``: does every sampled row carry its own key under concurrent writes?

A writer process appends steps that stamp their own absolute index in a
``stamp`` column (and a byte pattern derived from it in ``obs``), creating
items on a fixed schedule in one endless episode per stream, so the key of an
item names the steps it must hold:

* transitions of ``n`` steps, one per step: item ``seq`` starts at step ``seq``;
* sequence windows of ``T`` steps every ``period``: item ``seq`` starts at ``seq * period``;
* episodes of exactly ``L`` steps: item ``seq`` starts at ``seq * L``.

This process samples as fast as it can and checks, for every row, that the
stamps are the steps the key names (``bad_keys``) and that every byte of the
row matches its stamp (``torn_rows``), with the priority of every key updated
from the batch. Small rings make the writer lap the sampler, so the seqlock
redraws (``redrawn_items``) and the reader lags a whole record ring: the two
paths where a row's key could name another item.

Each configuration prints one JSON record; ``gearflow bench keys --scale 12``
runs each for 60 s. ``check`` is what the tests call.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from gearflow.bench import record
from gearflow.errors import GearflowError
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
from gearflow.replay.storage import RESERVE

OBS_BYTES = 4 * 84 * 84  # Atari-sized rows (the other cases use smaller ones to check more rows)


@dataclass(frozen=True)
class Case:
    """One stress configuration."""

    name: str
    kind: str  # transition | sequence | episode
    steps: int  # steps per partition (S)
    records: int | None = None  # record ring (R); None: the table's default
    partitions: int = 2
    mode: str = "extend"  # extend: chunks + stream items; append: one step per call for every stream
    selector: str = "prioritized"
    n: int = 3  # transition steps, sequence length, episode length
    period: int = 4
    obs_bytes: int = OBS_BYTES


CASES = {
    c.name: c
    for c in (
        Case("transition_S8192_R=S", "transition", 8192, obs_bytes=1024),
        Case("transition_S8192_R256", "transition", 8192, records=256, obs_bytes=1024),
        Case("transition_S100k", "transition", 100_000, partitions=1, obs_bytes=1024),
        Case("transition_atari_S8192", "transition", 8192),
        Case("transition_append_S2048_R128", "transition", 2048, records=128, mode="append"),
        Case("sequence_S4096_R64", "sequence", 4096, records=64, n=16, period=8, obs_bytes=2048),
        Case("episode_S4096", "episode", 4096, n=20, obs_bytes=2048, selector="uniform"),
        Case("transition_fifo_S2048", "transition", 2048, records=256, selector="fifo", obs_bytes=2048),
    )
}


def _kind(case: Case):
    if case.kind == "transition":
        return Transition(next_columns=("obs",))
    if case.kind == "sequence":
        return Sequence(length=case.n, period=case.period)
    return Episode(max_episode_length=case.n)


def expected_start(case: Case, seq: np.ndarray) -> np.ndarray:
    """The first step of item ``seq`` of a partition under the writer's schedule."""
    if case.kind == "transition":
        return seq
    if case.kind == "sequence":
        return seq * case.period
    return seq * case.n


def _writer(name: str, case: Case, seconds: float, go, stop, out, allow=None) -> None:
    """Write stamped steps into every partition until ``stop`` is set (or ``seconds`` pass).

    ``allow`` (a shared int, the tests' paced mode): the writer does not write a chunk that
    would take any partition past that many steps; the sampler raises it as it makes progress."""
    torch.set_num_threads(1)
    storage = SharedStorage.attach(name)
    try:
        P = storage.num_partitions
        writer = Writer(storage, list(range(P)), insert_timeout_s=seconds + 30)
        rng = np.random.default_rng(1)
        chunk_n = 64 if case.kind == "transition" else case.n * 4
        chunk = {"obs": np.zeros((chunk_n, case.obs_bytes), np.uint8), "stamp": np.zeros(chunk_n, np.int64)}
        go.wait()
        start, steps = time.perf_counter(), 0
        while not stop.is_set() and time.perf_counter() - start < seconds:
            if allow is not None and int(writer.positions.max()) + chunk_n > allow.value:
                time.sleep(0.0005)  # paced: wait for the sampler's progress (it raises allow)
                continue
            if case.mode == "extend":
                for p in range(P):
                    steps += _extend(writer, case, p, chunk, rng)
            else:
                steps += _append(writer, case, rng)
        out.put(steps)
    finally:
        storage.close()


def _stamp(chunk: dict[str, np.ndarray], first: int) -> None:
    idx = np.arange(first, first + len(chunk["stamp"]))
    chunk["stamp"][:] = idx
    chunk["obs"][:] = (idx % 251 + 1).astype(np.uint8)[:, None]


def _extend(writer: Writer, case: Case, p: int, chunk, rng) -> int:
    n = len(chunk["stamp"])
    _stamp(chunk, int(writer.positions[p]))
    first = writer.extend(chunk, stream=p)
    ends = first + np.arange(1, n + 1)  # step indices that complete after each appended step
    if case.kind == "transition":
        ends = ends[ends >= case.n]
        writer.create_items(rng.random(ends.size) + 0.01, case.n, streams=p, ends=ends)
    elif case.kind == "sequence":
        ends = ends[(ends >= case.n) & ((ends - case.n) % case.period == 0)]
        writer.create_items(rng.random(ends.size) + 0.01, case.n, streams=p, ends=ends)
    else:  # chunk = 4 whole episodes of n steps
        for j in range(n // case.n):
            writer.create_items([rng.random() + 0.01], case.n, streams=p, ends=[first + (j + 1) * case.n])
    if case.kind == "episode":
        writer.end_episode(p)
    return n


def _append(writer: Writer, case: Case, rng) -> int:
    P = writer.num_streams
    pos = int(writer.positions[0])
    steps = {"obs": np.full((P, case.obs_bytes), pos % 251 + 1, np.uint8), "stamp": np.full(P, pos, np.int64)}
    writer.append(steps)
    if case.kind == "transition" and pos + 1 >= case.n:
        writer.create_items(rng.random(P) + 0.01, case.n)
    return P


def _check_batch(case: Case, P: int, sample) -> tuple[int, int]:
    """(rows whose stamps are not the keyed item's steps, rows whose bytes do not match their stamp)."""
    keys = sample.keys.numpy()
    stamp = sample.data["stamp"].numpy()
    obs = sample.data["obs"]
    want = expected_start(case, keys // P)
    if case.kind == "transition":
        bad_key = stamp != want
        first = torch.from_numpy((stamp % 251 + 1).astype(np.uint8))
        last = torch.from_numpy(((stamp + case.n - 1) % 251 + 1).astype(np.uint8))
        torn = (obs != first[:, None]).any(1) | (sample.data["next_obs"] != last[:, None]).any(1)
        return int(bad_key.sum()), int(torn.sum())
    mask = sample.data["mask"].numpy()
    steps = want[:, None] + np.arange(stamp.shape[1])
    bad_key = ((stamp != steps) & mask).any(1)
    pattern = torch.from_numpy((stamp % 251 + 1).astype(np.uint8))
    torn = ((obs != pattern[..., None]).any(-1) & sample.data["mask"]).any(1)
    return int(bad_key.sum()), int(torn.sum())


def check(
    case: Case, seconds: float, batch_size: int = 256, seed: int = 0, min_redraws: int = 0, max_seconds: float | None = None,
    lap_every: int = 0, paced: bool | None = None,
) -> dict[str, int | float]:
    """Run one configuration for ``seconds``, or on until ``min_redraws`` items were redrawn
    (at most ``max_seconds``); the counts of what was checked and what was wrong.

    ``lap_every``: every that many samples, the sampler waits after its gather, before the
    seqlock re-check, until the writer has written a whole ring past every partition's
    position at the draw (progress, not time: it reads the counters), so that sample's items
    are overwritten mid-gather and redrawn however loaded the machine is (the tests).

    ``paced`` (default: on when ``lap_every`` is): the writer stays at most two rings ahead of
    where the partitions stood at the sampler's last completed sample (or past a forced lap's
    target), so a sampler descheduled on a loaded machine redraws a bounded number of times
    instead of losing every round to a writer that never stops (``RateLimiterTimeout`` after
    the sample timeout, seen in CI). Unpaced (the benchmark) the writer runs flat out."""
    max_seconds = max(seconds, max_seconds or seconds)
    spec = TableSpec.parse({"obs": f"uint8[{case.obs_bytes}]", "stamp": "int64"})
    storage = SharedStorage.create(spec, case.partitions, case.steps, case.records)
    P, R = storage.num_partitions, storage.items_per_partition
    kwargs = {"alpha": 0.6, "beta": 0.4} if case.selector == "prioritized" else {}
    selector = make_selector(case.selector, P * R, seed=seed, **kwargs)
    table = Table(storage, _kind(case), selector, RateLimiter(min_size_to_sample=1), num_buffers=1)
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    paced = bool(lap_every) if paced is None else paced
    S, counters = storage.steps_per_partition, storage.counters
    allow = ctx.RawValue("q", 2 * S) if paced else None

    def grant(steps: int) -> None:
        if allow is not None and steps > allow.value:
            allow.value = steps

    proc = ctx.Process(target=_writer, args=(storage.name, case, max_seconds + 5, go, stop, out, allow), daemon=True)
    rows = bad_keys = torn_rows = batches = applied = 0
    rng = np.random.default_rng(seed)
    if lap_every:
        _lap_the_gather(table, proc, lambda: lap_every and batches % lap_every == lap_every - 1, grant)
    try:
        proc.start()
        go.set()
        _wait_for_first_item(table, proc)
        start = time.perf_counter()
        while proc.is_alive():
            elapsed = time.perf_counter() - start
            if elapsed > max_seconds or (elapsed > seconds and table.torn >= min_redraws):
                break
            s = table.sample(batch_size)
            k, t = _check_batch(case, P, s)
            bad_keys, torn_rows, rows, batches = bad_keys + k, torn_rows + t, rows + batch_size, batches + 1
            applied += table.update_priorities(s.keys, rng.random(batch_size) + 0.01)
            grant(int(counters[:, RESERVE].min()) + 2 * S)
        elapsed = time.perf_counter() - start
        stop.set()
        written = out.get(timeout=max_seconds + 60)
        proc.join(timeout=30)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
        table.close()
    return {
        "rows_checked": rows,
        "bad_keys": bad_keys,
        "torn_rows": torn_rows,
        "redrawn_items": table.torn,
        "batches": batches,
        "steps_written": written,
        "evictions": table.evictions,
        "priority_updates_applied": applied,
        "seconds": elapsed,
    }


def _wait_for_first_item(table: Table, proc, guard_s: float = 900.0) -> None:
    """Wait until the writer process published an item: as long as it is alive (a spawned
    process importing torch on a loaded machine can take minutes), up to ``guard_s``."""
    from gearflow.replay.rate_limiter import RateLimiterTimeout

    deadline = time.monotonic() + guard_s
    while True:
        try:
            table.wait_until_ready(1, timeout_s=5)
            return
        except RateLimiterTimeout:
            if not proc.is_alive():
                raise GearflowError(f"the stamp writer process exited (code {proc.exitcode}) before writing an item") from None
            if time.monotonic() > deadline:
                raise


def _lap_the_gather(table: Table, proc, due: Callable[[], bool], grant: Callable[[int], None]) -> None:
    """Make ``table``'s first gather of each sample for which ``due()`` holds wait until every
    partition's RESERVE is a whole ring past where it stood (the writer ``proc`` laps it;
    ``grant`` lets a paced writer go that far)."""
    gather, counters, S = table._gather, table.storage.counters, table.storage.steps_per_partition

    def lapped(slots, rec, out, only=None, tensors=None):
        target = counters[:, RESERVE] + S if only is None and due() else None
        if target is not None:
            grant(int(target.max()) + S)
        gather(slots, rec, out, only=only, tensors=tensors)
        while target is not None and (counters[:, RESERVE] < target).any() and proc.is_alive():
            time.sleep(0.0005)

    table._gather = lapped


def run(args, wanted: list[str], emit: Callable[[dict], None]) -> int:
    unknown = [w for w in wanted if w not in CASES]
    if unknown:
        raise GearflowError(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    seconds = max(2.0, 5.0 * args.scale)
    failed = 0
    for name in wanted or list(CASES):
        res = check(CASES[name], seconds, seed=args.seed)
        failed += res["bad_keys"] + res["torn_rows"]
        for metric in ("rows_checked", "bad_keys", "torn_rows", "redrawn_items", "steps_written"):
            unit = "rows" if "rows" in metric or metric == "bad_keys" else ("items" if "items" in metric else "steps")
            emit(record("keys", name, metric, res[metric], unit))
    return 1 if failed else 0
