"""An allow-list unpickler: the only way reshard ever reads a pickle.

Checkpoints come from strangers. Plain ``pickle.load`` calls any importable function the file
names, so a ``.metadata`` or a ``.pt`` file can run code on the reader's machine (torch's own
``FileSystemReader.read_metadata`` does exactly that). Here every global a pickle refers to
must be on an explicit list; anything else stops the read with an error that names the global,
before it is imported or called.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from reshard.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["safe_loads", "PLAIN_GLOBALS", "bytearray_from_data", "bytes_from_data", "latin1_bytes"]

def bytearray_from_data(*args: Any) -> bytearray:
    """``bytearray`` from data only. Pickles call it with the bytes (or a latin-1 str) to copy;
    called with a number it allocates that many zeroed bytes, so a 30-byte file could claim
    gigabytes before any check (the allow-list's one amplifier)."""
    if not args or isinstance(args[0], (bytes, bytearray, str)):
        return bytearray(*args)
    raise ValueError(f"bytearray({type(args[0]).__name__}): only stored bytes are accepted")  # safe_loads names the file


def bytes_from_data(*args: Any) -> bytes:
    """``bytes`` from data only (``bytes()`` is how protocol 2 pickles b""); ``bytes(n)``
    would allocate n zeroed bytes, as ``bytearray(n)`` would."""
    if not args or isinstance(args[0], (bytes, bytearray, str)):
        return bytes(*args)
    raise ValueError(f"bytes({type(args[0]).__name__}): only stored bytes are accepted")


def latin1_bytes(text: Any, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 (torch.save's default) uses it for every bytes
    object: ``encode(str, "latin1")``. Only that: another codec name makes the codec registry
    import a module by name."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError(f"_codecs.encode({type(text).__name__}, {encoding!r}): only latin1 text is accepted")
    return text.encode("latin1")


# Harmless builtins that state dicts legitimately contain.
PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): bytearray_from_data,
    ("builtins", "bytes"): bytes_from_data,
    ("_codecs", "encode"): latin1_bytes,
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
        # Protocol 2 pickles (torch.save's default) spell Python 2 names, __builtin__.set for
        # builtins.set; pickle's own find_class maps them, and so must we (torch's does too).
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
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
