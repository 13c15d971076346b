"""Megatron-Core ``torch_dist`` checkpoints: a DCP folder with ``metadata.json`` and ``common.pt``.

``dist_checkpointing.save`` writes ``iter_0000002/`` (Megatron-LM names the folder and puts
``latest_checkpointed_iteration.txt`` beside it) holding:

* ``.metadata`` and ``__<rank>_<n>.distcp``: every sharded tensor as DCP (read by
  ``formats/dcp/format.py``; Megatron adds its ranks' save plans to ``.metadata``, read as data and
  dropped). Model keys are Megatron's module names at the top level, transformer layers
  stacked along a leading layer dim (``decoder.layers.self_attention.linear_qkv.weight`` is
  ``[num_layers, ...]``); optimizer state is ``optimizer.state.<exp_avg|exp_avg_sq|param>.<key>``;
  TransformerEngine's ``_extra_state`` are objects;
* ``common.pt``: what is not sharded (``args``, ``iteration``, the optimizer's param groups
  and ``common_step``, the scheduler), merged into the top level as Megatron's own ``load``
  does.

The catalog follows the ``megatron`` layout (``reshard.core.conventions``); its parameters get the
step from ``common_step``, as Megatron's optimizer does on load, so ``load_model`` resumes
Adam where it stopped. ``megatron-to-hf`` (``reshard.features.keymap.megatron``) maps the names to HF's,
and ``--to hf`` applies it by itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from reshard.formats.dcp.format import DCPFormat
from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.save import add_leaves, flatten_tree

from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError, UsageError
from reshard.pipeline.options import WriterOptions

__all__ = ["MegatronFormat", "resolve_iteration"]

_LATEST = "latest_checkpointed_iteration.txt"
_STATE = "optimizer.state."
_COMMON_STEP = "optimizer.state.common_step"


def _backend(folder: Path) -> dict[str, Any] | None:
    file = folder / "metadata.json"
    if not file.is_file() or file.stat().st_size > 1 << 16:
        return None
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and "sharded_backend" in meta else None


def resolve_iteration(path: Path) -> Path:
    """``path``, or the ``iter_<N>`` folder its ``latest_checkpointed_iteration.txt`` names."""
    if _backend(path) is not None:
        return path
    file = path / _LATEST
    if file.is_file():
        text = file.read_text(errors="replace").strip()
        if text == "release":
            return path / "release"
        if not re.fullmatch(r"\d{1,12}", text):
            raise CorruptCheckpointError(f"{file}: holds {text[:40]!r}, not an iteration number")
        folder = path / f"iter_{int(text):07d}"
        if not folder.is_dir():
            raise CheckpointNotFoundError(f"{file}: names iteration {text}, but {folder} does not exist")
        return folder
    raise CheckpointNotFoundError(f"{path}: not a Megatron-Core checkpoint (no metadata.json, no {_LATEST})")


class MegatronFormat:
    name = "megatron"

    def detect(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        # Only Megatron-LM writes latest_checkpointed_iteration.txt: a parent folder is
        # Megatron's even when the iteration it names is gone (read says so).
        return _backend(path) is not None or (path / _LATEST).is_file()

    def read(self, path: Path) -> Catalog:
        folder = resolve_iteration(Path(path))
        meta = _backend(folder) or {}
        backend = meta.get("sharded_backend")
        if backend != "torch_dist":
            raise UnsupportedFormatError(f"{folder / 'metadata.json'}: sharded backend {backend!r}; reshard reads "
                                         "torch_dist (Megatron's default): re-save with --ckpt-format torch_dist")
        if not (folder / ".metadata").is_file():
            raise CheckpointNotFoundError(f"{folder / '.metadata'}: missing (a torch_dist checkpoint is a DCP folder)")
        catalog = DCPFormat().read(folder)
        catalog.format = self.name
        catalog.facts.layout, catalog.facts.hf_keymap = "megatron", "megatron-to-hf"
        common = folder / "common.pt"
        if common.is_file():
            self._merge_common(catalog, common)
        self._steps(catalog)
        flat = [n for n in catalog.tensors if n.startswith("optimizer.distributed.")]
        if flat:
            catalog.notices.append(
                f"{len(flat)} optimizer tensors are DistributedOptimizer buckets (dp_reshardable), flat buffers that "
                "do not say which parameter each element belongs to: kept as they are, not resharded with the "
                "parameters; save with fully_reshardable for a resumable conversion")
        return catalog

    @staticmethod
    def _merge_common(catalog: Catalog, common: Path) -> None:
        """``common.pt``'s entries at the top level, as Megatron's ``load`` merges them."""
        flat = flatten_tree(read_torch_file(common), str(common))
        clash = next((n for n in flat.leaves if n in catalog.tensors or n in catalog.objects), None)
        if clash is not None:
            raise CorruptCheckpointError(f"{common}: {clash!r} is also a sharded entry of {common.parent}")
        add_leaves(catalog, flat, common)

    @staticmethod
    def _steps(catalog: Catalog) -> None:
        """``optimizer.state.step.<key>`` for every parameter with Adam state, all reading
        ``common_step`` (Megatron saves one step for all and hands it to each on load)."""
        step = catalog.tensors.get(_COMMON_STEP)
        if step is None or step.shape != ():
            return
        fqns = {n[len(_STATE):].partition(".")[2] for n in catalog.tensors
                if n.startswith(_STATE + "exp_avg.")}
        for fqn in sorted(fqns):
            name = f"{_STATE}step.{fqn}"
            if name in catalog.tensors:
                continue
            catalog.tensors[name] = TensorEntry(name, (), step.dtype, [Chunk(c.box, c.data) for c in step.chunks])
            catalog.paths[name] = (name,)

    def writer(self, dst: Path, options: WriterOptions | None = None) -> Any:
        raise UsageError("reshard reads Megatron-Core checkpoints but does not write them; convert to dcp, hf, "
                         "safetensors or torch (or --to-mesh for an FSDP2 run)")
