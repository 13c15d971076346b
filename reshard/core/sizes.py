"""Human sizes and counts on the command line: ``512MiB``, ``2GB``, ``20KB``, plain bytes, ``1 tensor``."""

from __future__ import annotations

import re

from reshard.core.errors import UsageError

__all__ = ["parse_size", "format_size", "plural"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; decimal units (KB, MB, GB) as the Hub uses them, binary (KiB...) too."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise UsageError(f"cannot read size {text!r}: use a number with a unit, e.g. 512MiB, 2GB, 20KB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return value


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def plural(n: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``, ``0 tensors``: a count and its noun (nouns that add an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def preview(items: list[str], shown: int = 3) -> str:
    """The first few of ``items`` and how many more, for reprs that fit one screen."""
    more = f", +{len(items) - shown} more" if len(items) > shown else ""
    return "[" + ", ".join(repr(i if len(i) <= 80 else i[:77] + "...") for i in items[:shown]) + more + "]"
