"""Actor reports (``episode``, ``counters``, ``error`` messages) folded into a run's progress.

Every place a run reads its actors' reports — the local actor processes' queue
(:class:`~gearflow.roles.actor_processes.LocalLauncher`), remote actors joined to a shard
(:class:`~gearflow.roles.remote_actors.RemoteActors`, a shard node's relay), a learner polling its
shard nodes (:class:`~gearflow.transport.learner.shards.RemoteShards`) and a Ray actor group — folds
them with :func:`fold_report`. Where reports are passed on rather than kept (a shard node
relays them to its learners), :class:`ReportSink` takes them as a Progress would and turns
them back into messages.
"""

from __future__ import annotations

import logging
import math
import queue
import re
from typing import Any

log = logging.getLogger("gearflow.runner")

__all__ = ["ReportSink", "check_report", "fold_report", "log_text", "queued"]

_KEY = re.compile(r"[A-Za-z0-9_./-]{1,64}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
MAX_RETURN = 1e12  # |episode return| an actor may report
MAX_TEXT = 8192  # characters of an error report that reach the log


def queued(q) -> list:
    """Every message in the (multiprocessing) queue ``q`` now, without waiting."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def log_text(text: Any, limit: int = MAX_TEXT) -> str:
    """``text`` fit for the learner's log: control characters shown as ``?``, cut at ``limit``
    characters, every line after the first indented (a report cannot pose as a log line)."""
    s = _CONTROL.sub("?", str(text))[:limit]
    return s.replace("\n", "\n    | ")


def _number(v: Any, lo: float, hi: float) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi


def check_report(m: Any) -> dict:
    """A remote actor's report message, checked field by field (``ValueError`` naming the field):
    an ``episode`` with a finite return (|r| ≤ 1e12), a length and an env index that are ints ≥ 0,
    a finite ε; ``counters`` of at most 64 keys of [A-Za-z0-9_./-], each a finite number or a
    short string without control characters; an ``error`` whose text is a string (logged with
    :func:`log_text`). Returns the message with only those fields."""
    if not isinstance(m, dict):
        raise ValueError("run.report: each message must be a dict")
    kind = m.get("type")
    if kind == "episode":
        ret, length = m.get("actor/episode_return"), m.get("actor/episode_length", 0)
        if not _number(ret, -MAX_RETURN, MAX_RETURN):
            raise ValueError(f"run.report: an episode's actor/episode_return must be a finite number within ±{MAX_RETURN:g}")
        if type(length) is not int or not 0 <= length <= 1 << 40:
            raise ValueError("run.report: an episode's actor/episode_length must be an int ≥ 0")
        env = m.get("env", 0)
        if type(env) is not int or not 0 <= env < 1 << 20:
            raise ValueError("run.report: an episode's env must be an int ≥ 0")
        eps = m.get("actor/epsilon", 0.0)
        if not _number(eps, -1e6, 1e6):
            raise ValueError("run.report: an episode's actor/epsilon must be a finite number")
        return {"type": kind, "env": env, "actor/episode_return": float(ret), "actor/episode_length": length,
                "actor/epsilon": float(eps)}  # fmt: skip
    if kind == "counters":
        if len(m) > 64:
            raise ValueError("run.report: counters hold at most 64 keys")
        out = {}
        for k, v in m.items():
            if not isinstance(k, str) or not _KEY.fullmatch(k):
                raise ValueError(f"run.report: counter key {str(k)[:40]!r} is not 1-64 characters of [A-Za-z0-9_./-]")
            if isinstance(v, str):
                if len(v) > 200 or _CONTROL.search(v) or "\n" in v:
                    raise ValueError(f"run.report: counter {k} is a string with control characters or over 200 characters")
            elif v is not None and not _number(v, -1e18, 1e18):
                raise ValueError(f"run.report: counter {k} must be a finite number (or a short string)")
            out[k] = v
        return out
    if kind == "error":
        if not isinstance(m.get("error"), str):
            raise ValueError("run.report: an error report's error must be a string")
        return {"type": kind, "error": m["error"][:MAX_TEXT]}
    raise ValueError("run.report: each message is a dict whose type is one of episode, counters, error")


def fold_report(
    progress, msg: Any, errors: dict[int, str] | None = None, source: str = "actor"
) -> str | None:
    """Fold one report into ``progress`` (a :class:`~gearflow.learner.Progress` or a
    :class:`ReportSink`): an episode's return, an actor's latest counters; an error is logged
    (``"<source> <actor> raised:"`` and its traceback) and its last line kept in ``errors``.
    Returns the message's type (other types, and anything not a dict, are left to the caller)."""
    kind = msg.get("type") if isinstance(msg, dict) else None
    if kind == "episode":
        progress.add_episode(int(msg["actor"]), float(msg["actor/episode_return"]))
    elif kind == "counters":
        progress.actor_counters[int(msg["actor"])] = msg
        if hasattr(progress, "saw"):  # a Progress: the actor is stepping its envs
            progress.saw(int(msg["actor"]))
    elif kind == "error":
        log.error("%s %s raised:\n    | %s", source, msg.get("actor"), log_text(msg.get("error")))
        if errors is not None:
            lines = str(msg.get("error") or "").strip().splitlines()
            errors[int(msg["actor"])] = lines[-1] if lines else "?"
    return kind


class ReportSink:
    """Takes reports as a Progress does (``add_episode``, ``actor_counters[actor] = msg``) and
    hands each on to :meth:`add` as a message again — for a process that relays its actors'
    reports to where the run's progress is kept."""

    def __init__(self):
        sink = self

        class _Counters(dict):
            def __setitem__(self, actor, msg):
                super().__setitem__(actor, msg)
                sink.add({**msg, "type": "counters", "actor": int(actor)})

        self.actor_counters: dict[int, dict] = _Counters()

    def add_episode(self, actor: int, ret: float) -> None:
        self.add({"type": "episode", "actor": int(actor), "actor/episode_return": float(ret)})

    def add(self, msg: dict) -> None:
        raise NotImplementedError
