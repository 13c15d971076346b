"""Megatron-Core ``torch_dist`` checkpoints: ``format`` reads them."""
