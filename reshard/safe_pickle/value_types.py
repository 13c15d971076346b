"""Harmless values checkpoints hold beside tensors, as the allow-list unpickler may build them
from torch files and DCP byte objects: ``io.BytesIO`` (older torchtitan's train state),
``argparse.Namespace`` (Megatron, fairseq, timm, DeepSpeed), ``collections`` types,
``datetime`` values, builtin types named as values (a defaultdict's factory), numpy
arrays, scalars and RNG states (``numpy_types``), and the few plain-data classes training
tools pickle into every checkpoint (``TOOL_CLASSES``: DeepSpeed's loss scaler, ZeRO stage
enum and fragment addresses), read as inert stand-ins exactly as if the user had allowed
them (``reshard.safe_pickle.inert``): never imported, never run, written back under their own names.

Every entry obeys three rules (docs/security.md):

* built from any data a pickle can supply, it runs no code of the file's choosing and
  allocates no more than the data it was given;
* what the unpickler receives is an immutable builtin type, a function, or a sealed class
  (``reshard.safe_pickle.inert.Sealed``), so a crafted BUILD cannot change it for later loads;
* the result is a real value of its type, so writers and ``reshard.core.values`` treat it like any
  other value (``Counter`` is a Counter, not a look-alike).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import io
from collections.abc import Iterator, Mapping
from typing import Any

from reshard.safe_pickle.inert import Sealed, standin_class
from reshard.safe_pickle.numpy_types import NUMPY_NAMES, numpy_globals
from reshard.safe_pickle.unpickler import bytearray_from_data, bytes_from_data

__all__ = ["VALUE_GLOBALS", "TOOL_CLASSES"]


class NamespaceFromData(metaclass=Sealed):
    """``argparse.Namespace`` as pickle makes it (NEWOBJ, then BUILD sets its attributes).
    The real class is a plain Python class that BUILD on the class itself would change."""

    def __new__(cls, *args: Any, **kwargs: Any) -> argparse.Namespace:  # type: ignore[misc]
        if args or kwargs:
            raise ValueError("argparse.Namespace takes its attributes from BUILD, not arguments")
        return argparse.Namespace()


def counter_from_data(counts: Any = None) -> collections.Counter:
    """``Counter(dict)``, as ``Counter.__reduce__`` writes it (a Python class: BUILD-safe here)."""
    if counts is not None and not isinstance(counts, dict):
        raise ValueError(f"collections.Counter({type(counts).__name__}): only a dict of counts is accepted")
    return collections.Counter(counts or {})


# What a defaultdict's factory may be, keyed by what the unpickler hands over for it.
_FACTORIES: dict[Any, Any] = {f: f for f in (int, float, complex, str, bool, list, dict, tuple, set, frozenset,
                                             collections.OrderedDict, collections.deque)}
_FACTORIES.update({bytes_from_data: bytes, bytearray_from_data: bytearray, counter_from_data: collections.Counter,
                   NamespaceFromData: argparse.Namespace})


def defaultdict_from_data(factory: Any = None, *rest: Any) -> collections.defaultdict:
    """``defaultdict(factory)`` for a factory that builds plain data when a missing key is read."""
    if factory is not None:
        factory = _FACTORIES.get(getattr(factory, "__wrapped__", factory))
        if factory is None:
            raise ValueError("collections.defaultdict: its factory is not a plain type")
    return collections.defaultdict(factory, *rest)


_FACTORIES[defaultdict_from_data] = collections.defaultdict

_PLAIN: dict[tuple[str, str], Any] = {
    ("_io", "BytesIO"): io.BytesIO, ("io", "BytesIO"): io.BytesIO,
    ("argparse", "Namespace"): NamespaceFromData,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "deque"): collections.deque,
    ("collections", "defaultdict"): defaultdict_from_data,
    ("collections", "Counter"): counter_from_data,
    **{("datetime", t.__name__): t for t in (datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
                                            datetime.timezone)},
    **{("builtins", t.__name__): t for t in (int, float, str, bool, list, dict, tuple)},
}


# Classes that hold nothing but numbers and flags, in files a tool writes on every save: a
# checkpoint cannot be read without them, and a stand-in keeps exactly what the pickle gave
# (NEWOBJ + BUILD state, or an enum's call with its value).
TOOL_CLASSES: tuple[tuple[str, str], ...] = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # {cur_scale, dynamic, ...}
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),  # fp16 runs
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # ZeroStageEnum(stage)
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # {numel, start}
)
_PLAIN.update({key: standin_class(*key) for key in TOOL_CLASSES})


class _ValueGlobals(Mapping):
    """``_PLAIN`` and numpy's entries; numpy is imported only when a pickle names it."""

    def __getitem__(self, key: tuple[str, str]) -> Any:
        if key in NUMPY_NAMES:
            return numpy_globals()[key]
        return _PLAIN[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        yield from _PLAIN
        yield from sorted(NUMPY_NAMES)

    def __len__(self) -> int:
        return len(_PLAIN) + len(NUMPY_NAMES)


VALUE_GLOBALS: Mapping[tuple[str, str], Any] = _ValueGlobals()
