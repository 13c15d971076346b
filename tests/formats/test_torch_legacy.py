"""Legacy (pre-1.6, non-zip) torch.save files, written by torch itself, read as data and
converted exactly; torch's own reader is the oracle."""

from __future__ import annotations

import collections
import pickle
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from reshard.formats.registry import detect_format
from reshard.formats.torch.legacy import MAGIC_NUMBER, PROTOCOL_VERSION
from reshard.formats.torch.save import TorchSaveFormat

import reshard
from reshard.core.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from tests.fixtures import full_tensor
from tests.formats.test_torch_save import _same, _zoo
from tests.test_hostile import _System


def _legacy(value: Any, path: Path) -> Path:
    torch.save(value, path, _use_new_zipfile_serialization=False)
    return path


def test_a_legacy_file_converts_exactly(tmp_path: Path) -> None:
    value = _zoo()  # views, shared storages, bf16, empty and 0-d tensors, int keys, tuples
    del value["model"]["f8"]  # torch's legacy loader cannot read float8 back (no oracle)
    value["model"]["row"] = value["model"]["view"][1]  # a second view of one storage
    src = _legacy(value, tmp_path / "legacy.pt")
    assert detect_format(src).name == "torch"
    theirs = torch.load(src, weights_only=True)
    cat = TorchSaveFormat().read(src)
    for name, entry in cat.tensors.items():
        path = cat.paths[name]
        want = theirs
        for key in path:
            want = want[key]
        _same(full_tensor(entry), want.detach(), name)
    assert cat.tensors["model.view"].chunks[0].data.strides is not None  # a strided view, read in place
    reshard.convert(src, tmp_path / "out.pt", quiet=True)
    want = {**theirs, "model": dict(theirs["model"])}
    want["model"]["param"] = want["model"]["param"].detach()
    _same(torch.load(tmp_path / "out.pt", weights_only=True), want)
    no_suffix = tmp_path / "checkpoint"
    no_suffix.write_bytes(src.read_bytes())
    assert TorchSaveFormat().detect(no_suffix)


def _raw_legacy(path: Path, obj: Any, storages: dict[str, tuple[int, bytes]], persistent: Any) -> Path:
    """A legacy file written record by record as torch's ``_legacy_save`` does, for layouts
    current torch no longer writes (storage views)."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            return persistent(o)

    with open(path, "wb") as f:
        for record in (MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": 1001, "little_endian": True,
                                                         "type_sizes": {"short": 2, "int": 4, "long": 8}}):
            pickle.dump(record, f, protocol=2)
        Pickler(f, protocol=2).dump(obj)
        pickle.dump(sorted(storages), f, protocol=2)
        for key in sorted(storages):
            numel, data = storages[key]
            f.write(numel.to_bytes(8, "little") + data)
    return path


class _ViewStorage:
    pass


class _Tensor:
    def __init__(self, *args: Any) -> None:
        self.args = args

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def test_storage_views_follow_view_metadata(tmp_path: Path) -> None:
    """``view_metadata = (view key, offset, size)``: the tensor's storage is that slice of the root."""
    root = torch.arange(10, dtype=torch.float32)
    view = _ViewStorage()
    obj = {"t": _Tensor(view, 1, torch.Size([3]), (1,), False, collections.OrderedDict())}
    src = _raw_legacy(tmp_path / "views.pt", obj, {"root": (10, root.numpy().tobytes())},
                      lambda o: ("storage", torch.FloatStorage, "root", "cpu", 10, ("view1", 2, 5)) if o is view else None)
    want = torch.load(src, weights_only=False)["t"]  # our own file: torch's reader as the oracle
    assert want.tolist() == [3.0, 4.0, 5.0]
    _same(full_tensor(TorchSaveFormat().read(src).tensors["t"]), want)
    out_of_bounds = _raw_legacy(tmp_path / "oob.pt", obj, {"root": (10, root.numpy().tobytes())},
                                lambda o: ("storage", torch.FloatStorage, "root", "cpu", 10, ("v", 8, 5)) if o is view else None)
    with pytest.raises(CorruptCheckpointError, match=r"oob\.pt: storage view .* lies outside storage root"):
        TorchSaveFormat().read(out_of_bounds)


def test_a_storage_retyped_by_a_later_reference_is_refused(tmp_path: Path) -> None:
    """As in zip files: torch.load types a storage by its first reference, so 'b' (uint8) on
    'a''s float32 storage is float32 [1, 2, 3, 4] to torch; reshard read it as uint8 [0, 0, 128,
    63] and refused the file only for its element count. Refused now, naming both tensors."""
    floats = torch.tensor([1.0, 2, 3, 4])
    sa, sb = _ViewStorage(), _ViewStorage()
    obj = {"a": _Tensor(sa, 0, torch.Size([4]), (1,), False, collections.OrderedDict()),
           "b": _Tensor(sb, 0, torch.Size([4]), (1,), False, collections.OrderedDict())}
    types = {id(sa): (torch.FloatStorage, 4), id(sb): (torch.ByteStorage, 16)}
    src = _raw_legacy(tmp_path / "retyped.pt", obj, {"k": (4, floats.numpy().tobytes())},
                      lambda o: ("storage", *types[id(o)][:1], "k", "cpu", types[id(o)][1], None) if id(o) in types
                      else None)
    theirs = torch.load(src, weights_only=False)["b"]  # our own file: torch's reader as the oracle
    # torch <= 2.14 types the storage by its first reference, 2.15 each reference on its own
    assert (theirs.dtype, theirs.tolist()) in ((torch.float32, [1, 2, 3, 4]), (torch.uint8, [0, 0, 128, 63]))
    with pytest.raises(CorruptCheckpointError, match=r"retyped\.pt: tensors 'a' and 'b' share a storage with "
                                                     r"different dtypes \('a' float32, 'b' uint8\)"):
        TorchSaveFormat().read(src)
    # 'b' on a storage first referenced empty: torch.load hands it uninitialized memory, and here
    # it would read the bytes of the next storage in the stream.
    obj["a"] = _Tensor(sa, 0, torch.Size([0]), (1,), False, collections.OrderedDict())
    empty_first = _raw_legacy(tmp_path / "empty_first.pt", obj, {"k": (0, b"")},
                              lambda o: ("storage", torch.FloatStorage, "k", "cpu", 0 if o is sa else 4, None)
                              if id(o) in types else None)
    with pytest.raises(CorruptCheckpointError, match=r"empty_first\.pt: storage k is referenced with 0 and then 4"):
        TorchSaveFormat().read(empty_first)


def test_broken_and_older_layouts_are_refused(tmp_path: Path) -> None:
    data = bytearray(_legacy({"w": torch.ones(4), "b": torch.zeros(2)}, tmp_path / "ok.pt").read_bytes())
    count_at = data.index((2).to_bytes(8, "little") + bytes(8))  # the header of "b"'s storage (2 elements)
    data[count_at] = 3
    (tmp_path / "count.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"count\.pt: storage \d+ holds 3 elements, the object says 2"):
        TorchSaveFormat().read(tmp_path / "count.pt")
    with tarfile.open(tmp_path / "tar.pt", "w") as tar:  # torch < 0.4: sys_info, pickle, storages, tensors
        for name in ("sys_info", "pickle", "storages", "tensors"):
            tar.add(tmp_path / "ok.pt", arcname=name)
    with pytest.raises(UnsupportedFormatError, match=r"tar\.pt: a torch.save file in the pre-0\.4 tar format"):
        TorchSaveFormat().read(tmp_path / "tar.pt")


def test_code_in_a_legacy_file_is_refused_when_asked_for(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    src = _legacy({"w": torch.ones(3), "extra": {"hook": _System(marker)}}, tmp_path / "evil.pt")
    cat = TorchSaveFormat().read(src)
    _same(full_tensor(cat.tensors["w"]), torch.ones(3))
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt: 'extra\.hook' refers to (posix|os)\.system"):
        cat.objects["extra.hook"]
    assert not marker.exists()
