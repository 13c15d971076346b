"""What `pip install` ships: every package of reshard/ and formats/ (installed as
reshard.formats) is in pyproject.toml's hand-kept list, so a new format package cannot be left
out of a wheel while the tests, which run from the checkout, pass."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _packages(folder: Path, name: str) -> set[str]:
    return {".".join((name, *p.parent.relative_to(folder).parts)) for p in folder.rglob("__init__.py")
            if "__pycache__" not in p.parts and not (folder.name == "reshard" and "formats" in p.parts)}


def test_every_package_is_listed_in_pyproject() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    assert setuptools["package-dir"] == {"reshard": "reshard", "reshard.formats": "formats"}
    on_disk = _packages(ROOT / "reshard", "reshard") | _packages(ROOT / "formats", "reshard.formats")
    assert on_disk == listed, {"missing from pyproject": sorted(on_disk - listed), "not on disk": sorted(listed - on_disk)}
