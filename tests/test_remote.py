"""Checkpoints on object stores: DCP folders, safetensors and HF folders read from and written
to fsspec URLs, checked against torch's own ``FsspecWriter``/``FsspecReader``, safetensors and
transformers.

``memory://`` has an object store's semantics (no rename) in this process; ``s3://`` goes to a
local S3 emulator (moto's server, a test extra) over HTTP, through s3fs, with the endpoint
given the fsspec way (``FSSPEC_S3_ENDPOINT_URL``, or ``--storage-options``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

import reshard
from reshard.commands.verify import verify_manifest
from reshard.core.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    OutputExistsError,
    UnsupportedFormatError,
    UsageError,
)
from reshard.pipeline import sinks
from tests.dist import HANG_GUARD

fsspec = pytest.importorskip("fsspec")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained_state() -> dict[str, Any]:
    """A tiny model after one AdamW step, as torch's get_state_dict gives it: FQN-keyed
    optimizer state, uneven shapes, a bfloat16 buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model.register_buffer("scale", torch.randn(3).to(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_zeros_like(v) for v in tree]
    return tree


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict under its dotted DCP name."""
    out: dict[str, torch.Tensor] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        else:
            out.update(_tensors(v, name + "."))
    return out


def _load_with_torch(url: str, like: dict[str, Any], **storage_options: Any) -> dict[str, torch.Tensor]:
    """What torch's own FsspecReader reads from ``url`` into a state dict shaped like ``like``."""
    into = _zeros_like(like)
    dcp.load(into, storage_reader=FsspecReader(url, **storage_options))
    return _tensors(into)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


@pytest.fixture
def memfs() -> Iterator[Any]:
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/ckpts"):
        fs.rm("/ckpts", recursive=True)


# -- memory://: in this process, every path of the code

def test_dcp_from_fsspec_writer_to_safetensors_and_mesh_and_back(memfs: Any, tmp_path: Path) -> None:
    state = _trained_state()
    want = _tensors(state)
    dcp.save(state, storage_writer=FsspecWriter("memory://ckpts/run"))
    _assert_same(_load_with_torch("memory://ckpts/run", state), want)  # the reference: torch reads its own save

    out = tmp_path / "model.safetensors"
    r = reshard.convert("memory://ckpts/run", out, quiet=True)
    assert r.src == "memory://ckpts/run" and r.tensors == len(want)
    _assert_same(safetensors_torch.load_file(out), want)

    # --to-mesh 3 onto the store: torch reads it back exactly, and the optimizer was resharded too
    r = reshard.convert("memory://ckpts/run", "memory://ckpts/run3", to_mesh="3", quiet=True)
    assert r.format == "dcp" and sorted(memfs.ls("/ckpts/run3", detail=False))[0].endswith(".metadata")
    _assert_same(_load_with_torch("memory://ckpts/run3", state), want)
    inspected = reshard.inspect("memory://ckpts/run3")
    assert inspected.facts.source_world_size in (None, 3)
    assert inspected.tensors["optim.state.0.weight.exp_avg"].chunk_count == 3

    # a remote safetensors file and a sharded folder with its index, read back from the store
    reshard.convert("memory://ckpts/run3", "memory://ckpts/one.safetensors", quiet=True)
    _assert_same(safetensors_torch.load(memfs.cat_file("/ckpts/one.safetensors")), want)
    reshard.convert("memory://ckpts/one.safetensors", "memory://ckpts/sharded", to="safetensors", max_shard_size="300B",
                    quiet=True)
    names = sorted(p.rsplit("/", 1)[-1] for p in memfs.ls("/ckpts/sharded", detail=False))
    assert names[-1] == "model.safetensors.index.json" and len(names) > 3
    back = tmp_path / "back.pt"
    reshard.convert("memory://ckpts/sharded", back, quiet=True)
    _assert_same(_tensors(torch.load(back, weights_only=True)), want)
    assert reshard.verify("memory://ckpts/run", "memory://ckpts/sharded").ok
    # and a torch.save file on the store
    reshard.convert("memory://ckpts/run", "memory://ckpts/run.pt", quiet=True)
    reshard.convert("memory://ckpts/run.pt", tmp_path / "from_pt.safetensors", quiet=True)
    _assert_same(safetensors_torch.load_file(tmp_path / "from_pt.safetensors"), want)


def test_an_interrupted_write_leaves_nothing_that_reads_as_a_checkpoint(memfs: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    state = _trained_state()
    dcp.save(state, storage_writer=FsspecWriter("memory://ckpts/run"))
    real, calls = sinks._Upload.write_at, []

    def dies_on_the_second_file(upload, offset, data):  # type: ignore[no-untyped-def]
        if upload.url not in calls:
            calls.append(upload.url)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C while the second rank's file streams
        return real(upload, offset, data)

    monkeypatch.setattr(sinks._Upload, "write_at", dies_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        reshard.convert("memory://ckpts/run", "memory://ckpts/cut", to_mesh="3", workers=1, quiet=True)
    assert not memfs.exists("/ckpts/cut/.metadata")
    assert memfs.find("/ckpts/cut") == []  # what was put is deleted again
    with pytest.raises(CheckpointNotFoundError, match="memory://ckpts/cut: no such file"):
        reshard.inspect("memory://ckpts/cut")
    monkeypatch.setattr(sinks._Upload, "write_at", real)

    # killed outright (no cleanup, as SIGKILL leaves it): the data files without .metadata read
    # as no checkpoint, by torch or reshard, and the next write refuses them until --overwrite,
    # which may clear them: the claim put first says they are reshard's
    monkeypatch.setattr(sinks._Upload, "write_at", dies_on_the_second_file)
    monkeypatch.setattr(sinks.RemoteSink, "abort", lambda self: None)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        reshard.convert("memory://ckpts/run", "memory://ckpts/cut", to_mesh="3", workers=1, quiet=True)
    monkeypatch.undo()
    left = memfs.find("/ckpts/cut")
    assert "/ckpts/cut/.reshard-writing.json" in left and any(k.endswith(".distcp") for k in left)
    with pytest.raises(CheckpointException, match="metadata read failed"):
        dcp.load(_zeros_like(state), storage_reader=FsspecReader("memory://ckpts/cut"))
    with pytest.raises(UnsupportedFormatError, match="not a checkpoint"):
        reshard.inspect("memory://ckpts/cut")
    with pytest.raises(OutputExistsError, match="unfinished write"):
        reshard.convert("memory://ckpts/run", "memory://ckpts/cut", to_mesh="3", quiet=True)
    # an object reshard did not put there is the user's: --overwrite refuses, nothing deleted
    memfs.pipe_file("/ckpts/cut/notes.txt", b"mine")
    with pytest.raises(OutputExistsError, match=r"did not write \(notes.txt\)"):
        reshard.convert("memory://ckpts/run", "memory://ckpts/cut", to_mesh="3", overwrite=True, quiet=True)
    assert memfs.find("/ckpts/cut") == sorted([*left, "/ckpts/cut/notes.txt"])
    memfs.rm_file("/ckpts/cut/notes.txt")
    reshard.convert("memory://ckpts/run", "memory://ckpts/cut", to_mesh="3", overwrite=True, quiet=True)
    assert "/ckpts/cut/.reshard-writing.json" not in memfs.find("/ckpts/cut")
    assert "/ckpts/cut/.reshard-manifest.json" in memfs.find("/ckpts/cut")
    _assert_same(_load_with_torch("memory://ckpts/cut", state), _tensors(state))
    with pytest.raises(OutputExistsError, match="already holds a checkpoint"):
        reshard.convert("memory://ckpts/run", "memory://ckpts/cut", quiet=True)

    # sharded safetensors whose index never arrived: refused, not read as a smaller model
    reshard.convert("memory://ckpts/run", "memory://ckpts/st", to="safetensors", max_shard_size="300B", quiet=True)
    memfs.rm_file("/ckpts/st/model.safetensors.index.json")
    first = sorted(k for k in memfs.ls("/ckpts/st", detail=False) if k.endswith(".safetensors"))[0]
    memfs.rm_file(first)
    with pytest.raises(CorruptCheckpointError, match="no index"):
        reshard.inspect("memory://ckpts/st")


def test_what_cannot_go_to_a_url_is_refused(memfs: Any, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(4)}, tmp_path / "a.pt")
    with pytest.raises(UsageError, match="per-rank torch files"):
        reshard.convert(tmp_path / "a.pt", "memory://ckpts/ranks", to="torch", to_mesh="2", quiet=True)
    torch.save({"w": torch.ones(4)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    memfs.put_file(str(tmp_path / "old.pt"), "/ckpts/old.pt")
    with pytest.raises(UnsupportedFormatError, match="pre-1.6 torch.save file, read from local files only"):
        reshard.inspect("memory://ckpts/old.pt")
    with pytest.raises(UsageError, match="no fsspec filesystem handles nosuchproto://"):
        reshard.convert(tmp_path / "a.pt", "nosuchproto://x/y", quiet=True)

    # an output onto, inside or around its URL source would delete it before reading it
    reshard.convert(tmp_path / "a.pt", "memory://ckpts/src", quiet=True)
    for dst in ("memory://ckpts/src", "memory://ckpts/src/inner", "memory://ckpts"):
        with pytest.raises(UsageError, match="overwrite or sit inside the source"):
            reshard.convert("memory://ckpts/src", dst, overwrite=True, quiet=True)
    assert reshard.verify(tmp_path / "a.pt", "memory://ckpts/src").ok  # untouched
    with pytest.raises(UsageError, match="verify --quick checks a local folder"):
        verify_manifest("memory://ckpts/src")


# -- s3:// on a local S3 emulator, through the command line

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A moto S3 server on a free port; the environment that points s3fs (and so torch's
    FsspecWriter and reshard) at it."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec.config

    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = env["FSSPEC_S3_ENDPOINT_URL"]  # read at import only
    fs = fsspec.filesystem("s3", endpoint_url=env["FSSPEC_S3_ENDPOINT_URL"], skip_instance_cache=True)
    fs.mkdir("ckpts")
    try:
        yield env
    finally:
        fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=HANG_GUARD,
                          env={**os.environ, **env})


def test_s3_round_trips_through_the_command_line(s3: dict[str, str], tmp_path: Path) -> None:
    endpoint = {"endpoint_url": s3["FSSPEC_S3_ENDPOINT_URL"]}
    state = _trained_state()
    want = _tensors(state)
    dcp.save(state, storage_writer=FsspecWriter("s3://ckpts/run", **endpoint))

    out = tmp_path / "model.safetensors"
    done = _cli("convert", "s3://ckpts/run", str(out), env=s3)
    assert done.returncode == 0, done.stderr
    _assert_same(safetensors_torch.load_file(out), _load_with_torch("s3://ckpts/run", state, **endpoint))
    _assert_same(safetensors_torch.load_file(out), want)

    # --to-mesh 3 onto s3://, the endpoint given as --storage-options instead of the environment
    no_endpoint = {k: v for k, v in s3.items() if k != "FSSPEC_S3_ENDPOINT_URL"}
    done = _cli("convert", "s3://ckpts/run", "s3://ckpts/run3", "--to-mesh", "3", "--storage-options", json.dumps(endpoint),
                env={**no_endpoint, "FSSPEC_S3_ENDPOINT_URL": ""})
    assert done.returncode == 0, done.stderr
    _assert_same(_load_with_torch("s3://ckpts/run3", state, **endpoint), want)
    done = _cli("inspect", "s3://ckpts/run3", "--json", env=s3)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["tensors"]) == len(want)
    done = _cli("convert", "s3://ckpts/run", "s3://ckpts/run3", "--to-mesh", "3", env=s3)
    assert done.returncode == 2 and "--overwrite" in done.stderr and "Traceback" not in done.stderr
    done = _cli("inspect", "s3://ckpts/nothing-here", env=s3)
    assert done.returncode == 2 and "s3://ckpts/nothing-here" in done.stderr and "Traceback" not in done.stderr


def test_hf_folder_on_s3_to_dcp(s3: dict[str, str], tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="10KB")  # sharded, with its index
    fs = fsspec.filesystem("s3", endpoint_url=s3["FSSPEC_S3_ENDPOINT_URL"])
    for p in (tmp_path / "hf").iterdir():
        fs.put_file(str(p), f"ckpts/hf/{p.name}")
    assert fs.exists("ckpts/hf/model.safetensors.index.json")

    done = _cli("convert", "s3://ckpts/hf", str(tmp_path / "dcp"), env=s3)
    assert done.returncode == 0, done.stderr
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=tmp_path / "dcp")
    _assert_same(got, want)
    # and back onto the store as an HF folder transformers loads
    done = _cli("convert", str(tmp_path / "dcp"), "s3://ckpts/hf2", "--to", "hf", "--config", str(tmp_path / "hf"), env=s3)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    fs.get("ckpts/hf2/", str(tmp_path / "hf2") + "/", recursive=True)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf2")
    _assert_same(again.state_dict(), model.state_dict())


def test_hf_url_is_read_from_the_local_cache_when_it_holds_the_weights(tmp_path: Path) -> None:
    """``hf://owner/name`` takes huggingface_hub's cached snapshot when it is whole, with no
    network; offline and not cached, it is one line of error."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--me--tiny"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    want = {"w": torch.randn(3, 5), "b": torch.arange(4)}
    safetensors_torch.save_file(want, snap / "model.safetensors")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = _cli("convert", "hf://me/tiny", str(tmp_path / "out.pt"), env=env)
    assert done.returncode == 0, done.stderr
    _assert_same(torch.load(tmp_path / "out.pt", weights_only=True), want)
    done = _cli("inspect", "hf://me/not-cached", env=env)
    assert done.returncode == 2 and "hf://me/not-cached" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_hf_folder_on_a_store_exports_with_its_assets(memfs: Any, tmp_path: Path) -> None:
    """An HF folder on a store -> ``--to hf`` here: config and tokenizer files come from the
    store, and transformers loads the result."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    for p in (tmp_path / "hf").iterdir():
        memfs.put_file(str(p), f"/ckpts/hf/{p.name}")
    reshard.convert("memory://ckpts/hf", tmp_path / "out", to="hf", quiet=True)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    _assert_same(again.state_dict(), model.state_dict())
