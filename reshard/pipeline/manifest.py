"""The integrity manifest: every file of a directory output with its size and SHA-256.

A conversion can run for an hour and its output is copied, synced and uploaded afterwards;
``reshard verify --quick DIR`` says, without the source and without parsing a tensor, whether
every byte is still the byte that was written, and names the file that is not. Megatron-Core
writes the same kind of record (``integrity.json``, SHA-256 per file).

Why SHA-256 and not a faster hash: on CPUs with SHA extensions (every x86 since ~2017, ARMv8)
OpenSSL's SHA-256, which ``hashlib`` uses, runs at 1-2 GB/s per core, faster than stdlib
BLAKE2b (~0.5 GB/s measured on the same machine), and it is the digest the rest of the
ecosystem already prints: ``sha256sum``, the Hugging Face Hub (the LFS ``oid`` of a file *is* its
SHA-256) and Megatron-Core, so a manifest entry can be checked with tools users already have.
Files are hashed after the engine has written them (kernel copies never pass through user
space, and buffered runs are written out of order, so there is nothing to hash "on the way"),
several files at once in threads (hashlib releases the GIL), each read in fixed 8 MiB blocks:
memory stays at workers x 8 MiB whatever the checkpoint size.

The manifest sits inside the folder as the hidden ``.reshard-manifest.json``: every reader we
know (torch's DCP, safetensors and transformers loaders, reshard's own) ignores files it is not
told about. Single-file outputs carry none: a sibling file would break "one file" for the user.

A file added after the conversion is mostly harmless (a README, a tokenizer), but not a
weights file that loaders take by its name: transformers' ``from_pretrained`` loads
``model.safetensors`` *before* ``model.safetensors.index.json``, so one dropped beside a
sharded export makes the folder load other weights while every listed byte is intact. Those
(``LOADED_BY_NAME``) are problems of their own kind, ``unlisted_weights``.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["MANIFEST_NAME", "ALGORITHM", "LOADED_BY_NAME", "FileDigest", "ManifestProblem", "file_digest",
           "write_manifest", "manifest_bytes", "read_manifest", "parse_manifest", "check_manifest"]

MANIFEST_NAME = ".reshard-manifest.json"
ALGORITHM = "sha256"
_VERSION = 1
_BLOCK = 8 << 20
_MAX_MANIFEST_BYTES = 100_000_000  # a hostile manifest must not exhaust memory (as safetensors bounds headers)


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True)
class ManifestProblem:
    relpath: str
    kind: str  # "size", "checksum", "missing", "unlisted_weights", "not_in_manifest"
    detail: str


# transformers' from_pretrained takes the first of these that a folder holds (modeling_utils.
# _get_resolved_checkpoint_files): a file early in the list wins over the manifest's later one.
_HF_ORDER = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Other weights files a loader takes by their name (globs, first match), and who does.
LOADED_BY_NAME: tuple[tuple[str, str], ...] = (
    ("model.*.safetensors", "from_pretrained(variant=...) loads it"),
    ("model.*.safetensors.index.json", "from_pretrained(variant=...) loads its files"),
    ("pytorch_model.*.bin", "from_pretrained(variant=...) loads it"),
    ("pytorch_model.*.bin.index.json", "from_pretrained(variant=...) loads its files"),
    ("*.index.json", "it is a second index: which files make the model has two answers (readers that take every "
                     "*.safetensors.index.json of a folder, reshard's without model.safetensors.index.json, read both)"),
    ("consolidated*.safetensors", "Mistral-format loaders (vLLM --load-format mistral, mistral-inference) load it"),
    ("adapter_model.safetensors", "PEFT and from_pretrained load it as an adapter on top of the model"),
    ("adapter_model.bin", "PEFT and from_pretrained load it as an adapter on top of the model"),
)


def _loaded_instead(expected: set[str], added: list[str]) -> dict[str, str]:
    """The files among ``added`` (not in the manifest) that a loader would take as weights,
    instead of or beside the manifest's, each with who takes it and why."""
    out = {}
    listed_hf = [n for n in _HF_ORDER if n in expected]
    indexed = any(n.endswith(".safetensors.index.json") for n in expected)
    unindexed = not indexed and any(n.endswith(".safetensors") for n in expected)
    for rel in added:
        if "/" in rel:
            continue  # loaders read a model folder's top level
        if rel in _HF_ORDER:
            ahead = not listed_hf or _HF_ORDER.index(rel) < _HF_ORDER.index(listed_hf[0])
            if ahead:
                how = f"instead of {listed_hf[0] if listed_hf else 'the files the manifest lists'}"
            else:
                how = f"once {listed_hf[0]} is gone" + (
                    " or with use_safetensors=False" if rel.startswith("pytorch_model") else "")
            out[rel] = f"transformers' from_pretrained loads it {how} (it takes the first of {', '.join(_HF_ORDER)})"
        elif why := next((w for pattern, w in LOADED_BY_NAME if fnmatch.fnmatchcase(rel, pattern)), None):
            out[rel] = why
        elif unindexed and rel.endswith(".safetensors"):
            out[rel] = "the manifest's safetensors have no index: readers of the folder (reshard, vLLM) load every *.safetensors"
    return out


def file_digest(path: Path) -> FileDigest:
    """Size and SHA-256 of one file, read in fixed blocks into one reused buffer."""
    h = hashlib.sha256()
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return FileDigest(size, h.hexdigest())


def _files(root: Path) -> list[str]:
    """Relative POSIX paths of every regular file under ``root``, the manifest excepted.
    Symlinked folders are not followed (a folder we wrote has none; one we check could point anywhere)."""
    out = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in names:
            path = Path(folder, name)
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST_NAME and path.is_file():
                out.append(rel)
    return sorted(out)


def _digests(root: Path, relpaths: list[str], workers: int | None) -> dict[str, FileDigest]:
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    biggest_first = sorted(relpaths, key=lambda r: -(root / r).stat().st_size)
    with ThreadPoolExecutor(workers) as pool:
        done = dict(zip(biggest_first, pool.map(lambda r: file_digest(root / r), biggest_first)))
    return {r: done[r] for r in relpaths}


def write_manifest(root: Path, *, workers: int | None = None, known: dict[str, FileDigest] | None = None) -> Path:
    """Hash every file under ``root`` and write ``root/.reshard-manifest.json``. ``known``
    digests (taken by the engine as it finished each file, on whichever rank wrote it) are
    used as they are while the file still has that size; every other file is hashed here.

    Deterministic (sorted, no timestamps): two conversions of the same source into the same
    layout produce byte-identical folders, manifest included."""
    root = Path(root)
    present = _files(root)
    reuse = {r: d for r, d in (known or {}).items() if r in set(present) and (root / r).stat().st_size == d.size}
    digests = {**reuse, **_digests(root, [r for r in present if r not in reuse], workers)}
    path = root / MANIFEST_NAME
    path.write_bytes(manifest_bytes({r: digests[r] for r in present}))
    return path


def manifest_bytes(digests: dict[str, FileDigest]) -> bytes:
    """The manifest listing ``digests`` (relative POSIX path -> size and SHA-256), as written."""
    doc = {
        "reshard_manifest": _VERSION,
        "algorithm": ALGORITHM,
        "files": {rel: {"size": d.size, ALGORITHM: d.sha256} for rel, d in sorted(digests.items())},
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _safe_relpath(manifest: Path | str, rel: object) -> str:
    """A manifest names files inside its folder only: a hostile one must not make us read
    (and report on) /etc/shadow or ../other_ckpt."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        raise CorruptCheckpointError(f"{manifest}: file entry {rel!r} is not a relative path")
    parts = PurePosixPath(rel).parts
    if rel.startswith("/") or ".." in parts or "." in parts or rel != PurePosixPath(rel).as_posix():
        raise UnsafeCheckpointError(f"{manifest}: file entry {rel!r} points outside its folder; refused")
    return rel


def read_manifest(root: Path) -> dict[str, FileDigest]:
    """The validated manifest of folder ``root``; errors name the manifest and the field."""
    root = Path(root)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        what = "a single file" if root.is_file() else "not found"
        raise CheckpointNotFoundError(
            f"{root}: {what}; verify --quick checks a folder's {MANIFEST_NAME} (single-file outputs carry none: "
            "compare with the source instead, reshard verify SRC DST)")
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{root}: no {MANIFEST_NAME} (written by reshard convert since 0.1); compare with the source instead: "
            "reshard verify SRC DST")
    if path.stat().st_size > _MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path}: larger than {_MAX_MANIFEST_BYTES} bytes; not a reshard manifest")
    return parse_manifest(path.read_bytes(), path)


def parse_manifest(data: bytes, path: Path | str) -> dict[str, FileDigest]:
    """The validated manifest in ``data`` (read from ``path``, which errors name)."""
    if len(data) > _MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path}: larger than {_MAX_MANIFEST_BYTES} bytes; not a reshard manifest")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("reshard_manifest") != _VERSION or doc.get("algorithm") != ALGORITHM:
        raise CorruptCheckpointError(
            f"{path}: not a version-{_VERSION} {ALGORITHM} reshard manifest (a newer reshard wrote it?)")
    files = doc.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"{path}: 'files' is not an object")
    out = {}
    for rel, entry in files.items():
        rel = _safe_relpath(path, rel)
        size = entry.get("size") if isinstance(entry, dict) else None
        digest = entry.get(ALGORITHM) if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not isinstance(digest, str) or len(digest) != 64 \
                or not all(c in "0123456789abcdef" for c in digest):
            raise CorruptCheckpointError(f"{path}: entry for {rel!r} needs a size and a 64-digit hex {ALGORITHM}")
        out[rel] = FileDigest(size, digest)
    return out


def check_manifest(root: Path, *, workers: int | None = None) -> tuple[int, list[ManifestProblem]]:
    """(files checked, problems) for folder ``root`` against its manifest: each file whose
    size or hash differs, that is missing, or that the manifest does not list: a weights file
    loaders would take (``unlisted_weights``), or any other file added afterwards, a README or
    tokenizer copied in (``not_in_manifest``: the caller decides what that means). Sizes are
    compared first, so a truncated file is reported without reading it."""
    root = Path(root)
    expected = read_manifest(root)
    present = set(_files(root))
    problems = [ManifestProblem(rel, "missing", "listed in the manifest but not in the folder")
                for rel in sorted(set(expected) - present)]
    added = sorted(present - set(expected))
    weights = _loaded_instead(set(expected), added)
    problems += [ManifestProblem(rel, "unlisted_weights", f"not in the manifest, and {weights[rel]}") if rel in weights
                 else ManifestProblem(rel, "not_in_manifest", "in the folder but not in the manifest (added later?)")
                 for rel in added]
    same_size = []
    for rel in sorted(set(expected) & present):
        size = (root / rel).stat().st_size
        if size != expected[rel].size:
            problems.append(ManifestProblem(rel, "size", f"{size} bytes, manifest says {expected[rel].size}"))
        else:
            same_size.append(rel)
    for rel, got in _digests(root, same_size, workers).items():
        if got.sha256 != expected[rel].sha256:
            problems.append(ManifestProblem(
                rel, "checksum", f"{ALGORITHM} {got.sha256[:16]}..., manifest says {expected[rel].sha256[:16]}..."))
    return len(expected), sorted(problems, key=lambda p: p.relpath)
