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

import fnmatch
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from reshard.errors import UsageError

__all__ = ["is_url", "RemotePath", "RemoteFile", "as_location", "open_read", "handle_size", "close", "pread_into",
           "set_default_storage_options", "parse_storage_options", "storage_options_for"]

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")
_defaults: dict[str, Any] = {}


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


def set_default_storage_options(options: dict[str, Any]) -> None:
    """The options every URL of this process is opened with (the CLI's ``--storage-options``)."""
    _defaults.clear()
    _defaults.update(options)


def storage_options_for(given: dict[str, Any] | None) -> dict[str, Any]:
    return {**_defaults, **(given or {})}


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
            fs, path = fsspec.core.url_to_fs(url, **storage_options_for(storage_options))
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


class RemoteFile:
    """An open remote file: its size, and ranged reads (one request each, no read-ahead
    cache: the engine asks for exactly the slabs it needs)."""

    __slots__ = ("path", "size")

    def __init__(self, path: RemotePath) -> None:
        self.path = path
        try:
            self.size = int(path.fs.size(path.path))
        except FileNotFoundError:
            raise FileNotFoundError(2, "No such file or directory", str(path)) from None

    def read_into(self, view: memoryview, offset: int) -> int:
        end = min(offset + view.nbytes, self.size)
        if end <= offset:
            return 0
        data = self.path.fs.cat_file(self.path.path, start=offset, end=end)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass


def as_location(path: Any) -> Any:
    """``path`` as readers take it: a ``RemotePath`` as it is, anything else as a ``Path``."""
    if isinstance(path, RemotePath):
        return path
    from pathlib import Path

    return Path(path)


def open_read(path: Any) -> int | RemoteFile:
    """A handle to read ``path`` through ``pread_into``: a descriptor, or a ``RemoteFile``."""
    if isinstance(path, RemotePath):
        return RemoteFile(path)
    return os.open(path, os.O_RDONLY)


def handle_size(handle: int | RemoteFile) -> int:
    return handle.size if isinstance(handle, RemoteFile) else os.fstat(handle).st_size


def close(handle: int | RemoteFile) -> None:
    if isinstance(handle, RemoteFile):
        handle.close()
    else:
        os.close(handle)


def pread_into(handle: int | RemoteFile, view: memoryview, offset: int) -> int:
    """Bytes read into ``view`` from ``offset`` (fewer at the end of the file, 0 past it)."""
    if isinstance(handle, RemoteFile):
        return handle.read_into(view, offset)
    return os.preadv(handle, [view], offset)
