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

import fcntl
import glob
import os
import shutil
import uuid
from pathlib import Path
from types import TracebackType

from reshard.core.errors import OutputExistsError, ReshardError, UsageError, option
from reshard.pipeline.manifest import FileDigest, write_manifest
from reshard.pipeline.replace import refuse_overlap, refuse_unreplaceable

__all__ = ["StagedOutput", "refuse_taken"]


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


def _pid_in(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return 0
    return int(text) if text.isdigit() else 0


def refuse_taken(dst: Path, overwrite: bool, sources: tuple[Path, ...] = ()) -> None:
    """Refuse an output whose parent folder is missing, that is, holds or sits inside a source,
    or that exists, unless ``overwrite`` and it is what ``--overwrite`` may replace
    (``reshard.pipeline.replace``): asked again when the output is claimed and before the old
    one is replaced, and first of all before a conversion reads anything, so that a taken name
    fails at once, not after the work."""
    parent = dst.parent
    if not parent.is_dir():
        raise UsageError(f"{dst}: parent folder {parent} does not exist")
    refuse_overlap(dst, sources)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{dst} already exists; pass {option('--overwrite', 'overwrite=True')} to replace it")
        refuse_unreplaceable(dst)


class StagedOutput:
    """``with StagedOutput(dst, is_dir) as out: write under out.staging; out.commit()`` (or
    ``open()`` ... ``commit()``, and ``close()`` in any case, as ``reshard.pipeline.sinks.StagedSink`` does)."""

    def __init__(self, dst: Path, *, is_dir: bool, overwrite: bool = False, sources: tuple[Path, ...] = (),
                 fsync: bool = False, manifest: bool = True) -> None:
        self.dst = Path(dst)
        self.fsync = fsync
        self.manifest = manifest  # directory outputs get .reshard-manifest.json (reshard.pipeline.manifest)
        self.is_dir = is_dir
        self.overwrite = overwrite
        self.sources = tuple(sources)
        refuse_overlap(self.dst, self.sources)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lock = self.dst.with_name(f".{self.dst.name}.reshard-lock")
        self.staging = self.dst.with_name(f".{self.dst.name}.reshard-tmp-{tag}")
        self._committed = False
        self._lock_fd: int | None = None

    def __enter__(self) -> StagedOutput:
        self.open()
        return self

    def open(self) -> None:
        """Claim ``dst``: refuse an existing output (unless ``overwrite``), take the lock,
        sweep what dead conversions left, make the staging folder (for a folder output)."""
        refuse_taken(self.dst, self.overwrite, self.sources)
        try:
            self._take_lock()
        except ReshardError:
            raise
        except OSError as e:  # the folder cannot take files (read-only, /proc...): say so of DST, not our lock
            raise OSError(e.errno, f"cannot write here ({e.strerror})", str(self.dst)) from None
        try:
            self._sweep_stale()
            # Again under the lock: another conversion may have committed since the check above.
            if self.dst.exists() or self.dst.is_symlink():
                if not self.overwrite:
                    raise OutputExistsError(f"{self.dst} already exists (another conversion just wrote it); "
                                            f"pass {option('--overwrite', 'overwrite=True')} to replace it")
                refuse_unreplaceable(self.dst)  # what it holds now; the sources cannot have moved since
            if self.is_dir:
                self.staging.mkdir()
        except BaseException:
            self._release_lock()
            raise

    def _busy(self, holder: int) -> OutputExistsError:
        return OutputExistsError(
            f"{self.dst}: another conversion (pid {holder or '?'}) is writing here; wait for it or pick another "
            f"output (if none is running, delete {self.lock})")

    def _take_lock(self) -> None:
        """An flock on the lock file, which the kernel drops when its holder dies (kill -9
        too): of two conversions starting together exactly one wins, and a dead one never
        blocks the next. Creating the file and writing the pid into it are not one step, so
        the pid is only for messages, and for a live holder that does not flock."""
        for _ in range(5):
            fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _pid_in(fd)
                os.close(fd)
                raise self._busy(holder) from None
            try:  # a finishing holder unlinks the file: then we hold a lock on nothing; retry
                current = os.path.samestat(os.fstat(fd), os.stat(self.lock))
            except FileNotFoundError:
                current = False
            holder = _pid_in(fd) if current else 0
            if not current or (holder and holder != os.getpid() and _alive(holder)):
                os.close(fd)
                if current:
                    raise self._busy(holder)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._lock_fd = fd
            return
        raise OutputExistsError(f"{self.dst}: could not take the lock {self.lock}; retry")

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            self.lock.unlink(missing_ok=True)  # while still holding it, so no one locks a doomed file
            os.close(self._lock_fd)
            self._lock_fd = None

    def _sweep_stale(self) -> None:
        for p in self.dst.parent.glob(f".{glob.escape(self.dst.name)}.reshard-*"):
            if p == self.lock:
                continue
            pid = _pid_of(p.name)
            if pid is not None and not _alive(pid):
                if ".reshard-old-" in p.name and not (self.dst.exists() or self.dst.is_symlink()):
                    os.rename(p, self.dst)  # killed between commit's two renames: the old output is whole
                else:
                    _remove(p)

    def commit(self, known_digests: dict[str, FileDigest] | None = None) -> None:
        """Move the finished staging into place; an existing output (with --overwrite) is
        replaced only after the new one is complete. ``known_digests``: files already hashed
        by the ranks that wrote them (see ``reshard.pipeline.manifest.write_manifest``)."""
        if self.is_dir and self.manifest:
            write_manifest(self.staging, known=known_digests)
        if self.fsync and self.is_dir:
            _fsync_dir(self.staging)
        exists = self.dst.exists() or self.dst.is_symlink()
        if exists and not self.overwrite:
            raise OutputExistsError(f"{self.dst} appeared while converting; pass {option('--overwrite', 'overwrite=True')} to "
                                    f"replace it")
        if exists:  # what the folder holds now, not what it held when the conversion began
            refuse_unreplaceable(self.dst)
        if exists and not self.is_dir and not self.dst.is_dir():
            os.replace(self.staging, self.dst)  # one atomic step for a file over a file
        elif exists:
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
        self.close()

    def close(self) -> None:
        """Remove the staging unless committed, and let the lock go; safe to call twice."""
        if not self._committed:
            _remove(self.staging)
        self._release_lock()


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
