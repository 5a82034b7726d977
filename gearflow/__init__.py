"""gearflow: asynchronous actor/learner RL with embedded, GPU-centric replay.

Importing gearflow never imports CuPy, pyverbs or a GPU runtime: those are
optional and loaded lazily by the code paths that ask for them.
"""

__version__ = "0.1.0"

from gearflow.errors import ConfigError, GearflowError, MissingDependencyError

__all__ = ["ConfigError", "GearflowError", "MissingDependencyError", "__version__"]
