"""Where a checkpoint's bytes live: a local path, or an object behind an fsspec URL
(``s3://``, ``gs://``, ``az://``, ``hf://``, ``memory://``...).

Readers are written against ``pathlib.Path``. A ``RemotePath`` offers the small part of that
interface they use (``/``, ``name``, ``is_file``, ``iterdir``, ``read_bytes``...), and
``open_read`` hands out a handle that ``pread_into`` reads byte ranges through: ``os.preadv``
on a local descriptor, one ranged GET on an object store. So a DCP folder or a safetensors
file on S3 is read as it is read from disk, header and metadata first, then only the byte
ranges of the slabs a conversion moves, never a whole-file download.

Endpoints and credentials are the fsspec way: the store's own environment (``AWS_*``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``HF_TOKEN``), fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>``
variables, or ``--storage-options JSON`` (``storage_options=`` in the API), which wins.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from reshard.core.errors import UsageError

__all__ = ["is_url", "RemotePath", "RemoteFile", "Handle", "as_location", "open_read", "handle_size", "close", "pread_into",
           "parse_storage_options", "forget_cached", "will_read", "Lender", "borrowing"]

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")


def is_url(location: object) -> bool:
    """True for ``scheme://...`` strings (not for Paths, which normalise ``//`` away)."""
    return isinstance(location, str) and bool(_URL.match(location))


def parse_storage_options(text: str | None) -> dict[str, Any]:
    """``--storage-options``: a JSON object of fsspec filesystem arguments."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--storage-options: not valid JSON ({e.msg} at character {e.pos}); "
                         """give an object, e.g. '{"endpoint_url": "http://localhost:9000"}'""") from None
    if not isinstance(value, dict):
        raise UsageError("--storage-options: give a JSON object of fsspec options, e.g. '{\"anon\": true}'")
    return value




@dataclass(frozen=True)
class _Stat:
    st_size: int


class RemotePath:
    """A file or folder behind an fsspec URL, with the pathlib methods reshard's readers use.

    ``str()`` gives the URL back, so every message names what the user typed. There is no
    ``__fspath__``: handing one to ``open`` or ``os.open`` fails loudly instead of reading
    some local file of the same name."""

    __slots__ = ("fs", "path", "protocol", "url")

    def __init__(self, fs: Any, path: str, protocol: str, url: str | None = None) -> None:
        self.fs = fs
        self.path = path.rstrip("/") or path
        self.protocol = protocol
        self.url = (url or f"{protocol}://{self.path}").rstrip("/")  # as the user spelled it

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any] | None = None) -> RemotePath:
        import fsspec

        protocol = url.split("://", 1)[0]
        try:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            raise UsageError(f"{url}: {protocol}:// URLs need an fsspec backend that is not installed "
                             f"({e}); e.g. pip install s3fs (s3://), gcsfs (gs://), adlfs (az://)") from None
        except ValueError as e:
            raise UsageError(f"{url}: no fsspec filesystem handles {protocol}:// ({e})") from None
        return cls(fs, path, protocol, url)

    # -- naming
    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and (self.protocol, self.path) == (other.protocol, other.path)

    def __lt__(self, other: RemotePath) -> bool:
        return self.path < other.path

    def __hash__(self) -> int:
        return hash((self.protocol, self.path))

    def __truediv__(self, name: str | os.PathLike) -> RemotePath:
        name = os.fspath(name).strip("/")
        return RemotePath(self.fs, f"{self.path}/{name}", self.protocol, f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        dot = name.rfind(".")
        return name[dot:] if 0 < dot < len(name) - 1 else ""

    @property
    def stem(self) -> str:
        return self.name[: len(self.name) - len(self.suffix)]

    @property
    def parent(self) -> RemotePath:
        if "/" not in self.path.strip("/"):
            return self
        return RemotePath(self.fs, self.path.rsplit("/", 1)[0], self.protocol, self.url.rsplit("/", 1)[0])

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def resolve(self) -> RemotePath:
        return self

    def is_relative_to(self, other: RemotePath) -> bool:
        return isinstance(other, RemotePath) and (self.path == other.path or self.path.startswith(other.path.rstrip("/") + "/"))

    # -- what is there
    def _info(self) -> dict | None:
        try:
            return self.fs.info(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def exists(self) -> bool:
        return self._info() is not None

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def stat(self) -> _Stat:
        info = self._info()
        if info is None:
            raise FileNotFoundError(str(self))
        return _Stat(int(info.get("size") or 0))

    def iterdir(self) -> Iterator[RemotePath]:
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return iter(())
        here = self.path.strip("/")
        return iter([self / n.rstrip("/").rsplit("/", 1)[-1] for n in sorted(names) if n.strip("/") != here])

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """One level only (``*.safetensors``), which is all the readers ask for."""
        return (p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern))

    def rglob(self, pattern: str) -> Iterator[RemotePath]:
        base = self.path.strip("/") + "/"
        found = sorted(n.strip("/") for n in self.fs.find(self.path, withdirs=False))
        return (self / n[len(base):] for n in found if n.startswith(base) and fnmatch.fnmatch(n.rsplit("/", 1)[-1], pattern))

    def read_bytes(self) -> bytes:
        try:
            return self.fs.cat_file(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(2, "No such file or directory", str(self)) from None

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open(self, mode: str = "rb") -> BinaryIO:
        return self.fs.open(self.path, mode)


_BLOCK = 256 << 10  # small reads fetch this much around them (a request costs its latency more than its bytes)
_BLOCKS = 64  # blocks kept, over all remote files: 16 MiB
_RECORD = 2 << 20  # a record up to this size is fetched whole when a reader is about to parse it
_RECORDS = 256  # records kept, and at most _RECORD_BYTES of them
_RECORD_BYTES = 48 << 20


class _SmallReads:
    """Blocks around the small reads of headers (a zip's end record, then its central
    directory, then each local header; a safetensors length, then its JSON): each read would
    otherwise be its own request, and a request to an object store costs milliseconds. One
    bounded LRU shared by every handle, since the readers open a file afresh for each record.
    Slabs of tensor data are larger than a block and go straight to the store."""

    def __init__(self) -> None:
        self._records: OrderedDict[tuple[int, str, int], bytes] = OrderedDict()
        self._record_bytes = 0
        self._blocks: OrderedDict[tuple[int, str, int], bytes] = OrderedDict()
        self._sizes: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()

    def size(self, path: RemotePath) -> int:
        key = (id(path.fs), path.path)
        found = self._sizes.get(key)
        if found is None:
            try:
                found = self._sizes[key] = int(path.fs.size(path.path))
            except FileNotFoundError:
                raise FileNotFoundError(2, "No such file or directory", str(path)) from None
        return found

    def prefetch(self, path: RemotePath, start: int, length: int) -> None:
        """Fetch ``length`` bytes at ``start`` in one request, for the reads about to follow (a
        DCP record: its sniffed head, its zip directory at the end, then its tensor bytes)."""
        key = (id(path.fs), path.path, start)
        with self._lock:
            if key in self._records:
                self._records.move_to_end(key)
                return
        data = path.fs.cat_file(path.path, start=start, end=start + length)
        with self._lock:
            self._records[key] = data
            self._record_bytes += len(data)
            while len(self._records) > _RECORDS or self._record_bytes > _RECORD_BYTES:
                self._record_bytes -= len(self._records.popitem(last=False)[1])

    def prefetched(self, path: RemotePath, offset: int, end: int) -> memoryview | None:
        fs = id(path.fs)
        with self._lock:
            for (f, p, start), data in reversed(self._records.items()):
                if f == fs and p == path.path and start <= offset and end <= start + len(data):
                    return memoryview(data)[offset - start: end - start]
        return None

    def block(self, path: RemotePath, index: int, size: int) -> bytes:
        key = (id(path.fs), path.path, index)
        with self._lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
                return data
        start = index * _BLOCK
        data = path.fs.cat_file(path.path, start=start, end=min(start + _BLOCK, size))
        with self._lock:
            self._blocks[key] = data
            while len(self._blocks) > _BLOCKS:
                self._blocks.popitem(last=False)
        return data

    def forget(self, root: RemotePath) -> None:
        """Drop what is known of ``root`` and everything under it (it is about to change, or a
        new command starts reading it)."""
        fs, prefix = id(root.fs), root.path.rstrip("/")

        def under(path: str) -> bool:
            return path == prefix or path.startswith(prefix + "/")

        with self._lock:
            for block in [k for k in self._blocks if k[0] == fs and under(k[1])]:
                del self._blocks[block]
            for record in [k for k in self._records if k[0] == fs and under(k[1])]:
                self._record_bytes -= len(self._records.pop(record))
            for file in [k for k in self._sizes if k[0] == fs and under(k[1])]:
                del self._sizes[file]


_small_reads = _SmallReads()


def will_read(path: Any, start: int, length: int) -> None:
    """A hint that ``length`` bytes at ``start`` of ``path`` are about to be read in several
    small reads: a remote file fetches them in one request (up to ``_RECORD``); a local file
    does nothing."""
    if isinstance(path, RemotePath) and 0 < length <= _RECORD:
        _small_reads.prefetch(path, start, length)


def forget_cached(root: RemotePath) -> None:
    """Forget the sizes and header blocks read under ``root`` (see ``_SmallReads``)."""
    _small_reads.forget(root)


class RemoteFile:
    """An open remote file: its size, and ranged reads. A read of a block or more is one
    request for exactly its bytes; smaller reads are served from ``_SmallReads``."""

    __slots__ = ("path", "size")

    def __init__(self, path: RemotePath) -> None:
        self.path = path
        self.size = _small_reads.size(path)

    def read_into(self, view: memoryview, offset: int) -> int:
        end = min(offset + view.nbytes, self.size)
        if end <= offset:
            return 0
        held = _small_reads.prefetched(self.path, offset, end)
        if held is not None:
            view[: len(held)] = held
            return len(held)
        if end - offset >= _BLOCK:
            data = self.path.fs.cat_file(self.path.path, start=offset, end=end)
            view[: len(data)] = data
            return len(data)
        index = offset // _BLOCK
        block = _small_reads.block(self.path, index, self.size)
        at = offset - index * _BLOCK
        n = min(end - offset, len(block) - at)  # up to the block's end; the caller asks again for the rest
        view[:n] = block[at: at + n]
        return n

    def close(self) -> None:
        pass


# What ``open_read`` gives: a descriptor of a local file, or a ``RemoteFile``.
Handle = int | RemoteFile


def as_location(path: Any) -> Any:
    """``path`` as readers take it: a ``RemotePath`` as it is, anything else as a ``Path``."""
    if isinstance(path, RemotePath):
        return path
    from pathlib import Path

    return Path(path)


class Lender(Protocol):
    """Read descriptors of local files, opened once and shared (``reshard.core.fd_pool.FdPool``)."""

    def lend(self, path: Any) -> Handle:
        """``path``'s descriptor, kept open until given back."""
        ...

    def take_back(self, fd: int) -> bool:
        """Whether ``fd`` was lent (and is now given back): else the caller closes it."""
        ...


# The lender each thread borrows from (``borrowing``), by thread id.
_lenders: dict[int, Lender] = {}


@contextlib.contextmanager
def borrowing(lender: Lender) -> Iterator[None]:
    """Within, this thread's ``open_read`` of a local file takes ``lender``'s descriptor and
    ``close`` gives it back. The readers open a file afresh for each record they parse (a DCP
    chunk's archive: sniffed, then its zip directory read): while the engine copies, those
    opens reuse the descriptor its copies read through, so each source file is opened once.
    Per thread, so a reader in a thread the engine does not run never holds the engine's
    descriptors (they are closed when its run ends)."""
    me = threading.get_ident()
    before = _lenders.get(me)
    _lenders[me] = lender
    try:
        yield
    finally:
        if before is None:
            del _lenders[me]
        else:
            _lenders[me] = before


def open_read(path: Any) -> Handle:
    """A handle to read ``path`` through ``pread_into``: a descriptor, or a ``RemoteFile``."""
    if isinstance(path, RemotePath):
        return RemoteFile(path)
    lender = _lenders.get(threading.get_ident())
    return os.open(path, os.O_RDONLY) if lender is None else lender.lend(path)


def handle_size(handle: Handle) -> int:
    return handle.size if isinstance(handle, RemoteFile) else os.fstat(handle).st_size


def close(handle: Handle) -> None:
    if isinstance(handle, RemoteFile):
        handle.close()
        return
    lender = _lenders.get(threading.get_ident())
    if lender is None or not lender.take_back(handle):
        os.close(handle)


def pread_into(handle: Handle, view: memoryview, offset: int) -> int:
    """Bytes read into ``view`` from ``offset`` (fewer at the end of the file, 0 past it)."""
    if isinstance(handle, RemoteFile):
        return handle.read_into(view, offset)
    return os.preadv(handle, [view], offset)
