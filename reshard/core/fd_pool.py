"""Open files, each opened once, never more at once than the process may hold.

A conversion of a checkpoint saved by 2048 ranks reads 2048 files, and one laid out for 2048
ranks writes as many: keeping every descriptor open would pass the usual limit of 1024 open
files (``ulimit -n``) and fail halfway. The pool opens a file when a worker asks for it, keeps
it open for the next read or write, and closes the least recently used idle ones once it holds
``limit``: a quarter of the soft limit, so the rest of the process (torch, gloo sockets,
threads) keeps room. A descriptor in use is never closed under its user.

Below the limit a file is opened once per run: a file the sink made is kept from its making
(``adopt``), and the readers that locate records (which open and close a file for each one)
borrow the pool's descriptors while the engine runs (``lending``, ``storage.borrowing``).
"""

from __future__ import annotations

import os
import resource
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reshard.core.storage import RemotePath, borrowing, close, open_read

__all__ = ["FdPool", "default_limit"]


def default_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 512
    return max(8, min(512, soft // 4))


class FdPool:
    """Descriptors by path, opened with ``flags``, shared by threads (pread and pwrite do not
    move a file position, so one descriptor serves every worker). A remote source file
    (``RemotePath``) gets a ``RemoteFile`` handle instead, read through ``storage.pread_into``."""

    def __init__(self, flags: int = os.O_RDONLY, limit: int | None = None) -> None:
        self.flags = flags
        self.limit = limit or default_limit()
        self._open: OrderedDict[Path, int] = OrderedDict()  # least recently used first
        self._users: Counter[Path] = Counter()
        self._path_of: dict[int, Path] = {}  # whose each handle is (``take_back``)
        self._lock = threading.Lock()

    @contextmanager
    def use(self, path: Path) -> Iterator[int]:
        fd = self.lend(path)
        try:
            yield fd
        finally:
            with self._lock:
                self._release(path)

    def lend(self, path: Path) -> int:
        """``path``'s handle, opened if it is not open, counted in use until released."""
        with self._lock:
            fd = self._open.get(path)
            if fd is None:
                self._make_room()
                fd = open_read(path) if isinstance(path, RemotePath) else os.open(path, self.flags)
                self._keep(path, fd)
            else:
                self._open.move_to_end(path)
            self._users[path] += 1
        return fd

    def take_back(self, fd: int) -> bool:
        """A descriptor ``lend`` gave a reader, given back (``storage.close``); False for one
        the pool does not hold."""
        with self._lock:
            path = self._path_of.get(fd)
            if path is None or not self._users[path]:
                return False
            self._release(path)
            return True

    @contextmanager
    def lending(self) -> Iterator[None]:
        """Within, this thread's ``storage.open_read`` of a local file takes this pool's
        descriptor (``storage.borrowing``): a reader locating a record in a file the engine
        copies from opens nothing."""
        assert self.flags == os.O_RDONLY, "only read descriptors are lent to readers"
        with borrowing(self):
            yield

    def adopt(self, path: Path, fd: int) -> None:
        """Keep ``fd``, which the caller opened on ``path`` with this pool's flags (making the
        file), for the next ``use`` instead of opening the file again."""
        with self._lock:
            assert path not in self._open
            self._make_room()
            self._keep(path, fd)

    def _keep(self, path: Path, fd: int) -> None:
        self._open[path] = fd
        self._path_of[fd] = path

    def _release(self, path: Path) -> None:
        self._users[path] -= 1
        if not self._users[path]:
            del self._users[path]

    def _make_room(self) -> None:
        """Close idle descriptors, oldest first, until one more fits (if all are busy, the
        pool runs over its limit by the number of busy workers, never by more)."""
        while len(self._open) >= self.limit:
            idle = next((p for p in self._open if p not in self._users), None)
            if idle is None:
                return
            self._close(self._open.pop(idle))

    def _close(self, fd: int) -> None:
        """Not ``storage.close`` for a descriptor: in a thread that borrows from this pool it
        would hand it back, taking the lock held here."""
        del self._path_of[fd]
        if isinstance(fd, int):
            os.close(fd)
        else:  # a RemotePath's ``RemoteFile``, which no reader borrows
            close(fd)

    @property
    def open_count(self) -> int:
        return len(self._open)

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                self._close(fd)
            self._open.clear()
