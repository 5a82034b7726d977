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


class ContractError(GearflowError, ValueError):
    """An agent or an env broke its contract with the actors (``gearflow/actors/contract.py``): what
    ``act()`` or ``recv()`` returned does not fit the env's spaces. The message names the agent module
    or the env factory, the field, what was expected and what came. Deterministic by nature: an actor
    that dies of one is not restarted, and ``gearflow train`` exits 3."""

    exit_code = 3
