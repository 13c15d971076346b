"""What a SRC or DST argument can be, resolved the same way by every command: a local path, a
``file://`` URL (a local path spelled as a URL), an fsspec URL (``s3://``, ``gs://``,
``memory://``...; ``reshard.core.storage``) of a DCP folder, safetensors file or folder or zarr
store, or, for a source, an ``owner/name[@revision]`` Hub repo id or ``hf://owner/name``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from reshard.core.catalog import Catalog
from reshard.core.conventions import detect_layout
from reshard.core.errors import CheckpointNotFoundError, ReshardError, UsageError
from reshard.core.gc_pause import without_gc
from reshard.core.storage import RemotePath, forget_cached, is_url
from reshard.features.hub import cached_hub_folder, hub_source
from reshard.features.provenance import hf_configs, training_config
from reshard.formats.registry import detect_format

if TYPE_CHECKING:
    from reshard.pipeline.options import SourceOptions

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
    storage_options = options.storage_options if options is not None else None

    path = local_path(src)
    if path is None:
        cached = cached_hub_folder(str(src))  # hf://owner/name found whole in the local cache
        if cached is not None:
            return Source(str(src), detect_format(cached).read(cached), cached, None)
        remote = RemotePath.from_url(str(src), storage_options)
        forget_cached(remote)  # a new command reads it afresh
        try:
            # a RemotePath stands in for a Path (reshard.core.storage): detect_format took a format that reads URLs
            return Source(str(src), detect_format(remote).read(cast(Path, remote)), None, None)
        except OSError as e:  # the store's own errors (offline, denied, unreachable): one line naming SRC
            if isinstance(e, ReshardError) or (e.filename and str(e.filename) != remote.path):
                raise
            raise CheckpointNotFoundError(f"{src}: {e.strerror or e}") from e
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

    detect_layout(catalog, layout)  # an unknown name is a usage error now, not after a key map
    return replace(catalog, facts=catalog.facts.but(layout=layout, layout_given=True))


def given_config(catalog: Catalog, config: str | os.PathLike | None) -> Catalog:
    """``catalog`` told what model its tensors are (``--config``): key maps read its head
    counts, the HF export its config.json."""
    if config is None:
        return catalog
    from reshard.features.hf_export import load_config  # the HF export's modules only when asked (start-up)

    loaded = load_config(config)
    _refuse_contradiction(catalog, config, loaded)
    return replace(catalog, facts=catalog.facts.but(hf_config=loaded, hf_config_given=True))


# What a checkpoint records of its model, as HF config.json keys, from the training loop's
# ModelConfig (train.model_config.*): a --config that says otherwise describes another model,
# whose head split the key maps would apply to these weights (garbage that loads).
_TRAIN_KEYS = {"n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "n_layers": "num_hidden_layers",
               "vocab_size": "vocab_size", "dim": "hidden_size"}
_HF_KEYS = ("num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size", "hidden_size", "head_dim")


def _model_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys that fix how weights split into heads and layers; KV heads default to the heads
    (as transformers' config classes do), head_dim to hidden_size / heads."""
    out = {k: config[k] for k in _HF_KEYS if isinstance(config.get(k), int)}
    if "num_attention_heads" in out:
        out.setdefault("num_key_value_heads", out["num_attention_heads"])
        if "hidden_size" in out and out["num_attention_heads"]:
            out.setdefault("head_dim", out["hidden_size"] // out["num_attention_heads"])
    return out


def _refuse_contradiction(catalog: Catalog, config: str | os.PathLike, given: Mapping[str, Any]) -> None:
    """A --config whose head counts, layers, vocabulary or width contradict what the checkpoint
    records of its own model (the training loop's ModelConfig, or the config.json an HF source
    carried) is refused, naming both values."""
    mine = _model_shape(given)
    records: list[tuple[str, dict[str, Any]]] = []
    train = training_config(catalog)
    if train:
        records.append(("train.model_config", _model_shape({_TRAIN_KEYS[k]: v for k, v in train.items() if k in _TRAIN_KEYS})))
    carried = None if catalog.facts.hf_config_given else hf_configs(catalog)[0]
    if carried:
        records.append(("its config.json", _model_shape(carried)))
    for where, recorded in records:
        for key, value in mine.items():
            if key in recorded and recorded[key] != value:
                raise UsageError(f"{config}: {key} is {value}, but {catalog.path} records {recorded[key]} ({where}): "
                                 "this config describes another model; give the config of the model these weights are, "
                                 "or leave --config out to use the recorded one")
