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
