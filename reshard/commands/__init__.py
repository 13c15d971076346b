"""Layer 8, the commands: ``convert``, ``verify``, ``validate`` and ``inspect``, each behind a
function of the public API (``reshard.convert``, ``reshard.verify``...), built on every layer below.
"""
