"""Objects the unpickler keeps as data instead of building them.

* ``Inert`` stand-ins, for classes the user allowed by name (``allow_classes``): the class
  is never imported and nothing of it runs. A stand-in records what the pickle asked for (a
  call or ``cls.__new__``, the arguments, BUILD's state, the items APPENDS and SETITEMS
  added) and pickles back to exactly that under the original global name, so an output
  loads wherever its input loaded.
* ``Refused`` placeholders, for globals nobody allowed, in readers that defer the refusal
  (torch files: one pickle holds the model and the data loader's state alike). A placeholder
  absorbs whatever the pickle does to it and calls nothing; the reader turns every object
  that holds one into an error raised only when that object is asked for.

Both are built on ``Sealed`` classes: a pickle may BUILD a global it names, and pickle then
sets attributes on the class itself, changing it for every later load in the process.
"""

from __future__ import annotations

import copyreg
from functools import cache, lru_cache
from typing import Any, ClassVar, cast

from reshard.core.errors import UnsafeCheckpointError, UsageError
from reshard.core.values import difference

__all__ = ["Sealed", "Inert", "Refused", "standin_class", "refused_class", "is_refused", "refused_name",
           "inert_name"]


class Sealed(type):
    """Metaclass of the classes reshard hands to the unpickler: read-only once created.
    BUILD on the class object itself reaches ``__setstate__`` below and is refused too."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise TypeError(f"{cls.__qualname__} is read-only (a pickle tried to set {name!r} on it)")

    def __delattr__(cls, name: str) -> None:
        raise TypeError(f"{cls.__qualname__} is read-only")

    def __setstate__(cls, state: Any) -> None:
        raise TypeError(f"{cls.__qualname__}: a pickle tried to BUILD the class itself")


class Inert(metaclass=Sealed):
    """An instance of an allowed class, as data. ``how`` is ``"call"`` (REDUCE: ``cls(*args)``),
    ``"new"`` (NEWOBJ: ``cls.__new__(cls, *args)``) or ``"new_ex"`` (with ``kwargs``)."""

    __slots__ = ("how", "args", "kwargs", "state", "items", "entries")
    how: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    state: Any
    items: list[Any]
    entries: list[tuple[Any, Any]]
    inert_module: ClassVar[str] = ""
    inert_qualname: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        self = object.__new__(cls)
        self.how, self.args, self.kwargs = ("new_ex" if kwargs else "new"), args, kwargs
        self.state, self.items, self.entries = None, [], []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.how = "call"  # only a call runs __init__; NEWOBJ calls __new__ alone

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.entries.append((key, value))

    def walk_children(self) -> list[Any]:
        return [*self.args, *self.kwargs.values(), self.state, *self.items, *(x for kv in self.entries for x in kv)]

    def remade(self, fn: Any) -> Inert:
        """A copy with ``fn`` applied to every argument, the state and the items."""
        new = object.__new__(type(self))
        new.how, new.args, new.kwargs = self.how, tuple(fn(a) for a in self.args), {k: fn(v) for k, v in self.kwargs.items()}
        new.state, new.items = fn(self.state), [fn(x) for x in self.items]
        new.entries = [(k, fn(v)) for k, v in self.entries]
        return new

    def __reduce_ex__(self, protocol: Any) -> tuple:
        items = iter(self.items) if self.items else None
        entries = iter(self.entries) if self.entries else None
        if self.how == "call":
            return (type(self), self.args, self.state, items, entries)
        if self.how == "new":
            # typeshed's copyreg leaves out __newobj__ (pickle's NEWOBJ, protocol 2), which the module has
            return (copyreg.__newobj__, (type(self), *self.args), self.state, items, entries)  # type: ignore[attr-defined]
        raise UsageError(f"{inert_name(type(self))} was created with keyword arguments (pickle protocol 4), "
                         "which a torch file (protocol 2) cannot express")

    def _fields(self) -> tuple:
        return (self.how, self.args, self.kwargs, self.state, self.items, self.entries)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and difference(self._fields(), other._fields()) is None

    def __hash__(self) -> int:
        return hash((type(self), self.how, len(self.args)))

    def __repr__(self) -> str:
        state = f", state={self.state!r}" if self.state is not None else ""
        text = f"{inert_name(type(self))}(inert: {self.how} {self.args!r}" + state
        return (text if len(text) < 200 else text[:196] + " ...") + ")"


class Refused(metaclass=Sealed):
    """Stands where a pickle named a global that is not allowed; ``refused`` is its name."""

    __slots__ = ()
    refused: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Refused:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __reduce_ex__(self, protocol: Any) -> tuple:
        raise UnsafeCheckpointError(f"a placeholder for {self.refused} reached a writer; it was never read")

    def __repr__(self) -> str:
        return f"<not read: {self.refused}>"


def _dotted(module: str, qualname: str) -> str:
    return f"{module}.{qualname}"


@cache
def standin_class(module: str, qualname: str) -> type[Inert]:
    """The one stand-in class for ``module.qualname`` in this process (so values read from two
    files compare equal). Its Python name marks it as ours: pickling it with a plain pickler
    fails loudly instead of writing reshard's module name into someone's checkpoint."""
    label = f"<inert {_dotted(module, qualname)}>"
    return cast(type[Inert], Sealed(label, (Inert,), {"__slots__": (), "__module__": __name__, "__qualname__": label,
                                                      "inert_module": module, "inert_qualname": qualname}))


@lru_cache(maxsize=1024)  # names come from strangers' pickles: bounded
def refused_class(module: str, qualname: str) -> type[Refused]:
    label = f"<refused {_dotted(module, qualname)}>"
    return cast(type[Refused], Sealed(label, (Refused,), {"__slots__": (), "__module__": __name__, "__qualname__": label,
                                                          "refused": _dotted(module, qualname)}))


def is_refused(value: Any) -> bool:
    return isinstance(value, Refused) or (isinstance(value, type) and issubclass(value, Refused))


def refused_name(value: Any) -> str:
    return value.refused


def inert_name(cls: type[Inert]) -> str:
    return _dotted(cls.inert_module, cls.inert_qualname)
