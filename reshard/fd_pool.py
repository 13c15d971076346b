"""Open files, never more at once than the process may hold.

A conversion of a checkpoint saved by 2048 ranks reads 2048 files, and one laid out for 2048
ranks writes as many: keeping every descriptor open would pass the usual limit of 1024 open
files (``ulimit -n``) and fail halfway. The pool opens a file when a worker asks for it, keeps
it open for the next read or write, and closes the least recently used idle ones once it holds
``limit``: a quarter of the soft limit, so the rest of the process (torch, gloo sockets,
threads) keeps room. A descriptor in use is never closed under its user.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from reshard.storage import RemotePath, close, open_read

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
        self._lock = threading.Lock()

    @contextmanager
    def use(self, path: Path) -> Iterator[int]:
        with self._lock:
            fd = self._open.get(path)
            if fd is None:
                self._make_room()
                fd = self._open[path] = open_read(path) if isinstance(path, RemotePath) else os.open(path, self.flags)
            else:
                self._open.move_to_end(path)
            self._users[path] += 1
        try:
            yield fd
        finally:
            with self._lock:
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
            close(self._open.pop(idle))

    @property
    def open_count(self) -> int:
        return len(self._open)

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                close(fd)
            self._open.clear()
