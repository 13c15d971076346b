"""The Hugging Face Hub: a repo id as a conversion source, and ``reshard push``.

Everything that talks to the Hub goes through huggingface_hub, so its cache, token lookup
(``HF_TOKEN``, ``hf auth login``), endpoint and offline mode (``HF_HUB_OFFLINE=1``) behave as
they do for every other HF tool. A push checks the folder first, the way transformers will
read it (index, headers, tied weights, config.json), because a broken upload is public and
slow to undo; ``dry_run`` stops after the check and touches no network.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, ReshardError, UsageError
from reshard.core.json_file import read_json
from reshard.core.log import log_notices
from reshard.core.values import same_values
from reshard.features.architecture import require_architecture
from reshard.features.hf_options import ARCHITECTURE_CHECK
from reshard.formats.registry import detect_format

__all__ = ["hub_source", "cached_hub_folder", "hub_files", "check_folder", "push", "PushResult", "LARGE_FOLDER_BYTES"]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_WEIGHTS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json"]
# Above this, ``upload_large_folder`` (resumable, several commits, parallel workers), as the
# Hub's own docs advise for folders of more than a few GB.
LARGE_FOLDER_BYTES = 5 * 10**9
HUB_FILE_LIMIT = 50 * 10**9  # the Hub refuses larger files (its docs: "max 50GB per file")
_SKIP = (".git", ".cache")  # what upload_folder leaves out (and upload_large_folder's state)
_LOCAL = ".reshard-"  # reshard's own bookkeeping (the .reshard-manifest.json of `verify --quick`)
_IGNORE = [".cache/**", ".git/**", f"{_LOCAL}*"]
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
_INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME


def hub_source(src: Path) -> tuple[Path, Path]:
    """(local folder, path to name default outputs after) for a SRC that does not exist here.

    ``owner/name`` or ``owner/name@revision`` is downloaded (weights and configs only) into the
    huggingface_hub cache, or found there when offline; outputs then default to the current
    folder, never into the cache. Anything else comes back unchanged, for the usual error.
    """
    text = str(src)
    repo_id, _, revision = text.partition("@")
    if src.exists() or not _REPO_ID.fullmatch(repo_id):
        return src, src
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    where = f"{src}: no such local path, and as a Hub repo"
    try:
        local = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=_WEIGHTS))
    except RepositoryNotFoundError:
        raise CheckpointNotFoundError(f"{where} it does not exist or you have no access (log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise CheckpointNotFoundError(f"{where} it has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise CheckpointNotFoundError(
            f"{where} it is not in the local cache and the Hub cannot be reached (offline mode or no network)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointNotFoundError(f"{where} it could not be downloaded: {_first_line(e)}") from None
    if not any(local.glob("*.safetensors")):
        raise CheckpointNotFoundError(f"{repo_id}: the repo has no *.safetensors weights (reshard reads those, not .bin files)")
    return local, Path.cwd() / repo_id.split("/")[-1]


def cached_hub_folder(url: str) -> Path | None:
    """The local snapshot of ``hf://owner/name[@revision]`` when huggingface_hub's cache holds
    all its weights (no network is asked); None when it does not, and the URL is then read from
    the Hub in byte ranges by ``HfFileSystem``, which honours ``HF_TOKEN`` and ``HF_HUB_OFFLINE``."""
    if not url.startswith("hf://"):
        return None
    repo_id, _, revision = url[len("hf://"):].strip("/").partition("@")
    if not _REPO_ID.fullmatch(repo_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        local = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=_WEIGHTS, local_files_only=True))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError):
        return None
    index = local / "model.safetensors.index.json"
    try:
        wanted = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
    except (ValueError, KeyError, TypeError, OSError):
        return None
    have = {p.name for p in local.glob("*.safetensors")}
    return local if have and wanted <= have else None


def hub_files(repo_id: str, names: list[str], *, what: str) -> Path:
    """The snapshot folder holding ``names`` (those the repo has) of Hub repo ``repo_id``,
    downloaded into huggingface_hub's cache, or found there when offline."""
    repo, _, revision = repo_id.partition("@")
    if not _REPO_ID.fullmatch(repo):
        raise UsageError(f"{what} {repo_id}: no such file or folder, and not a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=names))
    except RepositoryNotFoundError:
        raise UsageError(f"{what} {repo_id}: no such Hub repo, or no access (log in with `hf auth login`)") from None
    except LocalEntryNotFoundError:
        raise UsageError(f"{what} {repo_id}: not in the local Hugging Face cache and the Hub cannot be reached "
                         "(offline); give a local folder instead") from None
    except (HfHubHTTPError, OSError) as e:
        raise UsageError(f"{what} {repo_id}: could not be downloaded: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _files(folder: Path) -> list[tuple[str, int]]:
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(p in _SKIP for p in rel.parts[:-1]) and not rel.name.startswith(_LOCAL):
            out.append((rel.as_posix(), path.stat().st_size))
    return out


def _check_ties(folder: Path, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    tie = config.get("tie_word_embeddings")
    if tie is True and _HEAD in tensors and _EMBED in tensors and not same_values(tensors[_HEAD], tensors[_EMBED], 1 << 28):
        raise CorruptCheckpointError(f"{folder}: config.json ties the embeddings but {_HEAD} differs from {_EMBED}; "
                                     "re-export with tie_word_embeddings false, or drop lm_head.weight")
    causal = any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or [])
    if tie is False and causal and _EMBED in tensors and _HEAD not in tensors:
        raise CorruptCheckpointError(f"{folder}: config.json unties the embeddings but there is no {_HEAD}; "
                                     "transformers would initialize it at random (set tie_word_embeddings to true?)")


def check_folder(folder: Path, *, architecture_check: bool = True, notices: list[str] | None = None) -> list[tuple[str, int]]:
    """(path, bytes) of every file a push sends, once the folder passes the checks transformers
    relies on: config.json present; the index names only files that exist and covers every
    tensor of every shard (no stray shard); every header parses; tied weights consistent; the
    tensors are the model config.json describes (``reshard.features.architecture``, unless
    ``architecture_check`` is off). What the check could not do is added to ``notices``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: not a folder; push uploads an HF model folder (`reshard convert SRC --to hf`)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CorruptCheckpointError(f"{folder}: no config.json, so transformers cannot load it; export with "
                                     "`reshard convert SRC --to hf` from a checkpoint that records its config, or add one")
    config = read_json(config_path, "config.json")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise CorruptCheckpointError(f"{folder}: no *.safetensors weights to push")
    catalog = detect_format(folder).read(folder)  # safetensors (there are some): validates the index and every header
    if (folder / _INDEX).is_file():
        named = json.loads((folder / _INDEX).read_text())["weight_map"].values()
        stray = sorted(set(shards) - set(named))
        if stray:
            raise CorruptCheckpointError(f"{folder / stray[0]}: not named by {_INDEX}; transformers would ignore it "
                                         "(remove it, or re-export the folder)")
    elif shards != ["model.safetensors"]:
        raise CorruptCheckpointError(f"{folder}: {len(shards)} safetensors files but no {_INDEX} "
                                     "(transformers loads model.safetensors or an indexed set)")
    _check_ties(folder, config, catalog.tensors)
    if architecture_check:
        said = require_architecture(config, catalog.tensors, where=str(folder), action="push it",
                                    fix="re-export it with reshard convert SRC --to hf (with --keymap or --config as needed)")
    else:
        said = f"not checked against an architecture ({ARCHITECTURE_CHECK.named})"
    if notices is not None:
        notices.append(said)
    return _files(folder)


@dataclass
class PushResult:
    """What ``reshard.push`` sent (or, with ``dry_run``, would send): (path, bytes) per file,
    the repo or pull-request URL, and what the user should know (stale weights left in the repo)."""

    repo_id: str
    files: list[tuple[str, int]]
    dry_run: bool
    url: str | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "dry_run": self.dry_run, "url": self.url, "bytes": self.bytes,
                "files": [{"path": p, "bytes": n} for p, n in self.files], "notices": list(self.notices)}


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or flag.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _network_error(e: BaseException) -> bool:
    # huggingface_hub's HTTP client changed between releases (requests, httpx, httpx2).
    module = type(e).__module__.split(".")[0]
    return isinstance(e, (OSError, ConnectionError, TimeoutError)) or module.startswith(("httpx", "httpcore", "requests",
                                                                                         "urllib3"))


def _check_arguments(folder: Path, repo_id: str) -> None:
    """``hf upload`` takes REPO_ID PATH; push takes FOLDER REPO_ID: say so when they look swapped."""
    if not folder.exists() and _REPO_ID.fullmatch(str(folder)) and Path(repo_id).is_dir():
        raise UsageError(f"the arguments look swapped: reshard push takes FOLDER REPO_ID "
                         f"(reshard push {repo_id} {folder}), the other way round from `hf upload REPO_ID PATH`")
    if not _REPO_ID.fullmatch(repo_id):
        raise UsageError(f"{repo_id!r} is not a Hub repo id; use owner/name (reshard push FOLDER REPO_ID)")


def _selected(files: list[tuple[str, int]], include: list[str] | None, exclude: list[str] | None) -> list[tuple[str, int]]:
    out = [(n, size) for n, size in files
           if (not include or any(fnmatch.fnmatchcase(n, g) for g in include))
           and not any(fnmatch.fnmatchcase(n, g) for g in exclude or [])]
    if not out:
        raise UsageError("--include/--exclude leave nothing to upload")
    return out


def _stale(existing: set[str], sending: set[str]) -> list[str]:
    """Weight files the repo keeps that this push neither sends nor replaces: transformers may
    load them instead of (or beside) the new ones."""
    weights = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")
    return sorted(f for f in existing - sending if any(fnmatch.fnmatchcase(f, w) for w in weights))


def push(folder: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, dry_run: bool = False, token: str | None = None,
         create_pr: bool = False, include: list[str] | None = None, exclude: list[str] | None = None,
         architecture_check: bool = True) -> PushResult:
    """Upload HF model folder ``folder`` to Hub model repo ``repo_id`` (created if needed).

    The folder is checked first (``check_folder``: config, index, headers, ties, and the
    architecture config.json names, built by transformers on the meta device, unless
    ``architecture_check=False``) and no file may pass the Hub's 50 GB per-file limit; ``dry_run=True`` returns the files and
    sizes that would
    be sent without touching the network. ``include``/``exclude`` are globs on the folder's
    paths. A repo that already holds other files (a tokenizer uploaded first) is fine; weight
    files the push would leave stale are named in ``notices``. ``create_pr`` opens a pull
    request instead of committing to the branch. Folders over a few GB go through
    huggingface_hub's resumable large-folder upload.

    >>> reshard.push("ckpt_hf/", "me/tiny-llama", private=True)
    """
    folder = Path(folder)
    _check_arguments(folder, repo_id)
    notices: list[str] = []
    files = _selected(check_folder(folder, architecture_check=architecture_check, notices=notices), include, exclude)
    too_big = [(n, size) for n, size in files if size >= HUB_FILE_LIMIT]
    if too_big:
        name, size = too_big[0]
        raise UsageError(f"{folder / name}: {size / 1e9:.1f} GB passes the Hub's 50 GB limit per file; re-export with "
                         "--max-shard-size 5GB before pushing")
    result = PushResult(repo_id, files, dry_run, notices=notices)
    if dry_run:
        log_notices(result.notices)
        return result
    if _offline():
        raise UsageError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it to push, or use --dry-run")
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    token = token or huggingface_hub.get_token()
    if not token:
        raise UsageError("no Hugging Face token: run `hf auth login`, set HF_TOKEN or pass --token (write access)")
    api = huggingface_hub.HfApi(token=token)
    allow = [name for name, _ in files]
    try:
        result.url = str(api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model"))
        if revision and not create_pr:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        existing = set(api.list_repo_files(repo_id, revision=revision, repo_type="model"))
        stale = _stale(existing, set(allow))
        if stale:
            result.notices.append(f"the repo keeps weight files this push does not replace: {', '.join(stale[:4])}"
                                  f"{' ...' if len(stale) > 4 else ''}; delete them if they belong to an older export")
        large = getattr(api, "upload_large_folder", None)
        if large is not None and result.bytes >= LARGE_FOLDER_BYTES and not create_pr:
            # Resumable and committed in parts; it takes no commit message and keeps its state
            # in FOLDER/.cache/huggingface, which later pushes skip.
            large(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision, allow_patterns=allow,
                  ignore_patterns=_IGNORE)
            if commit_message:
                result.notices.append("large folders are committed in parts with automatic messages; --commit-message not used")
        else:
            info = api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                                     commit_message=commit_message or f"Upload {folder.name} with reshard",
                                     allow_patterns=allow, ignore_patterns=_IGNORE, create_pr=create_pr)
            pr = getattr(info, "pr_url", None)
            if pr:
                result.url = str(pr)
    except ReshardError:
        raise
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = " (is the token allowed to write there?)" if status in (401, 403) else ""
        raise ReshardError(f"{repo_id}: the Hub refused the push: {_first_line(e)}{hint}") from None
    except Exception as e:
        if _network_error(e):
            raise ReshardError(f"{repo_id}: could not reach the Hub ({_first_line(e)}); check the network, or use "
                               f"--dry-run") from None
        raise
    log_notices(result.notices)
    return result
