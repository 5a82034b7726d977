"""Launchers: where actor processes run and who watches them.

* :mod:`~gearflow.launchers.local` — :class:`LocalLauncher`: spawned processes on this
  machine, restarted when they die (``gearflow train``). A cluster launcher (Ray) is a
  sibling module with the same methods (``start``, ``check``, ``drain``, ``stop``, ``close``).
"""
