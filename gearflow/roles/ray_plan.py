"""What the ``launcher=ray`` driver decides without Ray (:mod:`gearflow.roles.ray`): where
each role goes (:func:`place_roles`, from ``ray.nodes()``), the GPUs a learner asks for
(:func:`learner_gpus`) and the run's summary from its roles' (:func:`run_summary`). Plain
functions of plain data: tested without a Ray cluster."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from gearflow.errors import GearflowError

log = logging.getLogger("gearflow.runner")  # the logger ray.py's driver writes to: the same lines as before the move

__all__ = ["learner_gpus", "needs_line", "place_roles", "run_summary"]


def run_summary(summaries: list[dict], node_summaries: list[dict], restarts: dict[str, int], shards: int,
                learners: int) -> dict[str, Any]:
    """The run's summary from its learners' (rank 0 first), its nodes' and the registry's restarts.

    Each learner counts the env steps the nodes reported to it and the learners share their highest
    at every iteration (``DataParallel.agree``); a rank's count can still rise by a poll after the
    last agree, so the summary gives the highest of the learners' final counts."""
    summary = dict(summaries[0])
    summary["actor/env_steps"] = max(s["actor/env_steps"] for s in summaries)
    summary["cluster/shards"], summary["cluster/learners"] = shards, learners
    summary["cluster/group_restarts"] = sum(v for k, v in restarts.items() if k.startswith("group-"))
    summary["cluster/shard_restarts"] = sum(v for k, v in restarts.items() if k.startswith("shard-"))
    summary["cluster/parameters_identical"] = len({s["learner/parameters_fingerprint"] for s in summaries}) == 1
    summary["cluster/learner_nodes"] = [s.get("learner/node") for s in summaries]
    summary["cluster/node_env_steps"] = [n.get("actor/env_steps") for n in node_summaries]
    lost = {n["address"]: n["lost"] for n in node_summaries if n.get("lost")}
    if lost:
        summary["cluster/nodes_lost"] = lost
    return summary


def needs_line(cfg: DictConfig, gpus: float) -> str:
    """What each role asks of the cluster, in words (the error of :func:`place_roles` says it)."""
    cl = cfg.cluster
    extra = "".join(f" + {k}={v:g}" for k, v in (cl.shard_resources or {}).items())
    return (f"a shard node needs {float(cl.shard_cpus) + int(cfg.actor.num_actors) * float(cl.actor_cpus):g} CPU on "
            f"one node (cluster.shard_cpus={float(cl.shard_cpus):g} + actor.num_actors={int(cfg.actor.num_actors)} × "
            f"cluster.actor_cpus={float(cl.actor_cpus):g}{extra}), a learner {float(cl.learner_cpus):g} CPU "
            f"(cluster.learner_cpus) and {gpus:g} GPU")  # fmt: skip


def place_roles(nodes: list[dict], shards: int, shard_need: dict[str, float], learners: int,
                learner_need: dict[str, float], *, what: str = "") -> tuple[list[str], list[str]]:
    """The node (Ray NodeID) of each shard node and its actor group, and of each learner, from
    ``ray.nodes()``: each shard on a live node whose resources hold ``shard_need`` (the shard and
    its group together), the one with the fewest shards so far, workers before the head, then the
    most free CPU; then each learner where ``learner_need`` fits in what is left, on the node with
    the most free GPUs, then CPUs, workers before the head. Returns ``(shard_nodes,
    learner_nodes)``. Raises one GearflowError line naming the role that does not fit and each
    node's resources.

    >>> place_roles([{"NodeID": "a", "Alive": True, "Resources": {"CPU": 1.0, "node:__internal_head__": 1.0}},
    ...              {"NodeID": "b", "Alive": True, "Resources": {"CPU": 4.0}}], 1, {"CPU": 3.0}, 1, {"CPU": 1.0})
    (['b'], ['b'])
    """
    live = [n for n in nodes if n.get("Alive")]
    free = {n["NodeID"]: dict(n.get("Resources") or {}) for n in live}
    head = {n["NodeID"] for n in live if "node:__internal_head__" in (n.get("Resources") or {})}
    addr = {n["NodeID"]: n.get("NodeManagerAddress", n["NodeID"][:8]) for n in live}
    count = {n: 0 for n in free}

    def fits(node: str, need: dict[str, float]) -> bool:
        return all(free[node].get(k, 0.0) >= v - 1e-9 for k, v in need.items() if v > 0)

    def take(node: str, need: dict[str, float]) -> None:
        for k, v in need.items():
            free[node][k] = free[node].get(k, 0.0) - v

    def refuse(role: str) -> GearflowError:
        have = "; ".join(f"{addr[n]}{' (head)' if n in head else ''}: {_resources(dict(m.get('Resources') or {}))}"
                         for n, m in ((m["NodeID"], m) for m in live)) or "no live node"  # fmt: skip
        return GearflowError(f"launcher=ray: the Ray cluster cannot hold the run: no node left for {role} ({what}); "
                             f"the nodes: {have}. Add nodes or CPUs (ray start --num-cpus), or lower cluster.shards, "
                             "actor.num_actors or cluster.*_cpus")  # fmt: skip

    placed = []
    for i in range(shards):
        ok = [n for n in free if fits(n, shard_need)]
        if not ok:
            raise refuse(f"shard node {i} of {shards} with its actor group")
        n = min(ok, key=lambda n: (count[n], n in head, -free[n].get("CPU", 0.0), n))
        take(n, shard_need)
        count[n] += 1
        placed.append(n)
    ranks = []
    for r in range(learners):
        ok = [n for n in free if fits(n, learner_need)]
        if not ok:
            raise refuse(f"learner rank {r} of {learners}")
        n = max(ok, key=lambda n: (free[n].get("GPU", 0.0), free[n].get("CPU", 0.0), n not in head))
        take(n, learner_need)
        ranks.append(n)
    return placed, ranks


def _resources(res: dict[str, float]) -> str:
    keep = {k: v for k, v in res.items() if not k.startswith(("node:", "memory", "object_store_memory"))}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(keep.items())) or "nothing"


def learner_gpus(cfg: DictConfig, cluster_gpus: float) -> float:
    """GPUs each learner asks Ray for: ``cluster.learner_gpus`` when set; else one each when the
    cluster has a GPU per learner and ``learner.device`` allows CUDA (``auto`` or ``cuda``), so
    learners land on GPU nodes where there are any."""
    asked = float(cfg.cluster.learner_gpus)
    if asked > 0 or str(cfg.learner.device) == "cpu":
        return asked
    K = int(cfg.cluster.learners)
    if cluster_gpus >= K:
        log.info("ray: %g GPU(s) in the cluster: each of the %d learner(s) gets one (cluster.learner_gpus=0 and "
                 "learner.device=%s)", cluster_gpus, K, cfg.learner.device)  # fmt: skip
        return 1.0
    if str(cfg.learner.device).startswith("cuda"):
        raise GearflowError(f"learner.device={cfg.learner.device} but the Ray cluster has {cluster_gpus:g} GPU(s) for "
                            f"{K} learner(s): add GPU nodes, or use learner.device=cpu")  # fmt: skip
    return 0.0
