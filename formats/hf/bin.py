"""Hugging Face model folders whose weights are torch.save files: ``pytorch_model.bin``, or
shards (``pytorch_model-00001-of-00002.bin``) listed by ``pytorch_model.bin.index.json``, as
``save_pretrained(..., safe_serialization=False)`` writes them and as most models on the Hub
from before safetensors are stored (zip or pre-1.6 legacy files alike: ``torch.file``).

The index is checked like a safetensors index (``formats/safetensors/format.py``, whose checks this
module reuses): file names stay inside the folder, every tensor the index maps to a file is
in that file and no other, and no file holds a tensor the index does not put there.
``config.json`` and ``generation_config.json`` ride in ``catalog.facts`` under the same keys
as a safetensors folder's, so ``--to hf`` writes them out again.

A folder that holds safetensors weights too (the Hub often keeps both) is read as safetensors,
as transformers does: the registry tries that format first. Among ``.bin`` files, a single
``pytorch_model.bin`` wins over an index, again as transformers' ``from_pretrained`` looks.
This format is read-only; ``--to hf`` writes safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reshard.formats.safetensors.format import _check_against_index, _indexed_files, take_hf_configs
from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.save import add_leaves, flatten_tree
from reshard.formats.torch.zip import DTensorRef

from reshard.core.catalog import Catalog, ObjectTable
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UsageError
from reshard.core.regions import StoredRegion

__all__ = ["HFBinFormat", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]

WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_INDEX_SUFFIX = ".bin.index.json"


def _bin_files(path: Path) -> tuple[Path, dict[Path, set[str] | None]]:
    """(folder, each weights file with the tensor names its index puts there, or None)."""
    if path.is_file():
        return path.parent, dict(_indexed_files(path.parent, [path]))
    if (path / WEIGHTS_NAME).is_file():
        return path, {path / WEIGHTS_NAME: None}
    main = path / WEIGHTS_INDEX_NAME
    indexes = [main] if main.is_file() else sorted(p for p in path.glob(f"*{_INDEX_SUFFIX}") if p.is_file())
    if not indexes:
        raise CheckpointNotFoundError(f"{path}: no {WEIGHTS_NAME} or *{_INDEX_SUFFIX} in this folder")
    return path, dict(_indexed_files(path, indexes))


class HFBinFormat:
    name = "hf-bin"

    def detect(self, path: Path) -> bool:
        if path.is_file():
            return path.name.endswith(_INDEX_SUFFIX)
        if not path.is_dir() or (path / ".metadata").exists():  # a DCP folder is DCP's
            return False
        return (path / WEIGHTS_NAME).is_file() or any(p.is_file() for p in path.glob(f"*{_INDEX_SUFFIX}"))

    def read(self, path: Path) -> Catalog:
        """The folder's weights (tensors as regions in the .bin files), its configs in its facts."""
        path = Path(path)
        if not path.exists():
            raise CheckpointNotFoundError(f"{path}: no such file or directory")
        root, files = _bin_files(path)
        catalog = Catalog(format=self.name, path=path, objects=ObjectTable())
        owner: dict[str, Path] = {}
        containers: dict = {}
        for file in sorted(files):
            flat = flatten_tree(read_torch_file(file), str(file))
            stored = {n for n, (_, leaf) in flat.leaves.items() if isinstance(leaf, (StoredRegion, DTensorRef))}
            _check_against_index(file, stored, files[file])
            for name in flat.leaves:
                if name in owner:
                    raise CorruptCheckpointError(f"{file}: {name!r} is also stored in {owner[name]}")
                owner[name] = file
            add_leaves(catalog, flat, file)
            containers.update(flat.containers)
        if containers:
            catalog.facts.containers = containers
        take_hf_configs(catalog, root)
        return catalog

    def writer(self, dst: Path, **options: Any) -> Any:
        raise UsageError("hf-bin is read only: write --to hf (safetensors, what transformers prefers) or --to torch")
