"""The agent protocol: what actors and the learner need from an agent, and nothing more.

An agent is a module with a ``Config`` dataclass (the ``agent`` config group)
and an ``Agent`` class. YAML names the module by import path, so a user's own
agent is one file anywhere on ``sys.path``::

    agent_cls = load_agent_class("agents.apex_dqn")
    agent = agent_cls(cfg.agent, env.env_spec, agent_settings(cfg), torch.device("cpu"))
    agent = make_agent(cfg, env.env_spec, "cpu")      # the same, in one call
    spec = TableSpec.parse(agent.replay_columns())   # {"obs": "float32[4]", "action": "int64", ...}
    kind = agent.item_kind()                          # Transition(next_columns=("obs",))

    # actor side
    policy = agent.make_network()
    out = agent.act(policy, obs, epsilon)             # out.actions (k,), out.values (k, A)

    # learner side
    agent.setup_learner()
    metrics, priorities = agent.learn(table.sample(256))   # {"learner/loss": ...}, (256,)
    store.publish(agent.learner_network())

Acting and learning are separate: actors only call ``make_network`` and
``act`` (with weights loaded from the parameter store; :class:`SequenceAgent` and
:class:`EpisodeAgent` declare what the sequence and episode actors call besides), so the same agent
serves a serial run, actor processes and a distributed launch unchanged.

``run.dry_run=true`` (:mod:`gearflow.tools.dryrun`) builds the agent and calls
``setup_learner`` on the meta device, so both must work on meta tensors (plain
``nn.Module`` and ``torch.optim`` code does). It measures activations by running
``learner_network()`` on a meta batch of ``obs``; an agent whose learner input is
something else may offer the optional hook
``memory_estimate(batch_size) -> {"activation_bytes": int, "activation_method": str}``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np
import torch

from gearflow.config import import_agent_module
from gearflow.envs import EnvSpec
from gearflow.errors import ConfigError
from gearflow.replay.items import ItemKind
from gearflow.replay.table import Sample

__all__ = [
    "ActOutput", "Agent", "AgentSettings", "EnvSpec", "EpisodeAgent", "SequenceAgent", "agent_settings",
    "learner_state", "load_agent_class", "load_learner_state", "make_agent", "resolve_device",
]  # fmt: skip


@dataclass
class ActOutput:
    """What ``act`` returns for ``k`` observations."""

    actions: np.ndarray  # the actions to send, exploration included: int64 (k,) for a discrete
    #                      action space, float32 (k, *action_shape) for a continuous one
    values: Optional[np.ndarray] = None  # float32 (k, A): Q-values the actor's priorities use
    # Continuous actions cannot index ``values``: such an agent gives the two values an n-step
    # item's initial priority |ret + disc · q_bootstrap(s_{t+n}) − q_action(s_t)| needs instead.
    q_action: Optional[np.ndarray] = None  # float32 (k,): Q(s, a) of the actions sent
    q_bootstrap: Optional[np.ndarray] = None  # float32 (k,): the value s bootstraps with, V(s) = Q(s, μ(s))

    def priority_values(self):
        """What the Ape-X adder's initial priorities read: ``values`` (k, A), the pair
        ``(q_action, q_bootstrap)`` when the agent gave those, or None."""
        if self.q_action is None:
            return self.values
        if self.q_bootstrap is None:
            raise ValueError("ActOutput.q_action needs q_bootstrap too (the value of s as a bootstrap row)")
        return (self.q_action, self.q_bootstrap)


_GROUPS = ("env", "actor", "replay", "learner", "agent", "run", "transport", "cluster")
_KIND_PARAMETERS = ("sequence_length", "sequence_period", "burn_in", "max_episode_length")


@dataclass(frozen=True)
class AgentSettings:
    """What an agent reads of the run beyond its own ``agent`` group, handed to it as values
    (``Agent(cfg, spec, settings, device)``) so that it never reaches into other groups::

        settings = agent_settings(cfg)     # AgentSettings(gamma=0.99, n_step=3, seed=0, ...)
        settings.gamma                     # cfg.actor.gamma: the same number the actors' n-step returns use
    """

    gamma: float
    """``actor.gamma``: the discount of the actors' n-step returns and of the learner's targets."""
    n_step: int
    """``actor.n_step``: steps in the n-step return (the transition and sequence adders use it too)."""
    seed: int
    """``run.seed``: the seed of the agent's own generators (exploration, sampling)."""
    bf16: bool
    """``learner.bf16``: run the learner's forward passes under bfloat16 autocast (gearflow/precision.py)."""
    kind: ItemKind
    """The run's item rule (``replay.item``, its parameters read by the kind:
    :func:`~gearflow.kinds.registry.make_kind`): ``Transition()``, ``Sequence(length, period,
    burn_in)``, ``Episode(max_episode_length)``. The agent learns from it (:meth:`item_kind`
    returns it) or refuses it (:meth:`learns_from`)."""

    def learns_from(self, item: type, agent: str) -> ItemKind:
        """:attr:`kind` when it is an ``item`` kind (``agent``: the agent's module, for the error);
        else a one-line :class:`~gearflow.errors.ConfigError` naming ``replay.item``."""
        if self.kind.name != item.name:
            raise ConfigError(f"replay.item={self.kind.name!r}: agent {agent} learns from {item.name} items")
        return self.kind

    def __getattr__(self, name: str):  # only called for names the dataclass does not have
        if name in _KIND_PARAMETERS:
            raise AttributeError(f"AgentSettings has no attribute {name!r}: the item kind's parameters are its own "
                                 f"(settings.kind: {self.__dict__.get('kind')!r}, made from replay.* by the kind)")  # fmt: skip
        if name in _GROUPS:
            have = ", ".join(f.name for f in fields(self))
            raise AttributeError(
                f"an agent gets AgentSettings ({have}), not the whole run config: read settings.gamma instead "
                f"of full_cfg.actor.gamma (docs/custom_agent.md); '{name}' is not one of them"
            )
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def agent_settings(cfg: Any) -> AgentSettings:
    """The :class:`AgentSettings` of a run config (the one place they are read from it)."""
    from gearflow.kinds.registry import make_kind

    a = cfg.actor
    return AgentSettings(gamma=float(a.gamma), n_step=int(a.n_step), seed=int(cfg.run.seed),
                         bf16=bool(cfg.learner.bf16), kind=make_kind(cfg.replay))  # fmt: skip


@runtime_checkable
class Agent(Protocol):
    """The smallest interface that serves every agent (DQN, R2D2, Decision Transformer)."""

    def __init__(self, cfg: Any, spec: EnvSpec, settings: AgentSettings, device: torch.device) -> None:
        """``cfg``: the agent's config group; ``settings``: what it reads of the rest of the run
        (γ, n-step, seed, bf16, the item kind: :class:`AgentSettings`)."""

    # ---- replay
    def replay_columns(self) -> dict[str, str]:
        """Table spec of one step, e.g. ``{"obs": "float32[4]", "action": "int64", ...}``."""

    def item_kind(self) -> ItemKind:
        """What is sampled: the run's kind, ``settings.kind`` (``settings.learns_from(Transition,
        ...)`` refuses another), e.g. ``Transition(next_columns=("obs",))``."""

    # ---- actor side
    def make_network(self) -> torch.nn.Module:
        """A fresh network on the agent's device (actor policy; weights from the store)."""

    def act(
        self,
        network: torch.nn.Module,
        obs: np.ndarray,
        epsilon: np.ndarray,
        rng: Optional[np.random.Generator] = None,
    ) -> ActOutput:
        """Actions for a batch ``obs`` (k, *obs_shape), exploring with per-row ``epsilon`` (k,).

        Called under ``torch.no_grad()``. ``rng`` is the actor's generator (one per actor
        process, so exploration is not correlated across actors).
        """

    # ---- learner side
    def setup_learner(self) -> None:
        """Build what learning needs: online and target networks, optimizer."""

    def learner_network(self) -> torch.nn.Module:
        """The network whose weights are published to the actors."""

    def learn(self, batch: Sample) -> tuple[dict[str, float], torch.Tensor]:
        """One update: metrics namespaced ``learner/...`` and new priorities (B,) ≥ 0."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class SequenceAgent(Agent, Protocol):
    """An agent of ``Sequence`` items (R2D2): what :class:`~gearflow.kinds.sequence.SequenceActor` calls.

    Optional (the one method the actor looks up, so a user's agent need not have it): a
    KV-cached policy, ``make_kv_cache(num_envs) -> KVCache | None``, ``context_hop() -> int``
    and ``act_cached(network, cache, ids, obs_new, n_new, epsilon, rng) -> ActOutput``
    (:mod:`agents.kv_cache`; ``agents/r2d2_transformer.py``). Without ``make_kv_cache`` (or
    when it returns None) the actor calls :meth:`act` on the whole context every step."""

    def context_length(self) -> int:
        """How many of an env's latest observations ``act`` sees (C)."""

    def act(
        self,
        network: torch.nn.Module,
        obs: np.ndarray,
        epsilon: np.ndarray,
        rng: Optional[np.random.Generator] = None,
        lengths: Optional[np.ndarray] = None,
    ) -> ActOutput:
        """Actions for contexts ``obs`` (k, C, *obs_shape), left-aligned, ``lengths`` (k,) valid steps."""

    def initial_priorities(self, values, action, reward, discount, first, lengths) -> np.ndarray:
        """Priorities (m,) of new windows from what the actor acted with: ``values`` (m, T, A),
        ``action``/``reward``/``discount``/``first`` (m, T) padded with 0, ``lengths`` (m,)."""


@runtime_checkable
class EpisodeAgent(Agent, Protocol):
    """An agent of ``Episode`` items (Decision Transformer): what :class:`~gearflow.kinds.episode.EpisodeActor` calls.

    Optional, as for :class:`SequenceAgent`: ``make_kv_cache``, ``context_hop`` and
    ``act_cached`` (``agents/decision_transformer.py``: three tokens a step)."""

    def context_length(self) -> int:
        """How many of an env's latest (R̂, obs, action, t) steps ``act`` sees (K)."""

    def initial_rtg(self) -> float:
        """The return-to-go an episode starts from (R̂_0)."""

    def episode_priority(self, ret: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Priorities (m,) of episode items from their returns and lengths (the learner agrees)."""

    def act(
        self,
        network: torch.nn.Module,
        obs: np.ndarray,
        epsilon: np.ndarray,
        rng: Optional[np.random.Generator] = None,
        lengths: Optional[np.ndarray] = None,
        rtg: Optional[np.ndarray] = None,
        actions: Optional[np.ndarray] = None,
        timesteps: Optional[np.ndarray] = None,
    ) -> ActOutput:
        """Actions for contexts: ``obs`` (k, K, *obs), ``rtg`` (k, K), ``actions`` (k, K[, A]),
        ``timesteps`` (k, K), ``lengths`` (k,) valid steps; ``epsilon``: the probability of
        sampling from the policy instead of taking its mode."""


def learner_state(agent, *names: str) -> dict:
    """An agent's learner state for a checkpoint: ``getattr(agent, name).state_dict()`` of each of
    ``names`` (networks, optimizers, schedulers) and its ``updates``; :func:`load_learner_state`
    reads it back::

        def state_dict(self):
            return learner_state(self, "online", "target", "optimizer")
    """
    return {**{n: getattr(agent, n).state_dict() for n in names}, "updates": agent.updates}


def load_learner_state(agent, state: dict, *names: str) -> None:
    """What :func:`learner_state` wrote, back into ``agent`` (its learner set up first if it is not)."""
    if agent.online is None:
        agent.setup_learner()
    for n in names:
        getattr(agent, n).load_state_dict(state[n])
    agent.updates = int(state["updates"])


def load_agent_class(name: str) -> type:
    """The ``Agent`` class of the agent module ``name`` (an import path: ``agents.apex_dqn``)."""
    module = import_agent_module(name, key=f"agent.name={name!r}")
    cls = getattr(module, "Agent", None)
    if cls is None or not isinstance(cls, type):
        raise ConfigError(
            f"agent.name={name!r}: module '{module.__name__}' has no Agent class "
            "(an agent module defines a Config dataclass and an Agent class)"
        )
    return cls


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` when available, else ``cpu``; anything else as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def make_agent(cfg: Any, spec: EnvSpec, device: torch.device | str) -> Agent:
    """Instantiate ``cfg.agent.name``'s Agent for the env ``spec``: its own group ``cfg.agent`` and
    the :class:`AgentSettings` of the run."""
    device = resolve_device(device) if isinstance(device, str) else device
    return load_agent_class(cfg.agent.name)(cfg.agent, spec, agent_settings(cfg), device)
