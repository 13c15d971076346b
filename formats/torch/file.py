"""A whole torch.save file, whichever layout torch wrote: the zip archive (torch >= 1.6) or the
pre-1.6 legacy stream; the tar layout of torch < 0.4 is refused."""

from __future__ import annotations

import os
from pathlib import Path

from reshard.errors import UnsupportedFormatError
from reshard.formats.torch.legacy import is_tar, read_legacy
from reshard.formats.torch.zip import read_torch_zip_deferred
from reshard.safe_pickle.unpickler import Unpickled

__all__ = ["read_torch_file"]


def read_torch_file(path: Path) -> Unpickled:
    """A whole torch.save file, zip or pre-1.6 legacy, read with placeholders where globals
    nobody allowed were (``safe_loads_deferred``): the caller refuses the objects that hold
    one when they are asked for, so a conversion of the model alone still works."""
    fd = os.open(path, os.O_RDONLY)
    try:
        head = os.pread(fd, 512, 0)
    finally:
        os.close(fd)
    if head[:4] != b"PK\x03\x04":
        if is_tar(head):
            raise UnsupportedFormatError(
                f"{path}: a torch.save file in the pre-0.4 tar format, which reshard does not read; load it with "
                "an old torch and save it again"
            )
        if head[:1] == b"\x80":
            return read_legacy(path)
    return read_torch_zip_deferred(path)
