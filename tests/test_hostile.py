"""Hostile and broken inputs for every reader, through the command line.

Each case must end in exit 2 with one stderr line naming the file, no traceback, no code run
(every payload would create a marker file) and nothing written: no DST, no hidden staging.
The format modules' own tests pin the exact messages; here the whole path from argv to exit
code is under test, for ``inspect`` and ``convert`` alike. Positive controls show that the
payloads are live: torch's own readers do run them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.formats.safetensors_cases import BROKEN, raw_file
from tests.test_cli import assert_one_line_error, reshard, reshard_process


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Eval(_System):
    def __reduce__(self):
        return (eval, (f"__import__('pathlib').Path({str(self.marker)!r}).touch()",))


class _Exec(_System):
    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


class _Popen(_System):
    def __reduce__(self):
        return (subprocess.Popen, (["touch", str(self.marker)],))


PAYLOADS = [_System, _Eval, _Exec, _Popen]


# ------------------------------------------------------------------------------ case makers
# Each takes (work folder, marker, the FSDP2 DCP checkpoint) and returns (SRC, what the one
# error line must name). They edit copies; the session checkpoint is never touched.


def _dcp_copy(work: Path, dcp_src: Path) -> Path:
    return Path(shutil.copytree(dcp_src, work / "ckpt"))


def _edit_metadata(ckpt: Path, edit: Callable) -> None:
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own fixture: trusted
    edit(meta)
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))


def _storage_key(meta, fqn: str):
    return next(k for k in meta.storage_data if k.fqn == fqn)


def metadata_is_code(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_System(marker)))
    return ckpt, ".metadata"


def metadata_hides_code(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    _edit_metadata(ckpt, lambda m: m.planner_data.__setitem__("model.embed.weight", _Eval(marker)))
    return ckpt, ".metadata"


def object_blob_is_code(work, marker, dcp_src):
    """A DCP byte object (``extra.note``) re-pointed at a torch.save blob whose pickle runs code."""
    ckpt = _dcp_copy(work, dcp_src)
    buf = io.BytesIO()
    torch.save({"note": _Exec(marker)}, buf)
    data = ckpt / "__0_0.distcp"
    at = data.stat().st_size
    with open(data, "ab") as f:
        f.write(buf.getvalue())

    def repoint(meta) -> None:
        key = _storage_key(meta, "extra.note")
        meta.storage_data[key] = dataclasses.replace(meta.storage_data[key], relative_path="__0_0.distcp", offset=at,
                                                 length=len(buf.getvalue()))

    _edit_metadata(ckpt, repoint)
    return ckpt, "__0_0.distcp"


def metadata_allocates(work, marker, dcp_src):
    """30 bytes of pickle asking ``bytearray(2**40)``: must fail before allocating anything."""
    ckpt = _dcp_copy(work, dcp_src)
    (ckpt / ".metadata").write_bytes(b"\x80\x02cbuiltins\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85R.")
    return ckpt, (".metadata: cannot be unpickled", "bytearray(int)")


def chunks_overlap(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    _edit_metadata(ckpt, lambda m: setattr(m.state_dict_metadata["model.embed.weight"].chunks[0], "sizes", torch.Size([5, 6])))
    return ckpt, ".metadata"


def chunks_leave_a_hole(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    _edit_metadata(ckpt, lambda m: setattr(m.state_dict_metadata["model.embed.weight"].chunks[0], "sizes", torch.Size([3, 6])))
    return ckpt, ".metadata"


def data_path_escapes(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    shutil.copy(ckpt / "__0_0.distcp", work / "outside.distcp")  # a real file, so only the path is wrong

    def escape(meta) -> None:
        key = _storage_key(meta, "model.embed.weight")
        meta.storage_data[key].relative_path = "../outside.distcp"

    _edit_metadata(ckpt, escape)
    return ckpt, ".metadata"


def distcp_truncated(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    data = ckpt / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return ckpt, "__1_0.distcp"


def distcp_missing(work, marker, dcp_src):
    ckpt = _dcp_copy(work, dcp_src)
    (ckpt / "__2_0.distcp").unlink()
    return ckpt, "__2_0.distcp"


def torch_file_is_code(work, marker, dcp_src):
    torch.save({"w": torch.ones(3), "opt": {"hook": _Popen(marker)}}, work / "evil.pt")  # torch itself writes it
    return work / "evil.pt", "evil.pt"


def torch_file_truncated(work, marker, dcp_src):
    torch.save({"w": torch.randn(4096)}, work / "cut.pt")
    (work / "cut.pt").write_bytes((work / "cut.pt").read_bytes()[:-100])
    return work / "cut.pt", "cut.pt"


def torch_file_allocates(work, marker, dcp_src):
    torch.save({"w": torch.ones(2)}, work / "big.pt")
    _replace_pickle(work / "big.pt",
                    b"\x80\x02}q\x00X\x01\x00\x00\x00bcbuiltins\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85Rs.")
    return work / "big.pt", ("big.pt: cannot be unpickled", "bytearray(int)")


def _replace_pickle(path: Path, data: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path) as src:
        records = [(i.filename, data if i.filename.endswith("data.pkl") else src.read(i)) for i in src.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for name, payload in records:
            dst.writestr(name, payload)


def rank_file_is_code(work, marker, dcp_src):
    folder = work / "ranks"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "rank0.pt")
    torch.save({"w": torch.ones(2), "x": _System(marker)}, folder / "rank1.pt")
    return folder, "rank1.pt"


def _indexed(work: Path, filename: str) -> tuple[Path, str]:
    from safetensors.torch import save_file

    folder = work / "hf"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, folder / "model-00001-of-00001.safetensors")
    save_file({"a": torch.ones(2)}, work / "outside.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": filename}}))
    return folder, "model.safetensors.index.json"


def index_dotdot(work, marker, dcp_src):
    return _indexed(work, "../outside.safetensors")


def index_absolute(work, marker, dcp_src):
    return _indexed(work, str(work / "outside.safetensors"))


def index_missing_file(work, marker, dcp_src):
    return _indexed(work, "model-00002-of-00002.safetensors")


def lone_surrogate_name(work, marker, dcp_src):
    """Python's JSON lets ``\\ud800`` through; no UTF-8 writer could store that name later."""
    header = b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    return raw_file(work / "s.safetensors", header, bytes(4)), "s.safetensors"


def offsets_past_u64(work, marker, dcp_src):
    header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [2**64, 2**64 + 4]}}
    return raw_file(work / "far.safetensors", header, bytes(4)), "far.safetensors"


CASES = {f.__name__: f for f in [
    metadata_is_code, metadata_hides_code, object_blob_is_code, metadata_allocates, chunks_overlap,
    chunks_leave_a_hole, data_path_escapes, distcp_truncated, distcp_missing, torch_file_is_code,
    torch_file_truncated, torch_file_allocates, rank_file_is_code, index_dotdot, index_absolute,
    index_missing_file, lone_surrogate_name, offsets_past_u64,
]}


def _refused_everywhere(work: Path, src: Path, needle: str | tuple[str, ...], marker: Path) -> None:
    """inspect, inspect --json and convert (to a folder and to a file): exit 2, one line naming
    the file, no code run, nothing written beside the destination."""
    out = work / "out"
    out.mkdir()
    for args in (["inspect", src], ["inspect", src, "--json"], ["convert", src, out / "dst", "--quiet"],
                 ["convert", src, out / "dst.safetensors", "--quiet"]):
        proc = reshard(*args)
        assert_one_line_error(proc, *((needle,) if isinstance(needle, str) else needle))
        assert proc.stdout == "", proc.stdout
    assert not marker.exists(), "the payload ran"
    assert list(out.iterdir()) == [], "a failed conversion left files behind"


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_input_is_refused(case: str, tmp_path: Path, fsdp2_dcp) -> None:
    marker = tmp_path / "pwned"
    src, needle = CASES[case](tmp_path, marker, fsdp2_dcp[0])
    _refused_everywhere(tmp_path, src, needle, marker)


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_safetensors_header_is_refused(case: str, tmp_path: Path) -> None:
    """Every header the Rust core's rules refuse (overlapping, reversed, mis-sized offsets,
    holes, trailing bytes, a header over 100 MB, shape x dtype overflow, bad JSON, unknown
    dtypes ...), from the shared case table, through the CLI."""
    header, data, length, _error, message, _rust = BROKEN[case]
    src = raw_file(tmp_path / "bad.safetensors", header, data, length)
    _refused_everywhere(tmp_path, src, ("bad.safetensors: ", message), tmp_path / "never")


@pytest.mark.parametrize("payload", PAYLOADS, ids=lambda p: p.__name__)
def test_every_payload_is_stopped_at_its_name(payload: type, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(1), "x": payload(marker)}, tmp_path / "evil.pt")
    assert_one_line_error(reshard("inspect", tmp_path / "evil.pt"), "evil.pt", "not on reshard's allow-list")
    assert not marker.exists()


def test_payloads_are_live_under_torchs_own_readers(tmp_path: Path, fsdp2_dcp) -> None:
    """Positive control: the same bytes do run code under torch.load(weights_only=False) and
    torch's FileSystemReader.read_metadata, so the marker checks above can fail."""
    from torch.distributed.checkpoint import FileSystemReader

    for i, payload in enumerate(PAYLOADS):
        marker = tmp_path / f"ran{i}"
        torch.save({"x": payload(marker)}, tmp_path / f"evil{i}.pt")
        torch.load(tmp_path / f"evil{i}.pt", weights_only=False)
        deadline = 50
        while not marker.exists() and deadline:  # Popen touches from a child process
            import time

            time.sleep(0.1)
            deadline -= 1
        assert marker.exists(), payload.__name__
    marker = tmp_path / "ran_dcp"
    src, _ = metadata_is_code(tmp_path, marker, fsdp2_dcp[0])
    with pytest.raises(Exception):
        FileSystemReader(src).read_metadata()  # it runs os.system, then finds no Metadata
    assert marker.exists()


def test_json_order_need_not_match_data_order(tmp_path: Path) -> None:
    """Control for the header rules: the Rust core sorts by offsets, so must we (no false refusal)."""
    header = {"b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
              "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    src = raw_file(tmp_path / "ok.safetensors", header, struct.pack("<2f", 1.0, 2.0))
    assert reshard("convert", src, tmp_path / "ok.pt", "--quiet").returncode == 0
    assert torch.load(tmp_path / "ok.pt", weights_only=True) == {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])}


def test_installed_entry_point_refuses_code(tmp_path: Path, fsdp2_dcp) -> None:
    """The console script itself, in a fresh process: exit 2, one line, no traceback, no code."""
    marker = tmp_path / "pwned"
    work = tmp_path / "w"
    work.mkdir()
    src, _ = metadata_hides_code(work, marker, fsdp2_dcp[0])
    assert_one_line_error(reshard_process("convert", src, tmp_path / "dst"), ".metadata", "builtins.eval")
    evil, _ = torch_file_is_code(work, marker, fsdp2_dcp[0])
    assert_one_line_error(reshard_process("inspect", evil), "evil.pt",
                          ".Popen, which is not on")  # protocol 2 names it commands.Popen
    assert not marker.exists() and not (tmp_path / "dst").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]
