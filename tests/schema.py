"""Every --json output is checked against reshard/cli/schema.json, the documented schema 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = json.loads((Path(__file__).parents[1] / "reshard" / "cli" / "schema.json").read_text())


def check(doc: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(doc, SCHEMA)
    return doc
