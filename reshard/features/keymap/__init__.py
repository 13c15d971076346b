"""Key maps: rename a checkpoint's tensors between naming schemes, lazily and invertibly.

``load_keymap(name_or_path)`` gives a ``KeyMap`` (a preset or a MAP.json) whose ``apply``
renames a catalog without reading data; its optimizer state follows every rename.

- ``maps``: the rules (rename, split, merge, stack, unstack, drop, RoPE permutation) and ``KeyMap``
- ``lookup``: a key map by preset name or JSON file (``load_keymap``)
- ``presets``: the tables of torchtitan's model families and HF's names
- ``megatron``: Megatron-Core GPT/Llama to HF
- ``patterns``: name templates and their inverses
- ``apply``: a key map applied to a catalog (routes, optimizer state)

What a rename does to stored chunks (box arithmetic, row gathers) is the data model's:
``reshard.core.chunk_reads``.
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {
    "apply_keymap": "reshard.features.keymap.apply",
    "FamilyKeyMap": "reshard.features.keymap.maps",
    "KeyMap": "reshard.features.keymap.maps",
    "load_keymap": "reshard.features.keymap.lookup",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
