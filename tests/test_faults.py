"""Faults during a conversion: SIGKILL at any point, a full disk, a read-only destination, a
source that changes underneath, and two conversions racing for one destination.

What must hold every time: the source is never touched; DST is absent or complete (it
verifies against the source and against its own manifest), never half-written; a clean
failure leaves no temp file; the next run succeeds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import reshard.pipeline.engine
from reshard.core.errors import OutputExistsError
from reshard.pipeline.staging import StagedOutput
from tests.dist import HANG_GUARD
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli

_EXE = [shutil.which("reshard")] if shutil.which("reshard") else [sys.executable, "-m", "reshard"]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.glob(f".{dst.name}.reshard-*"))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(48 MB torch.save file, a column-sharding PLAN.json, the file's sha256). Column shards
    of row-major tensors cannot be kernel-copied, so under a 1 MiB budget the write takes
    seconds: long enough to be killed in the middle."""
    root = tmp_path_factory.mktemp("faults")
    gen = torch.Generator().manual_seed(0)
    torch.save({f"layers.{i}.w": torch.randn(1024, 1024, generator=gen) for i in range(12)}, root / "src.pt")
    (root / "plan.json").write_text(json.dumps({"mesh": ["dp_shard"], "placements": {}, "default": ["Shard(1)"]}))
    return root / "src.pt", root / "plan.json", _digest(root / "src.pt")


def _convert_args(src: Path, plan: Path, dst: Path) -> list[str]:
    return ["convert", str(src), str(dst), "--to-mesh", "3", "--placements", str(plan), "--max-memory", "1MiB",
            "--quiet", "--overwrite"]


def _wait_for(predicate, timeout: float = HANG_GUARD, step: float = 0.005) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(step)
    return time.monotonic()


def _assert_absent_or_complete(src: Path, dst: Path, why: str) -> bool:
    if not dst.exists():
        return False
    quick = cli("verify", "--quick", dst)
    assert quick.returncode == 0, f"{why}: {quick.stdout}"
    full = cli("verify", src, dst)
    assert full.returncode == 0, f"{why}: {full.stdout}"
    return True


def test_sigkill_at_any_point_leaves_dst_absent_or_complete(source, tmp_path: Path) -> None:
    src, plan, digest = source
    dst = tmp_path / "out"
    args = _EXE + _convert_args(src, plan, dst)
    # One undisturbed run (in this process: torch is imported already) times the write phase.
    began = time.monotonic()
    assert cli(*_convert_args(src, plan, dst)).returncode == 0
    write_s = max(time.monotonic() - began, 0.2)
    assert _assert_absent_or_complete(src, dst, "undisturbed run")
    shutil.rmtree(dst)

    rng = random.Random(8)
    # Before the write starts (imports, reading the catalog), then spread over the write and
    # the commit (manifest hashing and the renames sit at its very end).
    bands = [(0, 0.05), (0.25, 0.5), (0.55, 0.8), (0.85, 1.15)]
    points = [("startup", rng.uniform(0.2, 0.8))] + [("write", rng.uniform(lo, hi) * write_s) for lo, hi in bands]
    outcomes = [_kill_at(args, src, dst, digest, phase, delay, write_s) for phase, delay in points]
    assert any(code == -signal.SIGKILL for code, _ in outcomes), outcomes  # some kills landed mid-run
    # The rerun takes over the dead runs' lock, sweeps their staging and completes.
    rerun = cli(*_convert_args(src, plan, dst))
    assert rerun.returncode == 0, rerun.stderr
    assert _assert_absent_or_complete(src, dst, "rerun")
    assert _leftovers(dst) == [] and _digest(src) == digest
    # Killed mid-write over a complete DST: --overwrite keeps the old output until the very end.
    code, complete = _kill_at(args, src, dst, digest, "write", rng.uniform(0.3, 0.6) * write_s, write_s)
    assert complete, code
    with StagedOutput(dst, is_dir=True, overwrite=True):  # the next run sweeps what the dead one left
        pass
    assert _leftovers(dst) == []


def _kill_at(args: list[str], src: Path, dst: Path, digest: str, phase: str, delay: float,
             write_s: float) -> tuple[int, bool]:
    """Start a conversion, SIGKILL it ``delay`` s into ``phase``; check DST and the source."""
    why = f"SIGKILL {delay:.2f}s into {phase} (write phase ~{write_s:.2f}s)"
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if phase == "write":
        _wait_for(lambda: any(n.startswith(f".{dst.name}.reshard-tmp-{proc.pid}-") for n in _leftovers(dst))
                  or proc.poll() is not None)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=HANG_GUARD)
    complete = _assert_absent_or_complete(src, dst, why)
    assert _digest(src) == digest, f"{why}: the source changed"
    assert sorted(p.name for p in src.parent.iterdir()) == ["plan.json", "src.pt"], why
    return proc.returncode, complete


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_killed_between_the_two_renames_of_an_overwrite(tmp_path: Path) -> None:
    """--overwrite moves the old DST aside, then the new one in: a kill between the two leaves
    DST absent and the old output whole but hidden; the next run puts it back, never deletes it."""
    dst = tmp_path / "out"
    pid = _dead_pid()
    old = tmp_path / f".out.reshard-old-{pid}-0badf00d"
    old.mkdir()
    (old / "weights").write_text("the previous, complete output")
    (tmp_path / f".out.reshard-tmp-{pid}-12345678").mkdir()  # the new one, never committed
    with pytest.raises(OutputExistsError, match="already exists"):
        with StagedOutput(dst, is_dir=True):
            pass
    assert (dst / "weights").read_text() == "the previous, complete output"
    assert _leftovers(dst) == []


def test_disk_full_is_one_line_and_leaves_nothing(source, tmp_path: Path, monkeypatch) -> None:
    """ENOSPC when the free space checked up front is too small, and when a write fails later
    anyway (another writer, thin volumes): exit 2, no staging left, rerun works."""
    from types import SimpleNamespace

    src, plan, digest = source
    dst = tmp_path / "out"
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=3, f_frsize=4096))
    proc = cli(*_convert_args(src, plan, dst))
    assert_one_line_error(proc, "No space left on device")
    assert "12.0 KiB is free" in proc.stderr
    assert not dst.exists() and _leftovers(dst) == []
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    calls = {"n": 0}
    real_pwrite = os.pwrite

    def fills_up(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", fills_up)
    assert_one_line_error(cli(*_convert_args(src, plan, dst)), "No space left on device")
    assert calls["n"] > 20 and not dst.exists() and _leftovers(dst) == []
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert cli(*_convert_args(src, plan, dst)).returncode == 0
    assert _digest(src) == digest


_NAMESPACE_SCRIPT = r"""
import json, os, subprocess, sys
from pathlib import Path
src, full, ro = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(full)], check=True)
subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
import contextlib, io
from reshard.cli.app import main
out = {}
for name, dst in (("full", full / "out"), ("ro", ro / "out")):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["convert", src, str(dst), "--quiet"])
    out[name] = {"code": code, "stderr": err.getvalue(), "left": sorted(os.listdir(dst.parent))}
print(json.dumps(out))
"""


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=HANG_GUARD).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _namespaces_work(), reason="needs unprivileged user+mount namespaces (unshare -rm)")
def test_real_full_disk_and_read_only_destination(source, tmp_path: Path) -> None:
    """A real 4 MiB tmpfs and a real read-only bind mount, in a private mount namespace (root
    in a container may not mount, an unprivileged user namespace may)."""
    src, _plan, digest = source
    (tmp_path / "full").mkdir()
    (tmp_path / "ro").mkdir()
    proc = subprocess.run(["unshare", "-rm", sys.executable, "-c", _NAMESPACE_SCRIPT, str(src),
                           str(tmp_path / "full"), str(tmp_path / "ro")], capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, problem in (("full", "No space left on device"), ("ro", "Read-only file system")):
        got = result[name]
        lines = got["stderr"].strip().splitlines()
        assert got["code"] == 2 and len(lines) == 1 and problem in lines[0], got
        assert got["left"] == [], got  # no DST, no staging, no lock
    assert _digest(src) == digest


def test_read_only_destination_in_process(source, tmp_path: Path, monkeypatch) -> None:
    """Where namespaces are not available: permission bits when not root, else an injected EROFS."""
    src, plan, digest = source
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
    else:
        real_open = os.open

        def read_only(path, flags, *args, **kwargs):
            if str(path).startswith(str(ro)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only)
    try:
        proc = cli(*_convert_args(src, plan, ro / "out"))
    finally:
        ro.chmod(0o755)
    assert_one_line_error(proc, str(ro))
    assert list(ro.iterdir()) == [] and _digest(src) == digest


def test_source_changed_during_conversion(source, tmp_path: Path, monkeypatch) -> None:
    """A training job rewriting the file we read (same size, new mtime), or cutting it short:
    exit 2 naming the file, output discarded, no temp left; the rerun on a stable source works."""
    src, plan, digest = source
    work = tmp_path / "src.pt"
    shutil.copy(src, work)
    dst = tmp_path / "out"
    real_run = reshard.pipeline.engine.Engine.run

    def rewritten_meanwhile(self, *args, **kwargs):
        stats = real_run(self, *args, **kwargs)
        with open(work, "r+b") as f:
            f.seek(4096)
            f.write(b"\x00" * 16)
        st = os.stat(work)
        os.utime(work, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return stats

    monkeypatch.setattr(reshard.pipeline.engine.Engine, "run", rewritten_meanwhile)
    assert_one_line_error(cli(*_convert_args(work, plan, dst)), "src.pt", "changed while it was being converted")
    assert not dst.exists() and _leftovers(dst) == []

    def truncated_meanwhile(self, *args, **kwargs):
        os.truncate(work, 1 << 20)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(reshard.pipeline.engine.Engine, "run", truncated_meanwhile)
    assert_one_line_error(cli(*_convert_args(work, plan, dst)), "src.pt", "truncated")
    assert not dst.exists() and _leftovers(dst) == []
    monkeypatch.setattr(reshard.pipeline.engine.Engine, "run", real_run)
    shutil.copy(src, work)
    assert cli(*_convert_args(work, plan, dst)).returncode == 0
    assert _assert_absent_or_complete(work, dst, "rerun") and _digest(src) == digest


def test_two_conversions_into_one_destination(source, tmp_path: Path) -> None:
    """Two real processes started together: one writes DST, the other exits 2 with a clear
    line (it found the other's lock, or the finished output)."""
    src, plan, digest = source
    dst = tmp_path / "out"
    args = _EXE + _convert_args(src, plan, dst)[:-1]  # no --overwrite: the loser must not replace the winner
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [(p.wait(timeout=HANG_GUARD), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in done) == [0, 2], done
    loser = next(err for code, err in done if code == 2).strip().splitlines()
    assert len(loser) == 1 and str(dst) in loser[0], loser
    assert "another conversion (pid" in loser[0] or "already exists" in loser[0], loser
    assert _assert_absent_or_complete(src, dst, "winner") and _leftovers(dst) == [] and _digest(src) == digest


def test_lock_admits_one_writer_at_a_time(tmp_path: Path) -> None:
    """Many contenders entering together, round after round (each open file description is its
    own flock, so threads contend like processes): never two inside, always one gets in."""
    dst = tmp_path / "out"
    inside, most, admitted = [0], [0], [0]
    guard = threading.Lock()
    for _ in range(15):
        start = threading.Barrier(6)

        def contend() -> None:
            start.wait()
            try:
                with StagedOutput(dst, is_dir=False, overwrite=True) as out:
                    with guard:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                        admitted[0] += 1
                    time.sleep(0.002)
                    out.staging.write_text("x")
                    with guard:
                        inside[0] -= 1
                    out.commit()
            except OutputExistsError:
                pass

        threads = [threading.Thread(target=contend) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=HANG_GUARD)
    assert most[0] == 1 and admitted[0] >= 15
    assert _leftovers(dst) == [] and dst.read_text() == "x"
