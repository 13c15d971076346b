"""``--to hf``: a folder transformers' ``from_pretrained`` loads as is.

Two steps, because an HF folder holds less than a training checkpoint and under other names:

1. ``export_catalog`` keeps the model tensors only (optimizer and training state are dropped,
   with a notice), removes the checkpoint's model section (whatever its tool calls it), maps
   torchtitan names to HF names when it finds them (the ``titan-to-hf`` key map of the model's
   family: q/k permutation, grouped experts, buffers HF lacks; or the map its reader recorded,
   ``megatron-to-hf`` for Megatron-Core), finds the config (``--config``,
   carried from an HF source, or built from ``train.model_config``; none is an error), the
   tokenizer and other side files (``--hf-assets``, or the source folder), and writes tied
   embeddings once, the HF way: ``lm_head.weight`` is left out when ``tie_word_embeddings``
   is set, after checking it equals the embedding.
2. ``HFWriter`` is the safetensors writer with the Hub's conventions: ``model.safetensors`` or
   ``model-0000i-of-0000n.safetensors`` shards of ``--max-shard-size`` (5GB by default) with
   ``model.safetensors.index.json``, ``{"format": "pt"}`` metadata, then ``config.json``, the
   side files, ``generation_config.json`` and a README model card.

Reading an HF folder is the safetensors format's job (detection stays there).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


from reshard.catalog import Catalog, TensorEntry, Target
from reshard.conventions import OPTIM_GROUP, OPTIM_STATE, PARAM, Layout, detect_layout
from reshard.storage import RemotePath
from reshard.architecture import require_architecture
from reshard.errors import UsageError
from reshard.formats.hf.files import (ASSET_FILES, export_config, find_assets, generation_config, llama_config, model_card,
                                      write_json)
from reshard.pieces import OutputFile
from reshard.formats.safetensors.format import SafetensorsFormat, SafetensorsWriter
from reshard.keymap.lookup import load_keymap
from reshard.keymap.maps import titan_family
from reshard.provenance import hf_configs, training_config
from reshard.values import same_values
from reshard.sizes import parse_size
from reshard.options import ConvertOptions, named

__all__ = ["HFFormat", "HFWriter", "export_catalog"]

_HUB_SHARD_SIZE = "5GB"
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _model_tensors(catalog: Catalog, layout: Layout) -> tuple[dict[str, TensorEntry], list[str]]:
    """(HF name -> entry) of the model's tensors, and what was left out, in words."""
    kept: dict[str, TensorEntry] = {}
    optim, other = 0, []
    for name, entry in catalog.tensors.items():
        p = layout.place(name)
        if p.role == PARAM and p.fqn is not None:
            kept[p.fqn] = entry.renamed(p.fqn)
        elif p.role in (OPTIM_STATE, OPTIM_GROUP):
            optim += 1
        else:
            other.append(name)
    notices = []
    if optim:
        notices.append(f"{optim} optimizer state tensors left out: an HF folder holds model weights only")
    if other:
        notices.append(f"{len(other)} tensors outside the model section left out (e.g. {other[0]!r})")
    return kept, notices


def _source_assets(catalog: Catalog) -> dict[str, Path]:
    """HF -> HF: the tokenizer and friends of the source folder travel by default."""
    folder = catalog.path if catalog.path.is_dir() else catalog.path.parent
    if not (folder / "config.json").is_file():
        return {}
    return {name: folder / name for name in ASSET_FILES if (folder / name).is_file()}


# Layouts whose parameters may carry torchtitan's names: its own, a plain model state dict (a
# torchtitan model's state_dict(), or our hf-to-titan output), and our training loop's.
_TITAN_LAYOUTS = ("torchtitan", "torchtitan-flat", "model", "reshard")


def _titan_names(layout: str, fqns: list[str], titan: Any) -> str | None:
    """None when the ``titan-to-hf`` map applies on its own: the layout is one torchtitan names
    live in and the map knows every parameter. Otherwise why not, in words ("" when no name
    looks like torchtitan's)."""
    touched = [f for f in fqns if (r := titan.route(f)) is not None and r.names != (f,)]
    if not touched:
        return ""
    if layout not in _TITAN_LAYOUTS:
        return (f"titan-to-hf not applied: layout {layout} does not hold torchtitan's names, though {len(touched)} of "
                f"{len(fqns)} parameter names look like them (e.g. {touched[0]!r}); pass --keymap titan-to-hf to rename")
    unknown = [f for f in fqns if titan.route(f) is None]
    if unknown:
        return (f"titan-to-hf not applied: it knows {len(fqns) - len(unknown)} of the {len(fqns)} parameter names, "
                f"not {unknown[0]!r}; pass --keymap with a map that covers them all")
    return None


def export_catalog(catalog: Catalog, *, max_memory: int = 1 << 30, assets: str | None = None,
                   weights_only: bool = False) -> Catalog:
    """The catalog an HF folder is written from: HF names, model tensors only, config and the
    side files (tokenizer, chat template, generation config) in attrs.

    The config comes from ``--config`` (already in ``catalog.attrs``, see ``convert``), the HF
    folder the checkpoint came from, or the project's training config; with none, the export
    is refused (a folder transformers cannot load is not an export) unless ``weights_only``.
    """
    train = training_config(catalog)
    config, gen = hf_configs(catalog)
    # An HF source's own side files travel as they were: no generation_config.json it never had.
    carried = config is not None and not catalog.attrs.get("hf_config_given")
    titan = load_keymap("titan-to-hf")
    notices: list[str] = []
    layout = detect_layout(catalog)
    fqns = [p.fqn for n in catalog.tensors if (p := layout.place(n)).role == PARAM and p.fqn is not None]
    preset = catalog.attrs.get("hf_keymap")  # the map to HF names a reader recorded (Megatron's)
    if isinstance(preset, str):
        catalog = load_keymap(preset).apply(catalog)
        notices.append(f"renamed {catalog.format} names to HF names ({preset} key map)")
        layout = detect_layout(catalog)
    elif (skip := _titan_names(layout.name, fqns, titan)) is None:
        catalog = titan.apply(catalog)  # torchtitan names (and our training model's): to HF names
        notices.append(f"renamed torchtitan names to HF names (titan-to-hf key map, {titan_family(catalog)} family)")
        layout = detect_layout(catalog)
    elif skip:
        notices.append(skip)
    tensors, dropped = _model_tensors(catalog, layout)
    notices += dropped
    if config is None and train is not None:
        tie = bool(train.get("tie_embeddings", False))
        config = llama_config(train, tie=tie)
    left = [n for n in catalog.objects if not n.startswith(("hf.", "train.model_config."))]
    if left:
        notices.append(f"{len(left)} non-tensor objects (step counters, optimizer settings...) left out")
    if config is None and not weights_only:
        raise UsageError(f"{catalog.path} records no model config, so transformers could not load the export: give "
                         "--config CONFIG.json|HF_DIR|REPO_ID (and --hf-assets DIR|REPO_ID for the tokenizer), "
                         "or --weights-only for the safetensors alone")
    if config is not None and config.get("tie_word_embeddings") and _EMBED in tensors and _HEAD in tensors:
        if not same_values(tensors[_EMBED], tensors[_HEAD], max_memory):
            raise UsageError(f"{catalog.path}: config ties the embeddings (tie_word_embeddings) but {_HEAD} differs "
                             f"from {_EMBED}; set tie_word_embeddings to false in the config or fix the checkpoint")
        del tensors[_HEAD]  # transformers re-ties it on load, as save_pretrained leaves it out
    files = find_assets(assets) if assets is not None else _source_assets(catalog)
    if config is not None and gen is None and not carried and "generation_config.json" not in files:
        gen = generation_config(config)
    if weights_only:
        config, gen, files = None, None, {}
    attrs: dict[str, Any] = {
        "hf_config": config, "hf_generation_config": gen, "hf_notices": notices, "hf_assets": files,
        "hf_source": f"the {catalog.format} checkpoint `{catalog.path.name}`",
    }
    return Catalog(catalog.format, catalog.path, tensors=tensors, attrs=attrs, notices=list(catalog.notices))


class HFFormat:
    """A write target only: HF folders are detected and read as safetensors."""

    name = "hf"

    def detect(self, path: Path) -> bool:
        return False

    def read(self, path: Path) -> Catalog:
        return SafetensorsFormat().read(path)

    def writer(self, dst: Path, options: ConvertOptions | None = None) -> HFWriter:
        options = options or ConvertOptions()
        return HFWriter(dst, max_shard_size=options.shard_bytes, architecture_check=options.architecture_check)


class HFWriter(SafetensorsWriter):
    """Safetensors shards as ``save_pretrained`` names them, plus the folder's side files.

    Before any file is laid out, the tensors are checked against the model config.json
    describes (``reshard.architecture``): an export that would load as another, partial or
    random model is refused, unless ``architecture_check`` is off, which the model card says."""

    def __init__(self, dst: Path, *, max_shard_size: int | None = None, architecture_check: bool = True) -> None:
        super().__init__(dst, max_shard_size=max_shard_size or parse_size(_HUB_SHARD_SIZE))
        self.dst = Path(dst)
        self.architecture_check = architecture_check
        self.checked: str | None = None  # the check's notice, once layout has run it

    def layout(self, target: Target) -> list[OutputFile]:
        if "hf_source" not in target.attrs:
            raise UsageError("--to hf output must be prepared by reshard.formats.hf.format.export_catalog (use reshard.convert)")
        config = export_config(target)
        if config is None:  # --weights-only: no config.json, no model to check against
            self.checked = None
        elif self.architecture_check:
            self.checked = require_architecture(config, target.tensors, where=str(self.dst), action="write it")
        else:
            self.checked = f"not checked against an architecture ({named('architecture_check')})"
        return super().layout(target)

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        if len(files) > 1:  # like save_pretrained: an index only when there are several shards
            super().finish(staging, target, files)
        config, gen = export_config(target), target.attrs.get("hf_generation_config")
        if config is not None:
            write_json(staging / "config.json", config)
        for name, source in (target.attrs.get("hf_assets") or {}).items():  # tokenizer, chat template...: as they are
            if isinstance(source, RemotePath):
                (staging / name).write_bytes(source.read_bytes())  # small files of an HF folder on a store
            else:
                shutil.copyfile(source, staging / name)
        if gen is not None and not (staging / "generation_config.json").exists():
            write_json(staging / "generation_config.json", gen)
        if config is not None:
            (staging / "README.md").write_text(model_card(self.dst.name, target, config, target.attrs["hf_source"], len(files),
                                                          checked=self.checked))

    def notices(self, target: Target) -> list[str]:
        return list(target.attrs.get("hf_notices", [])) + ([self.checked] if self.checked else [])
