"""Data-parallel learners (``gearflow.distributed``): real spawned processes, gloo on loopback.

* two ranks of the apex DQN agent, each learning from its half of a global batch, are identical
  after every step AND equal to one learner that learns from the whole global batch;
* ``Learner.run`` on two ranks whose batches and stop reasons come at different times: both
  make the same updates, in step, and stop together; only rank 0 publishes;
* a parameter that one rank's batch does not reach gets the averaged gradient on both ranks;
  an agent without ``state_dict`` still starts identical on every rank;
* a rendezvous that cannot happen is a GearflowError naming ``learner.dist_address``.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from gearflow.bench.data_parallel import make_learner_agent, random_batch, share
from gearflow.distributed import DataParallel, resolve_backend
from gearflow.errors import GearflowError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "cartpole_apex.yaml")
GLOBAL_BATCH, STEPS = 64, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_apex(seed: int, overrides=(), device: str = "cpu"):
    """The apex DQN learner built the way the runner builds it (config → env spec probe →
    make_agent → setup_learner), with gradient clipping made inactive."""
    cfg, agent = make_learner_agent(CONFIG, overrides, seed, device)
    agent.cfg.max_grad_norm = 1e9  # no clipping: the average of the shares is the global gradient
    return cfg, agent


def flat_params(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def spawn(target, world: int, *args, timeout: float = 240.0) -> None:
    """Run ``target(rank, world, *args)`` in ``world`` spawned processes; a child's traceback fails the test.

    ``timeout`` guards against a collective that never pairs up; it is far above a run's length because
    spawning, importing torch and building an agent take over a minute on a loaded 2-core box (a 60 s
    guard failed test_ranks_stay_identical_with_target_smoothing there)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(target, rank, world, errors, *args)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
        hung = [rank for rank, p in enumerate(procs) if p.exitcode is None]
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        assert not failures, "\n".join(failures)
        assert not hung, f"rank(s) {hung} still running after {timeout} s (a collective that never paired up?)"
        assert [p.exitcode for p in procs] == [0] * world
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()


def _child(target, rank, world, errors, *args):
    torch.set_num_threads(1)
    try:
        target(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1)


# ----------------------------------------------------------------------------- 1. the average is right


def _learn_shares(rank, world, port, out: Path, device: str = "cpu"):
    device = f"cuda:{rank}" if device == "cuda" else device
    cfg, agent = make_apex(seed=100 + rank, device=device)  # different initial weights on purpose: setup() makes them rank 0's
    before = flat_params(agent.online).cpu()
    parallel = DataParallel(rank, world, f"127.0.0.1:{port}", "auto", device, timeout_s=240).init()
    try:
        parallel.setup(agent)
        record = {"before_setup": before, "initial": flat_params(agent.online).cpu(),
                  "target": flat_params(agent.target).cpu(), "steps": [], "backend": parallel.backend}  # fmt: skip
        for step in range(STEPS):
            metrics, prio = agent.learn(share(random_batch(agent, GLOBAL_BATCH, seed=step), rank, world))
            record["steps"].append(flat_params(agent.online).cpu())
            prints = parallel.fingerprints(agent.online)
            assert prints[0] == prints[1], f"step {step + 1}: fingerprints differ {prints}"
        if rank == 1:  # one ulp in one weight: the fingerprints tell
            with torch.no_grad():
                w = next(agent.online.parameters())
                w.view(-1)[5] = torch.nextafter(w.view(-1)[5], torch.tensor(float("inf"), device=w.device))
        record["perturbed"] = parallel.fingerprints(agent.online)
        record["optimizer_steps"] = [int(s["step"]) for s in agent.optimizer.state_dict()["state"].values()]
        record["stats"] = parallel.stats()
        torch.save(record, out / f"rank{rank}.pt")
    finally:
        parallel.close()
        parallel.close()  # idempotent


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_two_ranks_learning_from_halves_equal_one_learner_on_the_global_batch(tmp_path, device):
    """gloo on the CPU; NCCL with one GPU per rank (skipped without two GPUs: NCCL does not
    put two ranks on one GPU)."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL data-parallel needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    tol = {"rtol": 1e-5, "atol": 1e-6} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    spawn(_learn_shares, 2, free_port(), tmp_path, device)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["backend"] == ("gloo" if device == "cpu" else "nccl")
    assert not torch.equal(r0["before_setup"], r1["before_setup"])  # the ranks were built differently
    assert torch.equal(r0["initial"], r1["initial"]) and torch.equal(r0["target"], r1["target"])

    _, single = make_apex(seed=100, device="cuda:0" if device == "cuda" else "cpu")  # rank 0's seed and weights
    torch.testing.assert_close(flat_params(single.online).cpu(), r0["initial"], rtol=0, atol=0)
    for step in range(STEPS):
        single.learn(random_batch(single, GLOBAL_BATCH, seed=step))
        want = flat_params(single.online).cpu()
        assert torch.equal(r0["steps"][step], r1["steps"][step]), f"ranks differ after step {step + 1}"
        moved = (r0["steps"][step] - (r0["steps"][step - 1] if step else r0["initial"])).abs().max()
        assert moved > 1e-6  # the step changed the weights (the comparison below is not vacuous)
        torch.testing.assert_close(r0["steps"][step], want, **tol,
                                   msg=lambda m: f"step {step + 1}: 2 ranks ≠ one learner on the global batch: {m}")  # fmt: skip
    assert r0["perturbed"][0] != r0["perturbed"][1]
    assert r0["optimizer_steps"] == r1["optimizer_steps"] == [STEPS] * len(r0["optimizer_steps"])
    assert r0["stats"]["learner/world_size"] == 2.0 and r0["stats"]["learner/grad_allreduce_ms"] > 0


@pytest.mark.timeout(60)
def test_the_sum_of_the_shares_is_not_the_answer():
    """Control for the test above: learning from one half alone gives different weights,
    so agreement with the global batch is a property of the averaging."""
    _, a = make_apex(seed=100)
    _, b = make_apex(seed=100)
    a.learn(random_batch(a, GLOBAL_BATCH, seed=0))
    b.learn(share(random_batch(b, GLOBAL_BATCH, seed=0), 0, 2))
    assert not torch.allclose(flat_params(a.online), flat_params(b.online), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- 2. the loop stays in step


class RecordingTable:
    """The learner's sampler side: records the keys it gets priorities for, in order."""

    def __init__(self):
        self.learned: list[int] = []

    def update_priorities(self, keys, priorities) -> None:
        assert torch.isfinite(torch.as_tensor(priorities)).all()
        self.learned.append(int(keys[0]))

    def stats(self) -> dict[str, float]:
        return {}


class RecordingParams:
    def __init__(self):
        self.published = 0

    def publish(self, network, version=None) -> int:
        self.published += 1
        return self.published

    def latest_version(self) -> int:
        return self.published


# rank → which next_batch calls return None (rank 0: a burst; rank 1: every 4th), and after
# how many iterations a rank's own stop reason fires (rank 1 first)
NO_BATCH = {0: {1, 2, 3, 9}, 1: {0, 4, 8, 12, 16}}
OWN_STOP_AFTER = {0: 10_000, 1: 30}


def _run_loop(rank, world, port, out: Path):
    from gearflow.learner import Learner, Progress

    cfg, agent = make_apex(seed=7, overrides=["run.log_every_s=0.000001", "run.checkpoint_every=0",
                                               "learner.publish_every=3", "learner.batch_size=16"])  # fmt: skip
    parallel = DataParallel.from_config(
        OmegaConf.merge(cfg, {"learner": {"world_size": world, "rank": rank, "dist_address": f"127.0.0.1:{port}"}}),
        "cpu", timeout_s=240,
    )
    parallel.init()
    table, params, rows = RecordingTable(), RecordingParams(), []
    calls, fetched, iterations = [0], [], [0]

    def next_batch():
        i = calls[0]
        calls[0] += 1
        if i in NO_BATCH[rank]:
            return None
        batch = share(random_batch(agent, 16, seed=i, key0=1000 * i), rank, world)
        fetched.append(int(batch.keys[0]))
        return batch

    def between():
        iterations[0] += 1
        return f"rank {rank}'s own stop" if iterations[0] > OWN_STOP_AFTER[rank] else ""

    try:
        parallel.setup(agent)
        own_steps = lambda: 10 * iterations[0] + 5 * rank  # rank 1 counts 5 more
        learner = Learner(cfg.learner, agent, table, params, Progress(), run=cfg.run, env_steps=own_steps, actor_version=lambda: 0,
                          parallel=parallel)  # fmt: skip
        reason, _ = learner.run(next_batch, between=between, emit=rows.append)
        torch.save({"reason": reason, "env_steps": learner.env_steps(), "own_steps": own_steps(), "updates": learner.progress.updates, "learned": table.learned,
                    "fetched": fetched, "published": params.published, "params": flat_params(agent.online),
                    "checkpoints_on": learner.checkpoints_on, "world_size": [r["learner/world_size"] for r in rows]},
                   out / f"rank{rank}.pt")  # fmt: skip
    finally:
        parallel.close()


@pytest.mark.timeout(600)
def test_learner_loop_learns_in_step_and_stops_together(tmp_path):
    spawn(_run_loop, 2, free_port(), tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r1["reason"] == "rank 1's own stop"
    assert r0["reason"] == "stopped with the other learners"
    # iterations 1..30 ran; an iteration learns when both ranks have a batch (a waiting batch
    # is kept): the same count on both ranks, and every batch fetched was learned, in order,
    # except at most the one a rank still held when the run stopped
    assert r0["updates"] == r1["updates"] == 22  # 30 iterations, 8 with a rank short of a batch
    for r in (r0, r1):
        assert r["learned"] == r["fetched"][: len(r["learned"])]
        assert len(r["fetched"]) - len(r["learned"]) in (0, 1)
    assert torch.equal(r0["params"], r1["params"])
    assert r0["published"] == r0["updates"] // 3 and r1["published"] == 0
    assert r0["world_size"] and set(r0["world_size"]) == {2.0}
    # the ranks' env-step counts differ (a killed shard takes different steps from each): both use
    # the highest, as of the last agree (iteration 31)
    assert (r0["own_steps"], r1["own_steps"]) == (310, 315)
    assert r0["env_steps"] == r1["env_steps"] == 315


def _run_on_replay(rank, world, port, out: Path, num_buffers: int):
    """A rank's learner on a real prioritized table sampled by the Prefetcher, publishing into a
    real ParameterStore; its batches run dry at scripted calls, rank 1 stops on run.max_seconds.
    ``num_buffers``: 0 = the runner's ``learner.prefetch + 2``; with ``prefetch + 1`` the held
    batches are overwritten and the test below fails (checked when it was written)."""
    import threading

    import numpy as np

    from gearflow.bench.common import prioritized_table, random_steps
    from gearflow.kinds.transition import Transition
    from gearflow.learner import Learner, Prefetcher, Progress
    from gearflow.params import ParameterStore
    from gearflow.replay import Writer

    limit = ["run.max_seconds=4"] if rank == 1 else []
    cfg, agent = make_apex(seed=3 + rank, overrides=["run.log_every_s=1000", "run.checkpoint_every=0",
                                                     "learner.publish_every=2", *limit])  # fmt: skip
    B = cfg.learner.batch_size // world
    table = prioritized_table(agent.replay_columns(), 1, 4096, Transition(next_columns=("obs",)), seed=rank)
    table.num_buffers = num_buffers or cfg.learner.prefetch + 2  # 0: as the runner makes it
    writer = Writer(table.storage, [0])
    rng = np.random.default_rng(rank)
    steps = random_steps(table.storage.spec, 2048, rng)
    steps["action"] = rng.integers(agent.num_actions, size=2048)
    steps["disc"] = rng.random(2048).astype(np.float32)
    first = writer.extend(steps)
    n = agent.n_step + 1
    ends = first + np.arange(n, 2048 + 1)
    writer.create_items(rng.random(ends.size) + 0.1, n, streams=0, ends=ends)
    table.scan()
    params = ParameterStore.create(agent.learner_network(), run_tag=rank)
    parallel = DataParallel(rank, world, f"127.0.0.1:{port}", "gloo", timeout_s=240).init()
    stop = threading.Event()
    learner = None
    prefetcher = None
    fetched, learned, calls = [], [], [0]
    learn = agent.learn

    def recording_learn(batch):  # what the learner learns from, read when it learns
        learned.append((batch.keys.clone(), batch.data["obs"].clone(), batch.data["next_obs"].clone()))
        return learn(batch)

    agent.learn = recording_learn
    try:
        parallel.setup(agent)
        version0 = params.publish(agent.learner_network())
        learner = Learner(cfg.learner, agent, table, params, Progress(), run=cfg.run, env_steps=lambda: 0, actor_version=lambda: 0,
                          parallel=parallel)  # fmt: skip
        prefetcher = Prefetcher(table, learner.lock, B, cfg.learner.prefetch, stop)
        dry = (lambda i: i % 3 == 2) if rank == 0 else (lambda i: 5 <= i < 12)

        def next_batch():
            calls[0] += 1
            if dry(calls[0]):
                time.sleep(0.01)  # the prefetcher keeps sampling meanwhile
                return None
            batch = prefetcher.next_batch()
            if batch is not None:
                fetched.append((batch.keys.clone(), batch.data["obs"].clone(), batch.data["next_obs"].clone()))
            return batch

        reason, _ = learner.run(next_batch)
        torch.save({"reason": reason, "updates": learner.progress.updates, "published": params.latest_version() - version0,
                    "fetched": fetched, "learned": learned, "params": flat_params(agent.online)},
                   out / f"rank{rank}.pt")  # fmt: skip
    finally:
        stop.set()
        if prefetcher is not None:
            prefetcher.close()
        parallel.close()
        params.close()
        table.close()


@pytest.mark.timeout(600)
def test_learner_on_a_prefetched_replay_holds_its_batch_while_the_other_rank_waits(tmp_path):
    """A batch a rank holds while the other has none is learned later unchanged (the table's
    prefetch + 2 buffer sets cover it); both stop when rank 1 reaches run.max_seconds; rank 0
    alone publishes into its parameter store."""
    spawn(_run_on_replay, 2, free_port(), tmp_path, 0)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r1["reason"] == "reached run.max_seconds=4.0" and r0["reason"] == "stopped with the other learners"
    assert r0["updates"] == r1["updates"] > 5
    for r in (r0, r1):
        assert len(r["learned"]) == r["updates"]
        for then, now in zip(r["fetched"], r["learned"]):  # keys, obs, next_obs (the reused buffers)
            assert all(torch.equal(a, b) for a, b in zip(then, now)), "a held batch's buffer was reused"
    assert torch.equal(r0["params"], r1["params"])
    assert r0["published"] == r0["updates"] // 2 and r1["published"] == 0


def test_only_rank_0_writes_checkpoints():
    from gearflow.config import load_config
    from gearflow.learner import Learner, Progress

    cfg = load_config(CONFIG, ["run.checkpoint_every=1"])
    parallel = {r: DataParallel(r, 2, "127.0.0.1:1", "gloo") for r in range(2)}  # not joined: nothing needs it
    learners = {r: Learner(cfg.learner, None, RecordingTable(), RecordingParams(), Progress(), run=cfg.run, env_steps=lambda: 0,
                           actor_version=lambda: 0, parallel=parallel[r]) for r in range(2)}  # fmt: skip
    for learner in learners.values():
        learner.progress.updates = 5
    assert learners[0].checkpoints_on and learners[0]._checkpoint_due()
    assert not learners[1].checkpoints_on and not learners[1]._checkpoint_due()
    assert DataParallel.from_config(cfg, "cpu") is None  # world_size 1: the loop as before


# ----------------------------------------------------------------------------- 3. sparse gradients, no state_dict


class TwoHeads:
    """A minimal agent without state_dict: two modules, one optimizer; rank 1's batch never reaches ``b``."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
        self.optimizer = torch.optim.Adam([*self.a.parameters(), *self.b.parameters()], lr=0.1)

    def learn(self, x, use_b: bool):
        loss = self.a(x).square().mean() + (self.b(x).square().mean() if use_b else 0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def _sparse(rank, world, port, out: Path):
    agent = TwoHeads(seed=rank)
    with DataParallel(rank, world, f"127.0.0.1:{port}", "gloo", timeout_s=240) as parallel:
        parallel.setup(agent)
        initial = [flat_params(agent.a), flat_params(agent.b)]
        x = torch.ones(4, 3) * (rank + 1)
        agent.learn(x, use_b=rank == 0)
        grads = [torch.cat([p.grad.reshape(-1) for p in m.parameters()]) for m in (agent.a, agent.b)]
        torch.save({"initial": initial, "after": [flat_params(agent.a), flat_params(agent.b)], "grads": grads},
                   out / f"rank{rank}.pt")  # fmt: skip


@pytest.mark.timeout(600)
def test_a_parameter_one_rank_did_not_reach_gets_the_averaged_gradient_everywhere(tmp_path):
    spawn(_sparse, 2, free_port(), tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for i in range(2):
        assert torch.equal(r0["initial"][i], r1["initial"][i])  # modules broadcast without state_dict
        assert torch.equal(r0["after"][i], r1["after"][i])
        assert not torch.equal(r0["after"][i], r0["initial"][i])  # b stepped on rank 1 too
        assert torch.equal(r0["grads"][i], r1["grads"][i])
    # b's gradient: rank 0's own / 2 (rank 1 contributed zero)
    agent = TwoHeads(seed=0)
    agent.b.load_state_dict({"weight": r0["initial"][1][:3].view(1, 3), "bias": r0["initial"][1][3:]})
    agent.b(torch.ones(4, 3)).square().mean().backward()
    own = torch.cat([p.grad.reshape(-1) for p in agent.b.parameters()])
    torch.testing.assert_close(r0["grads"][1], own / 2)


def _sequence_agents(rank, world, port, out: Path):
    import numpy as np

    from gearflow.replay.table import Sample
    from tests import test_decision_transformer as dt
    from tests import test_r2d2 as r2d2

    torch.manual_seed(rank)  # different initial weights on each rank
    r2d2_agent = r2d2.agent_for(r2d2.config())
    r2d2_agent.setup_learner()
    torch.manual_seed(10 + rank)
    dt_agent = dt.continuous_agent(dt.config())  # two optimizers: the policy's and the temperature's
    dt_agent.setup_learner()
    record = {}
    with DataParallel(rank, world, f"127.0.0.1:{port}", "gloo", timeout_s=240) as parallel:
        parallel.setup(r2d2_agent)
        record["r2d2_initial"] = flat_params(r2d2_agent.online)
        record["r2d2_target"] = flat_params(r2d2_agent.target)
        r2d2_agent.learn(r2d2.batch(np.random.default_rng(rank)))  # each rank its own batch
        record["r2d2_after"] = flat_params(r2d2_agent.online)

        parallel.setup(dt_agent)  # (one agent per process in a run; here the second replaces the first)
        record["dt_initial"] = flat_params(dt_agent.online)
        record["dt_temperature_initial"] = dt_agent.log_temperature.detach().clone()
        rewards = [[1.0] * 8, [1.0] * 3, [2.0, 0.0], [1.0] * 6] if rank == 0 else [[0.5] * 5, [3.0] * 8]
        data = dt.episode_batch(rewards, act=lambda B, T, g: torch.rand(B, T, 2, generator=g) * 4 - 2)
        B = len(rewards)
        for _ in range(2):
            dt_agent.learn(Sample(data, torch.arange(B), torch.ones(B), torch.ones(B, dtype=torch.float64)))
        record["dt_after"] = flat_params(dt_agent.online)
        record["dt_temperature_after"] = dt_agent.log_temperature.detach().clone()
        record["dt_lr"] = dt_agent.scheduler.get_last_lr()
    torch.save(record, out / f"rank{rank}.pt")


@pytest.mark.timeout(600)
def test_sequence_agents_start_identical_and_stay_identical(tmp_path):
    """R2D2 (online + target) and DT (a scheduler, and a second optimizer for the temperature):
    rank 0's whole learner state on both ranks, and the same update from different batches."""
    spawn(_sequence_agents, 2, free_port(), tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for key in r0:
        assert torch.equal(torch.as_tensor(r0[key]), torch.as_tensor(r1[key])), key
    assert not torch.equal(r0["r2d2_after"], r0["r2d2_initial"]) and not torch.equal(r0["dt_after"], r0["dt_initial"])
    assert not torch.equal(r0["dt_temperature_after"], r0["dt_temperature_initial"])  # its optimizer stepped too


def _one_dies(rank, world, port, out: Path):
    import os

    _, agent = make_apex(seed=1)
    # a timeout far above spawn()'s guard: an error that only came from the collective's timeout fails the test
    parallel = DataParallel(rank, world, f"127.0.0.1:{port}", "gloo", timeout_s=900).init()
    parallel.setup(agent)
    assert parallel.agree(True, False) == (True, False)
    if rank == 0:
        os._exit(0)  # killed: no close(), no goodbye
    errors = []
    for step in range(2):  # the next agree() and the next gradient all_reduce
        try:
            parallel.agree(True, False) if step == 0 else agent.learn(random_batch(agent, 8, seed=0))
        except GearflowError as exc:
            errors.append(str(exc))
    parallel.close()
    torch.save(errors, out / "errors.pt")


@pytest.mark.timeout(600)
def test_a_learner_that_dies_fails_the_others_at_once_with_a_clear_error(tmp_path):
    spawn(_one_dies, 2, free_port(), tmp_path)
    errors = torch.load(tmp_path / "errors.pt")
    assert len(errors) == 2
    assert "learner rank 1 of 2 lost the other data-parallel learners in agree()" in errors[0]
    assert "in the gradient all_reduce" in errors[1] and "learner.dist_address=127.0.0.1:" in errors[1]


# ----------------------------------------------------------------------------- 4. rendezvous errors


@pytest.mark.timeout(60)
def test_rendezvous_without_rank_0_names_the_address():
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    parallel = DataParallel(1, 2, address, "gloo", timeout_s=1)
    with pytest.raises(GearflowError, match=f"rank 1 of 2 .* learner.dist_address={address} .*rank 0 could not be reached"):
        parallel.init()
    assert not torch.distributed.is_initialized()
    parallel.close()  # nothing to leave: no error


@pytest.mark.timeout(60)
def test_rendezvous_errors_of_rank_0_say_what_went_wrong():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = "127.0.0.1:%d" % taken.getsockname()[1]
        with pytest.raises(GearflowError, match=f"learner.dist_address={address} .*could not listen there"):
            DataParallel(0, 2, address, "gloo", timeout_s=2).init()
    address = f"127.0.0.1:{free_port()}"  # rank 0 listens; rank 1 never comes
    with pytest.raises(GearflowError, match=f"learner.dist_address={address} .*other 1 learner\\(s\\) did not all arrive"):
        DataParallel(0, 2, address, "gloo", timeout_s=1).init()
    assert not torch.distributed.is_initialized()


def test_configuration_errors_are_clear():
    with pytest.raises(GearflowError, match="learner.dist_address='nowhere': must be HOST:PORT"):
        DataParallel(0, 2, "nowhere")
    with pytest.raises(GearflowError, match=r"learner.rank=2 must be in \[0, learner.world_size=2\)"):
        DataParallel(2, 2, "127.0.0.1:1")
    with pytest.raises(GearflowError, match="learner.dist_backend=nccl needs the learner on CUDA"):
        DataParallel(0, 2, "127.0.0.1:1", "nccl", "cpu")
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    with pytest.raises(GearflowError, match="DataParallel.init"):
        DataParallel(0, 2, "127.0.0.1:1").agree(True, False)


# ---------------------------------------------------------------------- learners on two hosts

NETNS = ("gfrc-a", "gfrc-b")  # two emulated hosts: a network namespace each on a bridge, 10.231.4.0/24
BRIDGE = "gfrc-br"


def _ip(*args: str, check: bool = True) -> None:
    import subprocess

    subprocess.run(["ip", *args], check=check, capture_output=True)


@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces on a bridge with no route out (10.231.4.1 and .2). This machine's
    hostname resolves to 127.0.0.1, as on many hosts and containers: what gloo falls back to."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("emulated hosts need root and iproute2")
    _ip("link", "add", BRIDGE, "type", "bridge")
    try:
        _ip("link", "set", BRIDGE, "up")
        for i, ns in enumerate(NETNS):
            _ip("netns", "add", ns)
            _ip("link", "add", f"{ns}-h", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", f"{ns}-h", "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"10.231.4.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield [f"10.231.4.{i + 1}" for i in range(len(NETNS))]
    finally:
        for ns in NETNS:
            _ip("link", "del", f"{ns}-h", check=False)
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", BRIDGE, check=False)


_MEET = """
import sys, torch
from gearflow.distributed import DataParallel
rank, address = int(sys.argv[1]), sys.argv[2]
dp = DataParallel(rank, 2, address, "gloo", timeout_s=60).init()
t = torch.tensor([float(rank + 1)])
torch.distributed.all_reduce(t)
print("SUM", t.item(), "|", dp.interface, flush=True)
dp.close()
"""


@pytest.mark.timeout(300)
def test_two_learners_on_two_hosts_meet_on_their_cluster_interface(two_hosts):
    """Rank 0 on host A, rank 1 on host B, no GLOO_SOCKET_IFNAME: each names the interface that
    holds its own address (eth0 in its namespace), so gloo does not fall back to the loopback
    address the hostname resolves to (there: `connectFullMesh failed ... remote=[127.0.0.1]`)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env["PYTHONPATH"] = str(ROOT)
    address = f"{two_hosts[0]}:29533"
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _MEET, str(rank), address],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank, ns in enumerate(NETNS)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    for rank, out in enumerate(outs):
        line = [x for x in out.splitlines() if x.startswith("SUM")][0]
        assert line.startswith("SUM 3.0"), out[-2000:]
        assert f"{two_hosts[rank]} on GLOO_SOCKET_IFNAME=eth0" in line


def test_the_interface_is_the_one_holding_the_address(monkeypatch):
    """127.0.0.1 is on lo; a user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are kept."""
    import gearflow.distributed as distributed_mod
    from gearflow.distributed import interface_of, socket_interfaces

    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so what socket_interfaces sets is undone
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert socket_interfaces("127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "ib0"}
    # a later call at another address: what an earlier call set is replaced, the user's kept
    monkeypatch.setattr(distributed_mod, "interface_of", lambda ip: "eth7")
    assert socket_interfaces("10.231.9.1") == {"GLOO_SOCKET_IFNAME": "eth7", "NCCL_SOCKET_IFNAME": "ib0"}


@pytest.mark.timeout(120)
def test_the_rendezvous_port_is_held_until_rank_0_serves_on_it():
    """hold_rendezvous() keeps its port bound (no other process can take it, unlike a port found
    free and closed); rank 0 then serves its store on that socket and rank 1 joins."""
    import threading

    from gearflow.distributed import hold_rendezvous

    address = hold_rendezvous("127.0.0.1")
    port = int(address.rpartition(":")[2])
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # EADDRINUSE: the port is held
    store_up = threading.Event()

    def rank1():
        store_up.wait(60)
        torch.distributed.TCPStore("127.0.0.1", port, 2, False, __import__("datetime").timedelta(seconds=30)).set("r1", "1")

    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    dp = DataParallel(0, 2, address, "gloo", timeout_s=30)
    store_up.set()
    store = dp._store()  # rank 0's store on the held socket: rank 1's client reaches it
    assert store.get("r1") == b"1"
    t.join(30)
