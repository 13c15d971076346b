"""reshard's release, here at the bottom so that every layer can name it (the DCP reader's
"newer than reshard X supports", ``reshard --version``); ``reshard.__version__`` is this one.
pyproject.toml's ``version`` is the same string (tests/test_packaging.py)."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.2.0"
