"""Real checkpoints for tests come from reshard.cli.example (written by torch itself); one helper
reads a catalog entry back whole, through its chunks' own reads."""

import pickle
import types
from collections.abc import Callable
from typing import Any

import torch

from reshard.cli.example import TinyNet, full_reference, save_fsdp2_dcp
from reshard.core.boxes import full_box
from reshard.core.catalog import TensorEntry

__all__ = ["TinyNet", "save_fsdp2_dcp", "full_reference", "full_tensor", "save_editing_refs", "onto",
           "torch_reading_of_retyped"]


def full_tensor(entry: TensorEntry) -> torch.Tensor:
    """The whole tensor of ``entry``, each chunk read by its reader (``torch.empty``: a box no
    chunk covers keeps garbage, so it cannot pass for zeros)."""
    out = torch.empty(entry.shape, dtype=entry.dtype.torch)
    for c in entry.chunks:
        out[c.box.as_slices()] = c.data.read(full_box(c.box.sizes))
    return out


StorageEdit = Callable[[tuple, int, dict[int, str]], tuple]


def save_editing_refs(obj: Any, f: Any, edit: StorageEdit, **kwargs: Any) -> None:
    """``torch.save(obj, f, **kwargs)`` with each storage reference torch pickles (``('storage',
    type, key, location, numel[, view])``) replaced by ``edit(pid, data_ptr, keys)``, ``keys``
    mapping the data pointers of the storages met so far to their keys: files torch.save
    refuses to write (views of one storage with different dtypes), which torch.load reads."""
    keys: dict[int, str] = {}

    def ptr(storage: Any) -> int:
        return getattr(storage, "_untyped_storage", storage).data_ptr()

    class Pickler(pickle._Pickler):  # type: ignore[name-defined]  # torch's subclass overrides persistent_id
        def save(self, o: Any, save_persistent_id: bool = True) -> None:
            pid = self.persistent_id(o) if save_persistent_id else None
            if pid is None:
                return super().save(o, save_persistent_id)
            keys.setdefault(ptr(o), pid[2])
            self.save_pers(edit(pid, ptr(o), keys))

    torch.save(obj, f, pickle_module=types.SimpleNamespace(__name__="pickle", Pickler=Pickler, dump=pickle.dump),
               **kwargs)


def onto(moved: torch.Tensor, target: torch.Tensor) -> StorageEdit:
    """An edit: ``moved``'s storage references name ``target``'s storage (pickled before it)."""
    src, dst = moved.untyped_storage().data_ptr(), target.untyped_storage().data_ptr()
    return lambda pid, ptr, keys: (*pid[:2], keys[dst], *pid[3:]) if ptr == src else pid


def torch_reading_of_retyped(load: Callable[[], Any]) -> torch.Tensor | None:
    """torch's own reading of a tensor whose storage an earlier reference gave another dtype
    (the oracle of the retyped-storage tests): up to 2.14 torch types the storage by its first
    reference and hands the float32 values back; 2.15 checks each zip record's size and refuses
    the file (None here), and its legacy reader types each reference on its own. Releases
    disagree on such a file, which is one more reason reshard refuses it."""
    try:
        return load()
    except RuntimeError as e:
        if "record size" not in str(e):
            raise
        return None
