"""One logging format for every gearflow process.

Actor processes call :func:`setup_logging` with the verbosity of their parent so
that every line reads ``time level process name: message``.
"""

import logging
import os
import warnings

FORMAT = "%(asctime)s %(levelname)-7s %(processName)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


def level_for(verbosity: int) -> int:
    """-1 (quiet) → WARNING, 0 → INFO, 1+ (verbose) → DEBUG."""
    if verbosity < 0:
        return logging.WARNING
    return logging.DEBUG if verbosity > 0 else logging.INFO


def setup_logging(verbosity: int = 0) -> None:
    """Configure the root logger once per process (idempotent)."""
    # gymnasium warns on every CartPole/Atari space it builds; it is noise in our logs
    warnings.filterwarnings("ignore", message=".*Box .* precision lowered.*")
    level = level_for(verbosity)
    os.environ["GEARFLOW_VERBOSITY"] = str(verbosity)
    root = logging.getLogger()
    if not any(getattr(h, "_gearflow", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
        handler._gearflow = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)


def inherited_verbosity() -> int:
    """The verbosity the launching process used (for spawned children)."""
    try:
        return int(os.environ.get("GEARFLOW_VERBOSITY", "0"))
    except ValueError:
        return 0
