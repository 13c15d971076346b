"""What a SRC or DST argument can be, resolved the same way by every command: a local path, a
``file://`` URL (a local path spelled as a URL), an fsspec URL (``s3://``, ``gs://``,
``memory://``...; ``reshard.storage``) of a DCP folder, safetensors file or folder or zarr
store, or, for a source, an ``owner/name[@revision]`` Hub repo id or ``hf://owner/name``."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from reshard.catalog import Catalog
from reshard.errors import CheckpointNotFoundError, ReshardError
from reshard.gc_pause import without_gc
from reshard.storage import RemotePath, forget_cached, is_url

if TYPE_CHECKING:
    from reshard.options import SourceOptions

__all__ = ["Source", "read_catalog", "resolve_source", "local_path", "given_layout", "given_config"]


def local_path(location: str | os.PathLike) -> Path | None:
    """The local path a location names (a path, or a ``file://`` URL); None for a remote URL."""
    if not is_url(location):
        return Path(location)
    text = str(location)
    return Path(text[len("file://"):]) if text.startswith("file://") else None


@dataclass
class Source:
    """A resolved source: its catalog, the local path it was read from (None for a remote URL,
    whose files cannot change under us or be overwritten by a local output), and the path
    default output names are made beside (None: a remote source has no "beside")."""

    location: str | Path
    catalog: Catalog
    path: Path | None
    beside: Path | None

    @property
    def label(self) -> str:
        return self.path.name if self.path is not None else str(self.location)


@without_gc
def resolve_source(src: str | os.PathLike, options: SourceOptions | None = None) -> Source:
    """Read ``src``'s catalog (metadata only) wherever it is. ``options.storage_options``:
    fsspec arguments for a URL (``--storage-options``), beside the store's own environment.
    The rest of ``options`` is the caller's: each public call allows ``allow_classes`` for as
    long as it runs, and applies layout, config and key map at its own step."""
    from reshard.formats.registry import detect_format

    storage_options = options.storage_options if options is not None else None

    path = local_path(src)
    if path is None:
        from reshard.hub import cached_hub_folder

        cached = cached_hub_folder(str(src))  # hf://owner/name found whole in the local cache
        if cached is not None:
            return Source(str(src), detect_format(cached).read(cached), cached, None)
        remote = RemotePath.from_url(str(src), storage_options)
        forget_cached(remote)  # a new command reads it afresh
        try:
            # a RemotePath stands in for a Path (reshard.storage): detect_format took a format that reads URLs
            return Source(str(src), detect_format(remote).read(cast(Path, remote)), None, None)
        except OSError as e:  # the store's own errors (offline, denied, unreachable): one line naming SRC
            if isinstance(e, ReshardError) or (e.filename and str(e.filename) != remote.path):
                raise
            raise CheckpointNotFoundError(f"{src}: {e.strerror or e}") from e
    from reshard.hub import hub_source

    path, beside = hub_source(path)  # a Hub repo id: its cached snapshot; outputs go to the cwd
    return Source(path, detect_format(path).read(path), path, beside)


def read_catalog(src: str | os.PathLike, options: SourceOptions | None = None) -> Catalog:
    """The catalog of ``src``, metadata only."""
    return resolve_source(src, options).catalog


def given_layout(catalog: Catalog, layout: str | None) -> Catalog:
    """``catalog`` with the layout its caller named (``--layout``, ``layout=``) recorded, so
    detection takes it as given; an unknown name is a usage error."""
    if layout is None:
        return catalog
    from reshard.conventions import detect_layout

    detect_layout(catalog, layout)  # an unknown name is a usage error now, not after a key map
    return replace(catalog, attrs={**catalog.attrs, "layout": layout, "layout_given": True})


def given_config(catalog: Catalog, config: str | os.PathLike | None) -> Catalog:
    """``catalog`` told what model its tensors are (``--config``): key maps read its head
    counts, the HF export its config.json."""
    if config is None:
        return catalog
    from reshard.export import load_config

    return replace(catalog, attrs={**catalog.attrs, "hf_config": load_config(config), "hf_config_given": True})
