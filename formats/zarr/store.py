"""Where a zarr store's keys live: a local folder, or any fsspec URL (``memory://``,
``file://``, ``s3://`` with s3fs installed...).

A zarr v3 store is a flat key-value space (``zarr.json``, ``name/zarr.json``,
``name/c/0/1``); these two small classes give the reader that view (and ``finish`` a local
folder to put metadata in) and nothing more; writing a store at a URL is the engine's
``reshard.pipeline.sinks.RemoteSink``. Local stores keep real paths, so uncompressed chunks become ``StoredRegion``s the
engine reads with ``preadv`` and kernel-copies; remote stores fetch bytes (ranges where it can)
through fsspec, the same layer zarr-python's ``FsspecStore`` sits on, with the same URLs and
credentials.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reshard.core.errors import CheckpointNotFoundError
from reshard.core.storage import RemotePath, is_url

__all__ = ["is_url", "LocalStore", "RemoteStore", "Store", "open_store"]


class LocalStore:
    """A store in a local folder; keys are relative paths."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.where = str(self.root)

    def local_path(self, key: str) -> Path:
        return self.root / key

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self.root / key).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes | None:
        try:
            with open(self.root / key, "rb") as f:
                f.seek(start)
                return f.read() if length is None else f.read(length)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def children(self, prefix: str) -> list[str]:
        """Sub-folder names under ``prefix`` (candidate child nodes of a group)."""
        try:
            return sorted(e.name for e in os.scandir(self.root / prefix) if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def listing(self, prefix: str) -> dict[str, int]:
        """Every key under ``prefix`` (relative to it) with its size: one walk per array, so
        missing chunks (which read as fill_value) cost no failed opens."""
        base = self.root / prefix
        out = {}
        for folder, _, files in os.walk(base):
            rel = os.path.relpath(folder, base)
            for name in files:
                key = name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")
                out[key] = os.stat(os.path.join(folder, name)).st_size
        return out


class RemoteStore:
    """A store behind an fsspec URL, read through its keys."""

    def __init__(self, url: str | RemotePath, storage_options: dict[str, Any] | None = None) -> None:
        self.remote = url if isinstance(url, RemotePath) else RemotePath.from_url(url, storage_options)
        self.url = self.where = str(url)
        self.fs, self.root = self.remote.fs, self.remote.path.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def local_path(self, key: str) -> None:
        return None

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            return None

    def get(self, key: str, start: int = 0, length: int | None = None) -> bytes | None:
        try:
            end = None if length is None else start + length
            return self.fs.cat_file(self._path(key), start=start or None, end=end)
        except FileNotFoundError:
            return None

    def children(self, prefix: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(prefix), detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def listing(self, prefix: str) -> dict[str, int]:
        base = self._path(prefix).strip("/") + "/"
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {path.strip("/")[len(base):]: int(info.get("size") or 0)
                for path, info in found.items() if path.strip("/").startswith(base)}


Store = LocalStore | RemoteStore


def open_store(location: str | os.PathLike) -> Store:
    """The store at a local path or URL; a ``file://`` URL is a local folder."""
    if isinstance(location, RemotePath):
        return RemoteStore(location)
    if is_url(location):
        if str(location).startswith("file://"):
            return LocalStore(Path(str(location)[len("file://"):]))
        return RemoteStore(str(location))
    path = Path(location)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    return LocalStore(path)
