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

__all__ = ["LOGGER", "log_notices", "to_stderr", "quiet"]

LOGGER = logging.getLogger("reshard")
LOGGER.addHandler(logging.NullHandler())


def log_notices(notices: list[str]) -> None:
    for notice in notices:
        LOGGER.info("notice: %s", notice)


@contextlib.contextmanager
def to_stderr(level: int = logging.INFO) -> Iterator[None]:
    """For the command line: the logger's records on stderr as plain lines, for one command."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = LOGGER.level, LOGGER.propagate
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False  # the command owns stderr: no second copy through the root logger
    try:
        yield
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(saved[0])
        LOGGER.propagate = saved[1]


def quiet() -> None:
    """``--quiet``: warnings and errors only, for the rest of the command."""
    LOGGER.setLevel(logging.WARNING)
