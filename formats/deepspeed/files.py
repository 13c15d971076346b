"""Which files make up a DeepSpeed checkpoint, checked before any is unpickled.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag, ``global_step2``) and
``dir/<tag>/``:

* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (the module, shapes, engine state) and one
  ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank (``bf16_`` in front
  for bf16 runs), each holding that rank's flat partition;
* ZeRO-3: a ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank too (empty placeholders
  for the weights), beside the optimizer files.

``ds_to_universal`` writes a universal folder (``latest_universal`` beside it): the model
states files and ``zero/<param>/{fp32,exp_avg,exp_avg_sq[,step]}.pt``.

Tensor-parallel (``mp_rank_01``...) and pipeline (``layer_*``) checkpoints are refused with a
message: their parts need the model's TP layout, which these files do not record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError

__all__ = ["ZeroFiles", "zero_files", "check_world", "resolve_tag", "is_zero_folder", "is_universal_folder"]

_OPTIM = re.compile(r"(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_Z3_MODEL = re.compile(r"(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_MODEL = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_TAG = re.compile(r"[A-Za-z0-9_.+-]{1,200}")


@dataclass(frozen=True)
class ZeroFiles:
    """A ZeRO checkpoint folder: its model states file(s) and one optimizer file per rank."""

    folder: Path
    optim: dict[int, Path]  # data-parallel rank -> *_optim_states.pt
    model: dict[int, Path]  # ZeRO-3: rank -> its model states; ZeRO-1/2: {0: mp_rank_00_model_states.pt}


def _names(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir() if p.is_file())
    except OSError:
        return []


def is_zero_folder(path: Path) -> bool:
    names = _names(path)
    return any(_OPTIM.fullmatch(n) for n in names) and any(_MODEL.fullmatch(n) or _Z3_MODEL.fullmatch(n) for n in names)


def is_universal_folder(path: Path) -> bool:
    return (path / "zero").is_dir() and any(_MODEL.fullmatch(n) or _Z3_MODEL.fullmatch(n) for n in _names(path))


def resolve_tag(path: Path) -> Path:
    """``path`` itself, or the folder its ``latest`` (or ``latest_universal``) file names."""
    if is_zero_folder(path) or is_universal_folder(path):
        return path
    for marker in ("latest", "latest_universal"):
        file = path / marker
        if not file.is_file():
            continue
        tag = file.read_text(errors="replace").strip()
        if not _TAG.fullmatch(tag) or tag in (".", ".."):
            raise CorruptCheckpointError(f"{file}: names {tag[:80]!r}, not a checkpoint tag such as global_step2")
        target = path / tag
        if not target.is_dir():
            raise CheckpointNotFoundError(f"{file}: names {tag!r}, but {target} does not exist")
        return target
    raise CheckpointNotFoundError(f"{path}: not a DeepSpeed checkpoint folder (no *_optim_states.pt, no latest file)")


def _refuse_parallel(folder: Path, names: list[str]) -> None:
    tp = sorted({n for n in names if (m := _OPTIM.fullmatch(n) or _MODEL.fullmatch(n) or _Z3_MODEL.fullmatch(n))
                 and int(m.groups()[-1]) != 0})
    if tp:
        raise UnsupportedFormatError(
            f"{folder / tp[0]}: a tensor-parallel DeepSpeed checkpoint (mp_rank > 0); reshard reads data-parallel "
            "ZeRO checkpoints: convert it with DeepSpeed's ds_to_universal first, then read the universal folder")
    if any(n.startswith("layer_") and n.endswith("model_states.pt") for n in names):
        raise UnsupportedFormatError(
            f"{folder}: a pipeline-parallel DeepSpeed checkpoint (layer_*-model_states.pt), which reshard does not read")


def _by_rank(pattern: re.Pattern[str], names: list[str], folder: Path, what: str) -> dict[int, Path]:
    out: dict[int, Path] = {}
    kinds: set[str | None] = set()
    for n in names:
        m = pattern.fullmatch(n)
        if m is None:
            continue
        kind, rank = m.group(1), int(m.group(2))
        if rank in out:
            raise CorruptCheckpointError(f"{folder}: two {what} files for rank {rank}: {out[rank].name} and {n}")
        out[rank], kinds = folder / n, kinds | {kind}
    if len(kinds) > 1:
        raise CorruptCheckpointError(f"{folder}: {what} files of different precisions mixed "
                                     f"({', '.join(sorted(k or 'plain' for k in kinds))}); left over from another run?")
    return dict(sorted(out.items()))


def zero_files(folder: Path) -> ZeroFiles:
    """The folder's files by rank (checked against the partition count the files record, once
    read: ``check_world``)."""
    names = _names(folder)
    _refuse_parallel(folder, names)
    optim = _by_rank(_OPTIM, names, folder, "optimizer state")
    z3 = _by_rank(_Z3_MODEL, names, folder, "model state")
    model = z3 or ({0: folder / "mp_rank_00_model_states.pt"} if "mp_rank_00_model_states.pt" in names else {})
    if not optim:
        raise CheckpointNotFoundError(f"{folder}: no *_optim_states.pt files (not a DeepSpeed ZeRO checkpoint)")
    if not model:
        raise CheckpointNotFoundError(f"{folder}: no mp_rank_00_model_states.pt or zero_pp_rank_*_model_states.pt")
    if 0 not in optim:
        raise CorruptCheckpointError(f"{folder / _rank_name(next(iter(optim.values())).name, 0)}: missing (optimizer "
                                     f"state of rank 0; the folder has ranks {sorted(optim)})")
    return ZeroFiles(folder, optim, model)


def _rank_name(example: str, rank: int) -> str:
    return re.sub(r"zero_pp_rank_\d+", f"zero_pp_rank_{rank}", example)


def check_world(files: ZeroFiles, world: int, said_by: Path) -> None:
    """Every rank 0..world-1 has its files, and no other rank does (``world``: the partition
    count ``said_by`` records)."""
    sets = [("optimizer state", files.optim)] + ([("model state", files.model)] if len(files.model) > 1 else [])
    for what, ranks in sets:
        missing = sorted(set(range(world)) - set(ranks))
        if missing:
            lost = _rank_name(next(iter(ranks.values())).name, missing[0])
            raise CorruptCheckpointError(f"{files.folder / lost}: missing ({what} of rank {missing[0]}: {said_by.name} "
                                         f"is one of {world} partitions, the folder has ranks {sorted(ranks)})")
        extra = sorted(set(ranks) - set(range(world)))
        if extra:
            raise CorruptCheckpointError(f"{ranks[extra[0]]}: {what} of rank {extra[0]}, but {said_by.name} is one of "
                                         f"{world} partitions (left over from a run with another world size?)")
