"""Layer 7 (with the sources), the runtime: loading a checkpoint into live ranks: ``load_model`` / ``load_state_dict``.

- ``load``: the entry points and their result
- ``targets``: each live rank's boxes of each tensor (DTensor placements, plain tensors)
- ``plan``: who reads what, and which source name fills which live tensor
- ``transfer``: reads on rank 0 and sends, or each rank's own reads
- ``storage_reader``: ``StorageReader``, any checkpoint as a source for torch's ``dcp.load``
- ``world``: spawned gloo worlds (the example, tests, ``reshard train``)
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "MODES": "reshard.runtime.load",
    "LoadResult": "reshard.runtime.load",
    "StateDictMismatchError": "reshard.runtime.load",
    "load_model": "reshard.runtime.load",
    "load_state_dict": "reshard.runtime.load",
    "StorageReader": "reshard.runtime.storage_reader",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
