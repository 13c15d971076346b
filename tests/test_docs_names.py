"""Every module, file and function the docs and reshard's own messages name exists: a renamed
module or a moved function cannot leave a sentence pointing at nothing (docs/architecture.md
once listed a zarr ``remote`` module that was gone; a message told users to call
``reshard.formats.hf.format.export_catalog``, which never existed).

Checked: in README.md, CONTRIBUTING.md and docs/**/*.md, and in every string literal of reshard/
and formats/ (messages, docstrings), each path under reshard/, formats/, scripts/ or tests/
names a file, and each dotted ``reshard.x.y`` names an importable module or an attribute of one.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w/.-])((?:reshard|formats|scripts|tests)/[\w/.-]*\w)")
DOTTED = re.compile(r"(?<![\w.])(reshard(?:\.[A-Za-z_]\w*)+)")
# Not modules: the keys reshard writes into a safetensors file's __metadata__, a zarr store's
# attributes and a DCP's containers record (checked below to be what the writers write).
METADATA_KEYS = {"reshard.objects", "reshard.paths", "reshard.dtype", "reshard.attrs", "reshard.containers",
                 "reshard.pickled_objects", "reshard.mesh", "reshard.mesh.placements"}
# Not in a checkout: the link .ci/run makes for mypy (CONTRIBUTING.md says how).
MADE_BY_CI = {"reshard/formats"}


def _docs() -> dict[str, str]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {str(f.relative_to(ROOT)): f.read_text() for f in files if f.is_file()}


def _literals() -> dict[str, str]:
    """Each source file's string literals (f-strings' constant parts too), joined."""
    out = {}
    for folder in ("reshard", "formats"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
                     and isinstance(n.value, str)]
            out[str(path.relative_to(ROOT))] = "\n".join(parts)
    return out


def _resolves(dotted: str) -> bool:
    """``reshard.a.b.c``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _exists(path: str) -> bool:
    return (ROOT / path.rstrip(".")).exists()


TEXTS = {**_docs(), **_literals()}


@pytest.mark.parametrize("where", sorted(TEXTS))
def test_every_named_path_and_module_exists(where: str) -> None:
    text = TEXTS[where]
    named = [m.group(1) for m in PATH.finditer(text) if text[m.end(): m.end() + 2] not in ("-<", "-X")]
    missing_paths = sorted({p for p in named if p not in MADE_BY_CI and not _exists(p)})
    missing_names = sorted({d for d in DOTTED.findall(text) if d not in METADATA_KEYS and not _resolves(d)})
    assert not missing_paths and not missing_names, {"paths": missing_paths, "names": missing_names}


def test_the_metadata_keys_are_what_the_writers_write() -> None:
    source = "\n".join(p.read_text() for folder in ("formats", "reshard") for p in (ROOT / folder).rglob("*.py"))
    assert [key for key in METADATA_KEYS if f'"{key}"' not in source] == []
