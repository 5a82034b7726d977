"""``learner.graph``: each form of an agent's update captured whole in a CUDA graph and replayed
(:class:`GraphedLearn`): one launch an update instead of one per op (a Nature-CNN DQN update is
~100 ops, gato_80m's ~1,200, each 5-15 µs to launch).

An agent opts in by taking the update as an argument of ``learn`` (the reference agents do)::

    def learn(self, batch, update=None):
        metrics, priorities = (update or self.update)(batch, *args)   # the tensor work: graphed
        self.updated()                                                 # counts, target copies: eager
        return metrics, priorities

``update(batch, *args)`` must do only tensor work of fixed shapes, with no host read (the same
rule as the host-read test's); ``args`` pick its form (DPG: whether the policy learns this
update) and each form gets its own graph. :class:`GraphedLearn` runs the first ``warmup`` updates
of each form eagerly on a side stream (optimizer state, cuBLAS workspaces, the allocator), then
copies the batch into static inputs, captures the form once and replays it from then on: the
batch is copied into the inputs (one foreach copy), the graph replayed, and the agent gets the
graph's static outputs back (metrics: read at metric rows, the latest update's; priorities: a
clone, as the write-back may read them after the next replay). Optimizers are made capturable
(their step counts moved to the device) and every CUDA generator the agent holds (DPG's
smoothing noise) is registered with each graph, so a replay draws what the eager update would.

Elsewhere (a CPU learner, an agent whose ``learn`` takes no ``update``) the learner learns
eagerly and says so once: :func:`learn_function`.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from gearflow.replay.host_batch import Sample

__all__ = ["GraphedLearn", "learn_function"]

log = logging.getLogger("gearflow.runner")


def takes_update(agent: Any) -> bool:
    """Whether ``agent.learn`` takes the update as an argument (``learn(batch, update=None)``)."""
    try:
        return "update" in inspect.signature(agent.learn).parameters
    except (TypeError, ValueError):
        return False


def learn_function(agent: Any, device: torch.device, graph: bool):
    """What the learner calls for an update: ``agent.learn``, or a :class:`GraphedLearn` of it when
    ``graph`` and the device and the agent allow one (else eager, logged once)."""
    if not graph:
        return agent.learn
    if torch.device(device).type != "cuda":
        log.info("learner.graph=true: the learner is on %s, not CUDA: it learns eagerly", device)
        return agent.learn
    if not takes_update(agent):
        log.info("learner.graph=true: agent %s's learn takes no update= (see gearflow/learner/graph.py): it "
                 "learns eagerly", type(agent).__module__)  # fmt: skip
        return agent.learn
    return GraphedLearn(agent, torch.device(device))


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """``optimizer``'s groups made capturable, its step counts moved to the device (as
    ``load_state_dict`` places them for a capturable optimizer)."""
    for group in optimizer.param_groups:
        group["capturable"] = True
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != device:
            state["step"] = step.to(device=device, dtype=torch.float32)


class GraphedLearn:
    """``agent.learn`` with each form of its update replayed from a CUDA graph (module docstring)."""

    def __init__(self, agent: Any, device: torch.device, warmup: int = 3):
        self.agent, self.device, self.warmup = agent, device, warmup
        self._learn = agent.learn  # bound now: a caller may put this object in its place
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.eager: dict[tuple, int] = {}  # eager updates so far, per form
        self.static: Sample | None = None  # the graphs' inputs
        self.pool = None  # the graphs' shared memory pool
        self.replays = 0
        self._side: torch.cuda.Stream | None = None  # the warm-up's stream
        for value in vars(agent).values():
            if isinstance(value, torch.optim.Optimizer):
                make_capturable(value, device)

    def __call__(self, batch: Sample):
        return self._learn(batch, update=self._update)

    def _update(self, batch: Sample, *args):
        key = tuple(args)
        held = self.graphs.get(key)
        if held is None and self.eager.get(key, 0) < self.warmup:
            self.eager[key] = self.eager.get(key, 0) + 1
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            side, current = self._side, torch.cuda.current_stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                out = self.agent.update(batch, *args)
            current.wait_stream(side)
            return out
        self._copy_in(batch)
        if held is None:
            held = self.graphs[key] = self._capture(key)
        graph, (metrics, priorities) = held
        graph.replay()
        self.replays += 1
        return dict(metrics), priorities.clone()

    def _copy_in(self, batch: Sample) -> None:
        data = {k: v for k, v in batch.data.items()}
        if self.static is None:
            self.static = Sample(data={k: torch.empty_like(v, device=self.device) for k, v in data.items()},
                                 keys=batch.keys, weights=torch.empty_like(batch.weights, device=self.device),
                                 probabilities=batch.probabilities)  # fmt: skip
        s = self.static
        if s.data.keys() != data.keys() or any(s.data[k].shape != v.shape for k, v in data.items()):
            raise ValueError("learner.graph: the batch's columns or shapes changed; a captured update takes fixed "
                             f"shapes ({ {k: tuple(v.shape) for k, v in s.data.items()} })")
        for k, v in data.items():
            s.data[k].copy_(v, non_blocking=True)
        s.weights.copy_(batch.weights, non_blocking=True)

    def _capture(self, key: tuple):
        generators = [g for g in vars(self.agent).values()
                      if isinstance(g, torch.Generator) and g.device.type == "cuda"]  # fmt: skip
        graph = torch.cuda.CUDAGraph()
        if generators and not hasattr(graph, "register_generator_state"):
            raise RuntimeError(f"learner.graph: {type(self.agent).__module__} draws from its own CUDA generator, and "
                               f"torch {torch.__version__} cannot register one with a graph (needs ≥ 2.5)")
        for gen in generators:
            graph.register_generator_state(gen)
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.agent.update(self.static, *key)
        if self.pool is None:
            self.pool = graph.pool()
        log.info("learner.graph: captured %s's update%s", type(self.agent).__module__, f" {key}" if key else "")
        return graph, out
