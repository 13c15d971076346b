"""Layer 7, the sources: ``reading`` opens a checkpoint (a path, a URL, a Hub repo) through the
format registry, with a given layout or model config. ``reshard.runtime`` (loading into live
ranks) and ``reshard.train`` (the FSDP2 loop) are of this layer too.
"""
