"""``gearflow bench learner``: the learner loop against its own floor, per reference agent.

For each config (``--config``, repeated or comma-separated; default on ``--device cpu``
``cartpole_apex``, ``halfcheetah_dpg``, ``cartpole_masked_r2d2``; on ``cuda`` ``pong_apex``,
``halfcheetah_dpg``, ``paper/mat_2m``, ``paper/gato_80m`` (bf16)), in one run:

* **the floor**: ``agent.learn`` alone on batches already on the learner's device (3 batches
  drawn from the table, copied there once, learned in turn): ``learn_updates_per_s``. The floor
  and the loops run in alternating slices of ~0.5 s (at least 3; medians), with the torch threads
  and the GIL switch interval ``gearflow train`` gives a learner (on a CPU: the cores the config's
  actors leave; 0.5 ms).
* **the full loop**: gearflow's own ``Learner.run`` fed by a ``Prefetcher`` over a replay table
  filled before (the config's columns, item kind, selector and batch buffers; random rows; no
  actors, no rate limit), publishing weights into a parameter store every
  ``learner.publish_every``: ``loop_updates_per_s`` with the floor beside it and their ratio
  (and ``loop_tokens_per_s``: valid steps learned from, for sequence items), the loop's
  ``wait_fraction``. On ``cuda`` the loop runs twice, with the CPU table and with the CUDA table
  (``replay.device=cuda``, where CuPy runs), as workloads ``NAME/replay_cpu`` and ``NAME/replay_cuda``.
* **host reads and aten ops per update** of the learner's thread over 50 steady updates of the
  loop (20 on ``cuda``) (:class:`gearflow.learner.syncs.HostReads`: ``.item()``/``float()``/``.tolist()``/``.numpy()``/
  ``.cpu()`` and every aten op; a metric row falls outside them).
* **FLOPs**: ``learn_gflop_per_update`` (``torch.utils.flop_counter`` over one learn step); on
  ``cuda`` the achieved ``learn_tflops`` of the floor with a bf16 8192³ matmul's TFLOP/s measured
  in the same run as its floor (the ratio is the fraction of it).
* On ``cuda`` every figure twice: the eager learn step (workload ``NAME``) and ``learner.graph``
  (``NAME/graph``: each form of the update replayed from a CUDA graph, floor and loop alike).

And once per run, workload ``noop``: the loop with a do-nothing agent (``learn`` returns at once)
over a filled table of ``cartpole_apex``'s: ``loop_cpu_us_per_update`` (the learner thread's CPU time per
update) against a bare loop taking the same batches off a queue and calling the same agent (its
floor; here ``ratio`` > 1 is slower), and ``loop_wall_us_per_update``.

``--seconds`` (default 2 on ``cpu``, 1 on ``cuda``, × ``--scale``) is each timed phase; the default
``--device cuda`` run (four configs, both forms, both tables) is sized for ~60-90 s on an H200.
``--budget-s B`` bounds the whole run: each config (in order: the reference agents first, gato_80m
last) gets an equal share of what is left; where its share is spent, its later rounds (after the
first) and its graph form are cut, and a config that cannot start is named skipped on stderr and
in the exit code's place stays 0 (``launch/gpu_check.sh`` calls ``gearflow bench learner --device
cuda --json --seconds 0.6 --budget-s`` its step's limit less 5 s; the do-nothing loop goes first
there, being cheap and the same on every machine). Lines are ``record``'s JSON
(``gearflow/bench/__init__.py``); ``--json`` prints only them.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gearflow.bench import record
from gearflow.bench.common import valid_rows
from gearflow.errors import GearflowError

__all__ = ["CPU_CONFIGS", "CUDA_CONFIGS", "NullAgent", "filled_table", "run"]

Emit = Callable[[dict], None]
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
CPU_CONFIGS = ("cartpole_apex", "halfcheetah_dpg", "cartpole_masked_r2d2")
CUDA_CONFIGS = ("pong_apex", "halfcheetah_dpg", "paper/mat_2m", "paper/gato_80m")
OVERRIDES = {"paper/gato_80m": ["learner.bf16=true"]}  # measured as the GPU run trains it
COUNTED_UPDATES = {"cpu": 50, "cuda": 20}  # steady updates whose host reads and aten ops are counted


def _item_steps(cfg, kind) -> tuple[int, int]:
    """(rows per item, rows between item ends) of the agent's items, as its actors write them."""
    from gearflow.kinds.sequence import Sequence
    from gearflow.kinds.transition import Transition

    if isinstance(kind, Transition):
        return int(cfg.actor.n_step) + 1, 1
    if isinstance(kind, Sequence):
        return int(kind.length), int(kind.period)
    raise GearflowError(f"bench learner fills transition and sequence items; agent {cfg.agent.name} samples "
                        f"{type(kind).__name__} items")  # fmt: skip


def filled_table(cfg, agent, *, device: str = "cpu", steps_per_partition: int = 4096, partitions: int = 2,
                 seed: int = 0, tag: int = 0):  # fmt: skip
    """A replay table of ``agent``'s columns and items as the runner makes it for ``cfg`` (selector,
    buffer sets for ``learner.prefetch``, ``device``), of ``partitions`` × ``steps_per_partition``
    rows, every row written with random values and every item an actor would create over them
    committed (random priorities); no rate limit (nothing inserts while a benchmark samples)."""
    from omegaconf import OmegaConf

    from gearflow.geometry import ReplayGeometry
    from gearflow.replay import Writer
    from gearflow.replay.items import records_per_partition
    from gearflow.replay.spec import replay_spec
    from gearflow.run.tables import make_table

    rng = np.random.default_rng(seed)
    kind = agent.item_kind()
    length, period = _item_steps(cfg, kind)
    S = max(int(steps_per_partition), 4 * length) // 64 * 64
    geom = ReplayGeometry(1, int(partitions), S, records_per_partition(kind, S))
    replay = OmegaConf.merge(cfg.replay, {"samples_per_insert": 0.0, "min_size_to_sample": 1})
    spec = replay_spec(agent.replay_columns(), cfg.replay.frame_stack)
    table = make_table(replay, kind, spec, geom, device, tag, seed=seed, prefetch=int(cfg.learner.prefetch))
    try:
        writer = Writer(table.storage, list(range(geom.num_partitions)))
        num_actions = int(getattr(agent, "num_actions", 0) or 1)
        rows = valid_rows(table.storage.spec, 64, num_actions, rng)
        for _ in range(S // 64):
            for s in range(geom.num_partitions):
                first = writer.extend(rows, stream=s)
                ends = first + np.arange(1, 65)
                ends = ends[(ends - length >= writer.episode_starts([s])[0]) & ((ends - length) % period == 0)]
                if ends.size:
                    writer.create_items(rng.random(ends.size) + 0.01, length, streams=s, ends=ends)
        table.scan()
    except BaseException:
        table.close()
        raise
    return table


class NullAgent:
    """The do-nothing agent: ``learn`` returns a constant metric and the same priorities at once,
    so a loop around it costs only the loop."""

    bf16 = False

    def __init__(self, batch_size: int):
        self.net = torch.nn.Linear(1, 1)
        self.priorities = torch.ones(batch_size)

    def learner_network(self) -> torch.nn.Module:
        return self.net

    def learn(self, batch):
        return {"learner/loss": 0.0}, self.priorities


# ----------------------------------------------------------------------------- pieces


def config_path(name: str) -> Path:
    """``pong_apex`` / ``paper/mat_2m`` / a path → the YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    q = CONFIG_DIR / f"{name}.yaml"
    if not q.exists():
        raise GearflowError(f"bench learner --config {name!r}: neither a YAML file nor a config under {CONFIG_DIR}")
    return q


def _name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(CONFIG_DIR.resolve()).with_suffix(""))
    except ValueError:
        return path.stem


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _env_spec(cfg):
    from omegaconf import OmegaConf

    from gearflow.envs import make_vec_env

    env = make_vec_env(OmegaConf.merge(cfg.env, {"num_envs": 1, "batch_size": 1}), seed=0)
    try:
        return env.env_spec
    finally:
        env.close()


def _on_device(sample, device: torch.device):
    """A private copy of ``sample`` on ``device`` (the floor's batches: nothing left to move)."""
    from gearflow.replay import Sample

    return Sample(data={k: v.to(device).clone() for k, v in sample.data.items()}, keys=sample.keys.clone(),
                  weights=sample.weights.to(device).clone(), probabilities=sample.probabilities.clone())  # fmt: skip


def _tokens(sample) -> int:
    mask = sample.data.get("mask")
    return len(sample.keys) if mask is None else int(mask.sum())


def learn_floor(agent, batches: list, device: torch.device, seconds: float) -> float:
    """Updates/s of ``agent.learn`` alone over ``batches`` (on the device already), in turn."""
    for i in range(3):  # warm-up: the optimizer's state, cuBLAS, the allocator
        agent.learn(batches[i % len(batches)])
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while n < 5 or time.perf_counter() - t0 < seconds:
        agent.learn(batches[n % len(batches)])
        n += 1
    _sync(device)
    return n / (time.perf_counter() - t0)


def _learner(cfg, agent, table, store, device, max_updates: int = 0, log_every_s: float | None = None):
    from omegaconf import OmegaConf

    from gearflow.learner import Learner, Progress

    run = OmegaConf.merge(cfg.run, {"max_updates": int(max_updates), "max_seconds": 0, "max_env_steps": 0,
                                    "stop_at_return": 0, "checkpoint_every": "0"})  # fmt: skip
    if log_every_s is not None:
        run.log_every_s = float(log_every_s)
    progress, stop = Progress(), threading.Event()
    learner = Learner(cfg.learner, agent, table, store, progress, run=run, env_steps=lambda: 0,
                      actor_version=lambda: 0, device=device, stop=stop)  # fmt: skip
    return learner, progress, stop


def loop_rate(cfg, agent, table, device: torch.device, seconds: float) -> dict:
    """The full loop (``Learner.run`` + ``Prefetcher`` over ``table``) for ``seconds`` after a
    warm-up: updates/s, tokens/s, the wait fraction, the learner thread's CPU per update."""
    from gearflow.learner import Prefetcher
    from gearflow.params import ParameterStore

    store = ParameterStore.create(agent.learner_network())
    learner, progress, stop = _learner(cfg, agent, table, store, device)
    B = int(cfg.learner.batch_size)
    pre = Prefetcher(table, learner.lock, B, max(1, int(cfg.learner.prefetch)), stop, progress)
    try:
        for _ in range(5):  # warm-up (not counted: the loop below counts from here)
            learner.learn_step(pre.get(timeout=300))
        _sync(device)
        learner.read_pending()  # the warm-up's tokens counted now, not in the timed part
        u0, w0, l0, tok0 = progress.updates, progress.wait_s, progress.learn_s, progress.tokens
        end = [0.0]
        t0, c0 = time.perf_counter(), time.thread_time()
        end[0] = t0 + seconds
        learner.run(pre.next_batch, between=lambda: "time" if time.perf_counter() >= end[0] else "")
        _sync(device)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        learner.read_pending()
        n = progress.updates - u0
        wait, learn = progress.wait_s - w0, progress.learn_s - l0
    finally:
        stop.set()
        pre.close()
        store.close()
    return {"updates_per_s": n / wall, "tokens_per_s": (progress.tokens - tok0) / wall,
            "wait_fraction": wait / max(1e-9, wait + learn), "cpu_us_per_update": 1e6 * cpu / max(1, n),
            "wall_us_per_update": 1e6 * wall / max(1, n), "updates": n}  # fmt: skip


def host_reads(cfg, agent, table, device: torch.device, updates: int = 0) -> tuple[float, float] | None:
    """(host reads, aten ops) per update of the learner's thread over ``updates`` steady updates of
    the full loop (after 5 of warm-up; 0: ``COUNTED_UPDATES`` of the device); None where this gearflow
    has no counter."""
    updates = updates or COUNTED_UPDATES[device.type]
    try:
        from gearflow.learner.syncs import HostReads
    except ImportError:  # an older gearflow (a benchmark of the code before it)
        return None
    from gearflow.learner import Prefetcher
    from gearflow.params import ParameterStore

    store = ParameterStore.create(agent.learner_network())
    learner, progress, stop = _learner(cfg, agent, table, store, device, max_updates=5 + updates, log_every_s=1e9)
    pre = Prefetcher(table, learner.lock, int(cfg.learner.batch_size), max(1, int(cfg.learner.prefetch)), stop,
                     progress)  # fmt: skip
    try:
        with HostReads() as reads:

            def next_batch():
                if progress.updates == 5:
                    _sync(device)
                    reads.reset()
                return pre.next_batch()

            learner.run(next_batch)
            counted = (reads.host_reads / updates, reads.aten_ops / updates)
            if reads.host_reads:
                print(f"bench learner: host reads at {reads.sites}", file=sys.stderr, flush=True)
    finally:
        stop.set()
        pre.close()
        store.close()
    return counted


def learn_flops(agent, batch) -> float:
    """FLOPs of one ``agent.learn`` on ``batch`` (forward, backward; ``torch.utils.flop_counter``)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        agent.learn(batch)
    return float(counter.get_total_flops())


def matmul_tflops(device: torch.device, seconds: float, n: int = 8192) -> float:
    """TFLOP/s of a bf16 ``n``³ matmul on ``device`` (the rate the learn step's is read against)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    _sync(device)
    calls, t0 = 0, time.perf_counter()
    while calls < 10 or time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.matmul(a, b, out=out)
        calls += 10
        _sync(device)
    return 2 * n**3 * calls / (time.perf_counter() - t0) / 1e12


def noop_loop(seconds: float, seed: int = 0) -> dict:
    """The loop's own cost: ``Learner.run`` with :class:`NullAgent` over a filled table of
    ``cartpole_apex``'s (batch 128, prefetch 16: refills of 8 in one draw, publishing every 10)
    against a bare loop taking batches off a queue a thread fills by sampling the same table the
    same way and calling the same agent (the learner thread's CPU µs per update; the sampler sets
    both loops' pace)."""
    from gearflow.agent import make_agent
    from gearflow.config import load_config
    from gearflow.envs import EnvSpec
    from gearflow.learner.batches import GROUP_SETS, refill_size
    from gearflow.replay.host_batch import BufferRing

    cfg = load_config(str(config_path("cartpole_apex")), ["learner.device=cpu", f"run.seed={seed}"])
    spec = EnvSpec(obs_shape=(4,), obs_dtype=np.dtype(np.float32), num_actions=2)
    B, prefetch = int(cfg.learner.batch_size), int(cfg.learner.prefetch)
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - int(cfg.actor.num_actors)))  # as gearflow train
    sys.setswitchinterval(0.0005)
    table = filled_table(cfg, make_agent(cfg, spec, "cpu"), seed=seed)
    try:
        agent = NullAgent(B)
        loop = loop_rate(cfg, agent, table, torch.device("cpu"), seconds)
        q: queue.Queue = queue.Queue(maxsize=prefetch)
        stop = threading.Event()

        refill, ring = refill_size(prefetch), BufferRing(GROUP_SETS)

        def feed():  # the same sampling (a refill a draw, as the Prefetcher), nothing else: no lock, no write-backs
            while not stop.is_set():
                for batch in table.sample_batches(B, refill, ring=ring):
                    while not stop.is_set():
                        try:
                            q.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            pass

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            n, t0, c0 = 0, time.perf_counter(), time.thread_time()
            while n < 100 or time.perf_counter() - t0 < seconds / 2:
                agent.learn(q.get())
                n += 1
            bare = 1e6 * (time.thread_time() - c0) / n
        finally:
            stop.set()
            feeder.join(timeout=5)
    finally:
        table.close()
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
    return {"cpu_us": loop["cpu_us_per_update"], "wall_us": loop["wall_us_per_update"], "bare_cpu_us": bare}


# ----------------------------------------------------------------------------- one config


def bench_config(path: Path, device: torch.device, seconds: float, emit: Emit, seed: int = 0,
                 matmul: float | None = None, rounds: int = 0, forms: tuple | None = None,
                 replays: tuple | None = None, deadline: float | None = None) -> None:  # fmt: skip
    """Every figure of one config (see the module docstring): per form of the learn step (eager;
    on CUDA also ``learner.graph``), the floor and the loop over each table measured in ``rounds``
    alternating slices of ``seconds / rounds`` (0: one a half second, at least 3), medians reported:
    on a shared machine the load moves within seconds, and both see the same moves. ``forms``
    (graph or not) and ``replays`` (the tables' devices) default to the device's. Past ``deadline``
    (``time.perf_counter()``), no further round after the first and no further form (said on stderr)."""
    rounds = rounds or max(3, round(seconds / 0.5))
    from gearflow.agent import make_agent
    from gearflow.config import load_config

    name = _name(path)
    overrides = [f"learner.device={device}", f"run.seed={seed}", *OVERRIDES.get(name, [])]
    cfg = load_config(str(path), overrides)
    spec = _env_spec(cfg)
    first = make_agent(cfg, spec, device)
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    if device.type == "cpu":  # as gearflow train sets a CPU learner's: the cores the actors leave (before the
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - int(cfg.actor.num_actors)))  # tables: their gathers'
    sys.setswitchinterval(0.0005)  # as gearflow train: the prefetch thread gets the GIL between the step's calls
    tables = {}
    rec = lambda w, metric, value, unit, f=None: emit(record("learner", w, metric, value, unit, f))
    try:
        for replay in replays or (("cpu",) if device.type == "cpu" else ("cpu", "cuda")):
            try:
                tables[replay] = filled_table(cfg, first, device=replay if replay == "cpu" else str(device), seed=seed)
            except (GearflowError, ImportError, RuntimeError) as exc:  # no CuPy / no usable GPU: said, skipped
                print(f"bench learner: {name} with replay.device={replay} skipped: {exc}", file=sys.stderr, flush=True)
        B = int(cfg.learner.batch_size)
        batches = [_on_device(tables["cpu"].sample(B), device) for _ in range(3)]
        tokens = float(np.mean([_tokens(b) for b in batches]))
        for graph in forms or ((False,) if device.type == "cpu" else (False, True)):
            if graph and _past(deadline, f"{name}: its learner.graph form"):
                break
            agent = first if not graph else make_agent(cfg, spec, device)
            agent.setup_learner()
            flops = learn_flops(agent, batches[0]) if not graph else None
            if graph:  # every learn of this agent replays its graphs (the loop's and the floor's)
                from gearflow.learner.graph import GraphedLearn

                agent.learn = GraphedLearn(agent, device)
            form = f"{name}/graph" if graph else name
            floors, loops = [], {r: [] for r in tables}
            for i in range(rounds):
                if i and _past(deadline, f"{form}: rounds {i + 1}-{rounds}"):
                    break
                floors.append(learn_floor(agent, batches, device, seconds / rounds))
                for r, table in tables.items():
                    loops[r].append(loop_rate(cfg, agent, table, device, seconds / rounds))
            floor = float(np.median(floors))
            rec(form, "learn_updates_per_s", floor, "updates/s")
            if flops is not None:
                rec(form, "learn_gflop_per_update", flops / 1e9, "GFLOP")
                gflop = flops
            if matmul is not None:
                rec(form, "learn_tflops", gflop * floor / 1e12, "TFLOP/s", matmul)  # ratio: of the bf16 matmul's
            for r, table in tables.items():
                w = form if len(tables) == 1 else f"{form}/replay_{r}"
                runs = sorted(loops[r], key=lambda x: x["updates_per_s"])
                loop = runs[len(runs) // 2]
                rec(w, "loop_updates_per_s", loop["updates_per_s"], "updates/s", floor)
                if "mask" in batches[0].data:
                    rec(w, "loop_tokens_per_s", loop["tokens_per_s"], "tokens/s", floor * tokens)
                rec(w, "wait_fraction", loop["wait_fraction"], "fraction")
                rec(w, "loop_cpu_us_per_update", loop["cpu_us_per_update"], "µs")
                counted = host_reads(cfg, agent, table, device)
                if counted is not None:
                    rec(w, "host_reads_per_update", counted[0], "reads")
                    rec(w, "aten_ops_per_update", counted[1], "ops")
    finally:
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)
        for table in tables.values():
            table.close()


def _past(deadline: float | None, what: str) -> bool:
    """Whether the budget's ``deadline`` has passed (said on stderr: ``what`` is cut)."""
    if deadline is None or time.perf_counter() < deadline:
        return False
    print(f"bench learner: budget spent: {what} cut", file=sys.stderr, flush=True)
    return True


def run(args, wanted: list[str], emit: Emit) -> int:
    """``gearflow bench learner``: every config's figures, then the do-nothing loop's."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GearflowError("bench learner --device cuda: torch sees no CUDA device (a CPU-only build, or no GPU)")
    names = [c for c in str(getattr(args, "config", "") or "").split(",") if c]
    names = names or list(CPU_CONFIGS if device.type == "cpu" else CUDA_CONFIGS)
    seconds = float(getattr(args, "seconds", 0) or 0) or (2.0 if device.type == "cpu" else 1.0) * float(args.scale)
    budget = float(getattr(args, "budget_s", 0) or 0)
    end = time.perf_counter() + budget if budget > 0 else None
    noop_first = end is not None and (not wanted or "noop" in wanted)
    if noop_first:  # cheap and the same on any machine: not left to whatever the configs leave
        _noop(seconds, args.seed, emit)
    matmul = None
    if device.type == "cuda":
        matmul = matmul_tflops(device, seconds / 2)
        emit(record("learner", "matmul", "bf16_matmul_tflops", matmul, "TFLOP/s"))
    failed = 0
    paths = [config_path(name) for name in names]
    paths = [p for p in paths if not wanted or _name(p) in wanted]
    for i, path in enumerate(paths):
        deadline = None
        if end is not None:
            left = end - time.perf_counter()
            if left <= 0:
                print(f"bench learner: budget spent: skipped {', '.join(_name(p) for p in paths[i:])}",
                      file=sys.stderr, flush=True)  # fmt: skip
                break
            deadline = time.perf_counter() + left / (len(paths) - i)
        try:  # one config's failure (a GPU out of memory, a capture torch refuses) leaves the others' figures
            bench_config(path, device, seconds, emit, seed=args.seed, matmul=matmul, deadline=deadline)
        except Exception as exc:  # noqa: BLE001 (said, counted in the exit code)
            failed += 1
            print(f"bench learner: {_name(path)} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            traceback.print_exc(file=sys.stderr)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if not noop_first and (not wanted or "noop" in wanted):
        _noop(seconds, args.seed, emit)
    return 1 if failed else 0


def _noop(seconds: float, seed: int, emit: Emit) -> None:
    noop = noop_loop(seconds, seed=seed)
    emit(record("learner", "noop", "loop_cpu_us_per_update", noop["cpu_us"], "µs", noop["bare_cpu_us"]))
    emit(record("learner", "noop", "loop_wall_us_per_update", noop["wall_us"], "µs"))
