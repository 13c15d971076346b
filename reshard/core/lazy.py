"""Packages whose public face is imported when first used.

A package ``__init__`` that imported its modules would load torch for ``reshard --help`` and
tie its modules into import cycles (``formats.safetensors`` and ``formats.dcp`` read each
other's headers); each names its exports here instead and they load on first access.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``exports`` maps a name to its module."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
