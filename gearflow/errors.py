"""Exceptions shared across gearflow."""


class GearflowError(Exception):
    """Base class of gearflow's own errors."""


class ConfigError(GearflowError, ValueError):
    """A configuration is invalid: the message names the key and where it came from."""


class MissingDependencyError(GearflowError, ImportError):
    """An optional dependency was asked for and is not installed.

    The message is one line that says what needs it and how to install it.
    """


class CheckpointNotWritten(GearflowError):
    """A run's final checkpoint could not be written (a full or read-only disk): the message names
    the checkpoint ``--resume`` continues from instead. ``gearflow train`` exits 4."""

    exit_code = 4
