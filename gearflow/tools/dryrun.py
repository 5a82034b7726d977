"""``run.dry_run=true``: what a run would need, planned on the meta device.

    gearflow train configs/paper/gato_80m.yaml run.dry_run=true

builds the agent's learner (its networks and optimizer, through the agent's own
``setup_learner``) on ``torch.device("meta")``: tensors with shapes and dtypes
but no memory, so a 1.2B-parameter plan takes a second on a laptop. It prints a
readable table, then ``train()`` returns the same figures and the CLI prints them
as one JSON line. No actor is started, no shared memory is created and no run
directory is made; only the environment is probed (one env, for its spaces).

Where each figure comes from:

* **parameters, gradients, buffers**: the learner network's tensors (gradients:
  one per trainable parameter, same dtype).
* **other networks** (target networks): every other ``nn.Module`` attribute of
  the agent after ``setup_learner``.
* **optimizer state**: every ``torch.optim.Optimizer`` attribute of the agent,
  stepped once on meta gradients; the tensors it then holds are counted (Adam:
  ``exp_avg`` + ``exp_avg_sq`` = 2 × the fp32 parameters). A step counter made on the
  meta device and read with ``.item()`` (torch 2.11's Adam) is moved to the host and the
  step retried; an optimizer that still cannot step there is "not measured" (named in
  the plan) instead of failing the plan.
* **activations per learner batch**: measured, not guessed: one forward pass of
  the learner network over a meta batch of observations shaped like the
  replay's batch (``item_kind().layout``: ``(B, *obs)`` for transitions,
  ``(B, T, *obs)`` for sequences) under ``torch.autograd.graph.saved_tensors_hooks``,
  summing every distinct tensor autograd keeps for the backward pass (parameters
  excluded) plus the output. This is what the configured dtype and this torch's
  kernels keep (on the meta device attention takes the math path, which stores
  the ``(B, heads, T, T)`` scores; fused flash / memory-efficient kernels do
  not). Gradients of activations during backward are transient and not counted.
  For sequence transformer agents (a config with ``d_model``, ``num_layers``,
  ``num_heads``; one token per step) the table also shows the 16-bit reference of Korthikanti et
  al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"):
  ``L · B·T · (34·d + 5·heads·T)`` bytes.
  An agent whose learner input is not just the observations (the measurement
  then says "not measured") offers
  ``memory_estimate(batch_size) -> {"activation_bytes": int, "activation_method": str}``,
  which replaces the measurement.
* **actors**: one policy network per actor process, on ``actor.device``.
* **replay**: the agent's ``replay_columns`` (bytes per step; with ``replay.frame_stack`` the
  obs is one stored frame per step plus its offset byte, and the bytes a step would take with
  whole stacks are shown beside it), the partition
  geometry the runner would create (``P = actors × envs``, ``S = capacity // P``
  steps, ``R`` item records each) and the size of that shared-memory segment,
  item records and 4 KiB alignment included; plus the learner's batch buffers; and the
  fewest steps per partition the kind's adder writes into (the kind registry's adder,
  ``min_steps``; flagged ``TOO FEW`` where the geometry gives less: the actor would refuse it).
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from gearflow.agent import make_agent
from gearflow.envs import EnvSpec, probe_env_spec
from gearflow.errors import GearflowError
from gearflow.geometry import replay_geometry
from gearflow.kinds.registry import kind_def
from gearflow.replay.items import ItemKind
from gearflow.replay.layout import buffer_sets
from gearflow.replay.spec import replay_spec
from gearflow.replay.storage import SharedStorage

META = torch.device("meta")
KORTHIKANTI = "L·B·T·(34·d + 5·heads·T) bytes (Korthikanti et al. 2022: 16-bit activations with dropout)"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _module_bytes(module: nn.Module) -> int:
    return sum(_nbytes(p) for p in module.parameters()) + sum(_nbytes(b) for b in module.buffers())


def _meta_scalars_to_host(opt: torch.optim.Optimizer) -> int:
    """Move the 0-d meta tensors of ``opt``'s state (a step counter) to the host, value 0, same
    dtype; returns how many. Their bytes are the same on either device."""
    moved = 0
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_meta and value.dim() == 0:
                state[key] = torch.zeros((), dtype=value.dtype, device="cpu")
                moved += 1
    return moved


def _optimizer_state_bytes(opt: torch.optim.Optimizer) -> tuple[int | None, str]:
    """Bytes of the state ``opt`` holds after one step on (meta) zero gradients, and how they were
    counted. An optimizer that makes its step counter with ``torch.tensor(0.0)`` (torch 2.11's Adam:
    under the meta device it lands there) fails its first step on ``.item()`` after making its
    state: the counter is moved to the host and the step taken again. An optimizer that cannot be
    stepped on the meta device at all gives None (the plan says why) rather than no plan."""
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        try:
            opt.step()
        except RuntimeError:  # "Tensor.item() cannot be called on meta tensors"
            if not _meta_scalars_to_host(opt):
                raise
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the rest of the plan still stands
        return None, f"not measured: {type(opt).__name__}.step() on the meta device failed ({type(exc).__name__}: {exc})"
    finally:
        for p in params:
            p.grad = None
    states = [v for state in opt.state.values() for v in state.values()]
    return sum(_nbytes(v) for v in states if isinstance(v, torch.Tensor)), "measured: one step on meta gradients"


def measure_activations(network: nn.Module, batch: torch.Tensor) -> int:
    """Bytes autograd saves for backward in ``network(batch)`` (parameters excluded) plus the
    output: every distinct tensor once, a view counted as its base."""
    params = {id(p) for p in network.parameters()}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if id(base) not in params:
            saved[id(base)] = base  # keeps it alive, so ids stay unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = network(batch)
    outputs = out if isinstance(out, (tuple, list)) else [out]
    for o in outputs:
        if isinstance(o, torch.Tensor):
            saved.setdefault(id(o if o._base is None else o._base), o)
    return sum(_nbytes(t) for t in saved.values())


def memory_plan(cfg: DictConfig, env_spec: EnvSpec | None = None) -> dict[str, Any]:
    """The dry-run figures of ``cfg`` (see the module docstring); ``env_spec`` skips the probe."""
    spec = env_spec if env_spec is not None else probe_env_spec(cfg.env)
    B = int(cfg.learner.batch_size)
    with META:
        agent = make_agent(cfg, spec, META)
        try:
            agent.setup_learner()
        except Exception as exc:  # a user's agent that needs real tensors to set up
            raise GearflowError(
                f"run.dry_run: agent {cfg.agent.name}: setup_learner() does not run on the meta device "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        net = agent.learner_network()
        learner_ids = {id(p) for p in net.parameters()}
        params = list(net.parameters())
        trainable = [p for p in params if p.requires_grad]
        others = {name: m for name, m in vars(agent).items()
                  if isinstance(m, nn.Module) and m is not net
                  and not any(id(p) in learner_ids for p in m.parameters())}  # fmt: skip
        optimizers = {name: o for name, o in vars(agent).items() if isinstance(o, torch.optim.Optimizer)}
        optimizer_bytes = {type(o).__name__ + ("" if name == "optimizer" else f" ({name})"): _optimizer_state_bytes(o)
                           for name, o in optimizers.items()}  # fmt: skip
        unmeasured = [f"{name}: {how}" for name, (n, how) in optimizer_bytes.items() if n is None]

        kind: ItemKind = agent.item_kind()
        table_spec = replay_spec(agent.replay_columns(), cfg.replay.get("frame_stack", False))
        layout = kind.layout(table_spec, B)  # {column: ((B, ...), dtype)}
        batch_bytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                          for shape, dt in layout.values())  # fmt: skip
        estimate = getattr(agent, "memory_estimate", None)
        if callable(estimate):
            est = dict(estimate(B))
            activation_bytes = int(est["activation_bytes"])
            method = str(est.get("activation_method", f"{cfg.agent.name}.memory_estimate({B})"))
        else:
            activation_bytes, method = None, "not measured: the agent has no 'obs' column"
            if "obs" in layout:
                shape, dtype = layout["obs"]
                try:
                    activation_bytes = measure_activations(net, torch.empty(shape, dtype=dtype))
                    method = f"measured: tensors saved for backward in one forward over obs {tuple(shape)} (meta device)"
                except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:  # takes more than obs
                    method = f"not measured: learner_network()(obs {tuple(shape)}) failed: {type(exc).__name__}"
            if activation_bytes is None:
                method += "; give the Agent a memory_estimate(batch_size) method"

    learner: dict[str, Any] = {
        "network": type(net).__name__,
        "dtype": str(params[0].dtype).replace("torch.", "") if params else "",
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "parameter_bytes": sum(_nbytes(p) for p in params),
        "buffer_bytes": sum(_nbytes(b) for b in net.buffers()),
        "gradient_bytes": sum(_nbytes(p) for p in trainable),
        "optimizer": ", ".join(optimizer_bytes) or "none",
        "optimizer_state_bytes": None if unmeasured else sum(n for n, _ in optimizer_bytes.values()),
        "optimizer_method": "; ".join(unmeasured) or "measured: one step on meta gradients",
        "other_networks": ", ".join(others) or "none",
        "other_network_bytes": sum(_module_bytes(m) for m in others.values()),
        "batch_size": B,
        "batch_bytes": batch_bytes,
        "activation_bytes": activation_bytes,
        "activation_method": method,
    }
    a = cfg.agent
    if all(k in a for k in ("d_model", "num_layers", "num_heads")) and kind.name == "sequence":  # a token per step
        T = int(kind.max_length)
        learner["tokens_per_batch"] = B * T
        learner["activation_bytes_16bit_reference"] = (
            int(a.num_layers) * B * T * (34 * int(a.d_model) + 5 * int(a.num_heads) * T)
        )
        learner["activation_reference_formula"] = KORTHIKANTI
    learner["total_bytes"] = sum(learner[k] or 0 for k in (
        "parameter_bytes", "buffer_bytes", "gradient_bytes", "optimizer_state_bytes",
        "other_network_bytes", "batch_bytes", "activation_bytes"))  # fmt: skip

    # the replay geometry Runner.connect_components creates, and what the kind's adder needs of it
    geom = replay_geometry(cfg, kind)
    P, S, R = geom.num_partitions, geom.steps_per_partition, geom.items_per_partition
    kd = kind_def(kind.name)  # the registry's adder and actor of the agent's kind
    need = int(kd.adder.min_steps(cfg.actor, kind))
    segment = SharedStorage.segment_nbytes(table_spec, P, S, R)
    buffers = buffer_sets(cfg.learner.prefetch)  # the table's rotating batch buffers
    replay = {
        "columns": {c.name: c.describe() for c in table_spec},
        "bytes_per_step": table_spec.stored_step_nbytes,  # stacked frames: one frame + its offset byte
        "bytes_per_step_whole_stacks": sum(c.item_nbytes for c in table_spec),  # replay.frame_stack=false
        "capacity": int(cfg.replay.capacity),
        "partitions": P,
        "steps_per_partition": S,
        "items_per_partition": R,
        "min_steps_per_partition": need,  # the adder's minimum: the actor refuses a smaller ring
        "steps_too_few": kd.adder.size_error(cfg.actor, kind, S) if S < need else "",
        "actor": f"{kd.actor.__name__} + {kd.adder.__name__}",
        "bytes_at_capacity": P * S * table_spec.stored_step_nbytes,
        "segment_bytes": segment,
        "batch_buffers": buffers,
        "batch_buffer_bytes": buffers * batch_bytes,
    }
    replay["total_bytes"] = segment + replay["batch_buffer_bytes"]
    num_actors = 1 if cfg.run.serial else int(cfg.actor.num_actors)
    if cfg.run.get("mode", "online") == "offline":
        num_actors = 0
    actors = {  # each actor process holds one policy network (make_network) on actor.device
        "device": str(cfg.actor.device),
        "num_actors": num_actors,
        "network_bytes": _module_bytes(net),
        "total_bytes": num_actors * _module_bytes(net),
    }
    return {
        "dry_run": True,
        "agent": str(cfg.agent.name),
        "env": str(cfg.env.id),
        "obs_shape": list(spec.obs_shape),
        "obs_dtype": str(spec.obs_dtype),
        "num_actions": spec.num_actions,
        "item": kind.name,
        "learner": learner,
        "replay": replay,
        "actors": actors,
        "total": {"learner_device_bytes": learner["total_bytes"], "host_bytes": replay["total_bytes"],
                  "actor_bytes": actors["total_bytes"]},
    }


def human(n: float) -> str:
    """1536 → '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""  # unreachable


def render(plan: dict[str, Any]) -> str:
    """The plan as a readable two-part table."""
    le, r = plan["learner"], plan["replay"]
    rows: list[tuple[str, str, str]] = [
        ("parameters", f"{le['parameters']:,} ({le['dtype']})", human(le["parameter_bytes"])),
        ("buffers", "", human(le["buffer_bytes"])),
        ("gradients", f"{le['trainable_parameters']:,}", human(le["gradient_bytes"])),
        ("optimizer state", le["optimizer"] + ("" if le["optimizer_state_bytes"] is not None
                                                else f" ({le['optimizer_method']})"),
         "n/a" if le["optimizer_state_bytes"] is None else human(le["optimizer_state_bytes"])),
        ("other networks", le["other_networks"], human(le["other_network_bytes"])),
        ("batch", f"{le['batch_size']} items", human(le["batch_bytes"])),
        ("activations / batch", le["activation_method"],
         "n/a" if le["activation_bytes"] is None else human(le["activation_bytes"])),
    ]
    if "activation_bytes_16bit_reference" in le:
        rows.append(("  16-bit reference", f"{le['tokens_per_batch']:,} tokens: {le['activation_reference_formula']}",
                     human(le["activation_bytes_16bit_reference"])))  # fmt: skip
    rows.append(("learner total", "" if le["activation_bytes"] is not None else "without activations",
                 human(le["total_bytes"])))
    rows += [
        ("replay / step", ", ".join(f"{k} {v}" for k, v in r["columns"].items())
         + (f" (whole stacks: {human(r['bytes_per_step_whole_stacks'])})"
            if r["bytes_per_step_whole_stacks"] != r["bytes_per_step"] else ""), human(r["bytes_per_step"])),
        ("replay at capacity", (f"{r['capacity']:,} steps = {r['partitions']} partitions × "
                                f"{r['steps_per_partition']:,}"), human(r["bytes_at_capacity"])),
        ("  shared-memory segment", f"+ item records ({r['items_per_partition']:,}/partition), alignment",
         human(r["segment_bytes"])),
        ("  per partition", f"{r['actor']} need ≥ {r['min_steps_per_partition']:,} steps"
         + (f": TOO FEW, {r['steps_too_few']}" if r["steps_too_few"] else ""), ""),
        ("  batch buffers", f"{r['batch_buffers']} × batch", human(r["batch_buffer_bytes"])),
        ("host total", "", human(r["total_bytes"])),
        ("", "", ""),
        ("actor networks", (f"{plan['actors']['num_actors']} × {human(plan['actors']['network_bytes'])} "
                            f"on actor.device={plan['actors']['device']}"), human(plan["actors"]["total_bytes"])),
    ]  # fmt: skip
    w0 = max(len(a) for a, _, _ in rows)
    w2 = max(len(c) for _, _, c in rows)
    head = (f"dry run: {plan['agent']} on {plan['env']} (obs {plan['obs_dtype']}{plan['obs_shape']}, "
            f"{plan['num_actions']} actions, {plan['item']} items); nothing allocated")  # fmt: skip
    lines = [head, ""]
    for a, b, c in rows:
        if a in ("learner total", "host total"):
            lines.append("-" * (w0 + w2 + 4))
        lines.append(f"{a:<{w0}}  {c:>{w2}}  {b}".rstrip())
        if a == "learner total":
            lines.append("")
    return "\n".join(lines)


def dry_run(cfg: DictConfig) -> dict[str, Any]:
    """Print the plan's table and return the plan (``gearflow train`` prints it as JSON)."""
    plan = memory_plan(cfg)
    print(render(plan), flush=True)
    return plan
