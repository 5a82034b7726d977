"""The roles a plan names, each with the lifecycle's methods (:mod:`gearflow.roles.base`), made by
the one builder (:mod:`gearflow.topology.build`); a role imports nothing above it (not the
topology, not an entry point).

* :mod:`~gearflow.roles.actor_processes` — :class:`LocalLauncher`: a machine's actor processes,
  supervised and restarted (``actors``).
* :mod:`~gearflow.roles.remote_actors` — :class:`RemoteActors`: the shard process serving a run to
  actors on other machines (``remote_actors``).
* :mod:`~gearflow.roles.evaluator` — :class:`EvalProcess`: greedy evaluation during training (``eval``).
* :mod:`~gearflow.roles.shards` — :class:`Shards`: the shard nodes a learner samples (``shards``).
* :mod:`~gearflow.roles.shard_service` — a shard node's service and the relay of its reports
  (``shard_service``).
* :mod:`~gearflow.roles.ray` — the ``ray`` plan's roles, driven from this machine; what runs in
  Ray's workers is :mod:`~gearflow.roles.ray_workers`.
* :mod:`~gearflow.roles.failures` — why actors failed, and when a failure is not worth a restart.
"""
