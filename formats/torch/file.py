"""A whole torch.save file, whichever layout torch wrote: the zip archive (torch >= 1.6) or the
pre-1.6 legacy stream; the tar layout of torch < 0.4 is refused."""

from __future__ import annotations

from pathlib import Path

from reshard.formats.torch.legacy import is_tar, read_legacy
from reshard.formats.torch.zip import read_torch_zip_deferred

from reshard.core.errors import UnsupportedFormatError
from reshard.core.regions import read_exact
from reshard.core.storage import RemotePath, close, handle_size, open_read
from reshard.safe_pickle.unpickler import Unpickled

__all__ = ["read_torch_file"]


def read_torch_file(path: Path) -> Unpickled:
    """A whole torch.save file, zip or pre-1.6 legacy, read with placeholders where globals
    nobody allowed were (``safe_loads_deferred``): the caller refuses the objects that hold
    one when they are asked for, so a conversion of the model alone still works."""
    fd = open_read(path)
    try:
        head = bytes(read_exact(fd, min(512, handle_size(fd)), 0, path))
    finally:
        close(fd)
    if head[:4] != b"PK\x03\x04":
        if is_tar(head):
            raise UnsupportedFormatError(
                f"{path}: a torch.save file in the pre-0.4 tar format, which reshard does not read; load it with "
                "an old torch and save it again"
            )
        if head[:1] == b"\x80":
            if isinstance(path, RemotePath):
                raise UnsupportedFormatError(f"{path}: a pre-1.6 torch.save file, read from local files only; copy it here first")
            return read_legacy(path)
    return read_torch_zip_deferred(path)
