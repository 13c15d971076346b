"""``reshard push``: the pre-upload checks, the dry run (no network), and what would be called
on huggingface_hub (its HfApi replaced by a recorder: no network in tests)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
import reshard.features.hub
from tests.dist import HANG_GUARD
from tests.hf_models import save_tiny_llama
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as run_cli


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tied tiny Llama exported by reshard (`--to hf`) into several shards."""
    root = tmp_path_factory.mktemp("push")
    src = save_tiny_llama(root / "saved", tie=True)
    return reshard.convert(src, root / "OUT", to="hf", max_shard_size="20KB", quiet=True).dst


@pytest.fixture
def folder(exported: Path, tmp_path: Path) -> Path:
    """A private copy each test may break."""
    return Path(shutil.copytree(exported, tmp_path / "OUT"))


def test_dry_run_offline_lists_every_file_through_the_entry_point(exported: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": ""}
    exe = shutil.which("reshard")
    assert exe, "the reshard console script is installed with the package"
    proc = subprocess.run([exe, "push", str(exported), "someone/tiny-llama", "--dry-run"],
                          capture_output=True, text=True, timeout=HANG_GUARD, env=env)
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0] for line in proc.stdout.splitlines()[1:]}
    weights = {p.name for p in exported.glob("*.safetensors")}
    assert len(weights) > 2 and weights | {"config.json", "model.safetensors.index.json"} <= listed
    assert proc.stdout.startswith(f"would upload {len(listed)} files") and "someone/tiny-llama" in proc.stdout
    assert not any(name.startswith(".reshard-") for name in listed)  # local bookkeeping stays local


def _index(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_no_config_json_is_refused(folder: Path) -> None:
    (folder / "config.json").unlink()
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), str(folder), "no config.json")


def test_index_naming_a_missing_file_is_refused(folder: Path) -> None:
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), shard.name, "missing")


def test_index_that_misses_a_tensor_is_refused(folder: Path) -> None:
    index = _index(folder)
    name = sorted(index["weight_map"])[0]
    del index["weight_map"][name]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), repr(name))


def test_stray_shard_and_bad_header_are_refused(folder: Path) -> None:
    save_file({"extra": torch.zeros(2)}, folder / "model-00009-of-00009.safetensors")
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), "model-00009-of-00009", "not named by")
    (folder / "model-00009-of-00009.safetensors").unlink()
    first = sorted(folder.glob("model-*.safetensors"))[0]
    first.write_bytes(b"\xff" * 8 + first.read_bytes()[8:])  # a header length past the end of the file
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), first.name)


def test_tied_weights_must_be_consistent(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), "no lm_head.weight")
    index = _index(folder)
    where = index["weight_map"]["model.embed_tokens.weight"]
    tensors = load_file(folder / where)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, folder / where, metadata={"format": "pt"})
    index["weight_map"]["lm_head.weight"] = where
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))  # tied again, but lm_head differs
    assert_one_line_error(run_cli("push", folder, "someone/x", "--dry-run"), "lm_head.weight differs")


class _Recorder:
    """Stands in for huggingface_hub.HfApi: records calls, serves ``existing`` as repo files."""

    calls: list[tuple[str, dict[str, Any]]] = []
    existing: list[str] = []
    fail: BaseException | None = None

    def __init__(self, token: str | None = None) -> None:
        self.calls.append(("init", {"token": token}))

    def __getattr__(self, name: str) -> Any:
        if name not in ("create_repo", "create_branch", "list_repo_files", "upload_folder", "upload_large_folder"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, {"args": args, **kwargs}))
            if self.fail is not None:
                raise self.fail
            return list(self.existing) if name == "list_repo_files" else f"https://huggingface.co/{args[0] if args else ''}"
        return call


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> type[_Recorder]:
    monkeypatch.setattr(huggingface_hub, "HfApi", _Recorder)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test_token")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    _Recorder.calls, _Recorder.existing, _Recorder.fail = [], [".gitattributes", "README.md"], None
    return _Recorder


def test_push_creates_the_repo_and_uploads_the_folder(folder: Path, hub: type[_Recorder]) -> None:
    proc = run_cli("push", folder, "me/tiny", "--private", "--revision", "v1", "--commit-message", "first")
    assert proc.returncode == 0, proc.stderr
    names = [c[0] for c in hub.calls]
    assert names == ["init", "create_repo", "create_branch", "list_repo_files", "upload_folder"]
    calls = dict(hub.calls)
    assert calls["init"]["token"] == "hf_test_token"
    assert calls["create_repo"]["args"] == ("me/tiny",) and calls["create_repo"]["private"] is True
    assert calls["create_repo"]["exist_ok"] is True and calls["create_branch"]["branch"] == "v1"
    upload = calls["upload_folder"]
    assert (upload["repo_id"], Path(upload["folder_path"]), upload["revision"], upload["commit_message"]) == \
        ("me/tiny", folder, "v1", "first")
    assert ".reshard-*" in upload["ignore_patterns"] and "config.json" in upload["allow_patterns"]
    assert proc.stdout.startswith("uploaded ")


def test_large_folders_use_upload_large_folder(folder: Path, hub: type[_Recorder], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reshard.features.hub, "LARGE_FOLDER_BYTES", 1)
    result = reshard.push(folder, "me/tiny")
    assert [c[0] for c in hub.calls][-1] == "upload_large_folder" and result.bytes > 1


def test_repo_with_other_content_is_updated_and_stale_weights_named(folder: Path, hub: type[_Recorder]) -> None:
    """A tokenizer uploaded first is fine; an old pytorch_model.bin left beside new safetensors is said."""
    hub.existing = [".gitattributes", "pytorch_model.bin", "config.json", "tokenizer.json"]
    proc = run_cli("push", folder, "me/tiny")
    assert proc.returncode == 0, proc.stderr
    assert "notice: the repo keeps weight files this push does not replace: pytorch_model.bin" in proc.stderr
    assert "tokenizer.json" not in proc.stderr and "upload_folder" in [c[0] for c in hub.calls]


def test_push_options_token_pr_include_exclude(folder: Path, hub: type[_Recorder], monkeypatch: pytest.MonkeyPatch) -> None:
    proc = run_cli("push", folder, "me/tiny", "--token", "hf_mine", "--create-pr", "--exclude", "README.md")
    assert proc.returncode == 0, proc.stderr
    calls = dict(hub.calls)
    assert calls["init"]["token"] == "hf_mine" and calls["upload_folder"]["create_pr"] is True
    allowed = calls["upload_folder"]["allow_patterns"]
    assert "README.md" not in allowed and "config.json" in allowed
    assert "create_branch" not in calls and "pull request on me/tiny" in proc.stdout
    dry = run_cli("push", folder, "me/tiny", "--dry-run", "--include", "*.json")
    assert dry.returncode == 0 and all(line.strip().split()[0].endswith(".json") for line in dry.stdout.splitlines()[1:])
    monkeypatch.setattr(reshard.features.hub, "HUB_FILE_LIMIT", 1000)
    assert_one_line_error(run_cli("push", folder, "me/tiny", "--dry-run"), "50 GB limit per file", "--max-shard-size 5GB")


def test_swapped_arguments_get_a_hint(folder: Path) -> None:
    assert_one_line_error(run_cli("push", "me/tiny", folder, "--dry-run"), "arguments look swapped",
                          f"reshard push {folder} me/tiny")


def test_no_token_offline_and_no_network_are_one_line_errors(folder: Path, hub: type[_Recorder],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The HTTP client huggingface_hub itself uses (requests, httpx or httpx2, by release).
    http = importlib.import_module(huggingface_hub.errors.HTTPError.__module__.split(".")[0])
    connect_error = getattr(http, "ConnectError", None) or http.ConnectionError
    hub.fail = connect_error("[Errno -3] Temporary failure in name resolution")
    assert_one_line_error(run_cli("push", folder, "me/tiny"), "could not reach the Hub")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert_one_line_error(run_cli("push", folder, "me/tiny"), "no Hugging Face token", "hf auth login")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_one_line_error(run_cli("push", folder, "me/tiny"), "HF_HUB_OFFLINE", "--dry-run")
    assert_one_line_error(run_cli("push", folder, "not a repo id", "--dry-run"), "owner/name")
