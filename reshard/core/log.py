"""The ``reshard`` logger: what the library has to say goes here, not to ``print``.

Notices (every automatic decision: the layout chosen, state dropped, what a cast touched) are
logged at INFO, as is progress off a terminal (a line at most every 10 s); detail for bug
reports at DEBUG. As a library should, reshard only adds a ``NullHandler``: a program shows
these by configuring logging (``logging.basicConfig(level=logging.INFO)``), and the ``reshard``
command shows them on stderr (``--quiet`` hides them, ``--debug`` adds the detail).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["LOGGER", "log_notices", "to_stream", "to_stderr", "quiet"]

LOGGER = logging.getLogger("reshard")
LOGGER.addHandler(logging.NullHandler())


def log_notices(notices: list[str]) -> None:
    for notice in notices:
        LOGGER.info("notice: %s", notice)


@contextlib.contextmanager
def to_stream(stream: TextIO, level: int = logging.INFO, logger: logging.Logger = LOGGER) -> Iterator[None]:
    """``logger``'s records on ``stream`` as plain lines, while the block runs: for a process's
    entry point (the command line, a training launch), never the library itself."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the entry point owns the stream: no second copy through a parent logger
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def to_stderr(level: int = logging.INFO) -> contextlib.AbstractContextManager[None]:
    """For the command line: the ``reshard`` logger's records on stderr, for one command."""
    return to_stream(sys.stderr, level)


def quiet() -> None:
    """``--quiet``: warnings and errors only, for the rest of the command."""
    LOGGER.setLevel(logging.WARNING)
