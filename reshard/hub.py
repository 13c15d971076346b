"""The Hugging Face Hub: a repo id as a conversion source, and ``reshard push``.

Everything that talks to the Hub goes through huggingface_hub, so its cache, token lookup
(``HF_TOKEN``, ``hf auth login``), endpoint and offline mode (``HF_HUB_OFFLINE=1``) behave as
they do for every other HF tool. A push checks the folder first, the way transformers will
read it (index, headers, tied weights, config.json), because a broken upload is public and
slow to undo; ``dry_run`` stops after the check and touches no network.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointNotFoundError, CorruptCheckpointError, OutputExistsError, ReshardError, UsageError

__all__ = ["hub_source", "check_folder", "push", "PushResult", "LARGE_FOLDER_BYTES"]

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_WEIGHTS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json"]
# Above this, ``upload_large_folder`` (resumable, several commits) where huggingface_hub has
# it; recent huggingface_hub versions batch large folders inside ``upload_folder`` itself.
LARGE_FOLDER_BYTES = 50 * 10**9
_SKIP = (".git", ".cache")  # what upload_folder leaves out (and upload_large_folder's state)
_LOCAL = ".reshard-"  # reshard's own bookkeeping (the .reshard-manifest.json of `verify --quick`)
_IGNORE = [".cache/**", ".git/**", f"{_LOCAL}*"]
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


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
    from reshard.formats.hf import same_values

    tie = config.get("tie_word_embeddings")
    if tie is True and _HEAD in tensors and _EMBED in tensors and not same_values(tensors[_HEAD], tensors[_EMBED], 1 << 28):
        raise CorruptCheckpointError(f"{folder}: config.json ties the embeddings but {_HEAD} differs from {_EMBED}; "
                                     "re-export with tie_word_embeddings false, or drop lm_head.weight")
    causal = any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or [])
    if tie is False and causal and _EMBED in tensors and _HEAD not in tensors:
        raise CorruptCheckpointError(f"{folder}: config.json unties the embeddings but there is no {_HEAD}; "
                                     "transformers would initialize it at random (set tie_word_embeddings to true?)")


def check_folder(folder: Path) -> list[tuple[str, int]]:
    """(path, bytes) of every file a push sends, once the folder passes the checks transformers
    relies on: config.json present; the index names only files that exist and covers every
    tensor of every shard (no stray shard); every header parses; tied weights consistent."""
    from reshard.formats.safetensors import INDEX_NAME, SafetensorsFormat

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: not a folder; push uploads an HF model folder (`reshard convert SRC --to hf`)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CorruptCheckpointError(f"{folder}: no config.json, so transformers cannot load it; export with "
                                     "`reshard convert SRC --to hf` from a checkpoint that records its config, or add one")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{config_path}: not a JSON object")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise CorruptCheckpointError(f"{folder}: no *.safetensors weights to push")
    catalog = SafetensorsFormat().read(folder)  # validates the index and every header
    if (folder / INDEX_NAME).is_file():
        named = json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()
        stray = sorted(set(shards) - set(named))
        if stray:
            raise CorruptCheckpointError(f"{folder / stray[0]}: not named by {INDEX_NAME}; transformers would ignore it "
                                         "(remove it, or re-export the folder)")
    elif shards != ["model.safetensors"]:
        raise CorruptCheckpointError(f"{folder}: {len(shards)} safetensors files but no {INDEX_NAME} "
                                     "(transformers loads model.safetensors or an indexed set)")
    _check_ties(folder, config, catalog.tensors)
    return _files(folder)


@dataclass
class PushResult:
    repo_id: str
    files: list[tuple[str, int]]
    dry_run: bool
    url: str | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.files)


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or flag.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _network_error(e: BaseException) -> bool:
    # huggingface_hub's HTTP client changed between releases (requests, httpx, httpx2).
    module = type(e).__module__.split(".")[0]
    return isinstance(e, (OSError, ConnectionError, TimeoutError)) or module.startswith(("httpx", "httpcore", "requests", "urllib3"))


def push(folder: str | os.PathLike, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, dry_run: bool = False) -> PushResult:
    """Upload HF model folder ``folder`` to Hub model repo ``repo_id`` (created if needed).

    The folder is checked first (``check_folder``); ``dry_run=True`` returns the files and sizes
    that would be sent without touching the network. A repo that already holds files other
    than these is refused rather than mixed with them.

    >>> reshard.push("ckpt_hf/", "me/tiny-llama", private=True)
    """
    if not _REPO_ID.fullmatch(repo_id):
        raise UsageError(f"{repo_id!r} is not a Hub repo id; use owner/name")
    folder = Path(folder)
    files = check_folder(folder)
    result = PushResult(repo_id, files, dry_run)
    if dry_run:
        return result
    if _offline():
        raise UsageError("HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it to push, or use --dry-run")
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    token = huggingface_hub.get_token()
    if not token:
        raise UsageError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)")
    api = huggingface_hub.HfApi(token=token)
    try:
        result.url = str(api.create_repo(repo_id, private=True if private else None, exist_ok=True, repo_type="model"))
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        existing = set(api.list_repo_files(repo_id, revision=revision, repo_type="model"))
        other = sorted(existing - {name for name, _ in files} - {".gitattributes"})
        if other:
            raise OutputExistsError(f"{repo_id}: the repo already holds other files ({', '.join(other[:3])}"
                                    f"{'...' if len(other) > 3 else ''}); push to a new repo or --revision, or delete them")
        large = getattr(api, "upload_large_folder", None)
        if large is not None and result.bytes >= LARGE_FOLDER_BYTES:
            # Resumable and committed in parts; it takes no commit message and keeps its state
            # in FOLDER/.cache/huggingface, which later pushes skip.
            large(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision, ignore_patterns=_IGNORE)
            if commit_message:
                result.notices.append("large folders are committed in parts with automatic messages; --commit-message not used")
        else:
            api.upload_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision,
                              commit_message=commit_message or f"Upload {folder.name} with reshard",
                              ignore_patterns=_IGNORE)
    except ReshardError:
        raise
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = " (is the token allowed to write there?)" if status in (401, 403) else ""
        raise ReshardError(f"{repo_id}: the Hub refused the push: {_first_line(e)}{hint}") from None
    except Exception as e:
        if _network_error(e):
            raise ReshardError(f"{repo_id}: could not reach the Hub ({_first_line(e)}); check the network, or use --dry-run") from None
        raise
    return result
