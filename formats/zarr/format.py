"""zarr v3 stores: one array per tensor, chunks that are the training shards.

Layout we write (``ckpt.zarr/``), readable by tensorstore, zarr-python (native dtypes) and JAX
tools:

- ``zarr.json``: the root group. Its attributes hold what zarr cannot say itself: objects
  (``reshard.objects``, tagged JSON as in safetensors metadata), nested paths that dots cannot
  recover (``reshard.paths``), provenance (``reshard.attrs``), the target mesh (``reshard.mesh``);
  objects JSON cannot hold (tensors inside objects, classes) go to ``.reshard-objects.pt``, a
  torch.save archive read back with the allow-list unpickler.
- ``NAME/zarr.json`` per tensor, ``NAME`` the flat name (``model.embed.weight``); the torch dtype
  is in the ``reshard.dtype`` attribute, the placements on the mesh in ``reshard.mesh.placements``.
- ``NAME/c/i/j``: chunks (default key encoding), uncompressed unless ``compress=True`` (zstd).

Without compression a chunk file is raw C-order bytes, so the engine writes it like any other
format (kernel copies where it can) and the reader hands out ``StoredRegion``s; an edge chunk
ends in a zero tail (``OutputFile.zero_tail``). With compression the engine assembles each
chunk whole and writes its zstd form (``OutputFile.encode``). Every rank can write its chunks;
``finish`` (rank 0, after the others) writes the metadata, the root ``zarr.json`` last (the
writer's ``marker``, put last to an object store too): a store without it is incomplete.
Reading accepts any zarr v3 store: nested groups (names joined with dots), the ``v2`` key
encoding, transpose / big-endian / zstd / gzip / blosc / crc32c codecs, missing chunks.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from reshard.formats.torch.zip import load_object_blob
from reshard.formats.torch.zip_write import torch_save_bytes
from reshard.formats.zarr.chunks import RAW_CODECS, ZSTD_CODECS, Codecs, EncodedChunk, FillChunk, compress
from reshard.formats.zarr.grid import ArrayLayout, chunk_segments, plan_arrays
from reshard.formats.zarr.meta import MAX_JSON_SIZE, ZARR_JSON, array_meta_json, group_meta_json, parse_array_meta, parse_json
from reshard.formats.zarr.options import COMPRESS
from reshard.formats.zarr.store import LocalStore, Store, open_store

from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from reshard.core.pieces import OutputFile
from reshard.core.regions import StoredRegion
from reshard.core.sizes import plural
from reshard.core.storage import RemotePath
from reshard.core.structure import CONTAINERS_KEY, containers_from_json, containers_to_json
from reshard.core.tagged_json import Unencodable, decode_value, encode_value
from reshard.core.target import Target
from reshard.pipeline.options import WriterOptions, shard_bytes

__all__ = ["ZarrFormat", "ZarrWriter", "read_store", "write_metadata", "OBJECTS_FILE"]

OBJECTS_KEY, PATHS_KEY, ATTRS_KEY, MESH_KEY = "reshard.objects", "reshard.paths", "reshard.attrs", "reshard.mesh"
PICKLED_KEY, PLACEMENTS_ATTR = "reshard.pickled_objects", "reshard.mesh.placements"
OBJECTS_FILE = ".reshard-objects.pt"  # a leading dot: no tensor name (array node) can take it
_MAX_CHUNKS = 1 << 21  # a hostile shape / chunk_shape must not make us build millions of chunks


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _read_doc(store: Store, key: str) -> dict[str, Any] | None:
    size = store.size(key)
    if size is None:
        return None
    if size > MAX_JSON_SIZE:
        raise CorruptCheckpointError(f"{store.where}/{key}: larger than {MAX_JSON_SIZE} bytes; not zarr metadata")
    raw = store.get(key)
    return None if raw is None else parse_json(raw, f"{store.where}/{key}")


# ---------------------------------------------------------------------------------- reading


class _Reader:
    def __init__(self, store: Store, catalog: Catalog) -> None:
        self.store, self.catalog, self.chunks = store, catalog, 0

    def add_array(self, prefix: str, parts: tuple[str, ...], doc: dict[str, Any]) -> None:
        name = ".".join(parts)
        if name in self.catalog.tensors:
            raise UnsupportedFormatError(f"{self.store.where}: two arrays flatten to the name {name!r}")
        if len(parts) > 1 and any("." in p for p in parts):
            self.catalog.paths[name] = parts  # dots inside node names: keep the real nesting
        where = f"{self.store.where}/{_join(prefix, ZARR_JSON)}"
        meta = parse_array_meta(doc, where)
        codecs = Codecs(meta.codecs, meta.dtype, f"{self.store.where}/{prefix}")
        count = math.prod(meta.grid)
        self.chunks += count
        if self.chunks > _MAX_CHUNKS:
            raise UnsupportedFormatError(f"{where}: the store has more than {_MAX_CHUNKS} chunks; reshard reads fewer")
        sizes = self.store.listing(prefix) if count else {}
        local = self.store.local_path(prefix) if isinstance(self.store, LocalStore) else None
        entry = TensorEntry(name, meta.shape, meta.dtype)
        for coords in itertools.product(*(range(g) for g in meta.grid)):
            key, box = meta.chunk_key(coords), meta.chunk_box(coords)
            size = sizes.get(key)
            if size is None:
                assert meta.fill is not None  # parse_array_meta always reads one
                data: Any = FillChunk(meta.fill, meta.dtype)  # zarr writers skip chunks that are all fill_value
            elif codecs.raw and size != meta.chunk_nbytes:
                raise CorruptCheckpointError(
                    f"{self.store.where}/{_join(prefix, key)}: {size} bytes, expected {meta.chunk_nbytes} for a chunk of "
                    f"{list(meta.chunk_shape)} {meta.dtype} (truncated, or zarr.json's shape does not match the data)"
                )
            elif codecs.raw and local is not None:
                data = StoredRegion(local / key, 0, meta.dtype, meta.chunk_shape)
            else:
                data = EncodedChunk(self.store, _join(prefix, key), codecs, meta.chunk_shape, size)
            entry.chunks.append(Chunk(box, data))
        self.catalog.tensors[name] = entry

    def walk(self, prefix: str, parts: tuple[str, ...]) -> None:
        for child in self.store.children(prefix):
            key = _join(prefix, child)
            doc = _read_doc(self.store, _join(key, ZARR_JSON))
            if doc is None:
                continue  # not a node (zarr v3 has no implicit groups)
            kind = doc.get("node_type")
            if kind == "array":
                self.add_array(key, parts + (child,), doc)
            elif kind == "group":
                self.walk(key, parts + (child,))
            else:
                raise CorruptCheckpointError(f"{self.store.where}/{key}/{ZARR_JSON}: node_type {kind!r}")


def _decoded(where: str, key: str, value: Any) -> dict[str, Any]:
    try:
        out = decode_value(value)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: attribute {key!r} is not valid ({e})") from None
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        raise CorruptCheckpointError(f"{where}: attribute {key!r} is not an object keyed by name")
    return out


def _pickled_objects(store: Store, where: str) -> dict[str, Any]:
    """``.reshard-objects.pt`` through the allow-list unpickler (never plain pickle)."""
    size = store.size(OBJECTS_FILE)
    if size is None:
        raise CorruptCheckpointError(f"{where}: names {OBJECTS_FILE} for objects but the store has no such file")
    local = store.local_path(OBJECTS_FILE) if isinstance(store, LocalStore) else None
    if local is not None:
        objects = load_object_blob(local, 0, size, lambda r: r.read_all())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "objects.pt"
            path.write_bytes(store.get(OBJECTS_FILE) or b"")
            objects = load_object_blob(path, 0, size, lambda r: r.read_all())
    if not isinstance(objects, dict) or not all(isinstance(k, str) for k in objects):
        raise CorruptCheckpointError(f"{store.where}/{OBJECTS_FILE}: not a dict of named objects")
    return objects


def _take_root_attributes(store: Store, attrs: dict[str, Any], catalog: Catalog) -> None:
    where = f"{store.where}/{ZARR_JSON}"
    rest = dict(attrs)
    catalog.objects.update(_decoded(where, OBJECTS_KEY, rest.pop(OBJECTS_KEY, {})))
    if rest.pop(PICKLED_KEY, None):
        catalog.objects.update(_pickled_objects(store, where))
    if CONTAINERS_KEY in rest:
        catalog.facts.containers = containers_from_json(rest.pop(CONTAINERS_KEY), where)
    for name, path in _decoded(where, PATHS_KEY, rest.pop(PATHS_KEY, {})).items():
        if not isinstance(path, list) or not all(type(p) in (str, int) for p in path):
            raise CorruptCheckpointError(f"{where}: {PATHS_KEY} entry {name!r} is not a list of keys")
        catalog.paths[name] = tuple(path)
    catalog.facts.take_persisted(_decoded(where, ATTRS_KEY, rest.pop(ATTRS_KEY, {})))
    mesh = rest.pop(MESH_KEY, None)
    if isinstance(mesh, dict) and isinstance(mesh.get("shape"), list) and all(type(n) is int for n in mesh["shape"]):
        catalog.facts.source_mesh = mesh
        catalog.facts.source_world_size = math.prod(mesh["shape"])
    if rest:
        catalog.facts.zarr_attributes = rest  # a foreign store's own attributes, written back on export


def read_store(store: Store, location: Path | str) -> Catalog:
    """The catalog of the zarr v3 store ``store``: metadata only, no chunk data is read."""
    root = _read_doc(store, ZARR_JSON)
    if root is None:
        raise CheckpointNotFoundError(f"{store.where}: no {ZARR_JSON} at the root; not a zarr v3 store (or an unfinished write)")
    catalog = Catalog(format="zarr", path=cast(Path, location))  # a URL stays a string, named in messages
    reader = _Reader(store, catalog)
    if root.get("node_type") == "array":  # a lone array: one tensor named after the store
        reader.add_array("", (Path(str(location).rstrip("/")).name.removesuffix(".zarr") or "array",), root)
        return catalog
    if root.get("node_type") != "group":
        raise CorruptCheckpointError(f"{store.where}/{ZARR_JSON}: node_type {root.get('node_type')!r}")
    attrs = root.get("attributes") or {}
    if not isinstance(attrs, dict):
        raise CorruptCheckpointError(f"{store.where}/{ZARR_JSON}: attributes is not an object")
    reader.walk("", ())
    _take_root_attributes(store, attrs, catalog)
    return catalog


class ZarrFormat:
    name = "zarr"

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / ZARR_JSON).is_file()

    def read(self, path: Path | str) -> Catalog:
        """A local store folder, or an fsspec URL (``memory://...``, ``s3://...``)."""
        return read_store(open_store(path), str(path) if isinstance(path, RemotePath) else path)

    def writer(self, dst: Path | str, options: WriterOptions | None = None) -> ZarrWriter:
        """``max_shard_size`` (``--max-shard-size``) caps the chunk size when no mesh sets it.
        Compressed chunks (``compress``) are compressed and decoded whole: ``max_memory`` then
        caps every chunk at an eighth of it, shards or not (``plan_arrays``). The engine holds
        a chunk and its zstd form per worker as it writes; a reader holds a chunk compressed,
        decoded and copied, beside its slabs (``Engine._workers_for``): a reader with the same
        budget then decodes on two workers, not one."""
        opts = options or WriterOptions()
        compress = opts.value(COMPRESS)
        cap = max(1, opts.budget // 8) if compress else None
        return ZarrWriter(compress=compress, chunk_bytes=shard_bytes(opts), chunk_cap=cap)


# ---------------------------------------------------------------------------------- writing


def _encodable(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(name -> tagged JSON, name -> value JSON cannot hold exactly)."""
    kept, other = {}, {}
    for name, value in values.items():
        try:
            kept[name] = encode_value(value)
        except (Unencodable, RecursionError):
            other[name] = value
    return kept, other


def write_metadata(store: LocalStore, target: Target, arrays: list[ArrayLayout]) -> None:
    """Every array's ``zarr.json``, the objects, and the root ``zarr.json`` last."""
    placements = target.facts.target_placements or {}
    for a in arrays:
        attributes = {PLACEMENTS_ATTR: placements[a.name]} if a.name in placements else {}
        store.put(f"{a.name}/{ZARR_JSON}", array_meta_json(a.meta.shape, a.meta.dtype, a.meta.chunk_shape,
                                                           a.meta.codecs, attributes))
    root: dict[str, Any] = dict(target.facts.zarr_attributes or {})
    objects, pickled = _encodable(target.objects)
    if objects:
        root[OBJECTS_KEY] = objects
    if pickled:
        store.put(OBJECTS_FILE, torch_save_bytes(pickled))  # values read safely; stand-ins under their own names
        root[PICKLED_KEY] = sorted(pickled)
    paths = {n: list(p) for n, p in target.paths.items() if (n in target.tensors or n in target.objects) and p != (n,)}
    if paths:
        root[PATHS_KEY] = paths
        if target.facts.containers:  # int-keyed dicts and tuples, which paths alone rebuild as lists
            root[CONTAINERS_KEY] = containers_to_json(target.facts.containers)
    attrs, _ = _encodable(target.facts.persisted())
    if attrs:
        root[ATTRS_KEY] = attrs
    if target.mesh is not None:
        root[MESH_KEY] = {"shape": list(target.mesh.shape), "names": list(target.mesh.names)}
    store.put(ZARR_JSON, group_meta_json(root))


class ZarrWriter:
    """Chunk files from ``layout`` (any rank may write any of them, padded and compressed as
    the engine writes them); ``finish`` writes all metadata, so it needs only the layout."""

    output_is_dir = True
    marker = ZARR_JSON  # the root group's metadata: until it is there, no reader takes the folder for a store

    def __init__(self, *, compress: bool = False, chunk_bytes: int | None = None, chunk_cap: int | None = None) -> None:
        self.compress = compress
        self.codecs = ZSTD_CODECS if compress else RAW_CODECS
        self.chunk_bytes = chunk_bytes
        self.chunk_cap = chunk_cap

    def arrays(self, target: Target) -> list[ArrayLayout]:
        return plan_arrays(target, self.codecs, self.chunk_bytes, self.chunk_cap)

    def layout(self, target: Target) -> list[OutputFile]:
        files = []
        for a in self.arrays(target):
            for key, box in a.chunks():
                f = OutputFile(key, chunk_segments(a.name, a.meta.dtype, box, a.meta.chunk_shape),
                               encode=compress if self.compress else None)
                f.zero_tail = a.meta.chunk_nbytes - f.size  # an edge chunk's padding
                files.append(f)
        return files

    def finish(self, staging: Path, target: Target, files: list[OutputFile]) -> None:
        write_metadata(LocalStore(staging), target, self.arrays(target))

    def notices(self, target: Target) -> list[str]:
        arrays = self.arrays(target)
        out = [f"{a.name!r}: its shards are not a regular grid, so chunks of {list(a.meta.chunk_shape)} tile them"
               for a in arrays if not a.regular]
        split = [a.name for a in arrays if a.split]
        if split:
            out.append(f"{plural(len(split), 'tensor')} (e.g. {split[0]!r}) {'is' if len(split) == 1 else 'are'} "
                       "stored in chunks smaller than their shards: a "
                       "compressed chunk is compressed and decoded whole, so each fits an eighth of --max-memory")
        return out
