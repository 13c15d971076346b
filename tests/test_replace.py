"""--overwrite deletes only what reshard wrote, or the one file the user named
(reshard/pipeline/replace.py): each case plants what a user has and shows it survives."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard.core.errors import OutputExistsError, UsageError
from reshard.pipeline.replace import foreign_files, refuse_unreplaceable
from reshard.pipeline.staging import StagedOutput
from tests.test_cli import assert_one_line_error
from tests.test_cli import reshard as cli


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (symlinks not followed) with its SHA-256."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_folder_holding_a_users_file_is_refused_and_kept(fsdp2_dcp, tmp_path: Path) -> None:
    src = fsdp2_dcp[0]
    o1 = tmp_path / "o1"
    o1.mkdir()
    (o1 / "mine.txt").write_text("mine\n")
    proc = cli("convert", src, o1, "--overwrite", "--to", "safetensors")
    assert_one_line_error(proc, str(o1), "did not write (mine.txt)", "1 entry")
    assert (o1 / "mine.txt").read_text() == "mine\n" and sorted(os.listdir(o1)) == ["mine.txt"]
    assert not list(tmp_path.glob(".o1.reshard-*"))  # refused before any work: no staging, no lock
    # the API alike
    o4 = tmp_path / "o4"
    o4.mkdir()
    (o4 / "tokenizer.json").write_text("{}")
    with pytest.raises(OutputExistsError, match=r"did not write \(tokenizer.json\)"):
        reshard.convert(src, o4, to="safetensors", overwrite=True, quiet=True)
    assert (o4 / "tokenizer.json").read_text() == "{}"


def test_a_previous_output_is_replaced_and_a_file_added_to_it_is_not(fsdp2_dcp, tmp_path: Path) -> None:
    src = fsdp2_dcp[0]
    o3 = tmp_path / "o3"  # the command, twice
    assert cli("convert", src, o3, "--to", "safetensors").returncode == 0
    assert cli("convert", src, o3, "--to", "safetensors", "--overwrite").returncode == 0
    one = tmp_path / "model.safetensors"  # one file the user named: replaced, alone
    assert cli("convert", src, one, "--only", "model").returncode == 0
    (tmp_path / "beside.txt").write_text("next to it")
    assert cli("convert", src, one, "--only", "model", "--overwrite").returncode == 0
    assert one.is_file() and (tmp_path / "beside.txt").read_text() == "next to it"
    shards = tmp_path / "shards"  # a folder output (its manifest lists every file): replaced
    assert cli("convert", src, shards, "--to", "safetensors", "--max-shard-size", "1KiB").returncode == 0
    proc = cli("convert", src, shards, "--to", "safetensors", "--max-shard-size", "2KiB", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert reshard.verify(src, shards).equal
    before = _tree(shards)
    (shards / "notes").mkdir()
    (shards / "notes" / "a.txt").write_text("a")
    for name in ("README.md", "tokenizer.json", "z.txt"):
        (shards / name).write_text(name)
    proc = cli("convert", src, shards, "--to", "safetensors", "--overwrite")
    assert_one_line_error(proc, "4 entries", "README.md, notes/, tokenizer.json and 1 more")
    assert _tree(shards) == {**before, "notes/a.txt": _tree(shards)["notes/a.txt"], "README.md": _tree(shards)["README.md"],
                             "tokenizer.json": _tree(shards)["tokenizer.json"], "z.txt": _tree(shards)["z.txt"]}
    # an empty folder holds nothing to lose
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("convert", src, empty, "--to", "safetensors", "--overwrite").returncode == 0


def test_the_source_under_the_destination_survives(fsdp2_dcp, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    (parent / "sub").mkdir(parents=True)
    ck = parent / "sub" / "ck"
    shutil.copytree(fsdp2_dcp[0], ck)
    before = _tree(ck)
    (tmp_path / "plink").symlink_to(parent)
    (tmp_path / "cklink").symlink_to(ck)
    for dst in (parent, tmp_path / "plink", parent / "sub" / ".." / "sub", ck, tmp_path / "cklink", ck / "inside"):
        for extra in (["--overwrite"], []):
            proc = cli("convert", ck, dst, "--to", "safetensors", *extra)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, (dst, proc.stderr)
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    with pytest.raises(UsageError, match="lies inside it"):
        reshard.convert(ck, tmp_path / "plink", to="safetensors", overwrite=True, quiet=True)
    with pytest.raises(UsageError, match="lies inside it"):  # a default-named output is held to it too
        reshard.convert(tmp_path / "cklink", parent / "sub", to="dcp", overwrite=True, quiet=True)
    assert _tree(ck) == before and (tmp_path / "plink").is_symlink()
    assert sorted(p.name for p in parent.rglob("*")) == sorted(["sub", "ck", *[Path(r).name for r in before]])


def test_working_and_home_directories_and_roots_are_never_replaced(fsdp2_dcp, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = fsdp2_dcp[0]
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(UsageError, match="is the home directory"):
        reshard.convert(src, home, to="safetensors", overwrite=True, quiet=True)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(UsageError, match="is the working directory"):
        reshard.convert(src, ".", to="safetensors", overwrite=True, quiet=True)
    with pytest.raises(UsageError, match="is the working directory"):
        reshard.convert(src, work / ".." / "work", to="safetensors", overwrite=True, quiet=True)
    with pytest.raises(UsageError, match="root of a file system"):
        refuse_unreplaceable(Path("/"))
    assert os.listdir(home) == [] and os.listdir(work) == []


def test_a_file_added_while_converting_stops_the_replacement(tmp_path: Path) -> None:
    """The rule is asked again under the lock, just before the old output goes."""
    dst = tmp_path / "out"
    with StagedOutput(dst, is_dir=True) as out:
        (out.staging / "a.bin").write_bytes(b"old")
        out.commit()
    with StagedOutput(dst, is_dir=True, overwrite=True) as out:
        (out.staging / "a.bin").write_bytes(b"new")
        (dst / "copied-in.txt").write_text("a user's file")  # while the conversion runs
        with pytest.raises(OutputExistsError, match="copied-in.txt"):
            out.commit()
    assert (dst / "a.bin").read_bytes() == b"old" and (dst / "copied-in.txt").exists()
    assert not list(tmp_path.glob(".out.reshard-*"))


def test_foreign_files_by_the_manifest() -> None:
    listed = {"a.safetensors", "model.w/c/0/0"}
    present = ["a.safetensors", ".reshard-manifest.json", "model.w/", "model.w/c/", "model.w/c/0/0", "notes/", "x.txt",
               ".cache/", ".cache/huggingface/", ".cache/huggingface/upload/state"]
    assert foreign_files(present, listed) == ["notes/", "x.txt"]
    assert foreign_files(["a"], set()) == ["a"]


# ------------------------------------------------- found by the adversarial review of 2026-11-28

# --- --overwrite: the source through a file of it --------------------------------------------


def _sharded_safetensors(folder: Path) -> None:
    folder.mkdir()
    save_file({"a": torch.arange(6, dtype=torch.float32)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.ones(3)}, folder / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_shard_of_an_index_source_is_not_overwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SRC an index file, DST one of the shards it names: the source checkpoint is destroyed (exit 0)."""
    monkeypatch.chdir(tmp_path)
    _sharded_safetensors(tmp_path / "hf")
    shard = tmp_path / "hf" / "model-00001-of-00002.safetensors"
    before = shard.read_bytes()
    proc = cli("convert", "hf/model.safetensors.index.json", "hf/model-00001-of-00002.safetensors",
               "--to", "safetensors", "--overwrite")
    assert shard.read_bytes() == before, "the source's shard was replaced"
    assert proc.returncode == 2, proc.stderr


def test_the_file_a_source_symlink_points_to_is_not_overwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An HF-cache-like source (snapshot symlinks into blobs/): DST the blob replaces the source's bytes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    save_file({"w": torch.arange(4, dtype=torch.float32)}, tmp_path / "blobs" / "abc123")
    (tmp_path / "snap" / "model.safetensors").symlink_to("../blobs/abc123")
    before = (tmp_path / "blobs" / "abc123").read_bytes()
    proc = cli("convert", "snap", "blobs/abc123", "--to", "safetensors", "--dtype", "bfloat16", "--overwrite")
    blob = tmp_path / "blobs" / "abc123"
    assert blob.is_file() and blob.read_bytes() == before, "the source's file (through its symlink) was replaced"
    assert proc.returncode == 2, proc.stderr


# --- --overwrite of a URL output: the old output goes before the new one exists -------------


def test_url_overwrite_keeps_the_old_output_until_the_new_one_is_complete(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    from reshard.pipeline import sinks

    save_file({"w": torch.ones(4)}, tmp_path / "src.safetensors")
    url = f"memory://review-{os.getpid()}/out"
    reshard.convert(tmp_path / "src.safetensors", url, to="safetensors")
    fs = fsspec.filesystem("memory")
    before = sorted(fs.find(url.removeprefix("memory:/")))
    assert before

    def interrupted(self: object, files: object) -> None:  # a dropped connection, Ctrl-C: the write stops
        raise KeyboardInterrupt

    monkeypatch.setattr(sinks.RemoteSink, "prepare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        reshard.convert(tmp_path / "src.safetensors", url, to="safetensors", overwrite=True)
    assert sorted(fs.find(url.removeprefix("memory:/"))) == before, "the old output was deleted before the new one"


# --- --overwrite: what the user never named -------------------------------------------------


def test_a_default_named_output_does_not_replace_a_users_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No DST: the default name model.pt is a file the user has (not a reshard output); --overwrite
    replaces it, though the rule is 'the one file the user named'."""
    monkeypatch.chdir(tmp_path)
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    torch.save({"mine": "precious"}, tmp_path / "model.pt")
    before = (tmp_path / "model.pt").read_bytes()
    proc = cli("convert", "model.safetensors", "--to", "torch", "--overwrite")
    assert (tmp_path / "model.pt").read_bytes() == before, "a file the user never named was replaced"
    assert proc.returncode == 2, proc.stderr


def test_a_users_file_under_cache_huggingface_is_not_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything under .cache/huggingface/ counts as reshard's (push state), whatever it is."""
    monkeypatch.chdir(tmp_path)
    save_file({"w": torch.ones(2)}, tmp_path / "src.safetensors")
    assert cli("convert", "src.safetensors", "out", "--to", "safetensors", "--max-shard-size", "1GB").returncode == 0
    notes = tmp_path / "out" / ".cache" / "huggingface" / "my-notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    proc = cli("convert", "src.safetensors", "out", "--to", "safetensors", "--max-shard-size", "1GB", "--overwrite")
    assert notes.is_file(), "a user's file under .cache/huggingface was deleted"
    assert proc.returncode == 2, proc.stderr
