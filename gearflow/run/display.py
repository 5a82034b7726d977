"""Live progress of a training run in the terminal.

On a TTY (``run.progress=auto`` or ``live``) a rich panel redraws in place:
env steps and steps/s, updates/s, replay size and fill, recent returns,
policy lag and the learner's wait fraction, with a bar towards the run's
step limit. Elsewhere (``log``, or ``auto`` when stderr is not a terminal:
CI, ``nohup``, a pipe) the same figures are one plain log line per period::

    display = make_display(cfg.run.progress, max_env_steps=cfg.run.max_env_steps)
    display.update(row)          # a metrics row (see Runner.snapshot)
    display.close()
"""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("gearflow.progress")

FIELDS = [  # (label, key, format)
    ("env steps", "actor/env_steps", "{:,.0f}"),
    ("env steps/s", "actor/env_steps_per_s", "{:,.0f}"),
    ("updates", "learner/updates", "{:,.0f}"),
    ("updates/s", "learner/updates_per_s", "{:.1f}"),
    ("replay size", "replay/size", "{:,.0f}"),
    ("replay fill", "replay/fill", "{:.0%}"),
    ("return (last 100)", "actor/return_last100", "{:.1f}"),
    ("return, greediest actor", "actor/return_last100_greediest", "{:.1f}"),
    ("policy lag (versions)", "actor/policy_lag", "{:.0f}"),
    ("learner wait", "learner/wait_fraction", "{:.0%}"),
    ("elapsed", "time/elapsed_s", "{:.0f} s"),
]


def _fmt(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and value != value):  # missing, or NaN: nothing to show yet
        return "-"
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)


def log_line(row: dict[str, Any]) -> str:
    """The plain one-line form."""
    return (
        f"steps {_fmt(row, 'actor/env_steps', '{:.0f}')} ({_fmt(row, 'actor/env_steps_per_s', '{:.0f}')}/s) "
        f"updates {_fmt(row, 'learner/updates', '{:.0f}')} ({_fmt(row, 'learner/updates_per_s', '{:.1f}')}/s) "
        f"replay {_fmt(row, 'replay/size', '{:.0f}')} return100 {_fmt(row, 'actor/return_last100', '{:.1f}')} "
        f"greediest {_fmt(row, 'actor/return_last100_greediest', '{:.1f}')} "
        f"lag {_fmt(row, 'actor/policy_lag', '{:.1f}')} wait {_fmt(row, 'learner/wait_fraction', '{:.0%}')}"
    )


class LogDisplay:
    def update(self, row: dict[str, Any]) -> None:
        log.info("%s", log_line(row))

    def close(self) -> None:
        pass


def _console_handlers() -> list[logging.Handler]:
    """The root logger's terminal handlers (not files such as the run's train.log)."""
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]  # fmt: skip


def _not_progress(record: logging.LogRecord) -> bool:
    return record.name != log.name


class LiveDisplay:
    """A rich panel redrawn in place on stderr. The plain progress lines still go to the
    log files (the run's train.log), just not to the terminal the panel is on."""

    def __init__(self, max_env_steps: int = 0, title: str = "gearflow train"):
        from rich.console import Console
        from rich.live import Live

        self.max_env_steps, self.title = int(max_env_steps), title
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=2, transient=False)
        self._filtered = _console_handlers()
        for handler in self._filtered:
            handler.addFilter(_not_progress)
        self.live.start()

    def render(self, row: dict[str, Any]):
        from rich.panel import Panel
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column(justify="right")
        for label, key, fmt in FIELDS:
            table.add_row(label, _fmt(row, key, fmt))
        if self.max_env_steps:
            done = float(row.get("actor/env_steps", 0))
            table.add_row(f"of {self.max_env_steps:,} steps", ProgressBar(total=self.max_env_steps, completed=done, width=30))
        return Panel(table, title=self.title, expand=False)

    def update(self, row: dict[str, Any]) -> None:
        self.live.update(self.render(row), refresh=True)
        log.info("%s", log_line(row))  # files only

    def close(self) -> None:
        self.live.stop()
        for handler in self._filtered:
            handler.removeFilter(_not_progress)


def make_display(mode: str, max_env_steps: int = 0, title: str = "gearflow train", stream=None):
    """``live`` / ``log`` / ``auto`` (live when ``stream``, default stderr, is a terminal)."""
    stream = stream if stream is not None else sys.stderr
    live = mode == "live" or (mode == "auto" and hasattr(stream, "isatty") and stream.isatty())
    return LiveDisplay(max_env_steps, title) if live else LogDisplay()
