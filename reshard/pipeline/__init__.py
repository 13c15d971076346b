"""Layer 3, the pipeline: source catalog -> plan -> engine -> sinks -> an output on disk.

``options`` (what a conversion is asked) and ``protocol`` (the contract a format implements),
``plan`` (what to read for each output region), ``byte_runs``, ``gather`` and ``assemble`` (how),
``engine`` (moving them under the memory budget), ``sinks``, ``staging`` and ``manifest``
(writing them atomically), the mesh layouts of an output (``placements``, ``mesh_target``,
``mesh_report``), progress and parallelism. May import ``reshard.core`` and ``reshard.safe_pickle``.
"""
