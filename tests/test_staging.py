from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.core.errors import OutputExistsError, UsageError
from reshard.pipeline.staging import StagedOutput


def test_commit_is_atomic_and_failure_leaves_nothing(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with StagedOutput(dst, is_dir=True) as out:
            (out.staging / "part").write_text("half")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with StagedOutput(dst, is_dir=True) as out:
        (out.staging / "part").write_text("whole")
        assert not dst.exists()
        out.commit()
    assert (dst / "part").read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_existing_output_needs_overwrite(tmp_path: Path) -> None:
    dst = tmp_path / "x.pt"
    dst.write_text("old")
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        with StagedOutput(dst, is_dir=False):
            pass
    with StagedOutput(dst, is_dir=False, overwrite=True) as out:
        out.staging.write_text("new")
        out.commit()
    assert dst.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pt"]


def test_concurrent_writer_is_refused_and_dead_ones_are_swept(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / ".out.reshard-lock").write_text(str(sleeper.pid))
        with pytest.raises(OutputExistsError, match=f"pid {sleeper.pid}"):
            with StagedOutput(dst, is_dir=True):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()
    # The holder is gone: its lock and its leftover staging are cleaned up by the next run.
    (tmp_path / f".out.reshard-tmp-{sleeper.pid}-deadbeef").mkdir()
    with StagedOutput(dst, is_dir=True) as out:
        out.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_inside_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="inside the source"):
        StagedOutput(tmp_path / "src" / "out", is_dir=True, sources=(tmp_path / "src",))
    assert os.listdir(tmp_path) == []
