from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from reshard.errors import CorruptCheckpointError, UnsafeCheckpointError
from reshard.safe_pickle import safe_loads


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_in_a_pickle_is_refused_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps({"x": _Evil(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        safe_loads(data, {}, origin="evil.pkl")
    assert not marker.exists()


def test_plain_containers_load_and_garbage_is_corrupt() -> None:
    value = {"a": [1, 2.5, (3, None)], "b": {"c": True}, "s": {1, 2}}
    assert safe_loads(pickle.dumps(value), {}, origin="ok.pkl") == value
    with pytest.raises(CorruptCheckpointError, match="bad.pkl"):
        safe_loads(b"\x80\x04not a pickle", {}, origin="bad.pkl")


def test_protocol_2_bytes_and_sets_load_as_torch_save_writes_them(tmp_path: Path) -> None:
    """torch.save pickles with protocol 2: bytes become _codecs.encode(str, "latin1"), b""
    becomes __builtin__.bytes(), sets __builtin__.set. A real torch.save file, read by our reader."""
    import torch

    from reshard.formats.torch_zip import read_torch_zip

    value = {"b": b"abc\x00\xff", "e": b"", "ba": bytearray(b"xy"), "s": {1, 2}, "fs": frozenset([3]), "w": torch.ones(2)}
    path = tmp_path / "objects.pt"
    torch.save(value, path)
    got = read_torch_zip(path)
    assert {k: got[k] for k in value if k != "w"} == {k: v for k, v in value.items() if k != "w"}
    assert type(got["b"]) is bytes and type(got["ba"]) is bytearray


@pytest.mark.parametrize("payload", [
    b"\x80\x02c_codecs\nencode\nX\x03\x00\x00\x00abcX\x0a\x00\x00\x00zlib_codec\x86R.",  # another codec
    b"\x80\x02c__builtin__\nbytes\nJ\x00\xca\x9a;\x85R.",  # bytes(10**9): an allocation, not data
])
def test_protocol_2_helpers_take_data_only(payload: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="only"):
        safe_loads(payload, {}, origin="x.pkl")
