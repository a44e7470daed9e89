"""One exception hierarchy for the whole package.

Every validation failure raises :class:`CheckpointError` or a subclass. It is a
``ValueError`` so code that already catches ``ValueError`` keeps working, and it
is never an ``assert``: ``python -O`` strips asserts, and a checkpoint loader that
stops validating under ``-O`` is worse than none.

Messages follow one rule: name the file (or step, or key), say what is wrong,
and say what to do about it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ContractMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "LoadEnvironmentError",
    "SchemaError",
    "StateMismatchError",
    "UnsafeCheckpointError",
]


class CheckpointError(ValueError):
    """Base class: a checkpoint could not be saved, found, verified or restored."""


class CorruptCheckpointError(CheckpointError):
    """The bytes on disk are not the bytes that were written (hash, size, truncation)."""


class IncompleteCheckpointError(CheckpointError):
    """A save never finished: a part, the index or the manifest is missing."""


class LoadEnvironmentError(CheckpointError):
    """The bytes verified, but this machine cannot load them (device, memory, version): not damage."""


class UnsafeCheckpointError(CheckpointError):
    """The weights-only loader refused the file, or a path tries to leave its directory."""


class SchemaError(CheckpointError):
    """The payload's schema field is missing, unknown, or newer than this code."""


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the objects it is being loaded into."""


class ContractMismatchError(CheckpointError):
    """Resume refused: data, model, config or environment differ from the saved run."""
