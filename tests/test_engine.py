from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.pieces import OutputFile, Piece
from reshard.core.regions import StoredRegion
from reshard.pipeline.engine import Engine
from reshard.pipeline.plan import full_target, make_plan
from tests.dist import HANG_GUARD


def _sharded_catalog(tmp_path: Path, t: torch.Tensor, rows: list[int], name: str = "w") -> Catalog:
    """``t`` stored as dim-0 shards of ``rows`` rows, each in its own file after a header."""
    cat = Catalog("test", tmp_path)
    entry = TensorEntry(name, tuple(t.shape), t.dtype)
    start = 0
    for i, n in enumerate(rows):
        p = tmp_path / f"shard{i}.bin"
        p.write_bytes(b"H" * 7 + t[start : start + n].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        box = Box((start,) + (0,) * (t.dim() - 1), (n,) + tuple(t.shape[1:]))
        entry.chunks.append(Chunk(box, StoredRegion(p, 7, t.dtype, box.sizes)))
        start += n
    cat.tensors[name] = entry
    return cat


def _run(cat: Catalog, pieces: list[Piece], out: Path, budget: int, workers: int = 2):
    files = [OutputFile("f.bin", [b"HEADER", *pieces, b"TAIL"])]
    plan = make_plan(cat, files)
    stats = Engine(budget, workers=workers, progress=False).run(plan, out, True)
    data = (out / "f.bin").read_bytes()
    assert data.startswith(b"HEADER") and data.endswith(b"TAIL")
    return stats, data[6:-4]


def test_contiguous_shards_move_by_kernel_copy(tmp_path: Path) -> None:
    t = torch.randn(11, 6)
    cat = _sharded_catalog(tmp_path, t, [4, 4, 3])
    (tmp_path / "out").mkdir()
    stats, body = _run(cat, [Piece("w", full_box(t.shape), t.dtype)], tmp_path / "out", 1 << 20)
    assert body == t.numpy().tobytes()
    assert stats.kernel_bytes == t.numel() * 4 and stats.buffered_bytes == 0


def test_tensor_larger_than_budget_moves_in_slabs_with_cast(tmp_path: Path) -> None:
    t = torch.randn(64, 33)
    cat = _sharded_catalog(tmp_path, t, [30, 30, 4])
    target = full_target(cat, dtype=torch.bfloat16)
    (tmp_path / "out").mkdir()
    tt = target.tensors["w"]
    budget = 1024  # far below the 8 KiB tensor: forces many slabs
    stats, body = _run(cat, [Piece("w", tt.boxes[0], tt.dtype)], tmp_path / "out", budget)
    assert body == t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert stats.kernel_bytes == 0 and stats.buffered_bytes == t.numel() * 2


def test_column_pieces_gather_across_shards(tmp_path: Path) -> None:
    """A target box cutting across stored chunks (a TP-style column slice) is assembled."""
    t = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)
    cat = _sharded_catalog(tmp_path, t, [3, 3, 1])
    (tmp_path / "out").mkdir()
    pieces = [Piece("w", Box((0, 0), (7, 4)), t.dtype), Piece("w", Box((2, 4), (5, 6)), t.dtype)]
    _, body = _run(cat, pieces, tmp_path / "out", 64, workers=1)
    expected = t[:, :4].contiguous().numpy().tobytes() + t[2:, 4:].contiguous().numpy().tobytes()
    assert body == expected


def test_digests_are_taken_as_each_file_is_finished(tmp_path: Path) -> None:
    """digests=True: every file of a directory output, pieces and literal-only files alike,
    hashed by the engine; the same bytes as a run without digests."""
    import hashlib

    t = torch.randn(40, 5)
    cat = _sharded_catalog(tmp_path, t, [13, 13, 14])
    rows = [Box((0, 0), (20, 5)), Box((20, 0), (20, 5))]
    files = [OutputFile("a.bin", [b"A", Piece("w", rows[0], t.dtype)]), OutputFile("meta.txt", [b"only literals"]),
             OutputFile("sub/b.bin", [Piece("w", rows[1], t.dtype), b"B"])]
    plain, hashed = tmp_path / "plain", tmp_path / "hashed"
    plain.mkdir(), hashed.mkdir()
    Engine(1 << 20, workers=2, progress=False).run(make_plan(cat, files), plain, True)
    stats = Engine(1 << 20, workers=2, progress=False).run(make_plan(cat, files), hashed, True, digests=True)
    assert sorted(stats.digests) == ["a.bin", "meta.txt", "sub/b.bin"]
    for rel, d in stats.digests.items():
        data = (hashed / rel).read_bytes()
        assert data == (plain / rel).read_bytes()
        assert (d.size, d.sha256) == (len(data), hashlib.sha256(data).hexdigest())


def test_more_files_than_the_open_file_limit(tmp_path: Path) -> None:
    """Writing 120 files and reading them back, in a process allowed 64 open files: the
    engine opens files as it needs them and closes idle ones, never all at once."""
    import subprocess
    import sys

    torch.save({"w": torch.arange(240 * 3, dtype=torch.float32).reshape(240, 3)}, tmp_path / "in.pt")
    script = (
        "import resource, sys, torch, reshard\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "src, mid, out = sys.argv[1:]\n"
        "reshard.convert(src, mid, to_mesh='120', quiet=True)\n"
        "reshard.convert(mid, out, quiet=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "mid"),
                           str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((tmp_path / "mid").glob("*.distcp"))) == 120
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.load(tmp_path / "in.pt")["w"])


def test_fd_pool_closes_idle_files_only() -> None:
    import os
    import tempfile

    from reshard.core.fd_pool import FdPool

    with tempfile.TemporaryDirectory() as d:
        paths = [Path(d) / f"f{i}" for i in range(5)]
        for p in paths:
            p.write_bytes(b"x")
        pool = FdPool(os.O_RDONLY, limit=2)
        with pool.use(paths[0]) as busy:
            for p in paths[1:]:
                with pool.use(p) as fd:
                    assert os.pread(fd, 1, 0) == b"x"
            assert os.pread(busy, 1, 0) == b"x"  # still open: in use while others came and went
            assert pool.open_count <= 2
        pool.close()
        assert pool.open_count == 0


def test_fd_pool_lends_its_descriptors_to_readers_of_its_threads_only(tmp_path: Path) -> None:
    """Inside ``lending``, ``storage.open_read`` of a local file gives the pool's descriptor
    and ``storage.close`` gives it back (still open, for the next reader and the copies);
    another thread, or this one afterwards, opens and closes its own."""
    import os
    import threading

    from reshard.core.fd_pool import FdPool
    from reshard.core.storage import close, open_read

    path = tmp_path / "f"
    path.write_bytes(b"xyz")
    pool = FdPool(os.O_RDONLY)
    with pool.use(path) as fd:
        with pool.lending():
            lent = open_read(path)
            other: list[int] = []
            thread = threading.Thread(target=lambda: other.append(open_read(path)))
            thread.start()
            thread.join()
            close(lent)
        assert lent == fd and other[0] != fd
        close(other[0])
        assert os.pread(fd, 3, 0) == b"xyz" and pool.open_count == 1  # given back, not closed
    own = open_read(path)
    assert own != fd
    close(own)
    pool.close()


def test_slabs_are_read_into_each_workers_reused_buffer(tmp_path: Path, monkeypatch) -> None:
    """Stored runs land in the worker's scratch buffer, not in fresh memory per slab (fresh
    pages are faulted in and zeroed by the kernel each time): slabs that cross shard
    boundaries, column pieces of one tensor, and pieces of several sizes in one run (the
    buffer grows) are all exact without one fresh-buffer read."""
    import reshard.core.regions as regions

    fresh: list[int] = []
    real_read = regions._read_array
    monkeypatch.setattr(regions, "_read_array", lambda fd, n, off, path: fresh.append(n) or real_read(fd, n, off, path))
    t = torch.randn(37, 101)
    cat = _sharded_catalog(tmp_path, t, [13, 13, 11])
    files = [OutputFile(f"c{i}.bin", [Piece("w", Box((0, c), (37, n)), torch.float32)])
             for i, (c, n) in enumerate([(0, 50), (50, 51)])]
    files += [OutputFile("rows.bin", [Piece("w", Box((2, 0), (30, 101)), torch.float32),
                                      Piece("w", Box((12, 0), (2, 101)), torch.float32)])]
    out = tmp_path / "out"
    out.mkdir()
    engine = Engine(24 << 10, workers=2, progress=False)
    engine._kernel_plan = lambda piece, sources: None  # the slab path, not the kernel copy, for the row pieces
    engine.run(make_plan(cat, files), out, True)
    assert (out / "c0.bin").read_bytes() == t[:, :50].contiguous().numpy().tobytes()
    assert (out / "c1.bin").read_bytes() == t[:, 50:].contiguous().numpy().tobytes()
    assert (out / "rows.bin").read_bytes() == t[2:32].numpy().tobytes() + t[12:14].numpy().tobytes()
    assert fresh == []


def test_a_cast_reads_its_source_in_small_bands(tmp_path: Path, monkeypatch) -> None:
    """A cast slab is read a band at a time (reads stay below the mmap threshold, so they
    reuse heap memory instead of fresh pages) and is exact whether bands cut rows or not."""
    import reshard.core.regions as regions
    import reshard.pipeline.assemble as assemble_module

    reads: list[int] = []
    real_read = regions._read_into
    monkeypatch.setattr(regions, "_read_into", lambda fd, view, off, path: reads.append(view.nbytes) or real_read(fd, view, off,
                                                                                                                  path))
    t = torch.randn(23, 17)
    cat = _sharded_catalog(tmp_path, t, [23])
    for band in (40, 200, 1 << 20):  # part of a row, a few rows, the whole slab
        monkeypatch.setattr(assemble_module, "_CAST_BAND_BYTES", band)
        reads.clear()
        out = tmp_path / f"out{band}"
        out.mkdir()
        _, body = _run(cat, [Piece("w", Box((0, 0), (23, 17)), torch.bfloat16)], out, 1 << 20)
        assert body == t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes(), band
        assert max(reads) <= max(band, 4) and sum(reads) == t.numel() * 4, band


def test_column_shards_of_one_tensor_read_their_rows_once(tmp_path: Path, monkeypatch) -> None:
    """Column pieces that share their rows, in several files (a Shard(1) target: uneven, with
    an empty shard) or twice in one, are written exactly, with and without a cast, while each
    stored byte is read about once: alone, every piece would read whole rows for its columns."""
    import reshard.core.regions as regions

    read: list[int] = []
    real_read = regions._read_into
    monkeypatch.setattr(regions, "_read_into", lambda fd, view, off, path: read.append(view.nbytes) or real_read(fd, view, off,
                                                                                                                 path))
    t = torch.randn(37, 101)
    cat = _sharded_catalog(tmp_path, t, [13, 13, 11])
    for dtype in (torch.float32, torch.bfloat16):
        cols = [(0, 34), (34, 34), (68, 33), (101, 0)]
        files = [OutputFile(f"r{i}.bin", [b"H", Piece("w", Box((0, c), (37, n)), dtype), b"T"]) for i, (c, n) in enumerate(cols)]
        files.append(OutputFile("twice.bin", [Piece("w", Box((5, 10), (20, 30)), dtype)] * 2))
        files.append(OutputFile("rows.bin", [Piece("w", Box((5, 40), (20, 61)), dtype)]))
        out = tmp_path / f"out_{dtype}"
        out.mkdir()
        read.clear()
        Engine(16 << 10, workers=2, progress=False).run(make_plan(cat, files), out, True)  # slabs of a few rows
        expect = t.to(dtype)
        for i, (c, n) in enumerate(cols):
            body = (out / f"r{i}.bin").read_bytes()
            assert body == b"H" + expect[:, c:c + n].contiguous().view(torch.uint8).numpy().tobytes() + b"T", (dtype, i)
        assert (out / "twice.bin").read_bytes() == expect[5:25, 10:40].contiguous().view(torch.uint8).numpy().tobytes() * 2
        assert (out / "rows.bin").read_bytes() == expect[5:25, 40:].contiguous().view(torch.uint8).numpy().tobytes()
        # Every row once for the four column shards, rows 5-24 once more for the other two files:
        # about 1.5x the tensor; piece by piece it would be about 4.5x.
        assert sum(read) <= 1.6 * t.numel() * 4, (dtype, sum(read) / (t.numel() * 4))


@pytest.mark.parametrize("way", ["kernel", "buffer"])
def test_adjacent_runs_are_one_copy(tmp_path: Path, monkeypatch, way: str) -> None:
    """Runs that follow each other both in their source file and in the output (two chunks of a
    tensor stored back to back, two tensors likewise) are one copy_file_range, or one read into
    a worker's buffer; a run after a gap in either file is a copy (a read) of its own. Through
    the buffer, runs that fill the output without a gap are one write."""
    import reshard.pipeline.engine as engine
    import reshard.pipeline.sinks as sinks

    copies: list[int] = []
    reads: list[int] = []
    writes: list[tuple[int, int]] = []
    real_copy, real_read, real_write = engine._kernel_copy, engine.read_into, sinks._LocalFile.write_at
    monkeypatch.setattr(engine, "_kernel_copy", lambda s, so, d, do, n, p: copies.append(n) or real_copy(s, so, d, do, n, p))
    monkeypatch.setattr(engine, "read_into", lambda fd, view, off, p: reads.append(len(view)) or real_read(fd, view, off, p))
    monkeypatch.setattr(sinks._LocalFile, "write_at",
                        lambda f, off, data: writes.append((off, len(data))) or real_write(f, off, data))
    if way == "kernel":  # no room in the budget for a buffer: every run is a kernel copy
        monkeypatch.setattr(engine, "_RUN_BUFFER_MIN", 1 << 40)
    a, b = torch.randn(6, 4), torch.randn(3, 4)
    src = tmp_path / "src.bin"
    src.write_bytes(b"HDR" + a.numpy().tobytes() + b.numpy().tobytes() + b"GAP" + b.numpy().tobytes())
    cat = Catalog("test", tmp_path)
    for name, t, chunks in (("a", a, [(0, 3, 3), (3, 3, 3 + 48)]), ("b", b, [(0, 3, 3 + 96)]),
                            ("c", b, [(0, 3, 3 + 96 + 48 + 3)])):
        entry = TensorEntry(name, tuple(t.shape), t.dtype)
        for row, rows, at in chunks:
            box = Box((row, 0), (rows, 4))
            entry.chunks.append(Chunk(box, StoredRegion(src, at, t.dtype, box.sizes)))
        cat.tensors[name] = entry
    pieces = [Piece(n, full_box(tuple(cat.tensors[n].shape)), torch.float32) for n in ("a", "b", "c")]
    out = tmp_path / "out"
    out.mkdir()
    stats = Engine(1 << 20, workers=2, progress=False).run(make_plan(cat, [OutputFile("f.bin", [b"H", *pieces])]), out, True)
    assert (out / "f.bin").read_bytes() == b"H" + a.numpy().tobytes() + b.numpy().tobytes() * 2
    assert stats.kernel_bytes == 192 and stats.buffered_bytes == 0
    if way == "kernel":
        assert sorted(copies) == [48, 144] and stats.run_buffer_bytes == 0  # a and b in one copy; c after the gap
    else:
        assert copies == [] and sorted(reads) == [48, 144] and stats.run_buffer_bytes == 192
        assert writes == [(0, 1), (1, 192)]  # the literal, then the three tensors in one write


def test_copy_steps_gather_runs_into_buffers_and_leave_aligned_ones_to_the_kernel() -> None:
    """How a file's runs are cut: misaligned runs gathered into buffers (a long one split across
    two), a write per stretch without a gap; a large run page-aligned in both files alone, for
    the kernel."""
    from reshard.pipeline.engine import _KERNEL_MIN, _Buffered, _copy_steps

    a, b = Path("a"), Path("b")
    big = _KERNEL_MIN
    runs = [(a, 3, 100, 50), (b, 7, 150, 30), (a, 900, 200, 120),  # 100..180 without a gap, then 200..320
            (b, 4096, 8192, big),  # aligned and large: the kernel's
            (a, 5, 8192 + big, 10)]
    steps = list(_copy_steps(runs, 100))
    assert steps == [
        _Buffered([(a, 3, 0, 50), (b, 7, 50, 30), (a, 900, 80, 20)], [(100, 0, 80), (200, 80, 20)], 100),
        _Buffered([(a, 920, 0, 100)], [(220, 0, 100)], 100),
        (b, 4096, 8192, big),
        _Buffered([(a, 5, 0, 10)], [(8192 + big, 0, 10)], 10),
    ]
    assert list(_copy_steps(runs, 0)) == runs  # no buffer: every run a kernel copy
    assert list(_copy_steps([(b, 4096, 8192, big - 1)], 1 << 20))[0] == _Buffered([(b, 4096, 0, big - 1)],
                                                                                [(8192, 0, big - 1)], big - 1)


def test_run_buffer_is_within_each_workers_share_of_the_budget(tmp_path: Path, monkeypatch) -> None:
    """A worker's buffer for stored runs is its scratch, at most its share of ``max_memory``;
    with too small a share there is none and the kernel copies every run."""
    import reshard.pipeline.engine as engine

    taken: list[int] = []
    real_take = engine._Scratch.take
    monkeypatch.setattr(engine._Scratch, "take", lambda self, n: taken.append(n) or real_take(self, n))
    t = torch.randn(300, 256)  # 300 KiB in 3 shards, every offset 7 bytes past a page
    cat = _sharded_catalog(tmp_path, t, [100, 100, 100])
    for budget, workers in ((1 << 20, 2), (1 << 20, 4), (64 << 10, 2)):
        out = tmp_path / f"out{budget}-{workers}"
        out.mkdir()
        taken.clear()
        stats = Engine(budget, workers=workers, progress=False).run(
            make_plan(cat, [OutputFile("f.bin", [b"HEADER", Piece("w", full_box(t.shape), t.dtype), b"TAIL"])]), out, True)
        assert (out / "f.bin").read_bytes() == b"HEADER" + t.numpy().tobytes() + b"TAIL"
        assert stats.kernel_bytes == t.numel() * 4
        assert max(taken, default=0) <= budget // workers, (budget, workers, taken)
        assert stats.run_buffer_bytes == (t.numel() * 4 if budget // workers >= engine._RUN_BUFFER_MIN else 0)


def test_files_are_not_reopened_per_record_and_one_worker_writes_a_file(tmp_path: Path, monkeypatch) -> None:
    """A DCP folder of many records into one file: the data file is opened once for the whole
    conversion, planning and copying alike (convert's read descriptors, which the
    engine copies through), however many records are located in it (each is its own torch.save
    archive, whose headers a reader opens the file to parse), the output once; and no two workers
    write or copy into the output at once (they would only queue on its inode lock, the second
    one spinning in the kernel), whichever way its runs go."""
    import os
    import threading

    import torch.distributed.checkpoint as dcp

    import reshard
    import reshard.pipeline.engine as engine
    import reshard.pipeline.sinks as sinks

    state = {f"layer{i}.w": torch.randn(16, 8) for i in range(12)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k))
    busy: dict[int, int] = {}
    most = [0]
    lock = threading.Lock()

    def alone(dst_fd: int, write):  # type: ignore[no-untyped-def]
        with lock:
            busy[dst_fd] = busy.get(dst_fd, 0) + 1
            most[0] = max(most[0], busy[dst_fd])
        try:
            threading.Event().wait(0.002)  # long enough for another worker to come in
            return write()
        finally:
            with lock:
                busy[dst_fd] -= 1

    real_copy, real_write = engine._kernel_copy, sinks._LocalFile.write_at
    copied: list[int] = []
    monkeypatch.setattr(engine, "_kernel_copy", lambda src_fd, src_off, dst_fd, dst_off, n, path: copied.append(n) or alone(
        dst_fd, lambda: real_copy(src_fd, src_off, dst_fd, dst_off, n, path)))
    monkeypatch.setattr(sinks._LocalFile, "write_at", lambda f, off, data: alone(f.fd, lambda: real_write(f, off, data)))
    monkeypatch.setattr(engine, "_KERNEL_BATCH", 1)  # a job per piece: four workers have all the chance to collide
    for way in ("buffer", "kernel"):
        if way == "kernel":  # no room for a buffer: every run a kernel copy
            monkeypatch.setattr(engine, "_RUN_BUFFER_MIN", 1 << 40)
        opened.clear()
        copied.clear()
        most[0] = 0
        out = tmp_path / f"{way}.safetensors"
        result = reshard.convert(tmp_path / "ckpt", out, workers=4, quiet=True)
        assert result.kernel_bytes == 12 * 16 * 8 * 4 and most[0] == 1, way
        assert sum(copied) == (result.kernel_bytes if way == "kernel" else 0), way
        data = [p for p in opened if p.endswith(".distcp")]
        assert data == [str(tmp_path / "ckpt" / "__0_0.distcp")], data  # (.metadata is read whole, by Path.read_bytes)
        made = [p for p in opened if f".{way}.safetensors.reshard-tmp" in p]
        assert len(made) == 1, made
        from safetensors.torch import load_file

        assert all(torch.equal(load_file(out)[n], t) for n, t in state.items())
