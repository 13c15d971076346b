"""Small JSON documents a user points reshard at (config.json, adapter_config.json): read
with a size bound, and refused in one line when they are not a JSON object."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reshard.core.errors import CorruptCheckpointError, UsageError

__all__ = ["read_json"]

_MAX_JSON = 100_000_000


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"{path}: no {what} there")
    if path.stat().st_size > _MAX_JSON:
        raise CorruptCheckpointError(f"{path}: {what} is larger than {_MAX_JSON} bytes")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path}: {what} is not a JSON object")
    return doc
