"""Parameters: the learner publishes versioned weights, actors read them.

* :mod:`~gearflow.params.store` — :class:`ParameterStore`: double-buffered weights in one
  shared-memory segment (the local transport).
* :mod:`~gearflow.params.protocol` — :class:`ParameterSource`: what an actor reads
  (``load_into``); a remote source plugs in here.
* :mod:`~gearflow.params.publisher` — :class:`WeightPublisher`: the learner's publishing, from a
  pinned staging copy by a helper thread on a GPU (the learn step never waits for the copy).
"""

from gearflow.params.protocol import ParameterSource
from gearflow.params.publisher import WeightPublisher
from gearflow.params.store import H_SEQ, ParameterStore

__all__ = ["H_SEQ", "ParameterSource", "ParameterStore", "WeightPublisher"]
