"""A run's topology, decided and wired in one place.

* :mod:`~gearflow.topology.plan` — ``plan_run(cfg)`` → ``RunPlan``: which roles this process runs.
* :mod:`~gearflow.topology.build` — ``Builder``: the agent, replay, parameters, learner and actors
  of a plan, for ``gearflow train``, ``gearflow serve`` and the Ray roles alike.
* :mod:`~gearflow.topology.lifecycle` — ``Lifecycle``: start / check / drain / stop / finish / close
  over a list of roles.
"""
