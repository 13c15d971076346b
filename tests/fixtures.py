"""Real checkpoints for tests come from reshard.example (written by torch itself)."""

from reshard.example import TinyNet, full_reference, save_fsdp2_dcp

__all__ = ["TinyNet", "save_fsdp2_dcp", "full_reference"]
