"""Progress of long work in bytes: a tqdm bar on a terminal, a logged line every 10 s anywhere else.

A conversion can run for an hour inside a batch job whose log is a file: a bar drawn with
carriage returns is noise there, and nothing at all leaves the user guessing whether it hangs.
Off a terminal this logs one plain line (``reshard.core.log``) at most every ``interval`` seconds
(bytes done, rate, time left), which the command line prints; on a terminal, a tqdm bar that
stays on screen when the work is done (a conversion of a few seconds shows one too). Both
count with ``format_size``, so the bar and the final summary print the same numbers
("512.5 MiB", never "513M" beside it).

The rate and the time left are bytes moved over *work time*: the clock starts at the first
byte (planning moves none) and stops while the work is starting up rather than moving bytes
(``starting_up``: importing torch for the first cast takes seconds on a loaded machine, in
the middle of a conversion whose first bytes are already copied).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from reshard.core.log import LOGGER
from reshard.core.sizes import format_size

__all__ = ["Progress", "format_duration", "status"]

# A terminal that reports no size (a pty nobody sized: `script`, some IDEs and agents) gets
# this one: tqdm would take its 0 columns and -1 rows and draw nothing at all.
_FALLBACK_SIZE = (80, 24)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@contextlib.contextmanager
def status(message: str, stream: TextIO | None = None) -> Iterator[None]:
    """``message`` on the terminal's status line while the block runs (seconds of imports,
    before any bar: "checking against LlamaForCausalLM: importing transformers"), erased when
    it ends; off a terminal only the debug log has it (a log file needs no transient line)."""
    out = stream or sys.stderr
    shown = out.isatty()
    if shown:
        width = _columns(out) or _FALLBACK_SIZE[0]
        out.write(("reshard: " + message)[: width - 1] + "\r")
        out.flush()
    else:
        LOGGER.debug("reshard: %s", message)
    try:
        yield
    finally:
        if shown:
            out.write("\x1b[K")  # the line is free again for the bar or the next message
            out.flush()


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class Progress:
    """``update(n)`` from any thread; ``close()`` when done (also on failure)."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, interval: float = 10.0,
                 stream: TextIO | None = None) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.done = 0
        self._work = 0.0  # seconds of work so far: from the first byte, less the time starting up
        self._mark = self._last = time.monotonic()
        self._starting = 0  # threads inside starting_up()
        self._lock = threading.Lock()
        self._bar = None
        if self.enabled and self.stream.isatty():
            from tqdm import tqdm

            sized = _columns(self.stream) > 0
            ncols, nrows = (None, None) if sized else _FALLBACK_SIZE
            self._bar = tqdm(total=total, desc=desc, file=self.stream, bar_format="{l_bar}{bar}| {postfix}",
                             dynamic_ncols=sized, ncols=ncols, nrows=nrows, leave=True)

    def _tick(self, now: float) -> None:
        """Count the time since the last event as work, if bytes were moving (under the lock)."""
        if self.done and not self._starting:
            self._work += now - self._mark
        self._mark = now

    def _status(self) -> str:
        moved = f"{format_size(self.done)} of {format_size(self.total)}"
        if self._work <= 0:  # no work time yet: no rate to speak of
            return moved
        rate = self.done / self._work
        return f"{moved}, {format_size(int(rate))}/s, {format_duration((self.total - self.done) / rate)} left"

    def update(self, n: int) -> None:
        if not self.enabled or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._tick(now)
            self.done += n
            if self._bar is not None:
                self._bar.postfix = self._status()
                self._bar.update(n)
            elif now - self._last >= self.interval and self._work > 0:  # a rate to report
                self._last = now
                pct = 100.0 * self.done / self.total
                LOGGER.info("reshard: %s: %.0f%% (%s)", self.desc, pct, self._status())

    @contextlib.contextmanager
    def starting_up(self) -> Iterator[None]:
        """Time spent inside is start-up (a first import), not work: the rate leaves it out.
        From any thread; the clock stops while any thread is inside."""
        with self._lock:
            self._tick(time.monotonic())
            self._starting += 1
        try:
            yield
        finally:
            with self._lock:
                self._tick(time.monotonic())
                self._starting -= 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
