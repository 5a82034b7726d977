"""Run management: what a training run leaves on disk and shows while it runs.

* :mod:`~gearflow.run.checkpoint` — ``RunCheckpoints``: atomic checkpoints, resume, retention.
* :mod:`~gearflow.run.metrics` — ``MetricsLog`` (JSON lines, CSV, TensorBoard), ``read_metrics``.
* :mod:`~gearflow.run.display` — the live panel / log lines.
* :mod:`~gearflow.run.evaluate` — ``gearflow eval`` (an actor without a writer, ε = 0).
* :mod:`~gearflow.run.plot` — ``gearflow plot``.
* :mod:`~gearflow.run.offline` — ``run.mode=offline``: a D4RL-style dataset into the table.
"""
