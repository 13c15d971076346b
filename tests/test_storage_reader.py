"""reshard.StorageReader: torch's own ``dcp.load`` reading every format reshard reads.

Every source is loaded three ways into state dicts of the same tensors, compared bit for bit:
``dcp.load`` through ``reshard.StorageReader``, ``reshard.load_state_dict``, and torch's own
reader of the format where torch has one (``FileSystemReader`` for DCP, ``HuggingFaceStorageReader``
for safetensors folders). Each in two shapes: the checkpoint's own names (objects included),
and the nesting torch's ``get_state_dict`` gives (``{"model": {fqn: ...}, "optim": {"state":
...}}``), which the reader finds under whatever names the writing tool used. The session's
FSDP2 + AdamW checkpoint (and its zarr copy) is also loaded into a real FSDP2 model and AdamW
from ``get_state_dict``, param groups included, against torch's ``FileSystemReader`` of the DCP.

The same checks run in one process without a process group (plain tensors) and in spawned
gloo worlds of 2 and 3 ranks (DTensors, ``Shard(0)``: uneven and empty shards), where each rank
must read only its own boxes (``bytes_read``). A new source is one row of ``SOURCES``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import reshard
from reshard.core.catalog import Catalog, TensorEntry
from reshard.core.conventions import OPTIM_STATE, PARAM, detect_layout
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from tests.dist import run_world
from tests.hf_models import save_tiny_llama

DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Source:
    """One checkpoint to load: how to make it, what torch itself reads it with, its key map."""

    id: str
    make: Callable[[Path, Path], Path]  # (a folder to write in, the session's FSDP2 DCP) -> the source
    torch_reader: str | None = None  # "dcp": FileSystemReader; "hf": HuggingFaceStorageReader
    keymap: str | None = None
    tinynet: bool = False  # holds the session DCP's TinyNet + AdamW: loaded into the real model too


def _converted(src: Path, dst: Path, **options: Any) -> Path:
    reshard.convert(src, dst, quiet=True, **options)
    return dst


SOURCES = (
    Source("dcp", lambda tmp, ckpt: ckpt, "dcp", tinynet=True),
    Source("zarr", lambda tmp, ckpt: _converted(ckpt, tmp / "ckpt.zarr"), tinynet=True),
    Source("safetensors", lambda tmp, ckpt: _converted(ckpt, tmp / "model", to="safetensors", only="model",
                                                       max_shard_size="200B"), "hf"),
    Source("hf", lambda tmp, ckpt: save_tiny_llama(tmp / "hf", tie=False), "hf"),
    Source("hf-to-titan", lambda tmp, ckpt: save_tiny_llama(tmp / "hf_tied", tie=True), keymap="hf-to-titan"),
    Source("deepspeed-zero3", lambda tmp, ckpt: DATA / "deepspeed" / "zero3_fp32_3ranks"),
    Source("deepspeed-zero2-bf16", lambda tmp, ckpt: DATA / "deepspeed" / "zero2_bf16"),
    Source("megatron", lambda tmp, ckpt: DATA / "megatron" / "gpt_tp2"),
    # what torch_checkpointing 0.1.1 itself saved (FSDP2 + AdamW on 2 ranks), and what reshard writes of the session's DCP
    Source("torch-checkpointing", lambda tmp, ckpt: DATA / "torch_checkpointing" / "torch-2.13.0" / "torch"),
    Source("torch-checkpointing-safetensors", lambda tmp, ckpt: DATA / "torch_checkpointing" / "torch-2.15.0" / "safetensors"),
    Source("torch-checkpointing-written", lambda tmp, ckpt: _converted(ckpt, tmp / "tc", to="torch-checkpointing"),
           tinynet=True),
)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, fsdp2_dcp: tuple[Path, Path]) -> Callable[[Source], Path]:
    """Each source's path, made once for the module."""
    paths: dict[str, Path] = {}

    def path(source: Source) -> Path:
        if source.id not in paths:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # transformers' and torch's notes on saving
                paths[source.id] = source.make(tmp_path_factory.mktemp(source.id), fsdp2_dcp[0])
        return paths[source.id]

    return path


# ------------------------------------------------------------------ the checks (in ranks, or in one process)

Make = Callable[[TensorEntry], torch.Tensor]


def _plain(entry: TensorEntry) -> torch.Tensor:
    return torch.full(entry.shape, -7, dtype=entry.dtype.torch)  # not a stored value: unfilled shows


def _sharded(entry: TensorEntry) -> torch.Tensor:
    """Shard(0) over every rank (uneven and empty shards); a 0-dim tensor plain."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not entry.shape:
        return _plain(entry)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return distribute_tensor(_plain(entry), mesh, [Shard(0)])


def _flat(catalog: Catalog, make: Make) -> dict[str, Any]:
    """The checkpoint's own names, objects too."""
    return {**{n: make(e) for n, e in catalog.tensors.items()}, **dict.fromkeys(catalog.objects)}


def _nested(catalog: Catalog, make: Make) -> dict[str, Any]:
    """get_state_dict's nesting, whatever the checkpoint calls its parameters and their state."""
    layout = detect_layout(catalog)
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for name, entry in catalog.tensors.items():
        p = layout.place(name)
        if p.role == PARAM and p.fqn is not None:
            model[p.fqn] = make(entry)
        elif p.role == OPTIM_STATE and p.fqn is not None and p.key is not None:
            state.setdefault(p.fqn, {})[p.key] = make(entry)
    assert model, f"{catalog.path}: no parameters under layout {layout.name}"
    return {"model": model, "optim": {"state": state}}


def _leaves(sd: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(sd, dict):
        for k, v in sd.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(sd, list):
        for i, v in enumerate(sd):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], sd


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _local(t).detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: Any, want: Any, what: str, objects: bool = True) -> None:
    a, b = dict(_leaves(got)), dict(_leaves(want))
    if not objects:
        a = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
        b = {k: v for k, v in b.items() if isinstance(v, torch.Tensor)}
    assert a and a.keys() == b.keys(), what
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[name].dtype and torch.equal(_bits(value), _bits(b[name])), f"{what}: {name}"
        else:
            assert type(value) is type(b[name]) and value == b[name], f"{what}: {name}: {value!r} != {b[name]!r}"


def _tensors(sd: Any) -> Any:
    """``sd`` without its non-tensor leaves (what load_state_dict fills)."""
    if isinstance(sd, dict):
        return {k: _tensors(v) for k, v in sd.items() if isinstance(v, (dict, torch.Tensor))}
    return sd


def _local_bytes(sd: Any) -> int:
    return sum(_local(t).numel() * t.element_size() for _, t in _leaves(sd) if isinstance(t, torch.Tensor))


def _torch_reader(kind: str, path: Path) -> Any:
    if kind == "dcp":
        return dcp.FileSystemReader(path)
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    return HuggingFaceStorageReader(str(path))


def check_source(source: Source, path: Path, make: Make) -> None:
    """dcp.load through reshard.StorageReader == reshard.load_state_dict == torch's reader, in
    both shapes; this rank read only its own boxes."""
    assert reshard.StorageReader.validate_checkpoint_id(path)
    reader = reshard.StorageReader(path, keymap=source.keymap)
    for shape in (_flat, _nested):
        what = f"{source.id} {shape.__name__}"
        got = shape(reader.catalog, make)
        dcp.load(got, storage_reader=reader)
        assert reader.bytes_read == _local_bytes(got), what  # each tensor in its stored dtype: bytes alike
        want = _tensors(shape(reader.catalog, make))
        reshard.load_state_dict(want, path, keymap=source.keymap, progress=False)
        _assert_same(got, want, f"{what} vs reshard.load_state_dict", objects=False)
        if shape is _flat:
            objects = reader.catalog.objects
            assert all(type(got[n]) is type(objects[n]) and got[n] == objects[n] for n in objects), what
        if shape is _flat and source.torch_reader is not None:
            theirs = shape(reader.catalog, make)
            if source.torch_reader == "hf":
                theirs = _tensors(theirs)
            dcp.load(theirs, storage_reader=_torch_reader(source.torch_reader, path))
            _assert_same(got, theirs, f"{what} vs torch's reader", objects=source.torch_reader == "dcp")


def _tinynet(sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from reshard.cli.example import TinyNet

    torch.manual_seed(1234)  # not the checkpoint's values
    model = TinyNet()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for sub in (model.embed, model.proj, model.head):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def _tinynet_state(sharded: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _tinynet(sharded)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def check_tinynet(source: Source, path: Path, reference_dcp: Path, sharded: bool) -> None:
    """Into a real (FSDP2) TinyNet and AdamW from get_state_dict, param groups included: equal
    to torch's FileSystemReader of the DCP it came from, and to reshard.load_state_dict."""
    got, theirs, want = (_tinynet_state(sharded) for _ in range(3))
    reader = reshard.StorageReader(path)
    dcp.load(got, storage_reader=reader)
    assert reader.bytes_read == _local_bytes(got)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(reference_dcp))
    _assert_same(got, theirs, f"{source.id} into TinyNet + AdamW vs FileSystemReader")
    assert got["optim"]["param_groups"][0]["lr"] == 0.01  # the checkpoint's, not the optimizer's 0.5
    reshard.load_state_dict(_tensors(want), path, progress=False)
    _assert_same(got, want, f"{source.id} into TinyNet + AdamW vs reshard.load_state_dict", objects=False)


def _world(rank: int, world: int, sources: list[tuple[str, str]], reference_dcp: str) -> None:
    by_id = {s.id: s for s in SOURCES}  # a Source's maker stays in the parent: ranks get ids and paths
    for source_id, path in sources:
        source = by_id[source_id]
        check_source(source, Path(path), _sharded)
        if source.tinynet:
            check_tinynet(source, Path(path), Path(reference_dcp), sharded=True)
    # A name the checkpoint lacks fails the load on every rank alike (no rank waits forever).
    reader = reshard.StorageReader(sources[0][1])
    with pytest.raises(CheckpointException, match="not.in.the.checkpoint"):
        dcp.load({"not.in.the.checkpoint": torch.zeros(3)}, storage_reader=reader)


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("source", SOURCES, ids=[s.id for s in SOURCES])
def test_dcp_load_in_one_process(source: Source, made: Callable[[Source], Path], fsdp2_dcp: tuple[Path, Path]) -> None:
    """No process group (dcp.load then runs as one rank): plain tensors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        check_source(source, made(source), _plain)
        if source.tinynet:
            check_tinynet(source, made(source), fsdp2_dcp[0], sharded=False)


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_load_on_gloo_ranks(world: int, made: Callable[[Source], Path], fsdp2_dcp: tuple[Path, Path]) -> None:
    """Every source in one spawned world: DTensors sharded over every rank, each rank reading its boxes."""
    run_world(_world, world, [(s.id, str(made(s))) for s in SOURCES], str(fsdp2_dcp[0]))


def test_the_metadata_is_the_catalog(made: Callable[[Source], Path]) -> None:
    """One whole-tensor chunk per tensor, objects as bytes, nested paths as planner_data; a
    caller's name for the same tensor finds the checkpoint's entry."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader = reshard.StorageReader(made(SOURCES[5]))  # DeepSpeed: parameters at the top level, optimizer.state.
    md = reader.read_metadata()
    catalog = reader.catalog
    assert list(md.state_dict_metadata) == [*catalog.tensors, *catalog.objects]
    entry = md.state_dict_metadata["model.embed_tokens.weight"]
    assert isinstance(entry, TensorStorageMetadata) and len(catalog.tensors["model.embed_tokens.weight"].chunks) > 1
    assert [(list(c.offsets), list(c.sizes)) for c in entry.chunks] == [([0, 0], [61, 32])]
    assert entry.properties.dtype is torch.float32
    assert isinstance(md.state_dict_metadata["deepspeed.iteration"], BytesStorageMetadata)
    assert md.planner_data["optimizer.param_groups.0.lr"] == ("optimizer", "param_groups", 0, "lr")
    found = md.state_dict_metadata
    assert found["model.model.embed_tokens.weight"] is entry and "model.model.embed_tokens.weight" in found
    assert found["optim.state.model.embed_tokens.weight.exp_avg"] is found[
        "optimizer.state.model.embed_tokens.weight.exp_avg"]
    assert found.get("optim.param_groups.0.lr") is found["optimizer.param_groups.0.lr"]
    assert "optim.param_groups.0.params" not in found  # how a group lists its parameters is the checkpoint's own
    assert "model.nothing.weight" not in found and found.get("model.nothing.weight") is None


def test_the_empty_state_dict_planner_rebuilds_the_checkpoint(fsdp2_dcp: tuple[Path, Path]) -> None:
    """torch's own "load everything" (``_load_state_dict_from_keys``, its ``_EmptyStateDictLoadPlanner``,
    what ``dcp_to_torch_save`` runs) gets the same nested state dict, int keys and tuples
    included, from reshard's reader as from FileSystemReader."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        got = _load_state_dict_from_keys(storage_reader=reshard.StorageReader(fsdp2_dcp[0]))
        theirs = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(fsdp2_dcp[0]))
    _assert_same(got, theirs, "everything")
    assert got["extra"]["step"] == 2 and got["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)


def test_a_key_map_renames_for_the_training_model(made: Callable[[Source], Path]) -> None:
    """keymap="hf-to-titan": transformers' folder into the training model's own state dict
    (q/k rows permuted back), equal to reshard.load_model with the same map."""
    from reshard.train.model import ModelConfig, Transformer

    src = made(SOURCES[4])
    cfg = replace(ModelConfig.preset("tiny"), tie_embeddings=True, norm_eps=1e-6)
    got, want = Transformer(cfg), Transformer(cfg)
    reader = reshard.StorageReader(src, keymap="hf-to-titan")
    assert "layers.0.attention.wq.weight" in reader.read_metadata().state_dict_metadata
    sd = {n: t for n, t in got.state_dict().items() if n != "output.weight"}  # tied: the folder holds it once
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, storage_reader=reader)
    got.load_state_dict(sd, strict=False)
    reshard.load_model(want, src, keymap="hf-to-titan", progress=False)
    _assert_same(got.state_dict(), want.state_dict(), "hf-to-titan")


def test_a_bad_source_raises_reshards_own_error(made: Callable[[Source], Path], tmp_path: Path) -> None:
    """The same refusal, with the same message, as reshard.inspect: from the constructor and
    from dcp.load(checkpoint_id=...); validate_checkpoint_id says False."""
    good = made(SOURCES[0])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not a checkpoint")
    truncated = tmp_path / "model.safetensors"
    truncated.write_bytes((1000).to_bytes(8, "little") + b'{"w": {')
    # (path, the error, what validate_checkpoint_id says: a truncated file is detected, refused when read)
    cases = [(tmp_path / "notes", UnsupportedFormatError, False), (tmp_path / "missing", CheckpointNotFoundError, False),
             (truncated, CorruptCheckpointError, True)]
    for path, error, detected in cases:
        assert reshard.StorageReader.validate_checkpoint_id(path) is detected
        with pytest.raises(error) as inspected:
            reshard.inspect(path)
        with pytest.raises(error) as constructed:
            reshard.StorageReader(path)
        assert str(constructed.value) == str(inspected.value)
        with pytest.raises(error) as loaded, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"x": torch.zeros(1)}, checkpoint_id=path, storage_reader=reshard.StorageReader(good))
        assert str(loaded.value) == str(inspected.value)
    assert not reshard.StorageReader.validate_checkpoint_id("s3://bucket/ckpt")  # read by the reader, not detected here


def test_a_box_the_checkpoint_does_not_store_whole_is_refused_before_reading(made: Callable[[Source], Path]) -> None:
    reader = reshard.StorageReader(made(SOURCES[5]))
    entry = reader.catalog.tensors["model.embed_tokens.weight"]
    reader.catalog.tensors["model.embed_tokens.weight"] = replace(entry, chunks=entry.chunks[1:])
    sd = {"model.embed_tokens.weight": torch.full((61, 32), -7.0)}
    with warnings.catch_warnings(), pytest.raises(CheckpointException, match="stores only .* the checkpoint is incomplete"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, storage_reader=reader)
    assert (sd["model.embed_tokens.weight"] == -7).all() and reader.bytes_read == 0
