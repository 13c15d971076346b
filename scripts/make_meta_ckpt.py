#!/usr/bin/env python
"""Make a metadata-only DCP checkpoint with Llama-3-405B shapes, saved by any number of ranks.

What a 512- or 2048-rank FSDP job's checkpoint looks like to a reader that plans: the real
``.metadata`` (the pickle torch's ``FileSystemWriter`` writes, with every chunk of every rank)
and one ``__R_0.distcp`` per rank of the right size, created sparse (``truncate``), so the
disk holds almost nothing. Planning, ``inspect`` and ``inspect --to-mesh`` see the real
layout; reading tensor bytes fails (each file's first record starts with a zip signature, as
a reader checks one record per file to tell torch.save records from safetensors blobs; the
rest is zeros).

Shapes: Llama-3-405B (126 layers, dim 16384, 128 heads / 8 kv heads, ffn 53248, vocab
128256): 1137 bf16 parameters plus AdamW's float32 ``exp_avg`` and ``exp_avg_sq`` of each,
3411 tensors, every one ``Shard(0)`` over the ranks (torch.chunk semantics: the vocab's
128256 rows leave the last rank empty from 512 ranks up, wk/wv's 1024 rows half the ranks at
2048; an empty piece still gets a record of its own, as torch writes one). Names follow
torchtitan's layout (``model.``, ``optimizer.state.<fqn>.<key>``).

The pickle is written as a stream of opcodes, object by object, never as one object tree:
at 2048 ranks the checkpoint has 7 million chunks, and building torch's ``Metadata`` objects
for them in Python would need more memory than a CI machine has. ``--check`` builds the same
checkpoint for a small rank count both ways and compares torch's own reading of the two.

A finished checkpoint is cached like ``make_bench_ckpt``'s: ``<out>.marker.json`` beside the
folder records the request, a later call with the same request reuses it, and the folder is
written under a temporary name and renamed into place.

    python scripts/make_meta_ckpt.py --ranks 256           # .bench/meta_256
"""

from __future__ import annotations

import argparse
import io
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_bench_ckpt import cached_build, generate, generator_args  # noqa: E402

__all__ = ["parameters", "tensors", "shards", "chunk_count", "make", "ensure_meta_checkpoint", "default_meta_path"]

REPO = Path(__file__).resolve().parent.parent
GENERATOR_VERSION = 2  # bump when the layout changes: invalidates caches (2: empty pieces have records)
DIM, N_LAYERS, N_HEADS, N_KV, FFN, VOCAB = 16384, 126, 128, 8, 53248, 128256
HEAD = DIM // N_HEADS
EMPTY_RECORD_BYTES = 1513  # len(torch.save(torch.empty(0, 16384, dtype=torch.bfloat16)))


def parameters(n_layers: int = N_LAYERS) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, shape) of every parameter, in the model's order."""
    out = [("tok_embeddings.weight", (VOCAB, DIM))]
    for i in range(n_layers):
        out += [
            (f"layers.{i}.attention.wq.weight", (N_HEADS * HEAD, DIM)),
            (f"layers.{i}.attention.wk.weight", (N_KV * HEAD, DIM)),
            (f"layers.{i}.attention.wv.weight", (N_KV * HEAD, DIM)),
            (f"layers.{i}.attention.wo.weight", (DIM, N_HEADS * HEAD)),
            (f"layers.{i}.feed_forward.w1.weight", (FFN, DIM)),
            (f"layers.{i}.feed_forward.w2.weight", (DIM, FFN)),
            (f"layers.{i}.feed_forward.w3.weight", (FFN, DIM)),
            (f"layers.{i}.attention_norm.weight", (DIM,)),
            (f"layers.{i}.ffn_norm.weight", (DIM,)),
        ]
    return out + [("norm.weight", (DIM,)), ("output.weight", (VOCAB, DIM))]


def tensors(n_layers: int = N_LAYERS) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, torch dtype name, itemsize): parameters (bf16) and both moments (fp32)."""
    out = []
    for fqn, shape in parameters(n_layers):
        out.append((f"model.{fqn}", shape, "bfloat16", 2))
        out.append((f"optimizer.state.{fqn}.exp_avg", shape, "float32", 4))
        out.append((f"optimizer.state.{fqn}.exp_avg_sq", shape, "float32", 4))
    return out


def chunk_count(ranks: int, n_layers: int = N_LAYERS) -> int:
    """Chunks in the checkpoint: one per rank per tensor (empty pieces included, as torch saves them)."""
    return ranks * len(tensors(n_layers))


def record_length(rows: int, row_bytes: int) -> int:
    """Bytes of one piece's record: its data, or for an empty piece what ``torch.save`` of an
    empty tensor takes (torch writes a record for every piece, so no two records of a file
    start at the same byte)."""
    return rows * row_bytes if rows else EMPTY_RECORD_BYTES


def shards(rows: int, ranks: int) -> Iterator[tuple[int, int, int]]:
    """(rank, first row, rows) of each rank's Shard(0) piece, torch.chunk semantics."""
    step = -(-rows // ranks)
    for r in range(ranks):
        start = min(r * step, rows)
        yield r, start, min(step, rows - start)


# ------------------------------------------------------------------ the pickle, as opcodes


class _Stream:
    """Protocol-2 pickle opcodes for torch's DCP metadata classes, memoizing each global once."""

    META, FS = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"

    def __init__(self, out: io.BufferedWriter) -> None:
        self.out, self.memo, self.next_memo = out, {}, 0

    def w(self, data: bytes) -> None:
        self.out.write(data)

    def _put(self) -> int:
        i = self.next_memo
        self.next_memo += 1
        self.w(b"r" + struct.pack("<I", i))  # LONG_BINPUT
        return i

    def _get(self, i: int) -> None:
        self.w(b"j" + struct.pack("<I", i))  # LONG_BINGET

    def glob(self, module: str, name: str) -> None:
        key = (module, name)
        if key in self.memo:
            self._get(self.memo[key])
        else:
            self.w(b"c" + f"{module}\n{name}\n".encode())
            self.memo[key] = self._put()

    def int_(self, v: int) -> None:
        if 0 <= v < 256:
            self.w(b"K" + bytes([v]))
        elif 0 <= v < 65536:
            self.w(b"M" + struct.pack("<H", v))
        elif -(2**31) <= v < 2**31:
            self.w(b"J" + struct.pack("<i", v))
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.w(b"\x8a" + bytes([len(raw)]) + raw)  # LONG1

    def str_(self, s: str, memo_key: str | None = None) -> None:
        if memo_key is not None and ("s", memo_key) in self.memo:
            self._get(self.memo[("s", memo_key)])
            return
        raw = s.encode()
        self.w(b"X" + struct.pack("<I", len(raw)) + raw)  # BINUNICODE
        if memo_key is not None:
            self.memo[("s", memo_key)] = self._put()

    def size(self, values: tuple[int, ...]) -> None:
        """torch.Size(values): REDUCE(torch.Size, ((values...),))."""
        self.glob("torch", "Size")
        self.w(b"(")  # MARK
        self.w(b"(")
        for v in values:
            self.int_(v)
        self.w(b"t")  # TUPLE
        self.w(b"tR")  # TUPLE, REDUCE

    def obj(self, cls: str, module: str | None = None) -> None:
        """NEWOBJ(cls, ()): the caller then pushes a state and calls build()."""
        self.glob(module or self.META, cls)
        self.w(b")\x81")  # EMPTY_TUPLE, NEWOBJ

    def build(self) -> None:
        self.w(b"b")  # BUILD

    def dict_items(self, items: Iterator[None], batch: int = 1000) -> None:
        """``items`` pushes one key and value each time it is advanced; SETITEMS per batch."""
        self.w(b"}(")  # EMPTY_DICT, MARK
        n = 0
        for _ in items:
            n += 1
            if n % batch == 0:
                self.w(b"u(")  # SETITEMS, MARK for the next batch
        self.w(b"u")


def write_metadata(path: Path, ranks: int, n_layers: int = N_LAYERS) -> tuple[int, dict[int, int]]:
    """Write ``.metadata``; returns (chunks, bytes per rank file).

    Each rank's file holds its pieces in the order of ``tensors``, so a piece's offset is the
    running total of that rank's earlier pieces: computed as the storage entries are written,
    nothing per chunk is kept (7 million chunks at 2048 ranks)."""
    specs = tensors(n_layers)
    offsets: dict[int, int] = {r: 0 for r in range(ranks)}
    chunks = 0
    with open(path, "wb") as f:
        s = _Stream(f)
        s.w(b"\x80\x02")  # PROTO 2
        s.obj("Metadata")
        s.w(b"}(")  # the state dict of Metadata
        s.str_("state_dict_metadata")

        def sdm() -> Iterator[None]:
            for name, shape, dtype, _ in specs:
                s.str_(name, memo_key=name)
                s.obj("TensorStorageMetadata")
                s.w(b"}(")
                s.str_("properties", memo_key="#properties")
                s.obj("TensorProperties")
                s.w(b"(")  # state tuple: (dtype, layout, requires_grad, memory format, pin_memory)
                s.glob("torch", dtype)
                s.glob("torch.serialization", "_get_layout")
                s.w(b"(")
                s.str_("torch.strided", memo_key="#strided")
                s.w(b"tR")
                s.w(b"\x89")  # NEWFALSE
                s.glob(s.META, "_MEM_FORMAT_ENCODING")
                s.w(b"(K\x00tR")
                s.w(b"\x89t")  # NEWFALSE, TUPLE
                s.build()
                s.str_("size", memo_key="#size")
                s.size(shape)
                s.str_("chunks", memo_key="#chunks")
                s.w(b"](")  # EMPTY_LIST, MARK
                for _r, start, rows in shards(shape[0], ranks):
                    s.obj("ChunkStorageMetadata")
                    s.w(b"}(")
                    s.str_("offsets", memo_key="#offsets")
                    s.size((start,) + (0,) * (len(shape) - 1))
                    s.str_("sizes", memo_key="#sizes")
                    s.size((rows,) + shape[1:])
                    s.w(b"u")
                    s.build()
                s.w(b"e")  # APPENDS
                s.w(b"u")
                s.build()
                yield

        s.dict_items(sdm())
        s.str_("planner_data")

        def planner() -> Iterator[None]:
            for name, *_ in specs:
                s.str_(name, memo_key=name)
                head, _, rest = name.partition(".")
                s.w(b"(")
                s.str_(head, memo_key="#" + head)
                s.str_(rest)
                s.w(b"t")
                yield

        s.dict_items(planner())
        s.str_("storage_data")

        def storage() -> Iterator[None]:
            nonlocal chunks
            for name, shape, _dtype, item in specs:
                row_bytes = item * (shape[1] if len(shape) > 1 else 1)
                for i, (r, start, rows) in enumerate(shards(shape[0], ranks)):
                    offset, length = offsets[r], record_length(rows, row_bytes)
                    offsets[r] += length
                    chunks += 1
                    s.obj("MetadataIndex")
                    s.w(b"}(")
                    s.str_("fqn", memo_key="#fqn")
                    s.str_(name, memo_key=name)
                    s.str_("offset", memo_key="#offset")
                    s.size((start,) + (0,) * (len(shape) - 1))
                    s.str_("index", memo_key="#index")
                    s.int_(i)
                    s.w(b"u")
                    s.build()
                    s.obj("_StorageInfo", s.FS)
                    s.w(b"}(")
                    s.str_("relative_path", memo_key="#relative_path")
                    s.str_(f"__{r}_0.distcp", memo_key=f"#file{r}")
                    s.str_("offset", memo_key="#offset")
                    s.int_(offset)
                    s.str_("length", memo_key="#length")
                    s.int_(length)
                    s.w(b"u")
                    s.build()
                    yield

        s.dict_items(storage())
        s.str_("storage_meta")
        s.w(b"N")  # NONE
        s.str_("version")
        s.str_("1.0.0")
        s.w(b"u")
        s.build()
        s.w(b".")  # STOP
    return chunks, offsets


def make(out: Path, ranks: int, n_layers: int = N_LAYERS) -> dict[str, float]:
    """The checkpoint folder ``out``: ``.metadata`` and sparse rank files."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    chunks, sizes = write_metadata(out / ".metadata", ranks, n_layers)
    for r, size in sizes.items():
        with open(out / f"__{r}_0.distcp", "wb") as f:
            f.truncate(size)  # sparse: the right size, no blocks
            f.write(b"PK\x03\x04")  # the first record looks like torch.save's, as readers check one per file
    return {"ranks": ranks, "chunks": chunks, "tensors": len(tensors(n_layers)), "seconds": time.perf_counter() - start,
            "metadata_bytes": (out / ".metadata").stat().st_size, "checkpoint_bytes": sum(sizes.values())}


def default_meta_path(ranks: int) -> Path:
    return REPO / ".bench" / f"meta_{ranks}"


def ensure_meta_checkpoint(out: Path, ranks: int, n_layers: int = N_LAYERS, quiet: bool = False) -> Path:
    """Return ``out`` holding the metadata-only checkpoint of ``ranks`` ranks, making it unless cached."""
    request = {"ranks": ranks, "layers": n_layers, "version": GENERATOR_VERSION}
    what = f"metadata-only checkpoint ({chunk_count(ranks, n_layers):,} chunks)"
    return cached_build(out, request, lambda tmp: make(tmp, ranks, n_layers), what, quiet)


def check(ranks: int = 3, n_layers: int = 2) -> None:
    """The stream equals torch's own pickling of the same Metadata, as torch reads it back."""
    import pickle
    import tempfile

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with tempfile.TemporaryDirectory() as tmp:
        ours = Path(tmp) / "ours"
        make(ours, ranks, n_layers)
        got = FileSystemReader(str(ours)).read_metadata()
        sdm, storage, offsets = {}, {}, {r: 0 for r in range(ranks)}
        for name, shape, dtype, item in tensors(n_layers):
            chunk_list = []
            for i, (r, start, rows) in enumerate(shards(shape[0], ranks)):
                off = torch.Size((start,) + (0,) * (len(shape) - 1))
                chunk_list.append(m.ChunkStorageMetadata(off, torch.Size((rows,) + shape[1:])))
                length = record_length(rows, item * (shape[1] if len(shape) > 1 else 1))
                storage[m.MetadataIndex(name, off, i)] = _StorageInfo(f"__{r}_0.distcp", offsets[r], length)
                offsets[r] += length
            sdm[name] = m.TensorStorageMetadata(m.TensorProperties(getattr(torch, dtype)), torch.Size(shape), chunk_list)
        planner = {name: tuple(name.split(".", 1)) for name, *_ in tensors(n_layers)}
        want = pickle.loads(pickle.dumps(m.Metadata(sdm, planner_data=planner, storage_data=storage, version="1.0.0")))
        assert got.state_dict_metadata == want.state_dict_metadata, "state_dict_metadata differs"
        assert got.planner_data == want.planner_data, "planner_data differs"
        assert got.storage_data == want.storage_data and \
            [got.storage_data[k] for k in want.storage_data] == list(want.storage_data.values()), "storage_data differs"
        assert got.version == want.version
    print(f"check: the streamed .metadata equals torch's own for {ranks} ranks, {n_layers} layers")


def main(argv: list[str] | None = None) -> int:
    ap = generator_args(__doc__.split("\n\n")[0], formatter=argparse.RawDescriptionHelpFormatter,
                        out_help="checkpoint folder (default .bench/meta_<ranks>; reused when its marker matches)")
    ap.epilog = __doc__
    ap.add_argument("--ranks", type=int, default=64, help="ranks that saved the checkpoint (default 64)")
    ap.add_argument("--layers", type=int, default=N_LAYERS, help=f"transformer layers (default {N_LAYERS})")
    ap.add_argument("--check", action="store_true", help="compare the stream with torch's own pickle, then exit")
    args = ap.parse_args(argv)
    if args.check:
        check()
        check(ranks=2048, n_layers=1)  # empty pieces (wk/wv, the vocab)
        return 0
    return generate(args.out or default_meta_path(args.ranks), args.force,
                    lambda out: ensure_meta_checkpoint(out, args.ranks, args.layers))

if __name__ == "__main__":
    sys.exit(main())
