"""Layer 1, the data model: what a checkpoint is to reshard, and the ground floor every layer stands on.

Boxes and chunks (``boxes``, ``columns``), the catalog of tensors and objects (``catalog``,
``structure``, ``values``), dtypes, where bytes lie and how to read them (``regions``,
``storage``, ``fd_pool``, ``chunk_reads``), what an output holds (``target``, ``pieces``),
meshes and placements (``sharding``), the layouts tools write (``conventions``), objects as
JSON that reads back with its types and bits (``tagged_json``), and the errors, sizes and
logging everything uses. Imports nothing of reshard outside this package.
"""
