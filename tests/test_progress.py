"""Progress: off a terminal (a log file, CI) a plain line at most every interval, its rate and
time left counted from bytes moved over work time (from the first byte, start-up left out);
on a terminal a bar, also on a terminal that reports no width."""

from __future__ import annotations

import io
import logging
import os
import re
import select
import sys
from pathlib import Path

import pytest
import torch

from reshard.core.boxes import Box, full_box
from reshard.core.catalog import Catalog, Chunk, TensorEntry
from reshard.core.pieces import OutputFile, Piece
from reshard.core.regions import StoredRegion
from reshard.pipeline import engine, progress
from reshard.pipeline.engine import Engine
from reshard.pipeline.plan import make_plan
from reshard.pipeline.progress import Progress


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_lines_without_a_terminal_count_the_rate_from_the_first_byte(clock: list[float],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
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


class _SlowSource:
    """Stored values whose every read takes a second of the (fake) clock: a slow disk."""

    def __init__(self, values: torch.Tensor, clock: list[float]) -> None:
        self.values, self.clock, self.reads = values, clock, 0

    def read(self, box: Box) -> torch.Tensor:
        self.clock[0] += 1.0
        self.reads += 1
        return self.values[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))].clone()


def test_the_rate_off_a_terminal_leaves_start_up_out(clock: list[float], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A conversion copies its first tensor at once, then starts torch up for the second
    (30 s on a loaded machine) and reads it slowly: the lines' rate and time left are the bytes
    moved over the seconds of work (a second per read), not over the start-up as well."""
    caplog.set_level(logging.INFO, logger="reshard")
    monkeypatch.setattr(engine, "_import_torch", lambda: clock.__setitem__(0, clock[0] + 30.0))
    a, b = torch.arange(1100, dtype=torch.float32), torch.randn(40, 25)
    (tmp_path / "a.bin").write_bytes(a.numpy().tobytes())
    cat = Catalog("test", tmp_path)
    cat.tensors["a"] = TensorEntry("a", (1100,), torch.float32,
                                   [Chunk(full_box((1100,)), StoredRegion(tmp_path / "a.bin", 0, torch.float32, (1100,)))])
    slow = _SlowSource(b, clock)
    cat.tensors["b"] = TensorEntry("b", (40, 25), torch.float32, [Chunk(full_box((40, 25)), slow)])
    plan = make_plan(cat, [OutputFile("f.bin", [Piece("a", full_box((1100,)), a.dtype), Piece("b", full_box((40, 25)),
                                                                                              b.dtype)])])
    (tmp_path / "out").mkdir()
    # 500 B of budget: slabs of one 100 B row of b, one read each; a (4400 B) is copied first.
    Engine(500, workers=1, desc="w").run(plan, tmp_path / "out", True)
    assert (tmp_path / "out" / "f.bin").read_bytes() == a.numpy().tobytes() + b.numpy().tobytes()
    assert slow.reads == 40 and clock[0] == 170.0  # 30 s of start-up, 40 s of reads
    lines = [m for m in caplog.messages if m.startswith("reshard: w: ")]
    # 8400 B: a at 100 s (the first byte), start-up until 130 s, then a row a second from 131 s.
    # Lines at 131 s (4500 B in 1 s of work), 141 s (5500 B in 11 s), 151 s (6500 B in 21 s)
    # and 161 s (7500 B in 31 s); counting the start-up, the second would say 134 B/s, 22s left.
    assert lines == ["reshard: w: 54% (4.4 KiB of 8.2 KiB, 4.4 KiB/s, 1s left)",
                     "reshard: w: 65% (5.4 KiB of 8.2 KiB, 500 B/s, 6s left)",
                     "reshard: w: 77% (6.3 KiB of 8.2 KiB, 309 B/s, 6s left)",
                     "reshard: w: 89% (7.3 KiB of 8.2 KiB, 241 B/s, 4s left)"], lines


def test_a_bar_on_a_terminal_that_reports_no_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr on a pty nobody sized (0x0, as under `script`) still gets a bar, and the bar stays
    once the work is done (a conversion of a few seconds showed none)."""
    leader, follower = os.openpty()
    try:
        stream = os.fdopen(follower, "w", closefd=False)
        monkeypatch.setattr(sys, "stderr", stream)
        with Progress(1000, "copying") as bar:
            for _ in range(4):
                bar.update(250)
        stream.flush()
        chunks, wait = [], 5.0  # a pty hands over what was written in pieces: read until it has no more
        while select.select([leader], [], [], wait)[0]:
            chunks.append(os.read(leader, 1 << 16))
            wait = 0.5
        text = b"".join(chunks).decode()
    finally:
        os.close(leader)
        os.close(follower)
    last = text.replace("\r\n", "\n").split("\r")[-1].strip()
    assert re.match(r"copying: 100%\|█+\| , 1000 B of 1000 B, ", last), text
    assert len(last) <= 80


def test_a_status_line_says_what_the_wait_is_for() -> None:
    """An HF export's architecture check imports transformers for seconds (a minute on a busy
    machine) before any bar: the terminal's status line says so while it does, then is erased;
    off a terminal nothing is printed (a log file needs no transient line)."""
    import io

    from reshard.features.architecture import check_architecture
    from reshard.pipeline.progress import status

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    with status("checking the tensors against LlamaForCausalLM: importing transformers", stream=term):
        assert term.getvalue() == "reshard: checking the tensors against LlamaForCausalLM: importing transformers\r"
    assert term.getvalue().endswith("\r\x1b[K")
    plain = io.StringIO()
    with status("anything", stream=plain):
        pass
    assert plain.getvalue() == ""

    import contextlib
    import sys

    seen = Terminal()
    with contextlib.redirect_stderr(seen):
        check_architecture({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, {})
    assert seen.getvalue().startswith("reshard: checking the tensors against LlamaForCausalLM: importing transformers")
    assert sys.stderr is not seen
