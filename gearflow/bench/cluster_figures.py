"""The figures ``gearflow bench cluster --simulate`` models from (:mod:`gearflow.bench.cluster`),
measured on this machine by :func:`measure`.

**Measured** (one process each, on this machine; ``--quick`` shortens every timing):

* ``actor_env_steps_per_s`` (a): one actor process of the config (its env, ``num_envs`` /
  ``batch_size``, its agent acting ε-greedily, one torch thread) writing a shared-memory
  table (``bench/actors.py``'s ``actor_rate``).
* ``insert_steps_per_s`` (I): steps of the config's columns written in calls of 64 with their
  items *and ingested* (``Table.scan`` after each call): what a node's shard does per step.
* ``shard_sample_s`` [(b, t)]: seconds per prioritized sample of b items from a local table of
  the config's columns and item kind, at ``b = B`` and ``b = B/16`` (``B`` = ``learner.batch_size``).
* ``learn_s`` [(b, t)]: seconds per ``agent.learn`` on such batches, at ``b = B`` and ``B/4``, on
  the config's learner device.
* ``allreduce_s`` [(bytes, t)]: a gloo ``all_reduce`` between two processes on loopback, of
  8 bytes and of the learner network's gradient bytes (``param_bytes``).
* ``transport_*``: a shard service in its own process on loopback (``transport/bench.py``'s
  ``ShardProcess``): ``ShippingWriter`` writes (steps/s, bytes/s), ``RemoteSampler`` batches of
  ``B`` (batches/s with ``learner.prefetch`` requests ahead; p50/p99 latency with none ahead), the
  p50 latency of an 8-item sample (``transport_request_latency_us``: what a request costs besides
  its bytes), and ``transport_loopback_bytes_per_s``: the better of two byte rates a shard served on
  loopback, 28 KiB rows (``transport.bench.sample``) and the config's batch at its p50 latency.
* ``learner_loop_updates_per_s``, ``learner_loop_cpu_s``: gearflow's own learner loop
  (``Prefetcher`` + ``Learner.learn_step``, a CPU agent) over that shard: updates/s and CPU
  seconds per update (:func:`_learner_loop`; the model charges what exceeds the learn step).
* ``item_bytes`` (c): bytes of one sampled item (every column of the batch, next columns, key,
  weight, probability); ``step_bytes``: bytes stored per step.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from collections.abc import Callable

import numpy as np

from gearflow.bench.common import valid_rows
from gearflow.errors import GearflowError

__all__ = ["measure"]


def _item_steps(cfg, kind) -> tuple[int, int]:
    """(steps per item, steps between item ends) of the agent's items as an actor writes them."""
    from gearflow.kinds.sequence import Sequence
    from gearflow.kinds.transition import Transition

    if isinstance(kind, Transition):
        return int(cfg.actor.n_step) + 1, 1
    if isinstance(kind, Sequence):
        return int(kind.length), int(kind.period)
    raise GearflowError(f"bench cluster models transition and sequence items; agent {cfg.agent.name} samples "
                        f"{type(kind).__name__} items")  # fmt: skip


def _write(writer, chunk: dict, calls: int, length: int, period: int, rng, streams=(0,), after=None) -> int:
    """``calls`` extends of ``chunk`` per stream, with an item ending every ``period`` steps from the
    episode's start + ``length``; ``after()`` after each call. Returns the steps written."""
    n = len(next(iter(chunk.values())))
    for _ in range(calls):
        for s in streams:
            first = writer.extend(chunk, stream=s)
            ends = first + np.arange(1, n + 1)
            ends = ends[(ends - length >= writer.episode_starts([s])[0]) & ((ends - length) % period == 0)]
            if ends.size:
                writer.create_items(rng.random(ends.size) + 0.01, length, streams=s, ends=ends)
        if after is not None:
            after()
    return calls * n * len(streams)


def _best_threads(fn: Callable[[], object], seconds: float) -> float:
    """Seconds per call of ``fn`` with one torch thread and with torch's default, the faster: on a
    shared machine an intra-op thread that gets descheduled stalls every op of a small network
    (10-200 ms per CartPole learn step measured here, against ~1 ms on one thread)."""
    import torch

    from gearflow.bench.replay import timed

    threads = torch.get_num_threads()
    try:
        costs = []
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            costs.append(timed(fn, seconds, min_calls=3))
    finally:
        torch.set_num_threads(threads)
    return min(costs)


def _replay_figures(cfg, agent, num_actions: int, seconds: float, quick: bool, seed: int) -> dict:
    """Insert + ingest steps/s, shard sample seconds at B and B/16, learn seconds at B and B/4."""
    from gearflow.bench.common import prioritized_table
    from gearflow.bench.replay import timed
    from gearflow.replay import Writer
    from gearflow.replay.spec import replay_spec

    rng = np.random.default_rng(seed)
    spec = replay_spec(agent.replay_columns(), cfg.replay.frame_stack)
    kind = agent.item_kind()
    length, period = _item_steps(cfg, kind)
    B = int(cfg.learner.batch_size)
    # a ring past the caches (16 / 128 MiB), as a shard's is: a small hot ring writes at cache speed
    ring_bytes = (16 if quick else 128) << 20
    S = max(4 * B, 4 * length, 2048, ring_bytes // spec.stored_step_nbytes) // 64 * 64
    table = prioritized_table(spec.to_dict(), 1, S, kind, seed)
    try:
        writer = Writer(table.storage, [0])
        chunk = valid_rows(table.storage.spec, 64, num_actions, rng)
        _write(writer, chunk, S // 64, length, period, rng, after=table.scan)  # a first lap: pages fault in
        calls, t0 = 0, time.perf_counter()
        while calls < 8 or time.perf_counter() - t0 < seconds:
            calls += 1
            _write(writer, chunk, 1, length, period, rng, after=table.scan)
        insert = calls * 64 / (time.perf_counter() - t0)
        table.scan()
        sizes = sorted({B, max(1, B // 16)})
        sample_s = [[b, timed(lambda b=b: table.sample(b), seconds / 2)] for b in sizes]
        first = table.sample(1)
        item_bytes = sum(t[0].numel() * t.element_size() for t in first.data.values()) + 8 + 4 + 8  # + key, weight, prob

        agent.setup_learner()
        learn_s = []
        for b in sorted({B, max(1, B // 4)}):
            batches = []
            for _ in range(3):
                s = table.sample(b)  # views of a rotating buffer: keep copies
                batches.append(type(s)({k: v.clone() for k, v in s.data.items()}, s.keys.clone(), s.weights.clone(),
                                       s.probabilities.clone()))  # fmt: skip
            turn = iter(range(1 << 30))
            learn_s.append([b, _best_threads(lambda bs=batches, t=turn: agent.learn(bs[next(t) % 3]), seconds / 4)])
        params = agent.learner_network().parameters()
        param_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    finally:
        table.close()
    return {"insert_steps_per_s": insert, "shard_sample_s": sample_s, "learn_s": learn_s, "item_bytes": int(item_bytes),
            "step_bytes": int(spec.stored_step_nbytes), "param_bytes": int(param_bytes)}  # fmt: skip


def _allreduce_peer(port: int, sizes: list[int], rounds: int) -> None:
    """Rank 1 of the two-rank gloo all-reduce (a spawned process)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    try:
        for n in sizes:
            t = torch.ones(max(1, n // 4))
            for _ in range(rounds + 3):
                dist.all_reduce(t)
    finally:
        dist.destroy_process_group()


def _allreduce_figures(param_bytes: int, rounds: int) -> list[list[float]]:
    """Seconds per gloo all_reduce of 8 bytes and of ``param_bytes`` between this process and a
    spawned one on loopback (median of ``rounds``)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise GearflowError("bench cluster measures its all-reduce in a process group of its own; one is already set up")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sizes = [8, max(8, int(param_bytes))]
    peer = mp.get_context("spawn").Process(target=_allreduce_peer, args=(port, sizes, rounds), daemon=True)
    peer.start()
    out = []
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=__import__("datetime").timedelta(seconds=120))  # fmt: skip
        try:
            for n in sizes:
                t = torch.ones(max(1, n // 4))
                times = []
                for i in range(rounds + 3):
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    if i >= 3:  # 3 warm-up rounds
                        times.append(time.perf_counter() - t0)
                out.append([n, float(np.median(times))])
        finally:
            dist.destroy_process_group()
    finally:
        peer.join(60)
        if peer.is_alive():
            peer.kill()
    return out


def _transport_figures(cfg, agent, num_actions: int, seconds: float, seed: int, item_bytes: int) -> dict:
    """A shard of the config's columns in its own process on loopback: ShippingWriter write rate,
    RemoteSampler batch rate and latency at the config's batch; the 28 KiB-row loopback byte rate."""
    from gearflow.transport import bench as tb
    from gearflow.transport.actor import ShippingWriter
    from gearflow.transport.learner import RemoteSampler
    from gearflow.transport.learner.sampler import LEARNER_PREFETCH

    rng = np.random.default_rng(seed)
    B, E = int(cfg.learner.batch_size), 4
    length, period = _item_steps(cfg, agent.item_kind())
    columns = dict(agent.replay_columns())  # unstacked: ShippingWriter ships whole rows
    S = max(4096, 2 * B) // 64 * 64
    shard = tb.ShardProcess(columns, E, S)
    try:
        addr = ("127.0.0.1", shard.port)
        w = ShippingWriter(addr, num_streams=E, token=tb.TOKEN)
        chunk = valid_rows(w.storage.spec, 64, num_actions, rng)
        step_bytes = sum(v[0].nbytes for v in chunk.values())
        _write(w, chunk, S // 64 // 4, length, period, rng, streams=range(E))  # warm-up, and items to sample
        w.flush()
        steps, t0 = 0, time.perf_counter()
        while steps < 8 * 64 * E or time.perf_counter() - t0 < seconds:
            steps += _write(w, chunk, 1, length, period, rng, streams=range(E))
        w.flush()
        write = steps / (time.perf_counter() - t0)
        w.close()
        prefetch = max(1, int(cfg.learner.prefetch))
        sampler = RemoteSampler(addr, token=tb.TOKEN, prefetch=prefetch)
        sampler.sample(B)
        times = tb.call_times(lambda: sampler.sample(B), seconds / 2)
        batches_per_s = len(times) / sum(times)
        sampler.close()
        sampler = RemoteSampler(addr, token=tb.TOKEN, prefetch=0)
        sampler.sample(B)
        lat = np.array(tb.call_times(lambda: sampler.sample(B), seconds / 2)) * 1e6
        batch_bytes = B * item_bytes
        sampler.sample(8)
        small = np.array(tb.call_times(lambda: sampler.sample(8), seconds / 4)) * 1e6
        sampler.close()
        sampler = RemoteSampler(addr, token=tb.TOKEN, prefetch=LEARNER_PREFETCH)  # as a learner over shards
        loop_rate, loop_cpu = _learner_loop(cfg, agent, sampler, max(1.0, seconds))
        sampler.close()
    finally:
        shard.close()
    loop = tb.sample(max(0.3, seconds / 2))
    return {"transport_write_steps_per_s": write, "transport_write_bytes_per_s": write * step_bytes,
            "transport_sample_batches_per_s": batches_per_s,
            "transport_batch_latency_p50_us": float(np.percentile(lat, 50)),
            "transport_batch_latency_p99_us": float(np.percentile(lat, 99)),
            "transport_request_latency_us": float(np.percentile(small, 50)),
            "learner_loop_updates_per_s": loop_rate, "learner_loop_cpu_s": loop_cpu,
            "transport_loopback_28k_rows_bytes_per_s": loop["remote_gb_per_s"] * 1e9,
            "transport_loopback_bytes_per_s": max(loop["remote_gb_per_s"] * 1e9,
                                                  batch_bytes / (np.percentile(lat, 50) * 1e-6))}  # fmt: skip


def _learner_loop(cfg, agent, sampler, seconds: float) -> tuple[float, float]:
    """(updates/s, CPU seconds per update) of gearflow's own learner loop over ``sampler``: the
    ``Prefetcher`` drawing ``learner.batch_size`` ahead in its thread and ``Learner.learn_step``
    (the learn step, the priority write-back, weights published every ``learner.publish_every``
    into a parameter store). What one learner process spends per update besides the shards' side
    of the draw: the sum of the learn step and one sample request misses the batches' assembly,
    the write-back and the threads' contention (issue 34: 8 ms an update measured, 3.4 ms summed)."""
    import threading

    from gearflow.learner import Learner, Prefetcher, Progress
    from gearflow.params import ParameterStore

    agent.setup_learner()
    store = ParameterStore.create(agent.learner_network())
    learner = Learner(cfg.learner, agent, sampler, store, Progress(), run=cfg.run, env_steps=lambda: 0,
                      actor_version=lambda: 0)  # fmt: skip
    stop = threading.Event()
    pre = Prefetcher(sampler, learner.lock, int(cfg.learner.batch_size), max(1, int(cfg.learner.prefetch)), stop)
    try:
        for _ in range(10):  # warm-up: the optimizer's state, the first publications
            learner.learn_step(pre.get(timeout=120))
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while n < 20 or time.perf_counter() - t0 < seconds:
            learner.learn_step(pre.get(timeout=120))
            n += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        pre.close()
        store.close()
        store.unlink()
    return n / wall, cpu / n


def measure(config: str, quick: bool = False, seed: int = 0) -> dict:
    """The figures of one machine for ``config`` (see the module docstring); ~1-2 min, ``quick`` ~20 s."""
    import torch

    from gearflow.agent import make_agent, resolve_device
    from gearflow.bench.actors import DEFAULT_CONFIG, actor_rate
    from gearflow.config import load_config
    from gearflow.envs import make_vec_env

    path = str(config or DEFAULT_CONFIG)
    cfg = load_config(path, [f"run.seed={seed}"])
    seconds = 0.4 if quick else 3.0
    start = time.perf_counter()
    threads = torch.get_num_threads()
    env = make_vec_env(cfg.env, seed=0)
    num_actions = int(env.num_actions or 1)
    env_spec = env.env_spec
    env.close()
    torch.set_num_threads(1)  # an actor process acts on one thread
    try:
        actor = actor_rate(cfg, seconds, random_policy=False)
    finally:
        torch.set_num_threads(threads)
    device = resolve_device(cfg.learner.device)
    fig = {"config": path, "env": cfg.env.id, "agent": cfg.agent.name, "num_envs": int(cfg.env.num_envs),
           "learner_device": str(device), "torch_threads": threads, "batch_size": int(cfg.learner.batch_size),
           "samples_per_insert": float(cfg.replay.samples_per_insert), "prefetch": int(cfg.learner.prefetch),
           "actor_env_steps_per_s": actor}  # fmt: skip
    fig.update(_replay_figures(cfg, make_agent(cfg, env_spec, device), num_actions, seconds, quick, seed))
    fig["learner_updates_per_s"] = 1.0 / max(fig["learn_s"])[1]  # at B (for reading; the model uses learn_s)
    fig["sample_batches_per_s"] = 1.0 / max(fig["shard_sample_s"])[1]
    fig["allreduce_s"] = _allreduce_figures(fig["param_bytes"], 5 if quick else 20)
    fig.update(_transport_figures(cfg, make_agent(cfg, env_spec, "cpu"), num_actions, seconds, seed, fig["item_bytes"]))
    fig["quick"] = bool(quick)
    fig["measured_s"] = time.perf_counter() - start
    return fig
