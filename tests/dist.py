"""Multi-rank tests spawn their gloo worlds through reshard.runtime.world.run_world: a ``file://``
rendezvous in a temp dir (no ports), a deadline on every wait, the failing rank's traceback
re-raised. Ranks pay ~2 s each to import torch on CI's two cores: check many things per world.
"""

from reshard.runtime.world import run_world

__all__ = ["run_world"]
