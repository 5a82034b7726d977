"""Commands that inspect a config or the machine without training: :mod:`~gearflow.tools.dryrun`
(``run.dry_run=true``: the memory plan) and :mod:`~gearflow.tools.info` (``gearflow info``)."""
