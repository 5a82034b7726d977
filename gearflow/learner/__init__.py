"""The learner: its loop (:mod:`.loop`: :class:`Learner`, :class:`BetaSchedule`), the batches it
learns from (:mod:`.batches`: :class:`Prefetcher`, :class:`SerialBatches`) and what the run tracks
(:mod:`.progress`: :class:`Progress`, :data:`ACTING_S`). See the README beside this file."""

from gearflow.learner.batches import Prefetcher, SerialBatches
from gearflow.learner.loop import BetaSchedule, Learner
from gearflow.learner.progress import ACTING_S, Progress

__all__ = ["ACTING_S", "BetaSchedule", "Learner", "Prefetcher", "Progress", "SerialBatches"]
