"""Deterministic test environments, usable as ``env.factory: helpers_envs:make``.

:class:`CountingEnv` makes n-step bookkeeping checkable by hand: its observation
is ``[t, episode, env_index]`` (float32), the reward for reaching step ``t`` is
``t`` (rewards 1, 2, 3, ...), and episode ``k`` lasts ``schedule[(k + env_index)
% len(schedule)]`` steps, ending by termination (``"term"``) or truncation
(``"trunc"``). So from any stored observation a test can recompute the n-step
return, the discount and the bootstrap observation of that step.

Tests put the ``tests`` directory on ``sys.path`` (``monkeypatch.syspath_prepend``)
and import this module as ``helpers_envs``.
"""

from __future__ import annotations

import gymnasium
import numpy as np

# (length, how it ends): short episodes (shorter than n = 3) included on purpose
DEFAULT_SCHEDULE = ((5, "term"), (2, "trunc"), (7, "trunc"), (1, "term"), (3, "term"), (4, "trunc"))


def expected_episode(env_index: int, episode: int, schedule=DEFAULT_SCHEDULE) -> tuple[int, str]:
    length, how = schedule[(episode + env_index) % len(schedule)]
    return int(length), str(how)


class CountingEnv(gymnasium.Env):
    """obs ``[t, episode, env_index]``; reward ``t`` on reaching step ``t``; scheduled ends."""

    metadata = {"render_modes": []}

    def __init__(self, env_index: int = 0, schedule=DEFAULT_SCHEDULE, num_actions: int = 2):
        self.env_index = int(env_index)
        self.schedule = tuple((int(n), str(h)) for n, h in schedule)
        self.observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = gymnasium.spaces.Discrete(num_actions)
        self.episode = -1
        self.t = 0
        self.actions: list[int] = []  # every action stepped, in order (tests read it)

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.episode, self.env_index], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.actions.append(int(action))
        self.t += 1
        length, how = expected_episode(self.env_index, self.episode, self.schedule)
        ended = self.t >= length
        return self._obs(), float(self.t), ended and how == "term", ended and how == "trunc", {}


def make(num_envs: int, seed: int, schedule=DEFAULT_SCHEDULE, num_actions: int = 2):
    """A gymnasium SyncVectorEnv of ``num_envs`` CountingEnvs with NEXT_STEP autoreset."""
    fns = [(lambda i=i: CountingEnv(i, schedule, num_actions)) for i in range(num_envs)]
    return gymnasium.vector.SyncVectorEnv(
        fns, autoreset_mode=gymnasium.vector.AutoresetMode.NEXT_STEP
    )


def make_same_step(num_envs: int, seed: int):
    """A vector env with SAME_STEP autoreset (refused: gearflow needs NEXT_STEP)."""
    fns = [(lambda i=i: CountingEnv(i)) for i in range(num_envs)]
    return gymnasium.vector.SyncVectorEnv(
        fns, autoreset_mode=gymnasium.vector.AutoresetMode.SAME_STEP
    )


def keep_positions(obs: np.ndarray) -> np.ndarray:
    """CartPole without velocities: keep cart position (0) and pole angle (2)."""
    return obs[:, [0, 2]]


def not_batched(obs: np.ndarray) -> np.ndarray:
    """A broken transform: drops the batch dimension."""
    return obs[0]


class AsyncCountingVecEnv:
    """CountingEnvs behind EnvPool's async API with ``batch_size < num_envs``.

    An independent implementation of EnvPool's semantics (final observation,
    then the reset observation with reward 0 after the next ``send``); each
    ``recv`` returns ``batch_size`` of the ready envs in a random order, so the
    actor sees the interleavings EnvPool produces.
    """

    backend = "test"

    def __init__(self, num_envs: int, batch_size: int, seed: int = 0, schedule=DEFAULT_SCHEDULE):
        self.envs = [CountingEnv(i, schedule) for i in range(num_envs)]
        self.num_envs, self.batch_size = num_envs, batch_size
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.obs_shape, self.obs_dtype, self.num_actions = (3,), np.dtype(np.float32), 2
        self._rng = np.random.default_rng(seed)
        self._ready: dict[int, tuple] = {}
        self._ended = np.zeros(num_envs, dtype=bool)
        self.closed = False

    @property
    def env_spec(self):
        from gearflow.envs import EnvSpec

        return EnvSpec(self.obs_shape, self.obs_dtype, self.num_actions, self.single_action_space)

    def async_reset(self) -> None:
        for i, env in enumerate(self.envs):
            obs, _ = env.reset()
            self._ready[i] = (obs, 0.0, False, False)

    def recv(self):
        ready = np.array(sorted(self._ready))
        ids = self._rng.permutation(ready)[: self.batch_size]
        rows = [self._ready.pop(int(i)) for i in ids]
        obs = np.stack([r[0] for r in rows])
        rew = np.array([r[1] for r in rows], dtype=np.float32)
        term = np.array([r[2] for r in rows], dtype=bool)
        trunc = np.array([r[3] for r in rows], dtype=bool)
        return obs, rew, term, trunc, ids.astype(np.int32)

    def send(self, actions, env_ids) -> None:
        for a, i in zip(np.asarray(actions).tolist(), np.asarray(env_ids).tolist()):
            env = self.envs[i]
            if self._ended[i]:
                obs, _ = env.reset()
                self._ready[i] = (obs, 0.0, False, False)
                self._ended[i] = False
                continue
            obs, r, te, tr, _ = env.step(a)
            self._ended[i] = te or tr
            self._ready[i] = (obs, r, te, tr)

    def close(self) -> None:
        self.closed = True


class Recvs:
    """EnvPool-shaped recvs of ``E`` envs, to drive an adder without an env (the adder tests,
    the transport tests): ``recvs(version=None)`` returns ``(env_ids, obs, reward, terminated,
    truncated, first, actions, values, version)`` for a random subset of ``b`` envs; an env whose
    previous recv ended its episode comes back with reward 0 and both flags False.

    ``obs``: (shape, dtype) of an observation (uint8: random bytes, else normal floats);
    ``stamp``: ``obs[:, 0]`` is the recv's index * E + the env id (a stored row names its step);
    ``sort``: env ids ascending; ``with_values``: Q-values (b, A), else None; ``version``
    defaults to the recv's 1-based index. Seeded: the same arguments give the same recvs.

        recvs = Recvs(E=4, b=3, seed=1, stamp=True, sort=True)
        for _ in range(100):
            adder.add(*recvs())
    """

    def __init__(self, E: int, b: int, A: int = 3, seed: int = 0, p_end: float = 0.1, *, obs=((3,), np.float32),
                 with_values: bool = True, stamp: bool = False, sort: bool = False):  # fmt: skip
        self.rng = np.random.default_rng(seed)
        self.E, self.b, self.A, self.p_end, self.with_values = E, b, A, p_end, with_values
        self.obs_shape, self.obs_dtype = obs
        self.stamp, self.sort = stamp, sort
        self.reset = np.ones(E, dtype=bool)
        self.t = 0  # recvs made

    def __call__(self, version=None):
        rng, b, A = self.rng, self.b, self.A
        ids = rng.choice(self.E, size=b, replace=False)
        ids = (np.sort(ids) if self.sort else ids).astype(np.int64)
        if self.obs_dtype == np.uint8:
            obs = rng.integers(0, 256, (b, *self.obs_shape), dtype=np.uint8)
        else:
            obs = rng.standard_normal((b, *self.obs_shape)).astype(self.obs_dtype)
        if self.stamp:
            obs[:, 0] = self.t * self.E + ids
        reward = rng.standard_normal(b).astype(np.float32)
        end = rng.random(b) < self.p_end
        terminated = end & (rng.random(b) < 0.5)
        truncated = end & ~terminated
        fresh = self.reset[ids]
        reward[fresh] = 0.0
        terminated[fresh] = truncated[fresh] = False
        self.reset[ids] = terminated | truncated
        actions = rng.integers(0, A, b, dtype=np.int64)
        values = rng.standard_normal((b, A)).astype(np.float32) if self.with_values else None
        self.t += 1
        return ids, obs, reward, terminated, truncated, fresh, actions, values, self.t if version is None else version
