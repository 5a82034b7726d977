"""Data-parallel learners on this machine's CPUs: updates/s of one learner vs K ranks with the
same global batch, and what the collectives cost (``python -m gearflow.bench.data_parallel``).

Each figure is one JSON line. The learner is the config's agent (apex DQN on CartPole by
default) built as the runner builds it, learning from batches made before the clock starts
(the replay is not measured here: ``gearflow bench replay`` is), in the loop the learner runs
with ``learner.world_size > 1``: ``agree()`` then ``learn()`` (one gradient all_reduce inside
the optimizer step). Rows:

* ``single``: one process, the global batch ``B``, ``--threads`` torch threads;
* ``share``: one process, ``B / K`` items, one thread: the compute floor of one rank;
* ``ranks``: K spawned ranks (gloo on loopback, one thread each), ``B / K`` items each:
  global updates/s, the mean time of the gradient all_reduce and of ``agree`` per update;
* ``allreduce``: a bare gloo all_reduce of the gradient's size between the K ranks (the floor
  of the gradient all_reduce).

On a 2-core machine K = 2 ranks use both cores; ``single`` with ``--threads 2`` is the fair
comparison (the same cores), ``--threads 1`` the one-core one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import time

import torch
from omegaconf import OmegaConf

from gearflow.replay.spec import TableSpec
from gearflow.replay.table import Sample


def make_learner_agent(config: str, overrides=(), seed: int = 0, device: str = "cpu"):
    """``(cfg, agent)``: the config's agent on ``device``, built as the runner builds it (env spec
    from a one-env probe, ``make_agent``, ``setup_learner``) after ``torch.manual_seed(seed)``."""
    from gearflow.agent import make_agent
    from gearflow.config import load_config
    from gearflow.envs import make_vec_env

    cfg = load_config(config, [f"run.seed={seed}", f"learner.device={device}", *overrides])
    probe = make_vec_env(OmegaConf.merge(cfg.env, {"num_envs": 1, "batch_size": 1}), seed=cfg.env.seed)
    env_spec = probe.env_spec
    probe.close()
    torch.manual_seed(seed)
    agent = make_agent(cfg, env_spec, torch.device(device))
    agent.setup_learner()
    return cfg, agent


def _batches(agent, size: int, n: int, seed: int):
    return [random_batch(agent, size, seed=seed + i) for i in range(n)]


def random_batch(agent, size: int, seed: int, key0: int = 0) -> Sample:
    """A batch of ``size`` random rows of the agent's replay columns (plus its item's ``next_*`` columns), fixed IS weights."""
    g = torch.Generator().manual_seed(seed)
    spec = TableSpec.parse(agent.replay_columns())
    data = {}
    for c in spec.columns:
        dtype = getattr(torch, c.dtype.name)
        if c.name == "action" and not dtype.is_floating_point:
            data[c.name] = torch.randint(0, agent.num_actions, (size,), generator=g)
        elif c.name == "action":  # continuous actions: in [-1, 1], inside any box the agent normalises by
            data[c.name] = (torch.rand(size, *c.shape, generator=g) * 2 - 1).to(dtype)
        elif c.name == "disc":
            data[c.name] = torch.rand(size, generator=g)
        elif dtype.is_floating_point:
            data[c.name] = torch.randn(size, *c.shape, generator=g).to(dtype)
        else:
            data[c.name] = torch.zeros(size, *c.shape, dtype=dtype)
    for name in agent.item_kind().next_columns:
        data[f"next_{name}"] = torch.randn(data[name].shape, generator=g).to(data[name].dtype)
    weights = torch.rand(size, generator=g) * 0.5 + 0.5
    return Sample(data, torch.arange(key0, key0 + size), weights, torch.full((size,), 1.0 / size, dtype=torch.float64))


def share(batch: Sample, rank: int, world: int) -> Sample:
    """Rank ``rank``'s rows of a global batch."""
    n = len(batch.keys) // world
    rows = slice(rank * n, (rank + 1) * n)
    return Sample({k: v[rows] for k, v in batch.data.items()}, batch.keys[rows], batch.weights[rows],
                  batch.probabilities[rows])  # fmt: skip


def _time_learn(agent, batches, updates: int, warmup: int, parallel=None) -> float:
    """Updates/s of ``updates`` learn steps after ``warmup`` (with ``agree`` when data-parallel)."""
    for i in range(warmup + updates):
        if i == warmup:
            if parallel is not None:
                parallel.stats()  # reset the collective timers
                torch.distributed.barrier()
            t0 = time.perf_counter()
        if parallel is not None:
            parallel.agree(True, False)
        agent.learn(batches[i % len(batches)])
    return updates / (time.perf_counter() - t0)


def _rank(rank, world, port, args, out):
    torch.set_num_threads(1)
    from gearflow.distributed import DataParallel

    cfg, agent = make_learner_agent(args.config, args.override, seed=rank)
    batches = _batches(agent, args.batch // world, 8, seed=1000 * rank)
    with DataParallel(rank, world, f"127.0.0.1:{port}", "gloo", timeout_s=120) as parallel:
        parallel.setup(agent)
        ups = _time_learn(agent, batches, args.updates, args.warmup, parallel)
        stats = parallel.stats()
        n = sum(p.numel() for p in agent.learner_network().parameters())
        buf = torch.zeros(n + len(list(agent.learner_network().parameters())))
        for _ in range(20):
            torch.distributed.all_reduce(buf)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(args.updates):
            torch.distributed.all_reduce(buf)
        bare = (time.perf_counter() - t0) / args.updates
    if rank == 0:
        out.put({"ups": ups, **stats, "bare_ms": 1e3 * bare, "grad_values": n})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/cartpole_apex.yaml")
    ap.add_argument("--override", nargs="*", default=[], help="config dotlist, e.g. agent.hidden_sizes=[1024,1024]")
    ap.add_argument("--batch", type=int, default=128, help="global batch B")
    ap.add_argument("--world", type=int, default=2, help="ranks K")
    ap.add_argument("--updates", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="torch threads of the single learner")
    args = ap.parse_args(argv)
    common = {"config": args.config, "override": args.override, "B": args.batch, "K": args.world}

    _, agent = make_learner_agent(args.config, args.override)
    params = sum(p.numel() for p in agent.learner_network().parameters())
    for threads in args.threads:
        torch.set_num_threads(threads)
        _, agent = make_learner_agent(args.config, args.override)
        ups = _time_learn(agent, _batches(agent, args.batch, 8, seed=0), args.updates, args.warmup)
        print(json.dumps({"bench": "data_parallel", "row": "single", **common, "threads": threads,
                          "updates_per_s": round(ups, 1), "grad_values": params}), flush=True)  # fmt: skip
    torch.set_num_threads(1)
    _, agent = make_learner_agent(args.config, args.override)
    ups = _time_learn(agent, _batches(agent, args.batch // args.world, 8, seed=0), args.updates, args.warmup)
    print(json.dumps({"bench": "data_parallel", "row": "share", **common, "threads": 1,
                      "items": args.batch // args.world, "updates_per_s": round(ups, 1)}), flush=True)  # fmt: skip

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    r = out.get(timeout=600)
    for p in procs:
        p.join()
    print(json.dumps({"bench": "data_parallel", "row": "ranks", **common, "threads": 1,
                      "updates_per_s": round(r["ups"], 1),
                      "grad_allreduce_ms": round(r["learner/grad_allreduce_ms"], 3),
                      "agree_ms": round(r["learner/agree_ms"], 3)}), flush=True)  # fmt: skip
    print(json.dumps({"bench": "data_parallel", "row": "allreduce", **common, "grad_values": r["grad_values"],
                      "bytes": 4 * r["grad_values"], "ms": round(r["bare_ms"], 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
