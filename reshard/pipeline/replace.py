"""What ``--overwrite`` may delete: what reshard wrote, or the one file the user named.

``--overwrite`` is the only place reshard removes anything a user has, so it is held to rules a
user can predict, checked before any work and again under the output's lock just before the
old output goes (a conversion can run for an hour; a user may copy a tokenizer in meanwhile):

* a destination that is, contains or lies inside a source, or is or holds any file the source
  reads (a shard an index names, the blob a Hub snapshot's symlink points to), is never
  written, with or without ``--overwrite`` (paths compared after resolving symlinks and
  ``..``: ``plink -> parent`` is ``parent``); bind mounts show the same files under two
  unrelated paths and are not seen;
* the working directory, the home directory and a file system root (a mount point) are never
  replaced;
* a file is replaced, that file alone;
* a folder is replaced only when everything in it is a previous reshard output: files its
  ``.reshard-manifest.json`` lists (every folder output carries one), the manifest itself, and
  the upload state ``reshard push`` leaves (huggingface_hub's ``.cache/huggingface/upload/``
  and its ``.gitignore``). An empty folder holds
  nothing to lose. Anything else (a user's file, a folder of notes, another tool's output) is
  named in the refusal, with nothing touched.

The same rule holds for a prefix of an object store (``reshard.pipeline.sinks.RemoteSink``),
whose folder outputs carry the manifest too, and where a write in progress keeps a claim
(``.reshard-writing.json``: the names it is putting) until its manifest is in place, so a
write killed outright is still known to be reshard's. The old output is removed only after
the new one is complete (``reshard.pipeline.staging``; an object store has no rename, see
``reshard.pipeline.sinks``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

from reshard.core.errors import OutputExistsError, ReshardError, UsageError
from reshard.pipeline.manifest import MANIFEST_NAME, parse_manifest, read_manifest

__all__ = ["CLAIM_NAME", "refuse_overlap", "refuse_unreplaceable", "foreign_files", "refusal", "claim_bytes",
           "remote_foreign"]

CLAIM_NAME = ".reshard-writing.json"  # an upload in progress: the names it puts (reshard.pipeline.sinks.RemoteSink)

# What reshard leaves inside a folder output besides the files its manifest lists: push's
# resumable upload state (huggingface_hub's upload_large_folder keeps it in
# FOLDER/.cache/huggingface/upload/, beside a .gitignore of its own); nothing else there.
_OURS_UNLISTED = (MANIFEST_NAME, ".cache/huggingface/upload", ".cache/huggingface/.gitignore")
_SHOWN = 3  # foreign entries named in a refusal


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


def refuse_overlap(dst: Path, sources: Iterable[Path]) -> None:
    """A destination that is, contains or lies inside a source (the path given, or any file
    the source reads): refused, whatever the options (writing there would delete or change
    the source before it is read)."""
    out = _resolved(dst)
    for src in sources:
        real = _resolved(src)
        if out == real or real in out.parents:
            raise UsageError(f"{dst}: the output would overwrite or sit inside the source {src}; pick another output")
        if out in real.parents:
            raise UsageError(f"{dst}: the source {src} lies inside it, and --overwrite would delete it; "
                             "pick another output")


def _protected(dst: Path) -> str | None:
    """Why ``dst`` may never be replaced, or None."""
    out = _resolved(dst)
    if out == _resolved(Path.cwd()):
        return "is the working directory"
    if out == _resolved(Path.home()):
        return "is the home directory"
    if out == Path(out.anchor) or os.path.ismount(out):
        return "is the root of a file system"
    return None


def _is_ours_unlisted(rel: str, folder: bool) -> bool:
    return any(rel == name or rel.startswith(name + "/") or (folder and name.startswith(rel + "/"))
               for name in _OURS_UNLISTED)


def foreign_files(present: Iterable[str], listed: set[str]) -> list[str]:
    """The entries of ``present`` (POSIX paths relative to a folder, folders ending in ``/``)
    that reshard did not write: files its manifest does not list, and folders that hold none
    of the listed files."""
    listed_dirs = {str(parent) for rel in listed for parent in PurePosixPath(rel).parents}
    out = []
    for rel in present:
        if _is_ours_unlisted(rel.rstrip("/"), rel.endswith("/")):
            continue
        if rel.endswith("/"):
            if rel.rstrip("/") not in listed_dirs:
                out.append(rel)
        elif rel not in listed:
            out.append(rel)
    return out


def _entries(folder: Path) -> list[str]:
    """Every file and folder under ``folder`` (folders as ``name/``), symlinks not followed
    (a symlink is an entry of its own: reshard writes none)."""
    out = []
    for root, dirs, names in os.walk(folder):
        base = Path(root).relative_to(folder)
        for name in sorted(dirs):
            rel = (base / name).as_posix()
            out.append(rel if (Path(root) / name).is_symlink() else rel + "/")
        out.extend((base / name).as_posix() for name in sorted(names))
    return out


def _outermost(foreign: list[str]) -> list[str]:
    """``notes/`` rather than ``notes/``, ``notes/a.txt``: each foreign folder once, not its files."""
    folders = [f for f in foreign if f.endswith("/")]
    return [f for f in foreign if not any(f != d and f.startswith(d) for d in folders)]


def refusal(dst: object, foreign: Sequence[str], where: str = "folder") -> OutputExistsError:
    """The one-line refusal of a destination that holds ``foreign`` entries."""
    shown = _outermost(sorted(foreign))
    names = ", ".join(shown[:_SHOWN]) + (f" and {len(shown) - _SHOWN} more" if len(shown) > _SHOWN else "")
    count = f"{len(shown)} entr{'y' if len(shown) == 1 else 'ies'}"
    return OutputExistsError(f"{dst}: --overwrite replaces only what reshard wrote, and this {where} holds {count} it "
                             f"did not write ({names}); move them away or pick another output")


def refuse_unreplaceable(dst: Path) -> None:
    """Refuse to replace ``dst`` (it exists; the caller was asked to overwrite) unless it is a
    file or a folder reshard wrote."""
    why = _protected(dst)
    if why is not None:
        raise UsageError(f"{dst}: {why}; --overwrite never replaces it, pick another output")
    real = _resolved(dst)
    if not real.is_dir():
        return  # one file, the one the user named
    entries = _entries(real)
    if not entries:
        return  # an empty folder: nothing to lose
    try:
        listed = set(read_manifest(real)) if (real / MANIFEST_NAME).is_file() else set()
    except ReshardError:  # a manifest we cannot read proves nothing
        listed = set()
    foreign = foreign_files(entries, listed)
    if foreign:
        raise refusal(dst, foreign)


def claim_bytes(names: Iterable[str]) -> bytes:
    """The claim an upload in progress keeps beside its files: the names it puts."""
    return json.dumps({"reshard_writing": 1, "files": sorted(set(names))}, indent=1).encode() + b"\n"


def _claimed(claim: bytes) -> set[str]:
    try:
        doc = json.loads(claim)
    except (ValueError, RecursionError):
        return set()
    files = doc.get("files") if isinstance(doc, dict) and doc.get("reshard_writing") == 1 else None
    return {f for f in files if isinstance(f, str)} if isinstance(files, list) else set()


def remote_foreign(keys: Sequence[str], manifest: bytes | None, claim: bytes | None, shown: str) -> list[str]:
    """The keys (relative to an output's prefix) that reshard did not write there, by the
    bytes of a finished output's manifest and of an unfinished upload's claim (None: absent)."""
    listed: set[str] = set()
    if manifest is not None:
        try:
            listed = set(parse_manifest(manifest, shown))
        except ReshardError:
            listed = set()
    if claim is not None:
        listed |= _claimed(claim) | {CLAIM_NAME}
    return foreign_files(keys, listed)
