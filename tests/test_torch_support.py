"""reshard installs beside the torch a user has: no upper bound on any dependency, and a torch
newer than the newest tested gets one notice line, never a refusal."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import tomllib

from reshard.core import torch_support
from reshard.core.torch_support import NEWEST_TESTED, installed_torch, newer_torch_notice, release
from tests.test_cli import reshard as run_cli

ROOT = Path(__file__).resolve().parents[1]


def test_no_dependency_is_capped_above() -> None:
    """A cap (``<``, ``<=``, ``==``, ``~=``) makes pip replace what a user has installed: torch
    with a multi-GB download, typer under another tool that needs a newer one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"] + project["optional-dependencies"]["zstd"]:
        assert not re.search(r"<|==|~=", requirement), requirement


def test_installed_torch_is_read_without_importing_it() -> None:
    import torch

    assert installed_torch() == torch.__version__


@pytest.mark.parametrize("version,newer", [
    ("2.15.0", False), ("2.15.3+cu132", False), ("2.9.1", False), ("2.16.0", True), ("2.16.0.dev20261201+cpu", True),
    ("3.0.0", True), ("not a version", False),
])
def test_notice_only_past_the_newest_tested(version: str, newer: bool) -> None:
    notice = newer_torch_notice(version)
    assert (notice is not None) is newer
    if notice:
        have = release(version)
        assert notice.startswith(f"reshard: torch {have[0]}.{have[1]} is newer than the newest tested ({NEWEST_TESTED}); "
                                 "report problems at https://")


def test_a_newer_torch_gets_one_line_and_the_command_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch_support, "_noted", False)
    monkeypatch.setattr(torch_support, "installed_torch", lambda: "2.16.0")
    src = ROOT / "tests" / "data" / "compat" / "torch-2.15.0" / "strided"
    proc = run_cli("convert", src, tmp_path / "out.safetensors")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "newer than the newest tested" in line]
    assert lines == ["reshard: torch 2.16 is newer than the newest tested (2.15); "
                     "report problems at https://github.com/reshard/reshard/issues"]
    again = run_cli("inspect", src)  # once per process
    assert "newer than the newest tested" not in again.stderr


def test_the_library_logs_it_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(torch_support, "_noted", False)
    with caplog.at_level(logging.WARNING, logger="reshard"):
        torch_support.note_newer_torch("2.17.1")
        torch_support.note_newer_torch("2.17.1")
    assert [r.getMessage() for r in caplog.records] == [newer_torch_notice("2.17.1")]
