"""Offline datasets: a D4RL-style HDF5 file loaded into the replay table once (``run.mode=offline``).

The file holds flat arrays over all ``N`` steps of all episodes, in order (the
layout D4RL's ``get_dataset()`` returns), or Minari's own layout — one group
``episode_<i>`` per episode with ``observations`` (L + 1 entries, the final one
included), ``actions``, ``rewards``, ``terminations``, ``truncations`` — which is
read into the same flat arrays::

    observations       (N, *obs_shape)     obs_t
    actions            (N,) int / (N, A)   action_t
    rewards            (N,)                r after action_t
    terminals          (N,) bool           the episode terminated after action_t
    timeouts           (N,) bool           the episode was truncated after action_t
    next_observations  (N, *obs_shape)     optional; checked, not stored (nothing bootstraps)

Episodes end where ``terminals | timeouts``; steps after the last end form one
more (unfinished) episode. Each episode becomes the rows ``obs, action, reward,
timestep`` of the agent's episode layout (``gearflow.kinds.episode.EpisodeAdder``) and one
``Episode`` item over its last ``min(L, T)`` steps (``T = replay.max_episode_length``;
only those steps are written), with the agent's ``episode_priority``. Episodes
fill the partitions in order, each partition up to its ``S`` steps.

    stats = load_dataset("cartpole.hdf5", table, agent, env_spec)
    stats["episodes"], stats["steps"]

Every problem is a :class:`~gearflow.errors.ConfigError` naming the file, the key and
the shapes: missing file, missing key, shape or dtype that does not match the env.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from gearflow.errors import ConfigError, MissingDependencyError
from gearflow.kinds.episode import Episode
from gearflow.replay.writer import Writer

log = logging.getLogger(__name__)

REQUIRED_KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")


def read_hdf5(path: str | Path) -> dict[str, np.ndarray]:
    """The dataset's arrays (the required keys, plus ``next_observations`` when present)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run.dataset={str(path)!r}: dataset file not found")
    try:
        import h5py
    except ImportError:
        raise MissingDependencyError("offline datasets need h5py: pip install 'gearflow[offline]'") from None
    try:
        with h5py.File(path, "r") as f:
            have = sorted(f.keys())
            episodes = sorted((k for k in have if _MINARI_EPISODE.match(k)), key=lambda k: int(k.split("_")[1]))
            if episodes:
                return _flatten_minari(f, episodes, path)
            missing = [k for k in REQUIRED_KEYS if k not in f]
            if missing:
                raise ConfigError(
                    f"dataset {path}: missing key(s) {missing}; it has {have} (expected the D4RL layout: "
                    f"{', '.join(REQUIRED_KEYS)}[, next_observations])"
                )
            keys = [*REQUIRED_KEYS, *(["next_observations"] if "next_observations" in f else [])]
            return {k: np.asarray(f[k]) for k in keys}
    except OSError as exc:
        raise ConfigError(f"run.dataset={str(path)!r}: not a readable HDF5 file: {exc}") from None


_MINARI_EPISODE = re.compile(r"^episode_\d+$")
MINARI_KEYS = ("observations", "actions", "rewards", "terminations", "truncations")


def _flatten_minari(f, episodes: list[str], path: Path) -> dict[str, np.ndarray]:
    """Minari's own layout (``episode_<i>`` groups; ``observations`` has one more entry
    than the steps: the final observation) as the flat D4RL arrays."""
    parts: dict[str, list[np.ndarray]] = {k: [] for k in (*REQUIRED_KEYS, "next_observations")}
    for name in episodes:
        group = f[name]
        missing = [k for k in MINARI_KEYS if k not in group]
        if missing:
            raise ConfigError(
                f"dataset {path}: Minari episode group '{name}' lacks {missing}; it has {sorted(group.keys())}"
            )
        if not hasattr(group["observations"], "shape"):
            raise ConfigError(
                f"dataset {path}: '{name}/observations' is a group (a dict observation space); "
                "only array observations are supported"
            )
        obs = np.asarray(group["observations"])
        L = len(group["actions"])
        if obs.shape[0] != L + 1:
            raise ConfigError(
                f"dataset {path}: '{name}/observations' has {obs.shape[0]} entries for {L} actions "
                f"(Minari stores L + 1: the final observation too)"
            )
        parts["observations"].append(obs[:-1])
        parts["next_observations"].append(obs[1:])
        parts["actions"].append(np.asarray(group["actions"]))
        parts["rewards"].append(np.asarray(group["rewards"]))
        terminals = np.asarray(group["terminations"], dtype=bool)
        timeouts = np.asarray(group["truncations"], dtype=bool).copy()
        if L and not (terminals[-1] or timeouts[-1]):
            timeouts[-1] = True  # an episode group ends its episode
        parts["terminals"].append(terminals)
        parts["timeouts"].append(timeouts)
    return {k: np.concatenate(v) for k, v in parts.items()}


def _converts_exactly(a: np.ndarray, dtype) -> bool:
    """Whether ``a``'s values survive a cast to ``dtype`` (to an integer type: integral and in
    range; to a float type: always, as the env's own observations are cast)."""
    dtype = np.dtype(dtype)
    if not np.issubdtype(dtype, np.integer):
        return True
    info = np.iinfo(dtype)
    integral = a.dtype == bool or np.issubdtype(a.dtype, np.integer) or bool((a == np.round(a)).all())
    return integral and a.min() >= info.min and a.max() <= info.max


def check_dataset(data: dict[str, np.ndarray], path: Any, columns: dict, num_actions: int | None) -> int:
    """Shapes and dtypes against the table's columns (the env's spaces); returns N."""
    obs_col, act_col = columns["obs"], columns["action"]
    obs = data["observations"]
    if obs.ndim < 1 or tuple(obs.shape[1:]) != obs_col.shape:
        raise ConfigError(
            f"dataset {path}: 'observations' has shape {list(obs.shape)}; the env's observations are "
            f"{list(obs_col.shape)}, so expected [N, {', '.join(map(str, obs_col.shape))}]"
        )
    if obs.size and not _converts_exactly(obs, obs_col.dtype):
        raise ConfigError(
            f"dataset {path}: 'observations' are {obs.dtype.name} in [{obs.min()}, {obs.max()}]; the env's "
            f"observations are {obs_col.dtype.name} and these values do not convert exactly"
        )
    N = obs.shape[0]
    expected = {
        "actions": (N, *act_col.shape),
        "rewards": (N,),
        "terminals": (N,),
        "timeouts": (N,),
        "next_observations": (N, *obs_col.shape),
    }
    for key, shape in expected.items():
        if key in data and tuple(data[key].shape) != shape:
            raise ConfigError(
                f"dataset {path}: '{key}' has shape {list(data[key].shape)}, expected {list(shape)} "
                f"(N={N} steps from 'observations'; env action column {act_col.describe()})"
            )
    actions = data["actions"]
    if num_actions is not None:
        if not np.issubdtype(actions.dtype, np.integer) and not (actions == np.round(actions)).all():
            raise ConfigError(f"dataset {path}: 'actions' are {actions.dtype.name} non-integers; the env's actions are discrete")
        if N and (actions.min() < 0 or actions.max() >= num_actions):
            raise ConfigError(
                f"dataset {path}: 'actions' range over [{actions.min()}, {actions.max()}]; the env has "
                f"{num_actions} discrete actions [0, {num_actions})"
            )
    for key in ("observations", "rewards", *(["actions"] if num_actions is None else [])):
        if np.issubdtype(data[key].dtype, np.floating) and not np.isfinite(data[key]).all():
            raise ConfigError(f"dataset {path}: '{key}' holds NaN or infinite values")
    return N


def split_episodes(terminals: np.ndarray, timeouts: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each episode: ends after every step with ``terminals | timeouts``;
    steps after the last end are one more episode.

    >>> split_episodes(np.array([0, 0, 1, 0, 0]), np.array([0, 0, 0, 0, 1]))
    [(0, 3), (3, 5)]
    """
    ends = np.flatnonzero(np.asarray(terminals, bool) | np.asarray(timeouts, bool)) + 1
    N = len(terminals)
    bounds = np.r_[0, ends, N] if (ends.size == 0 or ends[-1] != N) else np.r_[0, ends]
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def load_dataset(path: str | Path, table, agent, env_spec=None) -> dict[str, int]:
    """Fill ``table`` (empty, episode items) with the dataset's episodes; returns counts.

    ``env_spec`` is only used in messages (the table's columns come from the agent, which
    was built for that env)."""
    kind = table.kind
    if not isinstance(kind, Episode):
        raise ConfigError(
            f"run.mode=offline loads whole episodes: agent {type(agent).__module__} learns from {kind.name} items "
            "(use an agent with episode items, e.g. agents.decision_transformer, and replay.item=episode)"
        )
    storage = table.storage
    spec = storage.spec
    if set(spec.names) != {"obs", "action", "reward", "timestep"}:
        raise ConfigError(f"run.mode=offline writes columns obs, action, reward, timestep; the agent's table has {spec.names}")
    data = read_hdf5(path)
    columns = {c.name: c for c in spec}
    N = check_dataset(data, path, columns, getattr(env_spec, "num_actions", None))
    episodes = split_episodes(data["terminals"], data["timeouts"])
    if N == 0 or not episodes:
        raise ConfigError(f"dataset {path}: holds no steps")
    T, S, P = kind.max_length, storage.steps_per_partition, storage.num_partitions
    tails = [(max(a, b - T), b) for a, b in episodes]  # the rows an item covers
    lengths = np.array([b - a for a, b in tails])
    if lengths.sum() > P * S or lengths.max() > S:
        raise ConfigError(
            f"dataset {path}: {len(tails)} episodes need {int(lengths.sum())} steps of replay "
            f"(the last ≤ {T} steps of each), more than replay.capacity holds ({P} partitions × {S} steps); "
            "raise replay.capacity"
        )
    if len(tails) < table.rate_limiter.min_size_to_sample:
        raise ConfigError(
            f"dataset {path}: {len(tails)} episodes, fewer than replay.min_size_to_sample="
            f"{table.rate_limiter.min_size_to_sample} (no batch could ever be sampled)"
        )
    obs = data["observations"].astype(columns["obs"].dtype, copy=False)
    actions = data["actions"].astype(columns["action"].dtype, copy=False)
    rewards = data["rewards"].astype(np.float32, copy=False)
    writer = Writer(storage, np.arange(P), prefault=False)
    episode_priority = getattr(agent, "episode_priority", None)
    p, used, long = 0, 0, 0
    for (start, end), (a, b) in zip(episodes, tails):
        n = b - a
        if used + n > S:  # this partition is full: the next one
            p, used = p + 1, 0
            if p == P:  # the total fitted but the packing did not
                raise ConfigError(
                    f"dataset {path}: its episodes do not pack into {P} partitions × {S} steps; raise replay.capacity"
                )
        writer.extend({"obs": obs[a:b], "action": actions[a:b], "reward": rewards[a:b],
                       "timestep": np.arange(a - start, b - start, dtype=np.int64)}, stream=p)  # fmt: skip
        prio = 1.0 if episode_priority is None else float(np.asarray(episode_priority(np.array([rewards[a:b].sum(dtype=np.float64)]), np.array([n])))[0])
        writer.create_items([prio], n, streams=p)
        writer.end_episode(p)
        used += n
        long += int(end - start > T)
    table.scan()
    unfinished = int(not (data["terminals"][-1] or data["timeouts"][-1]))
    log.info("offline dataset %s: %d steps, %d episodes (%d longer than replay.max_episode_length=%d: their last %d "
             "steps kept; %d unfinished at the end of the file) in %d partitions", path, N, len(episodes), long, T, T,
             unfinished, p + 1)  # fmt: skip
    return {"steps": int(N), "episodes": len(episodes), "stored_steps": int(lengths.sum()), "long_episodes": long}
