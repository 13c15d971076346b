"""Write tests/data/compat/torch-<version>/: checkpoints made by the torch this runs under.

Run once per torch release, each in a venv of its own that has only torch, safetensors,
numpy and zstandard (reshard is not imported: every byte and every expected value here is the
work of that torch release alone). scripts/compat.sh builds such a venv:

    scripts/compat.sh 2.15.0 --fixtures        # venv with torch 2.15.0, then this script in it

What it writes (tens of KiB in all; tests/data/compat/README.md has the table):

- An FSDP2 model (uneven shards on 2 ranks, one parameter with an empty shard) trained two
  AdamW steps on 2 gloo ranks; ``get_state_dict`` gives {"model", "optim"} as DTensors, saved
  with ``dcp.save`` by each writer the release has: default (``single_file_per_rank=True``),
  ``single_file_per_rank=False``, ``SerializationFormat.SAFETENSORS``, the ZStandard
  extension; the model alone by ``HuggingFaceStorageWriter`` (distributed shards, and
  consolidated).
- ``experimental_sync/``: the same state by ``torch.distributed.checkpoint._experimental``'s
  synchronous checkpointer (``checkpoint_<rank>.pt``, torch.save of each rank's DTensors).
- ``full_state_dict.pt``: torch.save of ``get_state_dict(..., full_state_dict=True)``, both the
  torch.save fixture and the expected values. Before it is kept, this torch's own readers
  (``dcp_to_torch_save`` of each DCP folder, safetensors of the consolidated HF output) must
  equal it, tensor for tensor and object for object.
- ``strided/``: a transposed, a channels_last and an offset-view tensor saved by ``dcp.save``
  (torch 2.15 records their strides in ``.metadata``), ``strided.pt`` the same by torch.save,
  and ``strided.safetensors`` the tensors as saved (contiguous copies), the expected values.
- ``manifest.json``: the torch and Python versions, what was written, what this release
  cannot write and why, and whether this torch loads reshard's own DCP output
  (tests/data/compat/reshard-mesh3, when present) equal to what it was converted from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "data" / "compat"
WORLD = 2
DCP_VARIANTS = ("dcp_default", "dcp_per_item", "dcp_safetensors", "dcp_zstd")
HF_VARIANTS = ("hf_sharded", "hf_consolidated")
# torch.distributed.checkpoint._experimental's synchronous checkpointer: torch.save per rank
EXPERIMENTAL = "experimental_sync"


class Tiny(nn.Module):
    """Dims that 2 ranks split unevenly (11 rows: 6 + 5), and one parameter of a single row,
    so rank 1's shard of it is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 1, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.proj(self.embed(ids)))))


def _writers() -> dict:
    """Each writer this torch release has; a missing one is named in the manifest."""
    from torch.distributed.checkpoint import FileSystemWriter

    out: dict = {"dcp_default": lambda p: FileSystemWriter(p),
                 "dcp_per_item": lambda p: FileSystemWriter(p, single_file_per_rank=False)}
    try:
        from torch.distributed.checkpoint.filesystem import SerializationFormat
        out["dcp_safetensors"] = lambda p: FileSystemWriter(p, serialization_format=SerializationFormat.SAFETENSORS)
    except ImportError as e:
        out["dcp_safetensors"] = e
    try:
        import zstandard  # noqa: F401
        from torch.distributed.checkpoint._extension import ZStandard
        out["dcp_zstd"] = lambda p: FileSystemWriter(p, _extensions=[ZStandard()])
    except ImportError as e:
        out["dcp_zstd"] = e
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        out["hf_sharded"] = lambda p: HuggingFaceStorageWriter(p, save_distributed=True, enable_consolidation=False)
        out["hf_consolidated"] = lambda p: HuggingFaceStorageWriter(p, save_distributed=True, enable_consolidation=True)
    except ImportError as e:
        out["hf_sharded"] = out["hf_consolidated"] = e
    return out


def _refusal(e: BaseException) -> str:
    """One line for a writer's refusal (dcp wraps each rank's exception in a CheckpointException)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))  # (exception, traceback) in recent releases
        e = next((x for x in failure if isinstance(x, BaseException)), e) if isinstance(failure, tuple) else failure
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"torch refused to save it ({type(e).__name__}: {text})"


def _world(rank: int, init: str, out: str, errors: str) -> None:
    try:
        _train_and_save(rank, init, Path(out), Path(errors))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_and_save(rank: int, init: str, out: Path, errors: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = Tiny()
    for sub in (model.embed, model.proj, model.head):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(2):
        ids = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    writers = _writers()
    for name in (*DCP_VARIANTS, *HF_VARIANTS):
        writer = writers[name]
        if isinstance(writer, Exception):
            if rank == 0:
                (errors / name).write_text(f"this torch has no such writer ({type(writer).__name__}: {writer})")
            continue
        try:
            dcp.save(msd if name in HF_VARIANTS else state, storage_writer=writer(str(out / name)))
        except BaseException as e:  # noqa: BLE001 - dcp raises CheckpointException, a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            if rank == 0:
                (errors / name).write_text(_refusal(e))
        dist.barrier()
    try:
        from torch.distributed.checkpoint._experimental.builder import make_sync_checkpointer
    except ImportError as e:
        if rank == 0:
            (errors / EXPERIMENTAL).write_text(f"this torch has no such writer ({type(e).__name__}: {e})")
    else:
        make_sync_checkpointer().save(str(out / EXPERIMENTAL), state)
    dist.barrier()
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": full[0], "optim": full[1]}, out / "full_state_dict.pt")
    dist.barrier()


def _strided(out: Path) -> dict:
    """Tensors whose memory is not row-major, saved without a process group."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    base = torch.arange(60, dtype=torch.float32).reshape(1, 3, 4, 5) / 7
    tensors = {
        "transposed": (torch.arange(8, dtype=torch.float32).reshape(4, 2) * 0.5).t(),  # strides (1, 2)
        "channels_last": base.to(memory_format=torch.channels_last),  # strides (60, 1, 15, 3)
        "offset_view": torch.arange(10, dtype=torch.int32)[2:6],  # a view into a larger storage
        "plain": torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16),
    }
    skipped = {}
    dcp.save(tensors, checkpoint_id=str(out / "strided"), no_dist=True)
    try:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import SerializationFormat
        dcp.save(tensors, storage_writer=FileSystemWriter(str(out / "strided_safetensors"),
                                                          serialization_format=SerializationFormat.SAFETENSORS), no_dist=True)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        shutil.rmtree(out / "strided_safetensors", ignore_errors=True)
        skipped["strided_safetensors"] = _refusal(e)
    torch.save(tensors, out / "strided.pt")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "strided.safetensors"))
    return skipped


def _equal(a: object, b: object, where: str = "") -> str | None:
    """Where ``a`` and ``b`` first differ (tensors bit for bit, dtype and shape too), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor against {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}"
        a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
        same = a.view(torch.uint8).equal(b.view(torch.uint8)) if a.numel() else True
        return None if same else f"{where}: values differ"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(map(str, a)) != set(map(str, b)):
            return f"{where}: keys {sorted(map(str, a))} against {sorted(map(str, b))}"
        bk = {str(k): v for k, v in b.items()}
        for k, v in a.items():
            problem = _equal(v, bk[str(k)], f"{where}.{k}")
            if problem:
                return problem
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            problem = _equal(x, y, f"{where}[{i}]")
            if problem:
                return problem
        return None
    return None if a == b else f"{where}: {a!r} against {b!r}"


def _hf_reads(folder: Path) -> dict:
    """This torch's own reading of HuggingFaceStorageWriter's distributed shards."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load_state_dict_from_keys(storage_reader=HuggingFaceStorageReader(str(folder)))


def _torch_reads(folder: Path, tmp: Path) -> dict:
    """This torch's own reading of a DCP folder (``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{folder.name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=True)


def _experimental_reads(folder: Path, full: dict) -> str | None:
    """The experimental checkpointer's files hold each rank's DTensor shards: their local
    tensors must be the full state dict's rows, in rank order (FSDP2 shards dim 0)."""
    shards = [torch.load(folder / f"checkpoint_{r}.pt", weights_only=False) for r in range(WORLD)]  # our own files
    for section in ("model",):
        for name, want in full[section].items():
            got = torch.cat([s[section][name].to_local() for s in shards])
            problem = _equal(got, want, f"{folder.name}.{section}.{name}")
            if problem:
                return problem
    return None


def _check(out: Path, written: list[str]) -> None:
    """Refuse to keep fixtures that this torch's own readers do not read as the full state dict."""
    from safetensors.torch import load_file

    full = torch.load(out / "full_state_dict.pt", weights_only=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in written:
            if name == "dcp_safetensors":
                continue  # torch writes SerializationFormat.SAFETENSORS but has no reader for it
            if name == EXPERIMENTAL:
                problem = _experimental_reads(out / name, full)
            elif name == "hf_consolidated":
                files = sorted((out / name).glob("*.safetensors"))
                read: dict = {}
                for f in files:
                    read.update(load_file(str(f)))
                problem = _equal(read, full["model"], name)
            elif name == "hf_sharded":
                problem = _equal(_hf_reads(out / name), full["model"], name)
            else:
                problem = _equal(_torch_reads(out / name, Path(tmp)), full, name)
            if problem:
                raise SystemExit(f"torch {torch.__version__}'s own reader disagrees with its full state dict: {problem}")
        strided = _torch_reads(out / "strided", Path(tmp))
        saved = load_file(str(out / "strided.safetensors"))
        problem = _equal(strided, saved, "strided")
        if problem:
            raise SystemExit(f"torch {torch.__version__} does not read back the strided tensors it saved: {problem}")


def folder_digest(folder: Path) -> str:
    """SHA-256 over a folder's files (names and bytes, in name order)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _loads_reshard_output(out_root: Path) -> str:
    """Whether this torch loads reshard's DCP output (reshard-mesh3, converted from the
    2.13.0 fixture's dcp_default by ``reshard convert --to-mesh 3``) equal to its source."""
    folder = out_root / "reshard-mesh3"
    source = out_root / "torch-2.13.0" / "full_state_dict.pt"
    if not folder.is_dir() or not source.is_file():
        return "not checked (tests/data/compat/reshard-mesh3 is not there yet)"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            read = _torch_reads(folder, Path(tmp))
        except Exception as e:  # noqa: BLE001 - recorded, and the test fails on it
            return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    expected = torch.load(source, weights_only=True)
    read.pop("hf", None)  # the config JSON reshard keeps beside the tensors, when there is one
    problem = _equal(read, expected)
    return f"differs: {problem}" if problem else "equal"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the folder that gets torch-<version>/")
    args = ap.parse_args()
    version = torch.__version__.split("+")[0]
    out = args.out / f"torch-{version}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        errors = Path(tmp) / "errors"
        errors.mkdir()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_world, args=(r, f"file://{tmp}/rendezvous", str(out), str(errors))) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)  # a hang guard: two steps of a tiny model take seconds
            if p.exitcode != 0:
                for q in procs:
                    q.kill()
                raise SystemExit(f"rank process exited with {p.exitcode}")
        skipped = {f.name: f.read_text() for f in sorted(errors.iterdir())}
    written = [n for n in (*DCP_VARIANTS, *HF_VARIANTS, EXPERIMENTAL) if n not in skipped]
    skipped.update(_strided(out))
    _check(out, written)
    manifest = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "written": written + ["full_state_dict.pt", "strided", "strided.pt", "strided.safetensors"]
        + (["strided_safetensors"] if "strided_safetensors" not in skipped else []),
        "skipped": skipped,
        "checked": "equal to full_state_dict.pt as this torch reads them: dcp_to_torch_save of each DCP folder but "
                   "dcp_safetensors (torch has no reader for that serialization), HuggingFaceStorageReader of hf_sharded, "
                   "safetensors of hf_consolidated, the model's local shards of experimental_sync in rank order; "
                   "dcp_to_torch_save of strided equals strided.safetensors",
        "loads_reshard_mesh3": _loads_reshard_output(args.out),
    }
    if (args.out / "reshard-mesh3").is_dir():
        manifest["reshard_mesh3_sha256"] = folder_digest(args.out / "reshard-mesh3")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {len(written)} variants, {size // 1024} KiB; skipped: {sorted(skipped) or 'none'}; "
          f"loads reshard-mesh3: {manifest['loads_reshard_mesh3']}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
