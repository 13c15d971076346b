"""A key map by name: a preset, a JSON file, a parsed JSON map, or a map as it is."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from reshard.core.errors import UsageError, option
from reshard.features.keymap.maps import FamilyKeyMap, KeyMap, hf_to_titan, hf_unfuse, keymap_from_json, titan_to_hf
from reshard.features.keymap.megatron import megatron_to_hf
from reshard.features.keymap.presets import WRAPPERS

__all__ = ["PRESETS", "load_keymap"]

PRESETS: dict[str, Callable[[], Any]] = {
    "titan-to-hf": titan_to_hf,
    "hf-to-titan": lambda: hf_to_titan("v2"),
    "hf-to-titan-0.3": lambda: hf_to_titan("v3"),
    "hf-unfuse": hf_unfuse,
    "hf-fuse": lambda: replace(hf_unfuse().inverse(), name="hf-fuse"),
    "strip-wrappers": lambda: KeyMap(strip=WRAPPERS, name="strip-wrappers"),
    "megatron-to-hf": megatron_to_hf,
}


def load_keymap(spec: str | Path | dict | KeyMap | FamilyKeyMap) -> KeyMap | FamilyKeyMap:
    """A preset name (``titan-to-hf``, ``hf-to-titan``, ``hf-to-titan-0.3``, ``hf-unfuse``,
    ``hf-fuse``, ``strip-wrappers``, ``megatron-to-hf``), a path to a JSON map, an already parsed
    JSON map, or a map."""
    if isinstance(spec, (KeyMap, FamilyKeyMap)):
        return spec
    if isinstance(spec, dict):
        return keymap_from_json(spec, "key map")
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]()
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"{option(f'--keymap {spec}', f'keymap={spec!r}')}: neither a preset ({', '.join(PRESETS)}) nor a JSON "
                         f"file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: key map is not valid JSON ({e})") from None
    return keymap_from_json(doc, str(path))
