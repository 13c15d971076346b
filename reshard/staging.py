"""Outputs appear atomically, or not at all.

A conversion writes into a hidden temp sibling of the destination (same filesystem, so the
final ``rename`` is atomic) and renames it into place only after every byte and the
metadata are written and synced. A crash, Ctrl-C or SIGKILL leaves at most a hidden
``.NAME.reshard-tmp-PID`` sibling that no reader mistakes for a checkpoint; the next run
removes those whose process is gone. A lock file beside the destination makes a second
concurrent conversion into the same place fail fast instead of interleaving.

Atomic is not durable: after a power loss, a renamed output whose pages never reached the
disk can hold zeros. ``fsync=True`` (``--fsync``) syncs every file and both directories
before and after the rename, as torch's DCP writer does by default; it is off by default
because, like ``cp`` and safetensors' ``save_file``, most users convert on storage where a
process crash, not a power cut, is the risk.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from types import TracebackType

from reshard.errors import OutputExistsError, UsageError

__all__ = ["StagedOutput"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _pid_of(name: str) -> int | None:
    tail = name.rsplit("-", 2)
    return int(tail[-2]) if len(tail) == 3 and tail[-2].isdigit() else None


class StagedOutput:
    """``with StagedOutput(dst, is_dir) as out: write under out.staging; out.commit()``."""

    def __init__(self, dst: Path, *, is_dir: bool, overwrite: bool = False, sources: tuple[Path, ...] = (),
                 fsync: bool = False) -> None:
        self.dst = Path(dst)
        self.fsync = fsync
        self.is_dir = is_dir
        self.overwrite = overwrite
        for src in sources:
            if self.dst.resolve() == src.resolve() or src.resolve() in self.dst.resolve().parents:
                raise UsageError(f"{self.dst}: the output would overwrite or sit inside the source {src}")
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lock = self.dst.with_name(f".{self.dst.name}.reshard-lock")
        self.staging = self.dst.with_name(f".{self.dst.name}.reshard-tmp-{tag}")
        self._committed = False

    def __enter__(self) -> StagedOutput:
        parent = self.dst.parent
        if not parent.is_dir():
            raise UsageError(f"{self.dst}: parent folder {parent} does not exist")
        if (self.dst.exists() or self.dst.is_symlink()) and not self.overwrite:
            raise OutputExistsError(f"{self.dst} already exists; pass --overwrite to replace it")
        self._take_lock()
        self._sweep_stale()
        if self.is_dir:
            self.staging.mkdir()
        return self

    def _take_lock(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                try:
                    holder = int(self.lock.read_text().strip() or "0")
                except (OSError, ValueError):
                    holder = 0
                if holder and _alive(holder):
                    raise OutputExistsError(
                        f"{self.dst}: another conversion (pid {holder}) is writing here; wait for it or pick another output"
                    ) from None
                self.lock.unlink(missing_ok=True)  # left by a process that died
                continue
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return
        raise OutputExistsError(f"{self.dst}: could not take the lock {self.lock}")

    def _sweep_stale(self) -> None:
        for p in self.dst.parent.glob(f".{self.dst.name}.reshard-*"):
            if p == self.lock:
                continue
            pid = _pid_of(p.name)
            if pid is not None and not _alive(pid):
                _remove(p)

    def commit(self) -> None:
        """Move the finished staging into place; an existing output (with --overwrite) is
        replaced only after the new one is complete."""
        if self.fsync and self.is_dir:
            _fsync_dir(self.staging)
        if self.dst.exists() or self.dst.is_symlink():
            old = self.dst.with_name(f".{self.dst.name}.reshard-old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.rename(self.dst, old)
            os.rename(self.staging, self.dst)
            _remove(old)
        else:
            os.rename(self.staging, self.dst)
        if self.fsync:
            _fsync_dir(self.dst.parent)
        self._committed = True

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if not self._committed:
            _remove(self.staging)
        self.lock.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
