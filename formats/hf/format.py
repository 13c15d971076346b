"""``--to hf``: a folder transformers' ``from_pretrained`` loads as is.

The catalog it is written from is the core's export step (``reshard.features.hf_export``, the registry
entry's ``prepare``: model tensors under HF names, config, side files, and the check to run before
writing, the ``hf_check`` fact: this package imports no feature). Here:

* ``HFWriter`` is the safetensors writer with the Hub's conventions: ``model.safetensors`` or
   ``model-0000i-of-0000n.safetensors`` shards of ``--max-shard-size`` (5GB by default) with
   ``model.safetensors.index.json``, ``{"format": "pt"}`` metadata, then ``config.json``, the
   side files, ``generation_config.json`` and a README model card.

Reading an HF folder is the safetensors format's job (detection stays there).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from reshard.formats.hf.files import export_config, model_card, write_json
from reshard.formats.safetensors.format import SafetensorsFormat, SafetensorsWriter

from reshard.core.catalog import Catalog
from reshard.core.errors import UsageError
from reshard.core.pieces import OutputFile
from reshard.core.sizes import parse_size
from reshard.core.storage import RemotePath
from reshard.core.target import Target
from reshard.pipeline.options import WriterOptions, shard_bytes

__all__ = ["HFFormat", "HFWriter"]

_HUB_SHARD_SIZE = "5GB"


class HFFormat:
    """A write target only: HF folders are detected and read as safetensors."""

    name = "hf"

    def detect(self, path: Path) -> bool:
        return False

    def read(self, path: Path) -> Catalog:
        return SafetensorsFormat().read(path)

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> HFWriter:
        return HFWriter(dst, max_shard_size=shard_bytes(options or WriterOptions()))


class HFWriter(SafetensorsWriter):
    """Safetensors shards as ``save_pretrained`` names them, plus the folder's side files.

    Before any file is laid out, the tensors go through the check the export step recorded
    (``target.facts.hf_check``: against the model config.json describes,
    ``reshard.features.architecture``): an export that would load as another, partial or random
    model is refused, unless the check was turned off, which the model card says."""

    def __init__(self, dst: Path | str, *, max_shard_size: int | None = None) -> None:
        super().__init__(dst, max_shard_size=max_shard_size or parse_size(_HUB_SHARD_SIZE))
        self.dst = Path(dst)
        self.checked: str | None = None  # the check's notice, once layout has run it

    def layout(self, target: Target) -> list[OutputFile]:
        check = target.facts.hf_check
        if target.facts.hf_source is None or check is None:
            raise UsageError("--to hf output must be prepared by reshard.features.hf_export.export_catalog (use reshard.convert)")
        config = export_config(target)
        # --weights-only: no config.json, no model to check against
        self.checked = None if config is None else check(config, target.tensors, str(self.dst),
                                                          lambda n: target.renamed_from.get(n, n))
        return super().layout(target)

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        if len(files) > 1:  # like save_pretrained: an index only when there are several shards
            super().finish(staging, target, files)
        config, gen = export_config(target), target.facts.hf_generation_config
        if config is not None:
            write_json(staging / "config.json", config)
        for name, source in (target.facts.hf_assets or {}).items():  # tokenizer, chat template...: as they are
            if isinstance(source, RemotePath):
                (staging / name).write_bytes(source.read_bytes())  # small files of an HF folder on a store
            else:
                shutil.copyfile(source, staging / name)
        if gen is not None and not (staging / "generation_config.json").exists():
            write_json(staging / "generation_config.json", gen)
        if config is not None:
            (staging / "README.md").write_text(model_card(self.dst.name, target, config, target.facts.hf_source or "", len(files),
                                                          checked=self.checked))

    def notices(self, target: Target) -> list[str]:
        return list(target.facts.hf_notices or []) + ([self.checked] if self.checked else [])
