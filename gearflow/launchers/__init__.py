"""Launchers: where actor processes run and who watches them.

* :mod:`~gearflow.launchers.local` — :class:`LocalLauncher`: spawned processes on this
  machine, restarted when they die (``gearflow train``). A cluster launcher (Ray) is a
  sibling module with the same methods (``start``, ``check``, ``drain``, ``stop``, ``close``).
* :mod:`~gearflow.launchers.evaluator` — :class:`EvalProcess`: greedy evaluation during
  training (``run.eval_every``) in a process of its own, the plan's ``eval`` role.
"""
