"""``LoadResult.objects`` holds the objects a checkpoint saved as the types they were saved as,
whichever format they come from: torch.save (one file, per-rank files, torch's ``_experimental``
``checkpoint_<rank>.pt``), DCP, and reshard's safetensors and zarr outputs, through both
``load_model`` and ``load_state_dict``.

A saved ``torch.dtype`` came back from torch files as ``reshard.core.dtypes.DType`` (how reshard's
readers carry a dtype without importing torch), and from a DCP folder of the same data as a
``torch.dtype``: ``res.objects["cfg.dtype"] == torch.bfloat16`` raised ``TypeError``.
"""

from __future__ import annotations

import collections
import datetime
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import reshard
from reshard.core.values import difference
from tests.dist import HANG_GUARD, run_world


def saved_objects() -> dict:
    """Beside a tensor, values of the types a training config or state holds."""
    return {
        "dtype": torch.bfloat16,
        "inner": {"dtype": torch.float8_e4m3fn},
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "scalar": np.float32(1.5),
        "count": np.int64(-7),
        "complex": complex(1.0, -2.5),
        "set": {3, 1, 2},
        "frozen": frozenset({"x"}),
        "buffer": bytearray(b"\x00\xffxy"),
        "when": datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
        "day": datetime.date(2024, 5, 6),
        "took": datetime.timedelta(days=1, seconds=2, microseconds=3),
        "step": 12,
    }


def _flat(prefix: str, value: dict) -> dict:
    out = {}
    for k, v in value.items():
        if type(v) is dict:
            out.update(_flat(f"{prefix}{k}.", v))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _save_ranks(rank: int, world: int, root: str) -> None:
    """Per-rank torch.save files of a DTensor beside the objects, under both names torch's
    tools give them (``rank<r>.pt``; ``checkpoint_<r>.pt`` as the ``_experimental`` checkpointer)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(3.0), mesh, [Shard(0)]), "cfg": saved_objects()}
    torch.save(state, Path(root) / "ranks" / f"rank{rank}.pt")
    torch.save(state, Path(root) / "experimental" / f"checkpoint_{rank}.pt")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("objects")
    state = {"w": torch.arange(3.0), "cfg": saved_objects()}
    torch.save(state, root / "d.pt")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=root / "dcp", no_dist=True)
    (root / "ranks").mkdir()
    (root / "experimental").mkdir()
    run_world(_save_ranks, 2, str(root), timeout=HANG_GUARD)
    out = {"torch file": root / "d.pt", "per-rank files": root / "ranks", "_experimental": root / "experimental",
           "dcp": root / "dcp"}
    for name, dst in (("safetensors", root / "d.safetensors"), ("zarr", root / "d.zarr"), ("torch output", root / "o.pt")):
        reshard.convert(root / "d.pt", dst, quiet=True)
        out[name] = dst
    return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


@pytest.mark.parametrize("source", ["torch file", "per-rank files", "_experimental", "dcp", "torch output", "safetensors",
                                    "zarr"])
def test_objects_come_back_as_the_types_saved(sources: dict[str, Path], source: str) -> None:
    want = _flat("cfg.", saved_objects())
    if source == "dcp":  # DCP's own flattening takes every Mapping apart, an OrderedDict too
        del want["cfg.ordered"]
        want.update({"cfg.ordered.b": 1, "cfg.ordered.a": 2})
    for load in (lambda: reshard.load_model(Net(), sources[source], progress=False),
                 lambda: reshard.load_state_dict({"w": torch.zeros(3)}, sources[source], progress=False)):
        res = load()
        assert res.objects["cfg.dtype"] is torch.bfloat16, type(res.objects["cfg.dtype"])
        assert res.objects["cfg.dtype"] == torch.bfloat16  # raised TypeError
        assert res.objects["cfg.inner.dtype"] is torch.float8_e4m3fn
        wrong = {n: (type(res.objects.get(n)).__name__, difference(res.objects.get(n), v))
                 for n, v in want.items() if type(res.objects.get(n)) is not type(v) or difference(res.objects.get(n), v)}
        assert not wrong, (source, wrong)


def test_safetensors_and_zarr_outputs_hold_them_as_json(sources: dict[str, Path], tmp_path: Path) -> None:
    """A safetensors output left out torch.Size, OrderedDict, numpy scalars, datetime, complex,
    set and bytearray, a notice each; now every object is in its metadata (the safetensors
    package still opens the file: its metadata is strings, its tensors as they were), and a
    zarr store holds them in its attributes rather than a pickle beside them."""
    import json

    from safetensors import safe_open

    result = reshard.convert(sources["torch file"], tmp_path / "o.safetensors", quiet=True)
    assert not [n for n in result.notices if "left out" in n], result.notices
    with safe_open(str(tmp_path / "o.safetensors"), "pt") as f:
        assert f.keys() == ["w"] and torch.equal(f.get_tensor("w"), torch.arange(3.0))
        meta = f.metadata()
    objects = json.loads(meta["reshard.objects"])
    assert objects["cfg.size"] == {"__size__": [2, 3]} and objects["cfg.set"] == {"__set__": [1, 2, 3]}
    assert set(objects) == set(_flat("cfg.", saved_objects()))
    result = reshard.convert(sources["torch file"], tmp_path / "o.zarr", quiet=True)
    root = json.loads((tmp_path / "o.zarr" / "zarr.json").read_text())["attributes"]
    assert set(root["reshard.objects"]) == set(_flat("cfg.", saved_objects())) and "reshard.pickled_objects" not in root
    assert not (tmp_path / "o.zarr" / ".reshard-objects.pt").exists()
