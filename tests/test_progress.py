"""Progress off a terminal (a log file, CI): a plain line at most every interval, its rate
counted from the first byte (planning a large checkpoint takes a while and moves none)."""

from __future__ import annotations

import io
import logging

import pytest

from reshard import progress
from reshard.progress import Progress


def test_lines_without_a_terminal_count_the_rate_from_the_first_byte(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.INFO, logger="reshard")
    bar = Progress(1000, "copying", interval=10.0, stream=io.StringIO())  # not a terminal: logged lines
    clock[0] = 130.0  # 30 s of planning, then the first bytes: no rate yet, no line
    bar.update(100)
    assert caplog.messages == []
    clock[0] = 131.0
    bar.update(100)
    assert caplog.messages == ["reshard: copying: 20% (200 B of 1000 B, 200 B/s, 4s left)"]
    clock[0] = 135.0  # within the interval of the last line: nothing
    bar.update(100)
    clock[0] = 142.0
    bar.update(100)
    assert len(caplog.messages) == 2 and caplog.messages[1].startswith("reshard: copying: 40% (400 B of 1000 B")
    bar.close()
