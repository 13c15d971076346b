"""One error hierarchy, so the CLI can turn every expected failure into exit 2 and one line.

Each error mixes in the builtin it refines where one fits, so library users can catch
``FileNotFoundError`` or ``ValueError`` as they would anywhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = [
    "option",
    "speaking_cli",
    "ReshardError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "NewerFormatError",
    "UsageError",
    "OutputExistsError",
    "SourceChangedError",
]


class ReshardError(Exception):
    """Base of every error reshard raises on purpose; the message is meant for the user."""


class CheckpointNotFoundError(ReshardError, FileNotFoundError):
    """The source path does not exist or holds nothing reshard can read."""


class CorruptCheckpointError(ReshardError, ValueError):
    """The source exists but its bytes or metadata are inconsistent (truncated, overlapping...)."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """The source asks us to run code or reach outside its folder; refused, never executed."""


class UnsupportedFormatError(ReshardError, ValueError):
    """The source is well formed but uses a feature or format reshard does not handle."""


class NewerFormatError(UnsupportedFormatError):
    """The source holds a field, type, state or version reshard does not know: most likely written
    by a newer release of its tool than this reshard was tested with. Refused, never guessed: a
    field skipped could change what the bytes mean; the message says what to upgrade."""


class UsageError(ReshardError, ValueError):
    """The request itself is invalid (bad size string, bad flag combination...)."""


class OutputExistsError(ReshardError, FileExistsError):
    """The destination exists or another conversion is writing it."""


class SourceChangedError(ReshardError, RuntimeError):
    """A source file changed size or mtime while we were reading it."""


_CLI = contextvars.ContextVar("reshard_speaks_cli", default=False)


def option(cli: str, api: str) -> str:
    """An option as the user wrote it: ``--overwrite`` from the command line,
    ``overwrite=True`` from Python, so an error's advice can be followed as it reads."""
    return cli if _CLI.get() else api


@contextlib.contextmanager
def speaking_cli() -> Iterator[None]:
    """Errors and notices raised inside name options the CLI's way (``reshard.cli.app.main``)."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)
