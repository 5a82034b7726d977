"""The replay core's C hot paths (``_hotpath.c``, built by setup.py) as one public way in for the
code above replay: the kind modules' adders and window rows (``nstep_*``, ``window_rows``) and the
actors' episode statistics (``episode_stats``). ``C`` is the extension module, or None where it is
not built; each caller then runs its numpy reference::

    from gearflow.replay.hotpath import C as _hotpath
    if _hotpath is not None:
        ended = _hotpath.episode_stats(...)
"""

from __future__ import annotations

try:
    from gearflow.replay import _hotpath as C
except ImportError:  # pragma: no cover - depends on the build
    C = None

__all__ = ["C"]
