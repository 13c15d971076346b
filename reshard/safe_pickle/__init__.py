"""Layer 2, safe unpickling, the only way reshard reads a pickle: an allow-list that never imports or calls what a
file names beyond inert data types (docs/security.md).

- ``unpickler``: the allow-list unpickler, deferred refusals, ``allow_classes``
- ``value_types``: harmless objects read as data (BytesIO, Namespace, collections, datetime)
- ``numpy_types``: numpy arrays, scalars and RNG states, replayed with checked BUILD steps
- ``inert``: stand-ins for classes a user allowed by name, written back under that name
- ``walk``: finding and replacing values inside unpickled objects
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "allow_classes": "reshard.safe_pickle.unpickler",
    "allowed_classes": "reshard.safe_pickle.unpickler",
    "safe_loads": "reshard.safe_pickle.unpickler",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
