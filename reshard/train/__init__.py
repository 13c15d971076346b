"""Layer 7 (with the sources and the runtime): the FSDP2 training loop that validates round trips.
"""
