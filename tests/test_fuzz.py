"""Fuzzing the two parsers that take bytes from strangers first: the safetensors header and
the DCP ``.metadata`` loader.

The contract under test: whatever the bytes, only a ReshardError escapes, its message names
the file, and no code runs. Where an independent oracle exists the result must also be
*right*:

- safetensors (differential against the library's Rust core): a header is accepted exactly
  when the Rust core accepts it (we are stricter on a name given twice; a file torch cannot
  hold is ours to refuse as unsupported), and every file we accept is read in full by both
  sides: the same names, dtypes, shapes and ``__metadata__``, every tensor equal byte for byte.
- DCP: chunks are accepted exactly when they cover the tensor once (checked by counting
  elements), and every ``.metadata`` we accept reads the same through torch's own
  ``FileSystemReader``: names, sizes, dtypes, chunks in order, byte objects, and each
  chunk's storage record (file, offset, length).

Only the reference's own refusal (``SafetensorError``) counts as a refusal: any other
exception from a reference reader, a Rust panic included, fails the test.

Short in CI (``RESHARD_FUZZ_EXAMPLES``, default 200 examples per target); longer by hand:
``RESHARD_FUZZ_EXAMPLES=20000 python -m pytest -q tests/test_fuzz.py`` (docs/security.md).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reshard.formats.dcp.index import load_dcp_index
from reshard.formats.dcp.metadata import DCPIndex
from reshard.formats.safetensors.format import SafetensorsFormat
from reshard.formats.safetensors.header import Header, read_header
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcpm
from torch.distributed.checkpoint.filesystem import _StorageInfo

from reshard.core.boxes import full_box
from reshard.core.errors import ReshardError, UnsafeCheckpointError, UnsupportedFormatError
from reshard.core.regions import StoredRegion

FUZZ = settings(
    max_examples=int(os.environ.get("RESHARD_FUZZ_EXAMPLES", "200")),
    deadline=None,
    database=None,  # nothing written into the working tree; failures print their reproducer
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@contextmanager
def _scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="reshard-fuzz-") as d:
        yield Path(d)


_SCRATCH = Path(tempfile.mkdtemp(prefix="reshard-fuzz-"))  # reused by every example of a session


def _outcome(call, path: Path) -> BaseException | None:
    """None if ``call`` accepted the input, the ReshardError if it refused it; anything else
    is a bug and propagates. Every refusal must name the file."""
    try:
        call()
    except ReshardError as e:
        assert str(e).startswith(str(path)), f"error does not name the file: {e}"
        return e
    return None


# ----------------------------------------------------------------------------- safetensors

_CODES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL"]
_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def _st_file(header: bytes | dict, data: bytes, length: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = _SCRATCH / "fuzz.safetensors"
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


@contextmanager
def _reference_panics_fail(path: Path) -> Iterator[None]:
    """A Rust panic (pyo3's PanicException) derives from BaseException, not Exception: left
    alone it would skip hypothesis' shrinking and the printed reproducer. Re-raised as an
    AssertionError it fails the test like any other bug of the reference, with the input."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise  # exceptions fail the test as they are; KeyboardInterrupt still interrupts
        raise AssertionError(f"safetensors panicked on {path}: {e}") from e


def _rust_accepts(path: Path) -> bool:
    """Whether the Rust core accepts the header. Only its own refusal (SafetensorError) is a
    refusal; any other exception is a crash of the reference and fails the test."""
    try:
        with _reference_panics_fail(path), safe_open(str(path), "pt") as f:
            f.keys()
    except SafetensorError:
        return False
    return True


def _check_accepted_header(path: Path) -> Header:
    """What acceptance promises: tensors tile the data exactly, each sized shape x dtype."""
    header = read_header(path)
    at = 0
    for t in header.tensors:
        assert t.begin == at and t.end - t.begin == torch.Size(t.shape).numel() * t.dtype.itemsize
        at = t.end
    assert header.data_start + at == path.stat().st_size
    return header


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in C order: equal bytes, not equal values (NaN != NaN, -0.0 == 0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _our_tensors(path: Path, header: Header) -> dict[str, torch.Tensor]:
    """Every tensor as reshard reads it: through the catalog, as a conversion does. Where
    only the catalog refuses (reshard's own metadata keys malformed, a ReshardError naming the
    file) the tensors are still well defined: read them through the header's regions, which
    is what the catalog would have handed out."""
    try:
        catalog = SafetensorsFormat().read(path)
    except ReshardError as e:
        assert str(e).startswith(str(path)), f"error does not name the file: {e}"
        return {t.name: StoredRegion(path, header.data_start + t.begin, t.dtype, t.shape).read_all()
                for t in header.tensors}
    out = {}
    for name, entry in catalog.tensors.items():
        [chunk] = entry.chunks  # whole: only DCP's sharding info (never generated here) splits one
        assert chunk.box == full_box(entry.shape)
        out[name] = chunk.data.read_all()
        assert (out[name].dtype, tuple(out[name].shape)) == (entry.dtype.torch, entry.shape), name
    return out


def _check_same_content(path: Path) -> None:
    """A file we accept must read the same through safetensors itself: same names, dtypes,
    shapes and ``__metadata__``, every tensor the same bytes. The Rust core accepted the
    header, so any exception while it reads the tensors is a failure too."""
    header = _check_accepted_header(path)
    ours = _our_tensors(path, header)
    with _reference_panics_fail(path), safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(ours), f"names: rust {sorted(f.keys())}, ours {sorted(ours)}"
        assert (f.metadata() or {}) == header.metadata  # absent and null both read as no metadata
        for name, mine in ours.items():
            theirs = f.get_tensor(name)
            assert (theirs.dtype, theirs.shape) == (mine.dtype, mine.shape), name
            assert torch.equal(_raw(theirs), _raw(mine)), f"{name}: bytes differ"


def _check_against_rust(path: Path, ours: BaseException | None) -> None:
    """Differential: accepted exactly when the Rust core accepts, and then read the same.
    Two refusals of ours say nothing about the Rust core: a name given twice (serde keeps the
    last one, we refuse) and UnsupportedFormatError (a valid file holding a tensor torch
    cannot hold; raised per tensor before the tiling is checked, so the file may be invalid
    for other reasons too)."""
    if ours is None:
        assert _rust_accepts(path), "we accept a file the Rust core refuses"
        _check_same_content(path)
    elif not isinstance(ours, UnsupportedFormatError) and "twice" not in str(ours):
        assert not _rust_accepts(path), f"we refuse a file the Rust core accepts: {ours!r}"


@FUZZ
@given(st.binary(max_size=256), st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_header_random_bytes(body: bytes, length: int | None) -> None:
    path = _st_file(body, b"", length)
    _check_against_rust(path, _outcome(lambda: read_header(path), path))


def _tensor_entries() -> st.SearchStrategy:
    dims = st.lists(st.one_of(st.integers(0, 5), st.integers(-2, 2**64 + 2)), max_size=3)
    offsets = st.lists(st.integers(-1, 80), min_size=2, max_size=2)
    code = st.one_of(st.sampled_from(_CODES), st.sampled_from(["F128", "f32", "", "I4"]))
    return st.fixed_dictionaries({"dtype": code, "shape": dims, "data_offsets": offsets})


# Where sizes stop fitting: torch shapes are int64, the Rust core's usize (u64).
_EDGE_DIMS = [2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 2]


@st.composite
def _headers(draw) -> tuple[dict, int]:
    """Mostly valid headers (tensors laid back to back) with a few fields perturbed."""
    names = draw(st.lists(st.text(alphabet="abc.\u00e9\ud800", min_size=0, max_size=3), max_size=4, unique=True))
    header: dict = {}
    at = 0
    for name in names:
        code = draw(st.sampled_from(_CODES))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        size = torch.Size(shape).numel() * _BYTES[code]
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    if names and draw(st.booleans()):
        # Mostly one field at a time, so the entry stays plausible and edge values get past
        # the first check; an extreme dimension beside a zero keeps the byte size (zero) right.
        name = draw(st.sampled_from(names))
        entry, how = header[name], draw(st.sampled_from(["dtype", "shape", "data_offsets", "all", "edge dim"]))
        if how == "edge dim":
            shape = list(entry["shape"])
            shape.insert(draw(st.integers(0, len(shape))), draw(st.sampled_from(_EDGE_DIMS)))
            header[name] = {**entry, "shape": shape}
        else:
            perturbed = draw(_tensor_entries())
            fields = ["dtype", "shape", "data_offsets"] if how == "all" else [how]
            header[name] = {**entry, **{f: perturbed[f] for f in fields}}
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(
            st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
            st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=1), st.none(), st.integers()))
    return header, max(0, at + draw(st.sampled_from([0, 0, 0, -1, 1, 3])))


@FUZZ
@given(_headers())
def test_header_agrees_with_the_rust_core(case: tuple[dict, int]) -> None:
    """Differential: our validation accepts exactly what safetensors' own reader accepts."""
    header, data_len = case
    # Distinct bytes, so a tensor read from the wrong offset cannot pass for the right one.
    path = _st_file(json.dumps(header).encode(), bytes(i % 251 for i in range(data_len)))
    _check_against_rust(path, _outcome(lambda: read_header(path), path))


def _valid_file() -> bytes:
    path = _SCRATCH / "valid.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
               "c": torch.tensor([1, 2], dtype=torch.int64)}, str(path), metadata={"k": "v"})
    return path.read_bytes()


_VALID = _valid_file()


@st.composite
def _mutations(draw, original: bytes) -> bytes:
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[at] = draw(st.sampled_from(b'{}[]",:0123456789-eE. \\u'))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del data[at: at + draw(st.integers(1, 4))]
        else:
            del data[at:]
    return bytes(data)


@FUZZ
@given(_mutations(_VALID))
def test_header_mutated_file(data: bytes) -> None:
    path = _SCRATCH / "mutated.safetensors"
    path.write_bytes(data)
    _check_against_rust(path, _outcome(lambda: read_header(path), path))


# ----------------------------------------------------------------------------- DCP metadata


def _metadata(shape: list[int], chunks: list[tuple[list[int], list[int]]], relpaths: list[str]) -> bytes:
    """A real torch ``Metadata`` for one tensor ``w`` and one byte object, pickled as torch's
    FileSystemWriter pickles it."""
    props = dcpm.TensorProperties(dtype=torch.float32)
    tensor = dcpm.TensorStorageMetadata(props, torch.Size(shape), [
        dcpm.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    storage = {dcpm.MetadataIndex("w", torch.Size(o), i): _StorageInfo(relpaths[i % len(relpaths)], 64 * i, 16)
               for i, (o, _) in enumerate(chunks)}
    storage[dcpm.MetadataIndex("step")] = _StorageInfo("__0_0.distcp", 0, 8)
    planner = {"w": ("w",), "step": ("step",)}
    meta = dcpm.Metadata({"w": tensor, "step": dcpm.BytesStorageMetadata()}, planner_data=planner, storage_data=storage)
    return pickle.dumps(meta)


def _covers_once(shape: list[int], chunks: list[tuple[list[int], list[int]]]) -> bool:
    """Independent oracle: count how often each element is covered."""
    count = torch.zeros(shape, dtype=torch.int32)
    for o, s in chunks:
        if len(o) != len(shape) or any(x < 0 or n < 0 or x + n > d for x, n, d in zip(o, s, shape)):
            return False
        count[tuple(slice(x, x + n) for x, n in zip(o, s))] += 1
    return bool((count == 1).all())


def _load(root: Path, data: bytes) -> BaseException | None:
    (root / ".metadata").write_bytes(data)
    return _outcome(lambda: load_dcp_index(root), root / ".metadata")


def _check_torch_reads_the_same(root: Path, ours: DCPIndex) -> None:
    """The index we built from ``root/.metadata`` against torch's own reading of it.

    torch's reader is plain ``pickle.load``, which would run whatever code the bytes name.
    It is called only after our allow-list unpickler accepted the very same bytes: pickle
    executes the same opcodes either way, so the bytes name only allow-listed, inert globals
    (DCP's record classes, torch.Size, dtypes, pathlib paths, a few data-only builtins)
    called with arguments our stand-ins already accepted. Never call this on bytes we refused.
    Anything torch raises here is a failure: we accepted a file torch cannot read.
    """
    meta = FileSystemReader(root).read_metadata()
    entries = meta.state_dict_metadata
    tensors = {n: md for n, md in entries.items() if isinstance(md, dcpm.TensorStorageMetadata)}
    objects = {n for n, md in entries.items() if isinstance(md, dcpm.BytesStorageMetadata)}
    assert set(ours.tensors) == set(tensors) and set(ours.objects) == objects
    for name, (shape, dtype, chunks) in ours.tensors.items():
        md = tensors[name]
        assert (tuple(md.size), md.properties.dtype) == (shape, dtype.torch), name
        assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [(b.offsets, b.sizes) for b, _ in chunks]
        for box, rec in chunks:
            # The key torch's planner looks a chunk's bytes up by (index is not compared).
            info = meta.storage_data[dcpm.MetadataIndex(name, box.offsets)]
            assert (info.relative_path, info.offset, info.length) == (rec.relpath, rec.offset, rec.length), name


def _load_and_compare(root: Path, data: bytes) -> BaseException | None:
    """``_load``, then, when we accept, the same answer from torch's reader."""
    refused = _load(root, data)
    if refused is None:
        _check_torch_reads_the_same(root, load_dcp_index(root))
    return refused


@st.composite
def _tilings(draw) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """A tensor cut into a grid (a valid tiling, as DTensor shards are), then sometimes
    disturbed: a chunk moved, grown, shrunk, dropped, duplicated or given the wrong rank."""
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    cuts = [sorted(set(draw(st.lists(st.integers(0, d), max_size=2))) | {0, d}) for d in shape]
    chunks: list[tuple[list[int], list[int]]] = [([], [])]
    for c in cuts:
        chunks = [(o + [a], s + [b - a]) for o, s in chunks for a, b in zip(c, c[1:])] or [(o + [0], s + [0]) for o, s in chunks]
    edit = draw(st.sampled_from(["none", "none", "move", "grow", "shrink", "drop", "dup", "rank", "negative"]))
    i = draw(st.integers(0, len(chunks) - 1))
    o, s = chunks[i]
    d = draw(st.integers(0, len(shape) - 1))
    if edit == "move":
        o = o[:d] + [o[d] + draw(st.sampled_from([-1, 1]))] + o[d + 1:]
    elif edit in ("grow", "shrink"):
        s = s[:d] + [s[d] + (1 if edit == "grow" else -1)] + s[d + 1:]
    elif edit == "drop" and len(chunks) > 1:
        return shape, chunks[:i] + chunks[i + 1:]
    elif edit == "dup":
        return shape, chunks + [chunks[i]]
    elif edit == "rank":
        o, s = o + [0], s + [1]
    elif edit == "negative":
        o = o[:d] + [-1] + o[d + 1:]
    return shape, chunks[:i] + [(o, s)] + chunks[i + 1:]


@FUZZ
@given(_tilings())
def test_dcp_chunks_accepted_iff_they_cover_once(case) -> None:
    shape, chunks = case
    with _scratch() as root:
        try:
            data = _metadata(shape, chunks, ["__0_0.distcp"])
        except (RuntimeError, ValueError):  # torch.Size refuses a negative size: not writable, skip
            return
        refused = _load_and_compare(root, data)
        assert (refused is None) == _covers_once(shape, chunks), f"{shape} {chunks}: {refused!r}"


@FUZZ
@given(st.lists(st.sampled_from(["__0_0.distcp", "sub/__1_0.distcp", "../x.distcp", "/etc/passwd", "a/../../b",
                                 "..", "", "C:\\x", "./__0_0.distcp"]), min_size=1, max_size=3))
def test_dcp_data_paths_stay_inside(relpaths: list[str]) -> None:
    with _scratch() as root:
        refused = _load_and_compare(root, _metadata([4], [([0], [2]), ([2], [2])], relpaths))
        escapes = any(p.startswith(("/", "\\")) or ".." in p.split("/") or not p for p in relpaths[:2])
        assert isinstance(refused, UnsafeCheckpointError) == escapes, f"{relpaths}: {refused!r}"


_VALID_META = _metadata([6, 4], [([0, 0], [3, 4]), ([3, 0], [3, 4])], ["__0_0.distcp", "__1_0.distcp"])


@FUZZ
@given(st.one_of(_mutations(_VALID_META), st.binary(max_size=512)))
def test_dcp_metadata_mutated_or_random(data: bytes) -> None:
    with _scratch() as root:
        _load_and_compare(root, data)


class _Payload:
    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


@FUZZ
@given(st.sampled_from(["system", "eval", "exec", "popen", "getattr", "import", "torch_load"]),
       st.sampled_from(["planner", "state_dict", "storage", "top"]))
def test_dcp_metadata_never_runs_code(kind: str, where: str) -> None:
    import builtins
    import subprocess

    with _scratch() as root:
        marker = root / "pwned"
        payload = _Payload(*{
            "system": (os.system, (f"touch {marker}",)),
            "eval": (builtins.eval, (f"open({str(marker)!r}, 'w')",)),
            "exec": (builtins.exec, (f"open({str(marker)!r}, 'w')",)),
            "popen": (subprocess.Popen, (["touch", str(marker)],)),
            "getattr": (builtins.getattr, (os, "system")),
            "import": (builtins.__import__, ("os",)),
            "torch_load": (torch.load, (str(marker),)),
        }[kind])
        meta = pickle.loads(_VALID_META)  # our own bytes, made above
        if where == "planner":
            meta.planner_data["w"] = payload
        elif where == "state_dict":
            meta.state_dict_metadata["evil"] = payload
        elif where == "storage":
            meta.storage_data[dcpm.MetadataIndex("evil")] = payload
        try:
            data = pickle.dumps(payload if where == "top" else meta)
        except (TypeError, pickle.PicklingError):  # a module object (getattr's target) cannot be pickled
            return
        refused = _load(root, data)
        assert isinstance(refused, UnsafeCheckpointError) and "allow-list" in str(refused), repr(refused)
        assert not marker.exists()


@pytest.fixture(autouse=True, scope="module")
def _cleanup() -> Iterator[None]:
    yield
    import shutil

    shutil.rmtree(_SCRATCH, ignore_errors=True)
