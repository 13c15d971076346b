"""An allow-list unpickler: the only way reshard ever reads a pickle.

Checkpoints come from strangers. Plain ``pickle.load`` calls any importable function the file
names, so a ``.metadata`` or a ``.pt`` file can run code on the reader's machine (torch's own
``FileSystemReader.read_metadata`` does exactly that). Here every global a pickle refers to
must be on an explicit list; anything else stops the read with an error that names the global,
before it is imported or called. Beyond the list:

* ``allow_classes(["module.Name"])``: the user vouches for a class by name; it is read as an
  inert stand-in (``reshard.safe_pickle.inert``), still never imported or called, and written back under
  its own name;
* ``safe_loads_deferred``: for one pickle that holds many unrelated objects (a torch file),
  a global nobody allowed becomes a placeholder, and the reader refuses only the objects that
  hold one, when they are asked for.

Every global handed to the unpickler is immutable (a builtin type, a sealed class, a guarded
function): a pickle can BUILD any global it names, which would otherwise set attributes on
it for every later load in the process. The C unpickler does the work; a pickle that names
numpy is replayed by the pure-Python one, whose BUILD step reshard checks (``safe_pickle.numpy_types``).
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import contextvars
import io
import pickle
import re
import struct
import threading
import types
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from reshard.core.errors import CorruptCheckpointError, ReshardError, UnsafeCheckpointError, UsageError, option
from reshard.safe_pickle.inert import Refused, is_refused, refused_class, standin_class
from reshard.safe_pickle.numpy_types import NUMPY_NAMES, numpy_build

__all__ = ["safe_loads", "safe_loads_deferred", "Unpickled", "PLAIN_GLOBALS", "allow_classes", "AllowedClasses",
           "allowing", "allowed_classes", "class_names", "refusal_message", "bytearray_from_data", "bytes_from_data",
           "latin1_bytes"]


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


# Harmless builtins that every pickle reshard reads may contain.
PLAIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "bytearray"): bytearray_from_data,
    ("builtins", "bytes"): bytes_from_data,
    ("_codecs", "encode"): latin1_bytes,
    ("collections", "OrderedDict"): OrderedDict,
}

# ---------------------------------------------------------------------------------- opt-in

# Modules (and names) whose globals are code-execution primitives: never allowed, even as
# stand-ins, so that no output reshard writes names them.
_NEVER_MODULES = ("__builtin__", "builtins", "os", "posix", "nt", "subprocess", "commands", "sys", "importlib",
                  "runpy", "pickle", "_pickle", "marshal", "shutil", "socket", "ctypes", "code", "codeop", "pty",
                  "webbrowser", "types", "operator", "_operator", "functools", "_functools", "codecs", "_codecs",
                  "io", "_io", "pathlib", "tempfile", "multiprocessing", "threading", "signal", "asyncio",
                  "inspect", "gc", "copyreg", "copy_reg", "posixpath", "ntpath", "site", "zipimport", "pip",
                  "setuptools", "torch._C", "torch.hub", "torch.ops", "torch.jit", "torch.serialization")
_NEVER_NAMES = {("torch", "load"), ("torch", "save"), ("numpy", "load"), ("numpy", "fromfile"), ("torch", "from_file")}
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CLASS_NAME = re.compile(rf"({_IDENT}(?:\.{_IDENT})*)(?:\.|:)({_IDENT}(?:\.{_IDENT})*)")

_lock = threading.Lock()
_allowed: frozenset[tuple[str, str]] = frozenset()  # by allow_classes: process-wide, until closed
# By one call's options (``allow_classes=`` of SourceOptions, ``--allow-class``): in its context only.
_allowed_here: contextvars.ContextVar[frozenset[tuple[str, str]]] = contextvars.ContextVar(
    "reshard_allowed_classes", default=frozenset())


def _never(module: str, name: str) -> bool:
    return (module, name) in _NEVER_NAMES or any(module == m or module.startswith(m + ".") for m in _NEVER_MODULES)


def _parse_class_name(text: str) -> tuple[str, str]:
    """``module.Name`` (split at the last dot) or ``module:Qual.Name``."""
    given = option(f"--allow-class {text}", f"allow_classes=[{text!r}]")
    if not isinstance(text, str):
        raise UsageError(f"{given}: expected a name such as module.ClassName")
    m = _CLASS_NAME.fullmatch(text.strip())
    if ":" in text and m:
        module, name = m.group(1), m.group(2)
    elif m and "." in text:
        module, _, name = text.strip().rpartition(".")
    else:
        raise UsageError(f"{given}: expected a name such as module.ClassName")
    if _never(module, name):
        raise UsageError(f"{given}: {module}.{name} can run code when loaded; reshard never reads it, "
                         "even as inert data, so that no file it writes names it")
    return module, name


class AllowedClasses:
    """What ``allow_classes`` returns: the names stay allowed until ``close()`` or the end of
    the ``with`` block, for every thread of the process."""

    def __init__(self, names: frozenset[tuple[str, str]]) -> None:
        global _allowed
        with _lock:
            self._previous = _allowed
            _allowed = _allowed | names
        self.names = names

    def close(self) -> None:
        global _allowed
        with _lock:
            _allowed = self._previous

    def __enter__(self) -> AllowedClasses:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def allow_classes(names: Iterable[str]) -> AllowedClasses:
    """Allow the named classes (``"module.ClassName"``) in torch files and DCP objects, as
    inert stand-ins: never imported, never called, their constructor arguments and state kept
    as data and written back under the same name (like torch's ``add_safe_globals``, without
    running the class). Effective at once and process-wide, until the returned object is closed:

    >>> with allow_classes(["megatron.training.arguments.Args"]):
    ...     reshard.convert("ckpt.pt", "ckpt_dcp")

    A name that is a code-execution primitive (``os.system``, ``builtins.eval``...) is refused
    (``UsageError``). Pickles are read when a catalog is built, objects of DCP checkpoints when
    first asked for: keep the block open until then.
    """
    return AllowedClasses(class_names(names))


def class_names(names: Iterable[str]) -> frozenset[tuple[str, str]]:
    """``(module, name)`` of each ``module.Name``; a malformed name, or one that can run code, is
    a usage error naming it as the caller gave it (``--allow-class``, ``allow_classes=``)."""
    return frozenset(_parse_class_name(n) for n in ([names] if isinstance(names, str) else names))


@contextlib.contextmanager
def allowing(names: Iterable[str]) -> Iterator[None]:
    """Allow the named classes as ``allow_classes`` does, but only in this context (this
    thread, or task, and what it calls) until the block ends: how one call's options
    (``SourceOptions.allow_classes``, ``--allow-class``) apply without touching another's."""
    token = _allowed_here.set(_allowed_here.get() | class_names(names))
    try:
        yield
    finally:
        _allowed_here.reset(token)


def _allowed_now() -> frozenset[tuple[str, str]]:
    return _allowed | _allowed_here.get()


def allowed_classes() -> frozenset[str]:
    """The class names allowed right now (process-wide and in this context), as ``module.Name``."""
    return frozenset(f"{m}.{n}" for m, n in _allowed_now())


def refusal_message(origin: Any, global_name: str, *, opt_in: bool, what: str = "") -> str:
    """One line: which file names which global, and what the user can do about it."""
    text = (f"{origin}: {what}refers to {global_name}, which is not on reshard's allow-list of checkpoint types; "
            "refusing to load it (it could run code).")
    module, _, name = global_name.rpartition(".")
    if opt_in and module and not _never(module, name):
        return text + (f" If the file is trusted, pass --allow-class {global_name} (reshard.allow_classes() in Python) to "
                       "read it as inert data: its code is never run.")
    return text + " If this file is trusted, re-save it with plain tensors and containers."


# ---------------------------------------------------------------------------------- unpickling


class _Guarded:
    """A function the allow-list hands to pickle, shielded from BUILD (pickle would set its
    ``__defaults__`` or ``__dict__``). Where placeholders are on, a call that receives one
    returns it instead of running: an allowed function never sees an object nobody allowed."""

    __slots__ = ("__wrapped__", "_deferred")

    def __init__(self, fn: Callable[..., Any], deferred: bool) -> None:
        self.__wrapped__, self._deferred = fn, deferred

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._deferred:
            for a in args:
                for b in (a, *a) if type(a) in (tuple, list) else (a,):
                    if is_refused(b):
                        return b if isinstance(b, Refused) else b()
        return self.__wrapped__(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        raise TypeError("a pickle tried to BUILD a function")


class _NeedsCheckedBuild(Exception):
    """The pickle names numpy: replay it with the pure-Python unpickler."""


_MAX_REFUSED = 256  # distinct refused globals one pickle may name before it is refused whole


class _Policy:
    """find_class and persistent_load, shared by the C and the pure-Python unpickler."""

    def _setup(self, table: Mapping[tuple[str, str], Any], persistent: Callable[[Any], Any] | None, origin: str,
               *, stand_ins: bool, deferred: bool, checked: bool) -> None:
        self._table, self._persistent, self._origin = table, persistent, origin
        self._classes = _allowed_now() if stand_ins else frozenset()
        self._stand_ins, self._deferred, self._checked = stand_ins, deferred, checked
        self.refused: dict[str, None] = {}

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles (torch.save's default) spell Python 2 names, __builtin__.set for
        # builtins.set; pickle's own find_class maps them, and so must we (torch's does too).
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        key = (module, name)
        try:
            value = self._table[key]
        except KeyError:
            pass
        else:
            if key in NUMPY_NAMES and not self._checked:
                raise _NeedsCheckedBuild
            return value if isinstance(value, type) or not callable(value) else _Guarded(value, self._deferred)
        if key in self._classes:
            return standin_class(module, name)
        if not self._deferred:
            raise UnsafeCheckpointError(refusal_message(self._origin, f"{module}.{name}", opt_in=self._stand_ins))
        self.refused[f"{module}.{name}"] = None
        if len(self.refused) > _MAX_REFUSED:
            raise UnsafeCheckpointError(refusal_message(self._origin, f"{module}.{name}", opt_in=False))
        return refused_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafeCheckpointError(f"{self._origin}: unexpected persistent reference {pid!r}")
        return self._persistent(pid)


class _FastUnpickler(_Policy, pickle.Unpickler):
    pass


class _CheckedUnpickler(_Policy, pickle._Unpickler):
    """The pure-Python unpickler with BUILD checked: numpy's states go through
    ``numpy_build``, and BUILD on a class or function is refused outright."""

    stack: list[Any]  # the pure-Python unpickler's own (typeshed leaves it out)
    dispatch = dict(pickle._Unpickler.dispatch)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if numpy_build(inst, state):
            self.stack.pop()
            return
        if isinstance(inst, (type, _Guarded, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)):
            raise pickle.UnpicklingError(f"BUILD on {type(inst).__name__} {inst!r}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # typeshed leaves out the load_* handlers

    # typeshed types dispatch's handlers as taking the C Unpickler; this table is _Unpickler's
    dispatch[pickle.BUILD[0]] = load_build  # type: ignore[assignment]


@dataclass(frozen=True)
class Unpickled:
    """What ``safe_loads_deferred`` read: the value, and the globals that became placeholders
    (``module.Name``, in the order met; empty when the pickle named none)."""

    value: Any
    refused: tuple[str, ...] = ()


_DATA_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, LookupError, OverflowError,
                MemoryError, RecursionError, struct.error)


def _load(data: bytes | BinaryIO, allowed: Mapping[tuple[str, str], Any], origin: Path | str,
          persistent_load: Callable[[Any], Any] | None, *, stand_ins: bool, deferred: bool) -> Unpickled:
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    start = stream.tell()
    table = ChainMap(allowed, PLAIN_GLOBALS)  # type: ignore[arg-type]  # typeshed's ChainMap: mutable maps only; read here
    for unpickler in (_FastUnpickler, _CheckedUnpickler):
        stream.seek(start)
        u = unpickler(stream)
        u._setup(table, persistent_load, str(origin), stand_ins=stand_ins, deferred=deferred,
                 checked=unpickler is _CheckedUnpickler)
        try:
            return Unpickled(u.load(), tuple(u.refused))
        except _NeedsCheckedBuild:
            continue
        except ReshardError:
            raise
        except _DATA_ERRORS as e:
            if u.refused:  # the first refused global is the real problem, whatever broke after it
                raise UnsafeCheckpointError(refusal_message(origin, next(iter(u.refused)), opt_in=stand_ins)) from e
            raise CorruptCheckpointError(f"{origin}: cannot be unpickled ({type(e).__name__}: {e})") from e
    raise AssertionError("unreachable: the checked unpickler never asks to be replaced")


def safe_loads(
    data: bytes | BinaryIO,
    allowed: Mapping[tuple[str, str], Any],
    *,
    origin: Path | str,
    persistent_load: Callable[[Any], Any] | None = None,
    stand_ins: bool = False,
) -> Any:
    """Unpickle ``data`` (bytes, or a binary file positioned at the pickle, left just past it)
    allowing only the globals in ``allowed`` (plus PLAIN_GLOBALS); ``stand_ins``: classes the
    user allowed (``allow_classes``) too, as inert stand-ins. ``origin`` names the file in errors."""
    return _load(data, allowed, origin, persistent_load, stand_ins=stand_ins, deferred=False).value


def safe_loads_deferred(
    data: bytes | BinaryIO,
    allowed: Mapping[tuple[str, str], Any],
    *,
    origin: Path | str,
    persistent_load: Callable[[Any], Any] | None = None,
) -> Unpickled:
    """``safe_loads`` with stand-ins, where a global nobody allowed becomes a ``Refused``
    placeholder instead of an error: inert, it absorbs what the pickle does to it and calls
    nothing. The caller must refuse every object that holds one (``reshard.safe_pickle.inert.is_refused``)."""
    return _load(data, allowed, origin, persistent_load, stand_ins=True, deferred=True)
