"""Vectorised environments with EnvPool's asynchronous API, whatever the backend.

:func:`make_vec_env` returns one :class:`VecEnv`: EnvPool when it has the id
(``env.backend=auto|envpool``), otherwise a gymnasium vector env (by id, or by
``env.factory``) behind an adapter with the same API and the same semantics::

    env = make_vec_env(cfg.env, seed=0)      # e.g. CartPole-v1, num_envs=16, batch_size=8
    env.async_reset()
    while True:
        obs, reward, terminated, truncated, env_ids = env.recv()  # (b, *obs_shape), (b,) ...
        env.send(actions, env_ids)                                # actions int64 (b,)

Semantics (EnvPool's, verified against envpool 1.2): the ``recv`` that reports
``terminated | truncated`` for an env returns that episode's FINAL observation
(and its last reward); the next ``send`` for that env resets it (the action is
ignored), and the following ``recv`` returns the new episode's first
observation with reward 0 and both flags False. The very first ``recv`` after
``async_reset`` returns first observations with reward 0 too. (EnvPool's DeepMind Control
tasks leave the reward of a first observation unwritten: whatever the buffer held, up to
4e36 measured on ``CartpoleSwingup-v1``; :class:`EnvPoolVecEnv` sets it to 0 wherever
``elapsed_step`` is 0, so the rule holds for every backend.)

``env.obs_transform`` (``module:function``) is applied to every observation
batch that ``recv`` returns; :attr:`VecEnv.obs_shape` / :attr:`VecEnv.obs_dtype`
describe the transformed single observation (what agents and replay see),
while ``single_observation_space`` stays the backend's untransformed space.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Optional, Protocol

import numpy as np

from gearflow.config import envpool_ids
from gearflow.errors import ConfigError

BACKENDS = ("envpool", "gymnasium")


@dataclass(frozen=True)
class EnvSpec:
    """What an agent needs to know about the environment (after ``obs_transform``)."""

    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype
    num_actions: Optional[int]
    """Actions of a ``Discrete`` action space; ``None`` when the space is not discrete."""
    action_space: Any = None
    """The backend's single action space (for error messages and continuous agents)."""
    env_id: str = ""


class VecEnv(Protocol):
    """EnvPool's asynchronous API (``envpool/python/protocol.py``), as gearflow uses it."""

    num_envs: int
    batch_size: int
    backend: str
    single_observation_space: Any
    single_action_space: Any

    def async_reset(self) -> None: ...
    def recv(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
    def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None: ...
    def close(self) -> None: ...

    @property
    def obs_shape(self) -> tuple[int, ...]: ...
    @property
    def obs_dtype(self) -> np.dtype: ...
    @property
    def num_actions(self) -> Optional[int]: ...
    @property
    def env_spec(self) -> EnvSpec: ...


def import_path(path: str, key: str) -> Callable:
    """``"package.module:function"`` → the function; errors name ``key`` and the path."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={path!r}: expected an import path 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}={path!r}: cannot import module '{module_name}': {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}={path!r}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}={path!r}: '{attr}' is not callable")
    return obj


def _zeros(space):
    """A zero observation of ``space`` (arrays, dicts and tuples of them): the shape and dtype of
    a sample without drawing one (an unbounded float64 Box's sample overflows a float32 cast)."""
    subspaces = getattr(space, "spaces", None)
    if isinstance(subspaces, dict):
        return {k: _zeros(v) for k, v in subspaces.items()}
    if isinstance(subspaces, (tuple, list)):
        return tuple(_zeros(v) for v in subspaces)
    return np.zeros(space.shape, dtype=space.dtype)


def _batch_of_one(x):
    """One sample of a space as a batch of one: arrays (1, ...), dicts and tuples of them kept."""
    if isinstance(x, dict):
        return {k: _batch_of_one(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_batch_of_one(v) for v in x)
    return np.asarray(x)[None]


class _Adapter:
    """Shared part of both backends: obs transform and the spec properties."""

    backend = ""

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        batch_size: int,
        obs_space,
        act_space,
        transform: Optional[Callable[[np.ndarray], np.ndarray]],
    ):
        self.env_id = env_id
        self.num_envs, self.batch_size = int(num_envs), int(batch_size)
        self.single_observation_space, self.single_action_space = obs_space, act_space
        self._transform = transform
        if obs_space is None or (getattr(obs_space, "shape", None) is None and transform is None):
            raise ConfigError(
                f"env.id={env_id!r}: observation space {obs_space} is not an array space "
                "(dict/tuple observations need an env.obs_transform that returns an array, "
                "e.g. gearflow.transforms:flatten_float32)"
            )
        probe = _batch_of_one(_zeros(obs_space))  # (1, *raw_shape), or a dict/tuple of such
        if transform is not None:
            probe = np.asarray(transform(probe))
            if probe.ndim < 1 or probe.shape[0] != 1:
                raise ConfigError(
                    f"env.obs_transform must map a batch (b, ...) to a batch (b, ...); "
                    f"got shape {probe.shape} for a batch of 1"
                )
        self._obs_shape, self._obs_dtype = tuple(probe.shape[1:]), probe.dtype

    @property
    def obs_shape(self) -> tuple[int, ...]:
        return self._obs_shape

    @property
    def obs_dtype(self) -> np.dtype:
        return self._obs_dtype

    @property
    def num_actions(self) -> Optional[int]:
        n = getattr(self.single_action_space, "n", None)
        is_discrete = type(self.single_action_space).__name__ == "Discrete"
        return int(n) if is_discrete and n is not None else None

    @property
    def env_spec(self) -> EnvSpec:
        return EnvSpec(
            self.obs_shape, self.obs_dtype, self.num_actions, self.single_action_space, self.env_id
        )

    def _obs(self, obs: np.ndarray) -> np.ndarray:
        return obs if self._transform is None else np.asarray(self._transform(obs))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def _first_zero(reward: np.ndarray, elapsed: np.ndarray) -> np.ndarray:
    """``reward`` with 0 where ``elapsed`` is 0 (a first observation: no step led to it), in place
    (EnvPool's arrays are fresh each recv)."""
    if not elapsed.all():  # the usual case, no first observation: one pass, no temporary (2.8 vs 4.1 µs)
        reward[elapsed == 0] = 0
    return reward


class EnvPoolVecEnv(_Adapter):
    """EnvPool's own async env; only the env ids move out of ``info``.

    Where EnvPool's Python layer only copies (one array observation, one discrete
    action, one player: CartPole, Atari, ...), ``recv`` and ``send`` call its C++
    ``_recv`` / ``_send`` directly: the state list is picked by index (``terminated =
    done & ~trunc``, as EnvPool's gymnasium API computes it) and the action list is
    ``[env_ids, env_ids, actions]`` as int32. That skips ~20 µs of dict building, tree
    unflattening and config copies per ``recv`` + ``send`` (``fast=False``: always
    EnvPool's own ``recv`` / ``send``; tests/test_envs.py checks both give the same steps).
    """

    backend = "envpool"

    def __init__(self, env, env_id: str, transform=None, fast: bool = True):
        self._env = env
        cfg = env.config
        super().__init__(
            env_id,
            cfg["num_envs"],
            cfg["batch_size"],
            env.observation_space,
            env.action_space,
            transform,
        )
        self._fast = self._fast_layout(env, cfg) if fast else None

    @staticmethod
    def _fast_layout(env, cfg) -> Optional[tuple[int, int, int, int, int, np.dtype, int]]:
        """Indices of obs, reward, done, trunc and env_id in ``env._recv()``'s list, the
        action dtype and the index of elapsed_step, when EnvPool's Python recv/send would only
        copy; else None."""
        try:
            state, action = list(env._state_keys), list(env._action_keys)
            spec = env._spec._action_spec
        except AttributeError:  # another EnvPool version: its public API
            return None
        obs_keys = [k for k in state if k == "obs" or k.startswith("obs:") or k.startswith("obs.")]
        if (
            obs_keys != ["obs"]
            or type(env.observation_space).__name__ == "Dict"
            or action != ["env_id", "players.env_id", "action"]
            or int(cfg.get("max_num_players", 1)) != 1
            or any(k not in state for k in ("reward", "done", "trunc", "info:env_id", "elapsed_step"))
            or len(spec) != 3
            or list(spec[2][1]) != [-1]
        ):
            return None
        return (state.index("obs"), state.index("reward"), state.index("done"), state.index("trunc"),
                state.index("info:env_id"), np.dtype(spec[2][0]), state.index("elapsed_step"))  # fmt: skip

    @property
    def fast(self) -> bool:
        """Whether ``recv`` / ``send`` bypass EnvPool's Python layer."""
        return self._fast is not None

    def async_reset(self) -> None:
        self._env.async_reset()

    def recv(self):
        f = self._fast
        if f is None:
            obs, reward, terminated, truncated, info = self._env.recv()
            return self._obs(obs), _first_zero(reward, info["elapsed_step"]), terminated, truncated, info["env_id"]
        s = self._env._recv()  # fresh arrays each call, in EnvPool's state-key order
        trunc = s[f[3]]
        return self._obs(s[f[0]]), _first_zero(s[f[1]], s[f[6]]), s[f[2]] & ~trunc, trunc, s[f[4]]

    def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
        f = self._fast
        if f is None:
            self._env.send(actions, env_ids)
            return
        ids = env_ids if type(env_ids) is np.ndarray and env_ids.dtype == np.int32 else np.asarray(env_ids, np.int32)
        act = np.ascontiguousarray(actions, dtype=f[5])
        if act.shape != ids.shape:
            raise ValueError(f"send() needs one action per env id: actions {act.shape}, env_ids {ids.shape}")
        self._env._send([ids, ids, act])

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


class GymnasiumVecEnv(_Adapter):
    """A gymnasium ``VectorEnv`` with NEXT_STEP autoreset behind EnvPool's API.

    ``batch_size == num_envs``: every ``recv`` returns all envs (ids ``0..n-1``).
    The step happens in ``recv`` (``send`` only records the actions), so the
    arrays of one ``recv`` stay valid until the next ``recv``.
    """

    backend = "gymnasium"

    def __init__(self, env, env_id: str, seed: int, transform=None):
        import gymnasium

        mode = env.metadata.get("autoreset_mode", None)
        if mode is not None and mode != gymnasium.vector.AutoresetMode.NEXT_STEP:
            raise ConfigError(
                f"env {env_id!r}: the vector env uses autoreset_mode={mode}; gearflow needs "
                "AutoresetMode.NEXT_STEP (the final observation, then the reset one)"
            )
        self._env, self._seed = env, seed
        super().__init__(
            env_id,
            env.num_envs,
            env.num_envs,
            env.single_observation_space,
            env.single_action_space,
            transform,
        )
        self._ids = np.arange(self.num_envs, dtype=np.int32)
        self._actions: Optional[np.ndarray] = None
        self._reset_pending = False

    def async_reset(self) -> None:
        self._reset_pending, self._actions = True, None

    def recv(self):
        n = self.num_envs
        if self._reset_pending:
            obs, _ = self._env.reset(seed=self._seed)
            self._reset_pending = False
            zeros = np.zeros(n, dtype=bool)
            return (
                self._obs(obs),
                np.zeros(n, dtype=np.float32),
                zeros,
                zeros.copy(),
                self._ids.copy(),
            )
        if self._actions is None:
            raise RuntimeError(
                "recv() without a pending send(): call async_reset() or send() first"
            )
        obs, reward, terminated, truncated, _ = self._env.step(self._actions)
        self._actions = None
        return (
            self._obs(obs),
            np.asarray(reward, dtype=np.float32),
            np.asarray(terminated, dtype=bool),
            np.asarray(truncated, dtype=bool),
            self._ids.copy(),
        )

    def render(self) -> Optional[np.ndarray]:
        """Frame of env 0 (``render_mode="rgb_array"`` in ``env.kwargs``), None without one."""
        frames = self._env.render()
        if frames is None or len(frames) == 0:
            return None
        return np.asarray(frames[0])

    @property
    def render_fps(self) -> int:
        return int(self._env.metadata.get("render_fps", 0) or 0)

    def send(self, actions: np.ndarray, env_ids: np.ndarray) -> None:
        actions = np.asarray(actions)
        env_ids = np.asarray(env_ids)
        if env_ids.shape != (self.num_envs,):
            raise ValueError(
                f"send() needs actions for all {self.num_envs} envs, got {env_ids.shape}"
            )
        ordered = np.empty_like(actions)
        ordered[env_ids] = actions
        self._actions = ordered

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def _kwargs(env_cfg) -> dict:
    kw = getattr(env_cfg, "kwargs", None) or {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(kw, DictConfig):
            kw = OmegaConf.to_container(kw, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return dict(kw)


def make_vec_env(env_cfg, seed: int) -> VecEnv:
    """One asynchronous vectorised env for ``env_cfg`` (an :class:`~gearflow.config.EnvConfig`).

    ``env.factory`` is called as ``function(num_envs=, seed=, **env.kwargs)`` and must
    return a gymnasium ``VectorEnv`` with NEXT_STEP autoreset; otherwise ``env.kwargs``
    go to ``envpool.make`` or ``gymnasium.make``. Env ``i`` is seeded with
    ``seed + i``. ``batch_size == 0`` means
    ``max(1, num_envs // 2)`` (EnvPool only; the gymnasium adapter always
    returns every env). Raises :class:`~gearflow.errors.ConfigError` for an
    unknown id or a bad import path.
    """
    num_envs = int(env_cfg.num_envs)
    if num_envs < 1:
        raise ConfigError(f"env.num_envs={num_envs}: must be ≥ 1")
    batch_size = int(getattr(env_cfg, "batch_size", 0) or 0) or max(1, num_envs // 2)
    if batch_size > num_envs:
        raise ConfigError(f"env.batch_size={batch_size}: must be ≤ env.num_envs ({num_envs})")
    transform_path = getattr(env_cfg, "obs_transform", None)
    transform = import_path(transform_path, "env.obs_transform") if transform_path else None
    kwargs = _kwargs(env_cfg)
    backend = str(getattr(env_cfg, "backend", "auto"))
    if backend not in ("auto", *BACKENDS):
        raise ConfigError(f"env.backend={backend!r}: must be one of auto, {', '.join(BACKENDS)}")
    factory = getattr(env_cfg, "factory", None)
    env_id = str(env_cfg.id)

    if factory:
        make = import_path(factory, "env.factory")
        try:
            env = make(num_envs=num_envs, seed=seed, **kwargs)
        except Exception as exc:  # the user's factory: one line that names it and where it failed
            import traceback

            frame = traceback.extract_tb(exc.__traceback__)[-1]
            called = ", ".join([f"num_envs={num_envs}", f"seed={seed}", *(f"{k}={v!r}" for k, v in kwargs.items())])
            raise ConfigError(f"env.factory={factory!r}: {factory}({called}) raised {type(exc).__name__}: {exc} "
                              f"(at {frame.filename}:{frame.lineno} in {frame.name}); the factory is called with "
                              "num_envs=, seed= and **env.kwargs (docs/custom_agent.md)") from exc
        if not hasattr(env, "single_observation_space") or not hasattr(env, "step"):
            raise ConfigError(
                f"env.factory={factory!r} returned {type(env).__name__}, not a gymnasium VectorEnv"
            )
        return _adapt(GymnasiumVecEnv, env, env_id=str(factory), seed=seed, transform=transform)

    if backend in ("auto", "envpool") and env_id in envpool_ids():
        import envpool

        env = envpool.make(
            env_id,
            env_type="gymnasium",
            num_envs=num_envs,
            batch_size=batch_size,
            seed=seed,
            **kwargs,
        )
        return _adapt(EnvPoolVecEnv, env, env_id=env_id, transform=transform)

    from gearflow.config import env_id_known

    known, why = env_id_known(env_id, backend)
    if not known:
        raise ConfigError(f"env.id={env_id!r}: {why}")
    import gymnasium

    env = gymnasium.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gymnasium.vector.AutoresetMode.NEXT_STEP},
        **kwargs,
    )
    return _adapt(GymnasiumVecEnv, env, env_id=env_id, seed=seed, transform=transform)


def probe_env_spec(env_cfg) -> EnvSpec:
    """The observation and action spec of ``env_cfg``'s env, from one env made (seeded
    ``env.seed``) and closed at once: what a builder or an evaluation process makes its agent for."""
    from omegaconf import OmegaConf

    probe = make_vec_env(OmegaConf.merge(env_cfg, {"num_envs": 1, "batch_size": 1}), seed=int(env_cfg.seed))
    try:
        return probe.env_spec
    finally:
        probe.close()


def _adapt(cls, env, **kwargs):
    """Wrap ``env``; close it if the adapter refuses it (no leaked env threads)."""
    try:
        return cls(env, **kwargs)
    except BaseException:
        env.close()
        raise
