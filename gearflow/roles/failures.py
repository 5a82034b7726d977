"""Why actors failed, and when a failure is not worth a restart: the launcher's side of the
failure reports actor processes send (:func:`gearflow.actors.contract.describe_failure`)::

    failures = FailureLog()
    failures.note(msg)                      # every report read off the actors' queue
    why = failures.verdict(actor)           # a dead actor: None → restart it; a reason → stop the run
    stall = stalled(launcher, steps_at_start, env_steps_now)   # when a limit ended the run

* A :class:`~gearflow.errors.ContractError` (what ``act()`` or ``recv()`` returned does not fit the
  env's spaces) is the agent's or the env's fault and deterministic: never restarted.
* The same failure twice (same exception, message and place, in any actor) is deterministic too:
  not restarted again. The message names the agent module or env factory and the line.
* A run that ended by a limit (``run.max_seconds`` ...) with no env step made since it started,
  while its actors were failing, did not succeed: :func:`stalled` gives the failure to raise
  (``gearflow train`` exits 3), whatever limit came first.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any, Optional

from gearflow.errors import GearflowError

__all__ = ["ActorFailed", "FailureLog", "explain", "stalled"]


class ActorFailed(GearflowError):
    """An actor died more than ``actor.max_restarts`` times, or of a failure a restart cannot
    mend (``deterministic``), or every actor failed before the run made a step: the run stops,
    checkpointed, and ``gearflow train`` exits 3."""

    exit_code = 3

    def __init__(self, message: str, actor: int, deterministic: bool = False):
        super().__init__(message)
        self.actor, self.deterministic = actor, deterministic


class FailureLog:
    """The actors' failure reports: the last one per actor, and how often each signature came."""

    def __init__(self) -> None:
        self.last: dict[int, dict[str, Any]] = {}
        self.seen: collections.Counter = collections.Counter()

    def note(self, msg: Any) -> None:
        """Take one actor report (anything but an ``error`` with a ``signature`` is ignored)."""
        if isinstance(msg, dict) and msg.get("type") == "error" and msg.get("signature"):
            self.last[int(msg["actor"])] = msg
            self.seen[msg["signature"]] += 1

    def verdict(self, actor: int) -> Optional[str]:
        """Why dead ``actor`` must not be restarted (None: a restart may help)."""
        msg = self.last.get(actor)
        if msg is None:
            return None
        culprit = f"{msg['culprit']}, " if msg.get("culprit") else ""
        if msg.get("contract"):
            return (f"actor {actor} failed: {msg['message'].removeprefix('ContractError: ')} — a contract "
                    "violation, not restarted (it would fail the same way)")
        if self.seen[msg["signature"]] >= 2:
            return (f"actor {actor} failed twice with the same error at {culprit}{msg['where']}: {msg['message']} — "
                    "a deterministic failure, not restarted again")
        return None


def stalled(launcher, steps_at_start: int, steps_now: int) -> Optional[ActorFailed]:
    """The failure of a run that made no env step since it (re)started while its actors failed."""
    if launcher is None or steps_now > steps_at_start:
        return None
    errors = getattr(launcher, "errors", {}) or {}
    restarts = sum(getattr(launcher, "restarts", []) or [])
    if not errors and not restarts:
        return None  # nothing failed: a run too short for its actors to start is not a crash
    actor = min(errors) if errors else 0
    last = errors.get(actor, "no traceback received (killed by a signal?)")
    return ActorFailed(f"no env step was made: the actors failed ({restarts} restart(s)); actor {actor}'s last "
                       f"error: {last}", actor=actor)


def explain(failure: ActorFailed, errors: dict[int, str], summary: dict, run_dir: Path) -> ActorFailed:
    """``failure`` with its message completed: the actor's last error (unless the message has it)
    and where the run can continue from."""
    error = errors.get(failure.actor, "no traceback received (killed by a signal?)")
    text = str(failure)
    if error not in text:
        text += f"; its last error: {error}"
    if "checkpoint" in summary:
        fix = "fix it, then " if failure.deterministic else ""
        text += f"; final checkpoint {summary['checkpoint']}; {fix}continue with gearflow train --resume {run_dir}"
    else:
        text += "; no checkpoint (run.checkpoint_every=0)"
    failure.args = (text,)
    return failure
