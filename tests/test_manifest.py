"""The integrity manifest: written with every folder output, checked by ``verify --quick``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from reshard.core.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError
from reshard.pipeline.manifest import MANIFEST_NAME, check_manifest, file_digest, read_manifest, write_manifest
from reshard.pipeline.staging import StagedOutput
from tests.test_cli import assert_one_line_error, reshard


def _folder(root: Path) -> Path:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 1000)
    (root / "empty").write_bytes(b"")
    (root / "sub" / "deeper" / "c.json").write_text('{"x": 1}')
    (root / ".metadata").write_bytes(b"hidden files count too")
    return root


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def test_manifest_lists_every_file_with_its_sha256(tmp_path: Path) -> None:
    root = _folder(tmp_path / "out")
    write_manifest(root)
    first = (root / MANIFEST_NAME).read_bytes()
    entries = read_manifest(root)
    assert sorted(entries) == [".metadata", "a.bin", "empty", "sub/deeper/c.json"]
    for rel, d in entries.items():  # the digest sha256sum prints (and the Hub's LFS oid)
        data = (root / rel).read_bytes()
        assert (d.size, d.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    write_manifest(root, workers=1)  # deterministic: no timestamps, sorted, whatever the threads did
    assert (root / MANIFEST_NAME).read_bytes() == first
    assert check_manifest(root) == (4, [])
    big = tmp_path / "big"  # more than one 8 MiB read block
    big.write_bytes(b"\x07" * (9 << 20) + b"end")
    assert file_digest(big).sha256 == hashlib.sha256(big.read_bytes()).hexdigest()


def test_each_change_is_reported_by_file(tmp_path: Path) -> None:
    root = _folder(tmp_path / "out")
    write_manifest(root)
    _flip(root / "a.bin", 1234)
    (root / "sub" / "deeper" / "c.json").write_text('{"x": 2, "y": 3}')
    (root / "empty").unlink()
    (root / "stray.tmp").write_text("added later")
    checked, problems = check_manifest(root)
    assert checked == 4
    assert [(p.relpath, p.kind) for p in problems] == [
        ("a.bin", "checksum"), ("empty", "missing"), ("stray.tmp", "not_in_manifest"), ("sub/deeper/c.json", "size")]
    assert "16 bytes, manifest says 8" in problems[3].detail


@pytest.mark.parametrize("doc, error, message", [
    ("not json", CorruptCheckpointError, "not valid JSON"),
    ({"reshard_manifest": 99, "algorithm": "sha256", "files": {}}, CorruptCheckpointError, "not a version-1 sha256"),
    ({"reshard_manifest": 1, "algorithm": "md5", "files": {}}, CorruptCheckpointError, "not a version-1 sha256"),
    ({"reshard_manifest": 1, "algorithm": "sha256", "files": []}, CorruptCheckpointError, "'files' is not an object"),
    ({"reshard_manifest": 1, "algorithm": "sha256", "files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}},
     UnsafeCheckpointError, "points outside its folder"),
    ({"reshard_manifest": 1, "algorithm": "sha256", "files": {"/etc/passwd": {"size": 1, "sha256": "0" * 64}}},
     UnsafeCheckpointError, "points outside its folder"),
    ({"reshard_manifest": 1, "algorithm": "sha256", "files": {"a\\b": {"size": 1, "sha256": "0" * 64}}},
     CorruptCheckpointError, "is not a relative path"),
    ({"reshard_manifest": 1, "algorithm": "sha256", "files": {"a": {"size": -1, "sha256": "0" * 64}}},
     CorruptCheckpointError, "needs a size and a 64-digit hex sha256"),
    ({"reshard_manifest": 1, "algorithm": "sha256", "files": {"a": {"size": 1, "sha256": "xyz"}}},
     CorruptCheckpointError, "needs a size and a 64-digit hex sha256"),
])
def test_hostile_or_broken_manifest_is_refused(tmp_path: Path, doc, error: type, message: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(error, match=message) as caught:
        check_manifest(tmp_path)
    assert str(caught.value).startswith(str(tmp_path / MANIFEST_NAME))


def test_staged_folders_carry_a_manifest_files_do_not(tmp_path: Path) -> None:
    with StagedOutput(tmp_path / "dir", is_dir=True) as out:
        (out.staging / "x").write_text("x")
        out.commit()
    assert check_manifest(tmp_path / "dir") == (1, [])
    with StagedOutput(tmp_path / "plain", is_dir=True, manifest=False) as out:
        out.commit()
    with StagedOutput(tmp_path / "one.pt", is_dir=False) as out:
        out.staging.write_text("x")
        out.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "one.pt", "plain"]
    assert list((tmp_path / "plain").iterdir()) == []
    with pytest.raises(CheckpointNotFoundError, match="no .reshard-manifest.json"):
        check_manifest(tmp_path / "plain")


def test_verify_quick_on_real_outputs_that_real_readers_still_load(tmp_path: Path) -> None:
    """DCP, sharded safetensors and per-rank torch folders get a manifest; torch's dcp.load and
    safetensors' load_file ignore it; a flipped byte is exit 1 naming the file."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    ref = {"w": torch.randn(64, 32), "b": torch.arange(100, dtype=torch.int64), "h": torch.randn(8).half()}
    torch.save(ref, tmp_path / "src.pt")
    outs = {"dcp": ["--to", "dcp"], "st": ["--to", "safetensors", "--max-shard-size", "8KB"], "ranks": ["--to-mesh", "2"]}
    for name, args in outs.items():
        proc = reshard("convert", tmp_path / "src.pt", tmp_path / name, "--quiet", *args)
        assert proc.returncode == 0, proc.stderr
        ok = reshard("verify", "--quick", tmp_path / name)
        assert ok.returncode == 0 and ok.stdout.startswith("intact ("), ok.stdout
        assert reshard("verify", tmp_path / "src.pt", tmp_path / name).returncode == 0
    sd = {k: torch.empty_like(v) for k, v in ref.items()}
    dcp.load(sd, checkpoint_id=tmp_path / "dcp")
    assert all(torch.equal(sd[k], ref[k]) for k in ref)
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    loaded = {}
    for f in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / "st" / f))
    assert loaded.keys() == ref.keys() and all(torch.equal(loaded[k], ref[k]) for k in ref)
    assert "__1_0.distcp" in read_manifest(tmp_path / "ranks")  # --to-mesh: one DCP file per rank
    (tmp_path / "st" / "README.md").write_text("added by hand")  # not a failure of what reshard wrote
    added = reshard("verify", "--quick", tmp_path / "st")
    assert added.returncode == 0 and "note: 1 file(s) not in manifest (added after the conversion, not checked): " \
        "README.md" in added.stdout, added.stdout

    _flip(tmp_path / "dcp" / "__0_0.distcp", 2000)
    bad = reshard("verify", "--quick", tmp_path / "dcp")
    assert bad.returncode == 1
    assert bad.stdout.splitlines()[0].startswith("DIFF __0_0.distcp: checksum: sha256 "), bad.stdout
    assert "1 file(s) differ from the manifest (2 files checked)" in bad.stdout
    as_json = json.loads(reshard("verify", "--quick", tmp_path / "dcp", "--json").stdout)
    assert [(d["name"], d["kind"]) for d in as_json["differences"]] == [("__0_0.distcp", "checksum")]

    assert_one_line_error(reshard("verify", "--quick", tmp_path / "src.pt"), "src.pt", "single file")
    (tmp_path / "bare").mkdir()
    assert_one_line_error(reshard("verify", "--quick", tmp_path / "bare"), "bare", "no .reshard-manifest.json")
    assert_one_line_error(reshard("verify", "--quick", tmp_path / "st", tmp_path / "dcp"), "--quick")


def test_known_digests_are_reused_only_while_the_size_holds(tmp_path: Path) -> None:
    """The engine hashes files as it finishes them (on every rank under torchrun); the manifest
    takes those digests as they are (a planted wrong digest shows it was not recomputed)
    unless the file's size changed since."""
    from reshard.pipeline.manifest import FileDigest

    (tmp_path / "a.bin").write_bytes(b"a" * 100)
    (tmp_path / "b.bin").write_bytes(b"b" * 50)
    (tmp_path / "c.bin").write_bytes(b"c" * 10)
    real = {name: file_digest(tmp_path / name) for name in ("a.bin", "b.bin", "c.bin")}
    planted = FileDigest(100, "f" * 64)
    write_manifest(tmp_path, known={"a.bin": planted, "b.bin": FileDigest(49, "e" * 64), "gone.bin": planted})
    got = read_manifest(tmp_path)
    assert got == {"a.bin": planted, "b.bin": real["b.bin"], "c.bin": real["c.bin"]}


def test_weights_files_loaders_would_take_instead_fail_verify_quick(tmp_path: Path) -> None:
    """A sharded HF export stays byte-intact when another model.safetensors is dropped beside
    its index, yet transformers' from_pretrained then loads that file: verify --quick fails
    (exit 1) naming it, and so for pytorch_model.bin (loaded with use_safetensors=False) and a
    second index. A README still passes, as a note."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from tests.hf_models import save_tiny_llama

    out = tmp_path / "hf"
    proc = reshard("convert", save_tiny_llama(tmp_path / "src", tie=False), out, "--to", "hf",
                   "--max-shard-size", "20KB", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors.index.json").is_file() and not (out / "model.safetensors").exists()
    written = LlamaForCausalLM.from_pretrained(out).state_dict()
    other = {n: t + 1 for n, t in written.items()}
    (out / "NOTES.txt").write_text("notes")

    def loaded(**kwargs) -> bool:  # whether from_pretrained now gives the other weights
        got = LlamaForCausalLM.from_pretrained(out, **kwargs).state_dict()
        return all(torch.equal(got[n], other[n]) for n in written)

    def check(name: str, detail: str) -> None:
        bad = reshard("verify", "--quick", out)
        assert bad.returncode == 1, bad.stdout
        assert bad.stdout.splitlines()[0].startswith(f"DIFF {name}: unlisted_weights: not in the manifest, and "
                                                     f"{detail}"), bad.stdout
        assert "note: 1 file(s) not in manifest (added after the conversion, not checked): NOTES.txt" in bad.stdout
        assert "1 file(s) differ from the manifest" in bad.stdout
        as_json = json.loads(reshard("verify", "--quick", out, "--json").stdout)
        assert [(d["name"], d["kind"]) for d in as_json["differences"]] == [(name, "unlisted_weights")]

    order = "(it takes the first of model.safetensors, model.safetensors.index.json, pytorch_model.bin, " \
            "pytorch_model.bin.index.json)"
    save_file(other, out / "model.safetensors")
    assert loaded()  # every listed byte intact, other weights loaded
    check("model.safetensors", f"transformers' from_pretrained loads it instead of model.safetensors.index.json {order}")
    (out / "model.safetensors").unlink()
    torch.save(other, out / "pytorch_model.bin")
    assert loaded(use_safetensors=False)
    check("pytorch_model.bin", "transformers' from_pretrained loads it once model.safetensors.index.json is gone or "
          f"with use_safetensors=False {order}")
    (out / "pytorch_model.bin").unlink()
    (out / "model.fp32.safetensors.index.json").write_bytes((out / "model.safetensors.index.json").read_bytes())
    check("model.fp32.safetensors.index.json", "from_pretrained(variant=...) loads its files")
    (out / "model.fp32.safetensors.index.json").rename(out / "extra.safetensors.index.json")
    check("extra.safetensors.index.json", "it is a second index: which files make the model has two answers")
    (out / "extra.safetensors.index.json").unlink()
    ok = reshard("verify", "--quick", out)
    assert ok.returncode == 0 and "NOTES.txt" in ok.stdout and ok.stdout.splitlines()[-1].startswith("intact ("), ok.stdout


def test_a_safetensors_file_beside_unindexed_ones_is_loaded_with_them(tmp_path: Path) -> None:
    """Without an index, a folder's readers take every *.safetensors in it: one added later is
    a weights difference; a stray file in a subfolder or of another kind stays a note."""
    from safetensors.torch import save_file

    import reshard as api

    save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    write_manifest(tmp_path)
    save_file({"b": torch.zeros(3)}, tmp_path / "b.safetensors")
    (tmp_path / "sub").mkdir()
    save_file({"c": torch.zeros(3)}, tmp_path / "sub" / "model.safetensors")
    (tmp_path / "notes.txt").write_text("x")
    assert set(api.inspect(tmp_path).tensors) == {"a", "b"}  # the added file is read with the listed one
    _, problems = check_manifest(tmp_path)
    assert [(p.relpath, p.kind) for p in problems] == [
        ("b.safetensors", "unlisted_weights"), ("notes.txt", "not_in_manifest"), ("sub/model.safetensors", "not_in_manifest")]
    assert "have no index: readers of the folder (reshard, vLLM) load every *.safetensors" in problems[0].detail
