"""Which torch releases reshard is tested with, and the one notice a newer one gets.

pyproject.toml sets only a floor: reshard installs beside whatever torch a user has, because a
cap would make pip replace a user's (often multi-GB CUDA) torch. The releases the whole suite
has passed on are listed in docs/compat.md (scripts/compat.sh runs it), and tests/data/compat
holds checkpoints written by each of them. A torch past ``NEWEST_TESTED`` is used as it is,
with one line on the ``reshard`` logger saying so; the DCP reader still refuses any
``.metadata`` field it does not know (``reshard.formats.dcp.metadata.NewerFormatError``), so a
newer torch's format change is named, never read wrongly. Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from reshard.core.log import LOGGER

__all__ = ["FLOOR", "NEWEST_TESTED", "TESTED", "ISSUES_URL", "release", "newer_torch_notice", "note_newer_torch"]

FLOOR = "2.9"
NEWEST_TESTED = "2.15"
# Each release whose own writers made the checkpoints in tests/data/compat (read in CI).
TESTED = ("2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
ISSUES_URL = "https://github.com/reshard/reshard/issues"

_noted = False


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "2.15.0+cu130" or "2.16.0.dev20261101"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_torch() -> str | None:
    """The installed torch's version, read from its ``torch/version.py`` unless torch is
    imported already: importing torch to ask would cost a command's start-up a second, and
    package metadata (importlib.metadata) 15 ms."""
    if "torch" in sys.modules:
        return str(getattr(sys.modules["torch"], "__version__", "")) or None
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if m:
            return m.group(1)
    return None


def newer_torch_notice(version: str | None) -> str | None:
    """The notice for ``version`` when it is newer than the newest tested release, else None."""
    have = release(version or "")
    newest = release(NEWEST_TESTED)
    if have is None or newest is None or have <= newest:
        return None
    return (f"reshard: torch {have[0]}.{have[1]} is newer than the newest tested ({NEWEST_TESTED}); "
            f"report problems at {ISSUES_URL}")


def note_newer_torch(version: str | None = None) -> None:
    """Log the notice once per process (the command line shows it on stderr)."""
    global _noted
    if _noted:
        return
    _noted = True
    notice = newer_torch_notice(installed_torch() if version is None else version)
    if notice:
        LOGGER.warning(notice)
