"""Boundary checks: what an agent's ``act()`` returns and what an env's ``recv()`` returns,
refused as the agent's or the env's fault, with the agent module or the env factory named.

:func:`guard` wraps both where an actor is built (``ActorBase.__init__``, one line)::

    self.agent, self.env = guard(agent, env, env_cfg)
    out = self.agent.act(policy, obs, eps, rng)   # checked: actions (k,) int64 in [0, A), values (k, A)
    obs, reward, term, trunc, ids = self.env.recv()   # checked: obs (b, *obs_shape) of obs_dtype, ...

What is checked (a violation raises :class:`~gearflow.errors.ContractError`, one line naming the
field, what was expected and what came):

* ``act`` / ``act_cached`` (the first :data:`FULL_CHECKS` calls; then the agent's own methods are
  called directly, at no cost): an :class:`~gearflow.agent.ActOutput`; ``actions`` one per
  observation: ``(k,)`` integers in ``[0, n)`` for a ``Discrete(n)`` space, ``(k, *shape)`` floats
  inside the ``Box`` (finite); ``values`` ``(k, A)`` and finite; ``q_action`` / ``q_bootstrap``
  ``(k,)``, both or neither.
* ``recv`` — every call: observations ``(b, *obs_shape)`` of ``obs_dtype`` (what the env's
  spec declared after ``env.obs_transform``: a dtype that changes mid-run is named here, not in
  the replay writer); the first :data:`FULL_CHECKS` calls also: env ids ``(b,)`` within
  ``[0, num_envs)``, ``reward`` ``(b,)`` finite, ``terminated`` / ``truncated`` ``(b,)`` bool,
  no NaN in float observations.

:func:`describe_failure` turns an exception an actor died of into the report its launcher reads
(``roles/failures.py``): where it was raised (the innermost frame in the agent module or the
env factory when there is one) and a signature, so the same failure twice is known as such.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import traceback
from typing import Any, Optional

import numpy as np

from gearflow.errors import ContractError

__all__ = ["FULL_CHECKS", "CheckedAgent", "CheckedEnv", "agent_label", "check_act", "check_recv",
           "describe_failure", "env_label", "guard"]  # fmt: skip

FULL_CHECKS = 100  # calls of act()/recv() checked in full; after them only recv's obs shape/dtype


def agent_label(agent) -> str:
    """``agent module 'my_c51' (/path/my_c51.py)``."""
    cls = agent if isinstance(agent, type) else type(agent)
    try:
        where = f" ({inspect.getsourcefile(cls)})"
    except (TypeError, OSError):
        where = ""
    return f"agent module '{cls.__module__}'{where}"


def _method_line(agent, name: str) -> str:
    """``my_c51.py:57`` of the agent's method ``name`` (empty when it has no source)."""
    fn = getattr(type(agent), name, None)
    try:
        _, line = inspect.getsourcelines(fn)
        return f"{os.path.basename(inspect.getsourcefile(fn))}:{line}"
    except (TypeError, OSError):
        return ""


def env_label(env_cfg) -> str:
    """``env factory 'corridor:make'`` or ``env 'CartPole-v1'``."""
    factory = getattr(env_cfg, "factory", None) if env_cfg is not None else None
    if factory:
        return f"env factory '{factory}'"
    return f"env '{getattr(env_cfg, 'id', '?')}'"


def _shape(x) -> str:
    return str(tuple(np.shape(x)))


def _dtype(x) -> str:
    dt = getattr(x, "dtype", None)
    return str(dt) if dt is not None else type(x).__name__


# ---------------------------------------------------------------------- act()
def check_act(out, k: int, spec, who: str) -> None:
    """Raise :class:`ContractError` unless ``out`` is a valid answer to ``act`` on ``k`` observations
    of the env ``spec`` (:class:`~gearflow.envs.EnvSpec`); ``who`` names the agent's method."""
    if not hasattr(out, "actions"):
        raise ContractError(f"{who} returned {type(out).__name__}, not an ActOutput (gearflow.agent.ActOutput)")
    actions = out.actions
    if not hasattr(actions, "shape"):
        raise ContractError(f"{who}: ActOutput.actions is a {type(actions).__name__}; expected an array")
    actions = np.asarray(actions)
    space, n = spec.action_space, spec.num_actions
    if n is not None:  # Discrete(n)
        if actions.shape != (k,):
            raise ContractError(f"{who}: ActOutput.actions has shape {actions.shape}, expected ({k},): one integer "
                                f"action per observation for the env's Discrete({n}) action space")
        if actions.dtype.kind not in "iu":
            raise ContractError(f"{who}: ActOutput.actions has dtype {actions.dtype}, expected an integer dtype "
                                f"(int64) for the env's Discrete({n}) action space")
        if k and (int(actions.min()) < 0 or int(actions.max()) >= n):
            bad = actions[(actions < 0) | (actions >= n)]
            raise ContractError(f"{who}: ActOutput.actions holds {int(bad[0])}, expected actions in [0, {n}) "
                                f"for the env's Discrete({n}) action space")
    elif type(space).__name__ == "Box":
        shape = tuple(space.shape)
        if actions.shape != (k, *shape):
            raise ContractError(f"{who}: ActOutput.actions has shape {actions.shape}, expected {(k, *shape)}: one "
                                f"action of shape {shape} per observation for the env's Box action space")
        if actions.dtype.kind != "f":
            raise ContractError(f"{who}: ActOutput.actions has dtype {actions.dtype}, expected a float dtype "
                                "(float32) for the env's Box action space")
        if not np.isfinite(actions).all():
            raise ContractError(f"{who}: ActOutput.actions holds NaN or inf")
        low, high = np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
        tol = 1e-4 * (1.0 + np.maximum(np.abs(low), np.abs(high)))
        outside = (actions < low - tol) | (actions > high + tol)
        if outside.any():
            i = np.argwhere(outside)[0]
            raise ContractError(f"{who}: ActOutput.actions{list(i)} = {float(actions[tuple(i)]):.4g} is outside the "
                                f"env's Box [{float(low[tuple(i[1:])]):.4g}, {float(high[tuple(i[1:])]):.4g}] "
                                "(actions are in the env's units)")
    elif actions.ndim < 1 or len(actions) != k:
        raise ContractError(f"{who}: ActOutput.actions has shape {actions.shape}, expected {k} rows "
                            "(one action per observation)")
    _check_values(out, k, n, who)


def _check_values(out, k: int, n: Optional[int], who: str) -> None:
    values = getattr(out, "values", None)
    if values is not None:
        if n is None:
            raise ContractError(f"{who}: ActOutput.values is given for a continuous action space; give q_action "
                                "and q_bootstrap (k,) instead (docs/custom_agent.md, 'Continuous actions')")
        if np.shape(values) != (k, n):
            raise ContractError(f"{who}: ActOutput.values has shape {_shape(values)}, expected ({k}, {n}): one "
                                "Q-value per action and observation (the initial priorities read "
                                "max_a Q(s, a) and Q(s, a_t) from it)")
        if not np.isfinite(np.asarray(values, dtype=np.float64)).all():
            raise ContractError(f"{who}: ActOutput.values holds NaN or inf")
    qa, qb = getattr(out, "q_action", None), getattr(out, "q_bootstrap", None)
    if (qa is None) != (qb is None):
        have, missing = ("q_action", "q_bootstrap") if qb is None else ("q_bootstrap", "q_action")
        raise ContractError(f"{who}: ActOutput.{have} is given without {missing}; the initial priority "
                            "|ret + disc·q_bootstrap(s_last) − q_action(s_t)| needs both")
    for name, q in (("q_action", qa), ("q_bootstrap", qb)):
        if q is not None:
            if np.shape(q) != (k,):
                raise ContractError(f"{who}: ActOutput.{name} has shape {_shape(q)}, expected ({k},): one value "
                                    "per observation")
            if not np.isfinite(np.asarray(q, dtype=np.float64)).all():
                raise ContractError(f"{who}: ActOutput.{name} holds NaN or inf")


class CheckedAgent:
    """The agent, with its first :data:`FULL_CHECKS` answers of ``act`` / ``act_cached`` checked;
    every other attribute is the agent's own."""

    def __init__(self, agent, spec):
        self.agent, self.spec, self.label, self._left = agent, spec, agent_label(agent), FULL_CHECKS
        self.item_kind = agent.item_kind  # called by the actor and adders: no __getattr__ per call
        if hasattr(agent, "act_cached"):
            self.act_cached = self._act_cached

    def _who(self, name: str) -> str:
        line = _method_line(self.agent, name)
        return f"{self.label}: {name}(){' at ' + line if line else ''}"

    def _count(self) -> None:
        self._left -= 1
        if self._left <= 0:  # checked long enough: the agent's own methods from now on
            self.act = self.agent.act
            if hasattr(self.agent, "act_cached"):
                self.act_cached = self.agent.act_cached

    def act(self, network, obs, *args, **kwargs):
        out = self.agent.act(network, obs, *args, **kwargs)
        check_act(out, len(obs), self.spec, self._who("act"))
        self._count()
        return out

    def _act_cached(self, network, cache, ids, *args, **kwargs):
        out = self.agent.act_cached(network, cache, ids, *args, **kwargs)
        check_act(out, len(ids), self.spec, self._who("act_cached"))
        self._count()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["agent"], name)


# ---------------------------------------------------------------------- recv()
def check_recv(batch, spec, num_envs: int, who: str) -> None:
    """Raise :class:`ContractError` unless ``batch`` (what ``recv`` returned) fits the env's ``spec``."""
    try:
        obs, reward, terminated, truncated, env_ids = batch
    except (TypeError, ValueError):
        raise ContractError(f"{who}: recv() returned {type(batch).__name__}, expected (obs, reward, terminated, "
                            "truncated, env_ids)") from None
    ids = np.asarray(env_ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or not 1 <= len(ids) <= num_envs:
        raise ContractError(f"{who}: env_ids have shape {ids.shape} and dtype {ids.dtype}, expected 1 to "
                            f"{num_envs} integer ids (b,)")
    if int(ids.min()) < 0 or int(ids.max()) >= num_envs:
        raise ContractError(f"{who}: env id {int(ids.max() if ids.max() >= num_envs else ids.min())} is outside "
                            f"[0, {num_envs})")
    b = len(ids)
    check_obs(obs, b, spec, who)
    for name, x, kinds, want in (("reward", reward, "fiu", "a number"), ("terminated", terminated, "b", "bool"),
                                 ("truncated", truncated, "b", "bool")):  # fmt: skip
        a = np.asarray(x)
        if a.shape != (b,):
            raise ContractError(f"{who}: {name} has shape {a.shape}, expected ({b},): one per env of the batch")
        if a.dtype.kind not in kinds:
            raise ContractError(f"{who}: {name} has dtype {a.dtype}, expected {want} per env")
    if not np.isfinite(np.asarray(reward, dtype=np.float64)).all():
        raise ContractError(f"{who}: reward holds NaN or inf ({np.asarray(reward).tolist()[:8]})")
    o = np.asarray(obs)
    if o.dtype.kind == "f" and not np.isfinite(o).all():
        raise ContractError(f"{who}: the observations hold NaN or inf")


def check_obs(obs, b: int, spec, who: str) -> None:
    """The observations of one recv: an array ``(b, *obs_shape)`` of the spec's dtype."""
    want_shape, want_dtype = tuple(spec.obs_shape), np.dtype(spec.obs_dtype)
    if not isinstance(obs, np.ndarray):
        raise ContractError(f"{who}: observations are a {type(obs).__name__}, expected a numpy array "
                            f"{want_dtype}{list(want_shape)} per env (dict observations need an env.obs_transform)")
    if obs.dtype != want_dtype:
        raise ContractError(f"{who}: observations have dtype {obs.dtype}, expected {want_dtype} (what its "
                            "observation space declared, after env.obs_transform)")
    if obs.shape != (b, *want_shape):
        raise ContractError(f"{who}: observations have shape {obs.shape}, expected {(b, *want_shape)} "
                            f"({b} envs of {want_shape})")


class CheckedEnv:
    """The vector env, with every ``recv`` checked (obs shape and dtype; the first
    :data:`FULL_CHECKS` in full); every other attribute is the env's own."""

    def __init__(self, env, env_cfg):
        self.env, self.label, self._left = env, env_label(env_cfg), FULL_CHECKS
        self.spec = env.env_spec
        self.num_envs, self.batch_size = env.num_envs, env.batch_size
        self._shape, self._dtype = tuple(self.spec.obs_shape), np.dtype(self.spec.obs_dtype)
        self.send, self.async_reset, self.close = env.send, env.async_reset, env.close

    def recv(self):
        batch = self.env.recv()
        if self._left > 0:
            self._left -= 1
            check_recv(batch, self.spec, self.num_envs, self.label)
            return batch
        obs = batch[0]  # every recv: a dtype or shape that changes mid-run is the env's fault, named here
        if obs.__class__ is not np.ndarray or obs.dtype is not self._dtype or obs.shape[1:] != self._shape:
            check_obs(obs, len(batch[4]), self.spec, self.label)  # (builtin dtypes are singletons: `is` first)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["env"], name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def guard(agent, env, env_cfg) -> tuple[Any, Any]:
    """``(agent, env)`` behind their boundary checks (each wrapped once); ``env_cfg``: the run's
    ``env`` group (or ``None``), which their errors name."""
    if not isinstance(env, CheckedEnv) and hasattr(env, "env_spec"):
        env = CheckedEnv(env, env_cfg)
    if not isinstance(agent, CheckedAgent) and hasattr(env, "env_spec"):
        agent = CheckedAgent(agent, env.env_spec)
    return agent, env


# ---------------------------------------------------------------------- failures
def _module_file(name: str) -> Optional[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None
    return os.path.realpath(spec.origin) if spec is not None and spec.origin else None


def describe_failure(exc: BaseException, cfg) -> dict[str, Any]:
    """What a launcher needs to know about the exception an actor died of: ``where`` (``file:line in
    function``, the innermost frame in the agent module or the env factory's module if any, and whose
    code that is), ``culprit`` (``agent module 'x'`` / ``env factory 'm:f'`` / ``gearflow``),
    ``signature`` (type, message and place: the same failure twice has the same one) and
    ``contract`` (a :class:`ContractError`: the agent's or env's fault, never worth a restart)."""
    frames = traceback.extract_tb(exc.__traceback__)
    owners = {}
    agent_name = str(cfg.agent.name) if cfg is not None else ""
    factory = str(getattr(cfg.env, "factory", None) or "") if cfg is not None else ""
    if agent_name and (path := _module_file(agent_name)):
        owners[path] = f"agent module '{agent_name}'"
    if factory and (path := _module_file(factory.partition(":")[0])):
        owners[path] = f"env factory '{factory}'"
    pick, culprit = (frames[-1] if frames else None), ""
    for frame in reversed(frames):
        if os.path.realpath(frame.filename) in owners:
            pick, culprit = frame, owners[os.path.realpath(frame.filename)]
            break
    where = f"{pick.filename}:{pick.lineno} in {pick.name}" if pick is not None else "?"
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc) else type(exc).__name__
    return {"where": where, "culprit": culprit, "message": message, "signature": f"{message} @ {where}",
            "contract": isinstance(exc, ContractError)}  # fmt: skip
