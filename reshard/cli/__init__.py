"""Layer 9, the command line: ``app`` (the typer commands, calling ``reshard.commands``),
``flags`` (the one table of flags), ``example`` (the built-in example) and ``schema.json``
(the schema of every ``--json`` output).
"""

from reshard.core.lazy import lazy_exports

_EXPORTS = {"main": "reshard.cli.app", "entry": "reshard.cli.app"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
