"""``--to hf``: a folder transformers' ``from_pretrained`` loads as is.

Two steps, because an HF folder holds less than a training checkpoint and under other names:

1. ``export_catalog`` keeps the model tensors only (optimizer and training state are dropped,
   with a notice), removes the checkpoint's ``model`` section, maps the project's training
   names to HF Llama names when it finds them (the ``titan-to-hf`` key map, q/k permutation
   included), finds the config (carried from an HF source, or built from
   ``train.model_config``), and writes tied embeddings once, the HF way: ``lm_head.weight`` is
   left out when ``tie_word_embeddings`` is set, after checking it equals the embedding.
2. ``HFWriter`` is the safetensors writer with the Hub's conventions: ``model.safetensors`` or
   ``model-0000i-of-0000n.safetensors`` shards of ``--max-shard-size`` (5GB by default) with
   ``model.safetensors.index.json``, ``{"format": "pt"}`` metadata, then ``config.json``,
   ``generation_config.json`` and a README model card.

Reading an HF folder is the safetensors format's job (detection stays there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from reshard.boxes import Box
from reshard.catalog import Catalog, TensorEntry, Target
from reshard.errors import UsageError
from reshard.formats.hf_files import generation_config, llama_config, model_card, with_dtype, write_json, written_dtype
from reshard.formats.pieces import FileLayout
from reshard.formats.safetensors import SafetensorsFormat, SafetensorsWriter
from reshard.keymap import load_keymap
from reshard.keymap_apply import located
from reshard.keymap_chunks import read_box
from reshard.provenance import hf_configs, training_config
from reshard.sizes import parse_size

__all__ = ["HFFormat", "HFWriter", "export_catalog", "same_values"]

_HUB_SHARD_SIZE = "5GB"
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def same_values(a: TensorEntry, b: TensorEntry, max_bytes: int) -> bool:
    """Bit equality of two tensors, compared in row blocks so memory stays under ``max_bytes``."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.shape:
        return torch.equal(read_box(a, Box((), ())).view(-1), read_box(b, Box((), ())).view(-1))
    row = max(1, a.nbytes // max(1, a.shape[0]))
    step = max(1, max_bytes // (2 * row))
    for start in range(0, a.shape[0], step):
        box = Box((start,) + (0,) * (len(a.shape) - 1), (min(step, a.shape[0] - start),) + a.shape[1:])
        x, y = read_box(a, box), read_box(b, box)
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def _model_tensors(catalog: Catalog) -> tuple[dict[str, TensorEntry], list[str]]:
    """(HF name -> entry) of the model's tensors, and what was left out, in words."""
    sectioned = any(len(catalog.nested_path(n)) >= 2 and catalog.nested_path(n)[0] == "model" for n in catalog.tensors)
    kept: dict[str, TensorEntry] = {}
    optim, other = 0, []
    for name, entry in catalog.tensors.items():
        path = catalog.nested_path(name)
        if sectioned and path[0] == "model" and len(path) >= 2:
            fqn = ".".join(str(p) for p in path[1:])
            kept[fqn] = TensorEntry(fqn, entry.shape, entry.dtype, entry.chunks)
        elif path[0] == "optim" or name.startswith("optim."):
            optim += 1
        elif sectioned:
            other.append(name)
        else:
            kept[name] = entry
    notices = []
    if optim:
        notices.append(f"{optim} optimizer state tensors left out: an HF folder holds model weights only")
    if other:
        notices.append(f"{len(other)} tensors outside the model section left out (e.g. {other[0]!r})")
    return kept, notices


def export_catalog(catalog: Catalog, *, max_memory: int = 1 << 30) -> Catalog:
    """The catalog an HF folder is written from: HF names, model tensors only, config in attrs."""
    train = training_config(catalog)
    config, gen = hf_configs(catalog)
    titan = load_keymap("titan-to-hf")
    notices: list[str] = []
    fqns = [loc[1] for n in catalog.tensors if (loc := located(n, catalog.nested_path(n))) and loc[0] != ("optim", "state")]
    if any(titan.route(fqn) is not None for fqn in fqns):
        catalog = titan.apply(catalog)  # the project's training names: to HF Llama names
        notices.append("renamed the training model's tensors to HF Llama names (titan-to-hf key map)")
    tensors, dropped = _model_tensors(catalog)
    notices += dropped
    if config is None and train is not None:
        tie = bool(train.get("tie_embeddings", False))
        config = llama_config(train, tie=tie)
    left = [n for n in catalog.objects if not n.startswith(("hf.", "train.model_config."))]
    if left:
        notices.append(f"{len(left)} non-tensor objects (step counters, optimizer settings...) left out")
    if config is None:
        notices.append("no config.json: the source records none (not converted from HF, no train.model_config); "
                       "add one before `reshard push`")
    elif config.get("tie_word_embeddings") and _EMBED in tensors and _HEAD in tensors:
        if not same_values(tensors[_EMBED], tensors[_HEAD], max_memory):
            raise UsageError(f"{catalog.path}: config ties the embeddings (tie_word_embeddings) but {_HEAD} differs "
                             f"from {_EMBED}; set tie_word_embeddings to false in the config or fix the checkpoint")
        del tensors[_HEAD]  # transformers re-ties it on load, as save_pretrained leaves it out
    if config is not None and gen is None:
        gen = generation_config(config)
    attrs: dict[str, Any] = {
        "hf_config": config, "hf_generation_config": gen, "hf_notices": notices,
        "hf_source": f"the {catalog.format} checkpoint `{catalog.path.name}`",
    }
    return Catalog(catalog.format, catalog.path, tensors=tensors, attrs=attrs)


class HFFormat:
    """A write target only: HF folders are detected and read as safetensors."""

    name = "hf"

    def detect(self, path: Path) -> bool:
        return False

    def read(self, path: Path) -> Catalog:
        return SafetensorsFormat().read(path)

    def writer(self, dst: Path, *, max_shard_size: int | str | None = None, **options: Any) -> HFWriter:
        return HFWriter(dst, max_shard_size=None if max_shard_size is None else parse_size(max_shard_size))


class HFWriter(SafetensorsWriter):
    """Safetensors shards as ``save_pretrained`` names them, plus the folder's side files."""

    def __init__(self, dst: Path, *, max_shard_size: int | None = None) -> None:
        super().__init__(dst, max_shard_size=max_shard_size or parse_size(_HUB_SHARD_SIZE))
        self.dst = Path(dst)

    def layout(self, target: Target) -> list[FileLayout]:
        if "hf_source" not in target.attrs:
            raise UsageError("--to hf output must be prepared by reshard.formats.hf.export_catalog (use reshard.convert)")
        return super().layout(target)

    def finish(self, staging: Path, target: Target, files: list[FileLayout]) -> None:
        if len(files) > 1:  # like save_pretrained: an index only when there are several shards
            super().finish(staging, target, files)
        config, gen = target.attrs.get("hf_config"), target.attrs.get("hf_generation_config")
        if config is not None:
            write_json(staging / "config.json", with_dtype(config, written_dtype(target)))
        if gen is not None:
            write_json(staging / "generation_config.json", gen)
        (staging / "README.md").write_text(model_card(self.dst.name, target, config, target.attrs["hf_source"], len(files)))

    def notices(self, target: Target) -> list[str]:
        return list(target.attrs.get("hf_notices", []))
