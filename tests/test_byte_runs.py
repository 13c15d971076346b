"""The column path for many small pieces (``reshard.pipeline.byte_runs``, ``reshard.pipeline.gather``, the DCP
record locator) against the piece-by-piece path it stands in for.

* Planning, property-style: random tensors (0-3 dims, sizes down to 0, several dtypes) saved
  as by 3 ranks (uneven and empty shards, some cut along dim 1, some stored strided), laid
  out for random meshes (replicas included) by the DCP and safetensors writers, some with a
  cast. Every piece the column path gathers has exactly the byte runs the piece-by-piece path
  would copy, every piece it leaves is one that path could not kernel-copy whole, and the
  engine writes the same bytes either way, in a few writes and reads per file.
* A DCP saved by torch on 3 gloo ranks (a fine-grained MoE's many small tensors): converted
  for several meshes through the column path and through the piece-by-piece path, the same
  bytes, read back by torch's ``dcp.load`` as the tensors saved; records are located in bulk
  as one by one; a record whose archive differs from its kind's is left to the one-by-one
  path, which reads it (padding) or refuses it (its pickle contradicts ``.metadata``).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from reshard.formats.dcp.format import DCPWriter
from reshard.formats.safetensors.format import SafetensorsWriter

from reshard.core import dtypes
from reshard.core.boxes import Box, contiguous_range
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.pieces import Piece
from reshard.core.regions import StoredRegion, as_region, c_strides
from reshard.core.sharding import parse_mesh
from reshard.pipeline import byte_runs, gather
from reshard.pipeline.engine import Engine
from reshard.pipeline.mesh_target import mesh_target
from reshard.pipeline.placements import load_placement_plan
from reshard.pipeline.plan import full_target, make_plan, sources_for
from tests.dist import run_world

_DTYPES = ["float32", "bfloat16", "int64", "uint8"]


def _cut(n: int, ranks: int) -> list[tuple[int, int]]:
    """(start, size) of each rank's shard of ``n``, as torch.chunk / DTensor cut it."""
    step = -(-n // ranks) if n else 0
    return [(min(r * step, n), max(0, min(step, n - r * step))) for r in range(ranks)]


def _random_catalog(root: Path, seed: int, tensors: int = 90, ranks: int = 3) -> Catalog:
    """Tensors saved as by ``ranks`` ranks: each shard's bytes in its rank's file, C order,
    or transposed for some 2-D shards (a strided region)."""
    rng = random.Random(seed)
    files = [root / f"rank{r}.bin" for r in range(ranks)]
    data = [bytearray() for _ in range(ranks)]
    entries = {}
    for i in range(tensors):
        ndim = rng.choice([0, 1, 2, 2, 2, 3])
        shape = tuple(rng.choice([0, 1, 2, 3, 4, 5, 7, 9]) if rng.random() < 0.15 else rng.randint(1, 9) for _ in range(ndim))
        dtype = dtypes.by_name(rng.choice(_DTYPES))
        dim = 1 if ndim >= 2 and rng.random() < 0.2 else 0
        chunks = []
        for r, (start, size) in enumerate(_cut(shape[dim], ranks) if ndim else [(0, 1)]):
            if ndim and not size:
                continue  # an empty shard stores nothing
            offsets = tuple(start if d == dim else 0 for d in range(ndim))
            sizes = tuple(size if d == dim else s for d, s in enumerate(shape))
            n = int(np.prod(sizes)) * dtype.itemsize
            if not n and ndim:
                continue
            strided = ndim == 2 and rng.random() < 0.15
            region = StoredRegion(files[r], len(data[r]), dtype, sizes,
                                  (1, sizes[0]) if strided else None)
            data[r] += rng.randbytes(n)
            chunks.append(Chunk(Box(offsets, sizes), region))
        entries[f"layers.{i}.w"] = TensorEntry(f"layers.{i}.w", shape, dtype, chunks)
    for f, d in zip(files, data):
        f.write_bytes(bytes(d))
    return Catalog(format="test", path=root, tensors=entries)


def _expected_runs(catalog: Catalog, piece: Piece, at: int) -> list[tuple[int, int, Path, int]] | None:
    """The runs the piece-by-piece path copies for ``piece`` at byte ``at`` of its file: each
    source part one stored run and one run of the piece; None when some part is not."""
    entry = catalog.tensors[piece.name]
    if entry.dtype != piece.dtype or piece.nbytes > byte_runs.GATHER_MAX_PIECE:
        return None
    runs = []
    for src in sources_for(entry, piece.box):
        region = as_region(src.chunk.data)
        stored = region.byte_range(src.box.shifted(src.chunk.box.offsets)) if region is not None else None
        dst = contiguous_range(src.box.shifted(piece.box.offsets), piece.box.sizes)
        if stored is None or dst is None:
            return None
        if stored[1]:
            runs.append((at + dst[0] * piece.dtype.itemsize, stored[1], region.path, stored[0]))
    return runs


def _layouts(catalog: Catalog, seed: int) -> list[tuple[str, list]]:
    rng = random.Random(seed)
    out = []
    for mesh in rng.sample(["2", "3", "4", "5", "2x2", "2x3", "3x2"], 3):
        spec = parse_mesh(mesh)
        cast = dtypes.by_name("float16") if rng.random() < 0.3 else None
        target = mesh_target(catalog, spec, load_placement_plan(None, spec), dtype=cast)
        out.append((f"dcp {mesh}{' cast' if cast else ''}", DCPWriter().layout(target)))
    out.append(("safetensors", SafetensorsWriter(catalog.path / "x.safetensors").layout(full_target(catalog))))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_gathered_pieces_copy_what_the_piece_path_copies(seed: int, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "src").mkdir()
    catalog = _random_catalog(tmp_path / "src", seed)
    for label, files in _layouts(catalog, seed):
        monkeypatch.setattr(byte_runs, "GATHER_MIN_PIECES", 1)
        plan = make_plan(catalog, files)
        assert plan.gathered is not None, label
        gathered = 0
        for f in files:
            runs = plan.gathered.files.get(f.relpath)
            done = set(plan.gathered.segments[f.relpath].tolist()) if runs is not None else set()
            expected: set[tuple[int, int, Path, int]] = set()
            literals: set[tuple[int, int]] = set()
            for k, (at, seg) in enumerate(zip(f.offsets(), f.segments)):
                if not isinstance(seg, Piece):
                    assert runs is None or k in done, (label, f.relpath, k)
                    if len(seg):
                        literals.add((at, len(seg)))
                    continue
                want = _expected_runs(catalog, seg, at)
                assert (want is not None) == (k in done), (label, seg)
                if want is not None:
                    expected.update(want)
                    gathered += 1
            if runs is None:
                continue
            real = runs.length > 0
            stored = runs.src >= 0
            got = {(d, n, plan.gathered.paths[s], o) for d, n, s, o in
                   zip(*(a[real & stored].tolist() for a in (runs.dst, runs.length, runs.src, runs.src_off)))}
            assert got == expected, label
            assert set(zip(runs.dst[real & ~stored].tolist(), runs.length[real & ~stored].tolist())) == literals, label
            for d, n, o in zip(*(a[real & ~stored].tolist() for a in (runs.dst, runs.length, runs.src_off))):
                assert bytes(plan.gathered.pool[o:o + n]) == _literal_at(f, d), label
        assert gathered, label
        _same_bytes_either_way(catalog, files, plan, tmp_path / label.replace(" ", "_"), monkeypatch)


def _literal_at(f, at: int) -> bytes:
    for off, seg in zip(f.offsets(), f.segments):
        if off == at and not isinstance(seg, Piece) and len(seg):
            return seg
    raise AssertionError(f"no literal at {at}")


def _same_bytes_either_way(catalog: Catalog, files: list, plan, out: Path, monkeypatch) -> None:
    """The engine writes the gathered plan, and the plan made without gathering, byte for
    byte alike; each gathered file in a few writes and reads, not one per piece; a rank's
    subset (torchrun) writes its files alike too."""
    writes, reads = [], []
    real_window, real_read = gather.assemble_window, gather.read_into

    def one_write(*args):  # type: ignore[no-untyped-def]  # each window is assembled for one write
        at, data = real_window(*args)
        writes.append(at)
        return at, data

    monkeypatch.setattr(gather, "assemble_window", one_write)
    monkeypatch.setattr(gather, "read_into", lambda fd, view, at, path: reads.append(at) or real_read(fd, view, at, path))
    def run(plan, where: str) -> None:
        (out / where).mkdir(parents=True)
        is_dir = bool(plan.files[0].relpath)  # a safetensors file is its own relpath ""
        Engine(1 << 20, workers=2, progress=False).run(plan, out / where / ("" if is_dir else "file"), is_dir)

    def read(where: str, relpath: str) -> bytes:
        return (out / where / (relpath or "file")).read_bytes()

    run(plan, "gathered")
    monkeypatch.undo()
    # One write per stretch of a file between pieces left to the piece path, one read per
    # source file for it: never one per gathered piece.
    stretches = len(plan.gathered.files) + sum(1 for f, _, _ in plan.pieces(gathered=False) if f.relpath in plan.gathered.files)
    assert len(writes) <= stretches and len(reads) <= 3 * stretches, (len(writes), len(reads), stretches)
    assert len(writes) < sum(len(s) for s in plan.gathered.segments.values()), "not one write per segment"
    monkeypatch.setattr(byte_runs, "GATHER_MIN_PIECES", 10**9)
    plain = make_plan(catalog, files)
    assert plain.gathered is None
    run(plain, "plain")
    for f in files:
        assert read("gathered", f.relpath) == read("plain", f.relpath), f.relpath
    monkeypatch.setattr(byte_runs, "GATHER_MIN_PIECES", 1)
    share = make_plan(catalog, files).subset(list(range(0, len(files), 2)))
    run(share, "share")
    for f in share.files:
        assert read("share", f.relpath) == read("plain", f.relpath), f.relpath


def test_strided_region_is_not_located(tmp_path: Path) -> None:
    """A chunk stored transposed is no run of its file: located as -1, left to the slab path."""
    f32 = dtypes.by_name("float32")
    (tmp_path / "a.bin").write_bytes(bytes(48))
    plain = TensorEntry("a", (2, 3), f32, [Chunk(Box((0, 0), (2, 3)), StoredRegion(tmp_path / "a.bin", 0, f32, (2, 3)))])
    strided = TensorEntry("b", (2, 3), f32, [Chunk(Box((0, 0), (2, 3)), StoredRegion(tmp_path / "a.bin", 24, f32, (2, 3),
                                                                                      c_strides((3, 2))[::-1]))])
    found = byte_runs.locate_chunks([plain, strided])
    assert found.file.tolist() == [0, -1] and found.start[0] == 0 and found.paths == [tmp_path / "a.bin"]


# ---------------------------------------------------------------- a DCP saved by torch, 3 ranks

def _moe_state() -> dict:
    """A fine-grained MoE's small tensors (experts' projections and their AdamW moments):
    uneven rows over 3 ranks, rows fewer than ranks (empty shards), a column-sharded tensor,
    bf16 beside fp32, a replicated scalar."""
    import torch

    g = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    out = {}
    for layer in range(2):
        for e in range(12):
            for w in ("w1", "w2"):
                shape = (rng.choice([1, 2, 4, 5, 8]), rng.choice([3, 4]))
                dtype = torch.bfloat16 if e % 5 == 0 else torch.float32
                fqn = f"layers.{layer}.experts.{e}.{w}.weight"
                out[f"model.{fqn}"] = (torch.randn(shape, generator=g).to(dtype), 0)
                for moment in ("exp_avg", "exp_avg_sq"):
                    out[f"optim.state.{fqn}.{moment}"] = (torch.randn(shape, generator=g).to(dtype), 0)
    out["model.router.weight"] = (torch.randn(7, 6, generator=g), 1)
    out["optim.state.step"] = (torch.tensor(3.0), None)
    return out


def _save_moe(rank: int, world_size: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {name: distribute_tensor(t, mesh, [Replicate() if dim is None else Shard(dim)])
             for name, (t, dim) in _moe_state().items()}
    dcp.save(state, checkpoint_id=root)


@pytest.fixture(scope="module")
def moe_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moe") / "ckpt"
    run_world(_save_moe, 3, str(root))
    return root


def _torch_load(path: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {name: torch.empty_like(t) for name, (t, _) in _moe_state().items()}
    dcp.load(state, checkpoint_id=path)
    return state


def test_many_small_tensors_convert_alike_either_way(moe_dcp: Path, tmp_path: Path, monkeypatch) -> None:
    import torch

    import reshard

    saved = {name: t for name, (t, _) in _moe_state().items()}
    for mesh in ("4", "2x2", "3"):
        gathered = reshard.convert(moe_dcp, tmp_path / f"g{mesh}", to_mesh=mesh, quiet=True)
        with monkeypatch.context() as m:
            m.setattr(byte_runs, "GATHER_MIN_PIECES", 10**9)
            plain = reshard.convert(moe_dcp, tmp_path / f"p{mesh}", to_mesh=mesh, quiet=True)
        assert plain.kernel_bytes > 0 and gathered.kernel_bytes == 0, mesh  # the paths taken differ...
        names = sorted(p.name for p in (tmp_path / f"p{mesh}").iterdir())
        assert names == sorted(p.name for p in (tmp_path / f"g{mesh}").iterdir())
        for name in names:  # ...their bytes do not
            assert (tmp_path / f"g{mesh}" / name).read_bytes() == (tmp_path / f"p{mesh}" / name).read_bytes(), (mesh, name)
        loaded = _torch_load(tmp_path / f"g{mesh}")
        for name, t in saved.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), (mesh, name)


def test_records_are_located_in_bulk_as_one_by_one(moe_dcp: Path, tmp_path: Path) -> None:
    from reshard.formats.dcp.format import DCPFormat
    from reshard.formats.dcp.index import load_dcp_index

    import reshard
    from reshard.core.errors import CorruptCheckpointError

    catalog = DCPFormat().read(moe_dcp)
    entries = list(catalog.tensors.values())
    found = byte_runs.locate_chunks(entries)
    one_by_one = [(r.path, r.offset) for e in DCPFormat().read(moe_dcp).tensors.values()
                  for c in e.chunks if (r := as_region(c.data)) is not None]
    assert (found.file >= 0).all() and len(one_by_one) == len(found.file)
    assert [(found.paths[f], s) for f, s in zip(found.file.tolist(), found.start.tolist())] == one_by_one

    # A record is taken from its kind's pattern only where it equals it outside payload, CRCs
    # and serialization id. A pickle that says another shape (second of its kind) differs: it
    # is read on its own and refused, as before, naming the file. A pattern that matches
    # nothing else (a padding byte changed, first of its kind) is followed by the next one.
    import torch

    index = load_dcp_index(moe_dcp)
    for tampered, refused in ((entries[0].name, False), (entries[1].name, True)):
        ckpt = tmp_path / ("shape" if refused else "padding") / "ckpt"
        shutil.copytree(moe_dcp, ckpt)
        table = index.table(tampered)
        path, at, n = ckpt / index.files[int(table.file[0])], int(table.start[0]), int(table.length[0])
        record = bytearray(path.read_bytes()[at:at + n])
        rows, cols = (int(x) for x in table.sizes[0])
        old = bytes([ord("K"), rows, ord("K"), cols, 0x86]) if refused else b"ZZZZ"
        new = bytes([ord("K"), rows, ord("K"), cols - 1, 0x86]) if refused else b"ZZZY"
        record[record.index(old):record.index(old) + len(old)] = new
        with open(path, "r+b") as fh:
            fh.seek(at)
            fh.write(record)
        tampered_entries = list(DCPFormat().read(ckpt).tensors.values())
        found = byte_runs.locate_chunks(tampered_entries)
        chunk_names = [e.name for e in tampered_entries for _ in range(e.chunk_count)]
        assert [x for x, f in zip(chunk_names, found.file.tolist()) if f < 0] == ([tampered] if refused else []), refused
        out = tmp_path / f"out_{refused}"
        if refused:
            with pytest.raises(CorruptCheckpointError, match=f"{path.name}.*metadata says"):
                reshard.convert(ckpt, out, to_mesh="4", quiet=True)
        else:
            reshard.convert(ckpt, out, to_mesh="4", quiet=True)
            loaded = _torch_load(out)
            assert all(torch.equal(loaded[k], t) for k, (t, _) in _moe_state().items())


def test_large_records_are_located_from_their_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of megabytes are located in bulk too, reading only their zip headers, pickle
    and trailer (not their payload); one whose pickle says another shape is refused as before."""
    import torch
    import torch.distributed.checkpoint as dcp
    from reshard.formats.dcp import locate
    from reshard.formats.dcp.format import DCPFormat

    import reshard
    from reshard.core.errors import CorruptCheckpointError

    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(200, 100, generator=g), "b": torch.randn(200, 100, generator=g),
             "c": torch.randn(50, 40, generator=g).bfloat16(), "d": torch.randn(600, 100, generator=g)}
    ckpt = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    asked = []
    real = locate.read_into

    def counted(fd, view, offset, path):  # type: ignore[no-untyped-def]
        asked.append(view.nbytes)
        return real(fd, view, offset, path)

    monkeypatch.setattr(locate, "read_into", counted)
    found = byte_runs.locate_chunks(list(DCPFormat().read(ckpt).tensors.values()))
    one_by_one = [(r.path, r.offset) for e in DCPFormat().read(ckpt).tensors.values()
                  for c in e.chunks if (r := as_region(c.data)) is not None]
    assert (found.file >= 0).all()
    assert [(found.paths[f], s) for f, s in zip(found.file.tolist(), found.start.tolist())] == one_by_one
    assert 0 < sum(asked) < 16 << 10  # "b" against "a"'s pattern: headers and trailer, not 80 KB of payload

    path = next(ckpt.glob("*.distcp"))
    data = bytearray(path.read_bytes())
    first = data.index(bytes([ord("K"), 200, ord("K"), 100, 0x86]))
    second = data.index(bytes([ord("K"), 200, ord("K"), 100, 0x86]), first + 1)  # "b"'s pickle
    data[second + 3] = 99
    path.write_bytes(bytes(data))
    entries = list(DCPFormat().read(ckpt).tensors.values())
    found = byte_runs.locate_chunks(entries)
    assert [e.name for e, f in zip(entries, found.file.tolist()) if f < 0] == ["b"]
    with pytest.raises(CorruptCheckpointError, match=f"{path.name}.*metadata says"):
        reshard.convert(ckpt, tmp_path / "out", to_mesh="2", quiet=True)
