"""The collector paused around big builds: restored after, nested pauses kept, and the
objects a pause made frozen (not walked again) only when the console script asks."""

from __future__ import annotations

import gc

import pytest

from reshard.core import gc_pause


def test_pauses_nest_and_freeze_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gc.isenabled()
    before = gc.get_freeze_count()
    with gc_pause.paused_gc():
        with gc_pause.paused_gc():
            pass
        assert not gc.isenabled()  # the inner pause ended; the outer one holds
        kept = [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == before  # a library leaves its host's heap alone

    monkeypatch.setattr(gc_pause, "_freeze", True)
    try:
        with gc_pause.paused_gc():
            kept += [[i] for i in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= before + 2000
    finally:
        gc.unfreeze()
