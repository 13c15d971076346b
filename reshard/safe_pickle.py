"""An allow-list unpickler: the only way reshard ever reads a pickle.

Checkpoints come from strangers. Plain ``pickle.load`` calls any importable function the file
names, so a ``.metadata`` or a ``.pt`` file can run code on the reader's machine (torch's own
``FileSystemReader.read_metadata`` does exactly that). Here every global a pickle refers to
must be on an explicit list; anything else stops the read with an error that names the global,
before it is imported or called.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["safe_loads", "PLAIN_GLOBALS", "bytearray_from_data"]

def bytearray_from_data(*args: Any) -> bytearray:
    """``bytearray`` from data only. Pickles call it with the bytes (or a latin-1 str) to copy;
    called with a number it allocates that many zeroed bytes, so a 30-byte file could claim
    gigabytes before any check (the allow-list's one amplifier)."""
    if not args or isinstance(args[0], (bytes, bytearray, str)):
        return bytearray(*args)
    raise ValueError(f"bytearray({type(args[0]).__name__}): only stored bytes are accepted")  # safe_loads names the file


# Harmless builtins that state dicts legitimately contain.
PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): bytearray_from_data,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(
        self,
        data: bytes,
        allowed: Mapping[tuple[str, str], Any],
        persistent_load: Callable[[Any], Any] | None,
        origin: str,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._persistent = persistent_load
        self._origin = origin

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._origin}: refers to {module}.{name}, which is not on reshard's allow-list "
                "of checkpoint types; refusing to load it (it could run code). If this file is "
                "trusted, re-save it with plain tensors and containers."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeCheckpointError(f"{self._origin}: unexpected persistent reference {pid!r}")
        return self._persistent(pid)


def safe_loads(
    data: bytes,
    allowed: Mapping[tuple[str, str], Any],
    *,
    origin: Path | str,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Any:
    """Unpickle ``data`` allowing only the globals in ``allowed`` (plus PLAIN_GLOBALS).

    ``origin`` names the file in error messages.
    """
    table = {**PLAIN_GLOBALS, **allowed}
    try:
        return _AllowListUnpickler(data, table, persistent_load, str(origin)).load()
    except UnsafeCheckpointError:
        raise
    except CorruptCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
            IndexError, OverflowError, MemoryError, RecursionError) as e:
        raise CorruptCheckpointError(f"{origin}: cannot be unpickled ({type(e).__name__}: {e})") from e
