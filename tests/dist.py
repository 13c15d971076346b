"""Multi-rank tests spawn their gloo worlds through reshard.runtime.world.run_world: a ``file://``
rendezvous in a temp dir (no ports), a deadline on every wait, the failing rank's traceback
re-raised. Ranks pay ~2 s each to import torch on CI's two cores: check many things per world.

Every wait in the tests (a world, a subprocess, a thread) is a hang guard, never a speed check:
``HANG_GUARD`` seconds, far above the slowest world seen on a 2-core machine loaded by a second
copy of the suite (minutes), so a busy machine only makes the suite slower. pytest's own
per-test timeout (pyproject.toml) is larger still, so the guard of the wait that hung fires
first and says which.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from reshard.runtime.world import run_world as _run_world

__all__ = ["run_world", "HANG_GUARD"]

HANG_GUARD = float(os.environ.get("RESHARD_TEST_HANG_GUARD", "1500"))


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = HANG_GUARD) -> None:
    """``reshard.runtime.world.run_world`` with the tests' hang guard."""
    _run_world(fn, world_size, *args, timeout=timeout)
