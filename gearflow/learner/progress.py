"""What the run tracks while it learns: updates, episodes and returns per actor, restarts, the
actors' latest counters; the greediest *acting* actor (:data:`ACTING_S`). The actor roles and the
transport's learner side fold actors' reports into it (:mod:`gearflow.reports`); checkpoints
store :meth:`Progress.state`."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ACTING_S = 30.0  # an actor that reported nothing for this long (held by a rate limiter, dead, restarting) is not acting


@dataclass
class Progress:
    """What the run tracks for logs, checkpoints and the final summary."""

    start: float = field(default_factory=time.monotonic)
    updates: int = 0
    episodes: int = 0
    wait_s: float = 0.0
    learn_s: float = 0.0
    returns: dict[int, collections.deque] = field(default_factory=dict)  # per actor
    all_returns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100))
    restarts: int = 0
    samples: int = 0  # items learned from
    tokens: int = 0  # steps learned from (items × their valid steps)
    data_age: float = 0.0
    actor_counters: dict[int, dict] = field(default_factory=dict)  # latest "counters" message per actor
    seen: dict[int, float] = field(default_factory=dict)  # per actor: time.monotonic() of its latest report

    def saw(self, actor: int, now: float | None = None) -> None:
        """``actor`` reported (an episode, or counters: it is stepping its envs)."""
        self.seen[actor] = time.monotonic() if now is None else now

    def add_episode(self, actor: int, ret: float) -> None:
        self.saw(actor)
        self.returns.setdefault(actor, collections.deque(maxlen=100)).append(ret)
        self.all_returns.append(ret)
        self.episodes += 1

    def state(self, now: float) -> dict[str, Any]:
        """JSON-able counters for a checkpoint (``now``: ``time.monotonic()``)."""
        return {
            "elapsed_s": now - self.start, "updates": self.updates, "episodes": self.episodes,
            "samples": self.samples, "tokens": self.tokens,
            "wait_s": self.wait_s, "learn_s": self.learn_s, "restarts": self.restarts,
            "returns": {str(a): list(r) for a, r in self.returns.items()},
            "all_returns": list(self.all_returns),
        }  # fmt: skip

    def load_state(self, state: dict[str, Any]) -> None:
        self.start = time.monotonic() - float(state["elapsed_s"])
        self.updates, self.episodes = int(state["updates"]), int(state["episodes"])
        self.wait_s, self.learn_s = float(state["wait_s"]), float(state["learn_s"])
        self.restarts = int(state["restarts"])
        self.samples, self.tokens = int(state.get("samples", 0)), int(state.get("tokens", 0))
        self.returns = {int(a): collections.deque(r, maxlen=100) for a, r in state["returns"].items()}
        self.all_returns = collections.deque(state["all_returns"], maxlen=100)

    def greediest(self, now: float | None = None) -> int | None:
        """The greediest actor that is acting: the highest index among those with episodes that
        reported within ``ACTING_S`` (a starved, dead or restarting actor's last episodes are
        old news, and it may be the one on a node that started late); None when none is."""
        now = time.monotonic() if now is None else now
        acting = [a for a in self.returns if now - self.seen.get(a, -math.inf) <= ACTING_S]
        return max(acting, default=None)

    def greediest_return(self, now: float | None = None) -> float:
        """Mean of the last 100 episodes of the greediest acting actor (:meth:`greediest`; none
        acting: of the highest index, the last one that acted)."""
        if not self.returns:
            return float("nan")
        actor = self.greediest(now)
        return float(np.mean(self.returns[max(self.returns) if actor is None else actor]))

    def actor_weights_version(self) -> int:
        """The oldest weights version any actor that has acted reported (-1 before one has): an
        actor still starting (a spawned process importing torch) has no policy lag yet."""
        versions = [int(c.get("actor/weight_version", -1)) for c in self.actor_counters.values()
                    if int(c.get("actor/env_steps", 1)) > 0]  # fmt: skip
        return min(versions) if versions else -1

