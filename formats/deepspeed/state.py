"""Reading DeepSpeed's pickles: each file through the allow-list, entries checked as they are
taken, DeepSpeed's own classes handed on as the plain data they hold, and catalog entries
added with their tiling checked. Shared by the ZeRO and the universal readers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.formats.torch.file import read_torch_file
from reshard.formats.torch.save import add_leaves, flatten_tree

from reshard.core.boxes import Box, tiles_exactly
from reshard.core.catalog import Catalog, Chunk, NestedPath, TensorEntry
from reshard.core.dtypes import DType
from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError
from reshard.core.regions import StoredRegion
from reshard.safe_pickle.inert import Inert, is_refused, refused_name
from reshard.safe_pickle.unpickler import Unpickled, refusal_message
from reshard.safe_pickle.walk import find_in

if TYPE_CHECKING:
    import torch

__all__ = ["LAYOUT_KEYS", "ScalarValue", "load_state", "field_of", "plain", "flat_partition", "scalar_data", "add_tensor",
           "add_objects"]

# Entries of a model states file that describe the layout (read here, not carried as objects).
LAYOUT_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
               "shared_params")
# Entries of the ZeRO optimizer state that hold partitions (read as tensors, not carried).
_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_flat_groups", "base_optimizer_state", "optimizer_state_dict",
               "param_slice_mappings")


@dataclass(frozen=True)
class ScalarValue:
    """A per-group scalar of the optimizer (``step`` saved as a Python number) as a 0-d tensor."""

    value: torch.Tensor

    def read(self, box: Box) -> torch.Tensor:
        return self.value.clone()


def load_state(path: Path) -> Unpickled:
    """A DeepSpeed torch file, read by the allow-list: a dict, with placeholders where the
    file names a global nobody allowed (refused only where that part is needed)."""
    u = read_torch_file(path)
    if not isinstance(u.value, dict):
        raise CorruptCheckpointError(f"{path}: holds a {type(u.value).__name__}, not a DeepSpeed state dict")
    return u


def field_of(d: Any, key: str | int, where: Path | str, kinds: type | tuple[type, ...] = object) -> Any:
    """``d[key]``, refusing a missing entry, a placeholder for a refused global, or a wrong type."""
    if not isinstance(d, Mapping) or key not in d:
        raise CorruptCheckpointError(f"{where}: no {key!r} entry (not a DeepSpeed ZeRO checkpoint file, or a newer "
                                     "layout reshard does not know)")
    value = d[key]
    hit = find_in(value, is_refused) if not isinstance(value, StoredRegion) else None
    if hit is not None:
        raise UnsafeCheckpointError(refusal_message(where, refused_name(hit), opt_in=True, what=f"{key!r} "))
    if not isinstance(value, kinds):
        raise CorruptCheckpointError(f"{where}: {key!r} is a {type(value).__name__}, not what DeepSpeed saves there")
    return value


def plain(value: Any) -> Any:
    """DeepSpeed's stand-ins as the data they hold: an enum as its value, an object as its state."""
    if isinstance(value, Inert):
        if value.how == "call" and len(value.args) == 1 and not value.state:
            return plain(value.args[0])
        return plain(value.state) if isinstance(value.state, dict) else value
    if isinstance(value, dict):
        return type(value)((k, plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(plain(v) for v in value)
    return value


def flat_partition(value: Any, where: str) -> StoredRegion:
    if not isinstance(value, StoredRegion) or len(value.shape) != 1 or not value.is_contiguous:
        raise CorruptCheckpointError(f"{where}: expected a flat 1-D partition, found {type(value).__name__} "
                                     f"{getattr(value, 'shape', '')}")
    return value


def scalar_data(value: Any) -> Any:
    """A per-group optimizer scalar (``step``) as chunk data, or None when it is no number."""
    import torch

    if isinstance(value, StoredRegion) and value.shape == ():
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ScalarValue(torch.tensor(float(value), dtype=torch.float32))
    return None


def add_tensor(catalog: Catalog, name: str, shape: tuple[int, ...], dtype: DType, chunks: list[Chunk],
               path: NestedPath) -> None:
    why = tiles_exactly(shape, [c.box for c in chunks])
    if why is not None:
        raise CorruptCheckpointError(f"{catalog.path}: the stored parts of {name!r} do not make up the tensor: {why}")
    catalog.tensors[name] = TensorEntry(name, shape, dtype, chunks)
    catalog.paths[name] = path


def add_objects(catalog: Catalog, tree: dict[str, Any], refused: tuple[str, ...], where: Path) -> None:
    """Objects (nested dicts flattened as DCP flattens them), refused only when asked for."""
    if tree:
        add_leaves(catalog, flatten_tree(Unpickled(tree, refused), str(where)), where)
