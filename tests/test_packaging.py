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


def test_boto3_is_bounded_by_aiobotocores_botocore_pin() -> None:
    """The test extras bound boto3 where s3fs's aiobotocore bounds botocore (each boto3 release
    pins its own botocore, so pip backtracked through every newer boto3 before: 20 downloads on
    2026-11-28). When aiobotocore moves its pin, move the bound with it."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    ours = next(Requirement(r) for r in extras if Requirement(r).name == "boto3")
    pin = next(Requirement(r) for r in requires("aiobotocore") or [] if Requirement(r).name == "botocore")
    upper = [s.version for s in pin.specifier if s.operator == "<"]
    assert [s.version for s in ours.specifier if s.operator == "<"] == upper, (str(ours), str(pin))


def _setup_commands() -> list[str]:
    """The README's two set-up commands: the first lines of its first ``bash`` block."""
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines()[:2]]


def test_set_up_installs_beside_the_users_torch() -> None:
    """The README's set-up commands (and CI, which runs the second) name no torch release: a
    pin there would replace the torch a user has (with torch 2.14.1 installed, ``pip install
    torch==2.13.0`` installs 2.13.0). reshard's own requirement on torch has no upper bound."""
    import re

    from packaging.requirements import Requirement

    install, test = _setup_commands()
    assert install.startswith("pip install -e .") and "scripts/example.py" in install
    assert test.startswith('pip install -e ".[test]"') and test.endswith("python -m pytest -q")
    for command in (install, test):
        assert not re.search(r"\btorch\b", command), command
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test]"' in ci and not re.search(r"torch[=<>~]", ci)
    assert "python -m pytest -q" in ci
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    every = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    for requirement in map(Requirement, every):
        assert not any(s.operator in ("<", "<=", "==", "~=") for s in requirement.specifier) \
            or requirement.name not in ("torch", "numpy", "transformers", "safetensors"), str(requirement)
