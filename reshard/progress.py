"""Progress of long work in bytes: a tqdm bar on a terminal, a logged line every 10 s anywhere else.

A conversion can run for an hour inside a batch job whose log is a file: a bar drawn with
carriage returns is noise there, and nothing at all leaves the user guessing whether it hangs.
Off a terminal this logs one plain line (``reshard.log``) at most every ``interval`` seconds
(bytes done, rate, time left), which the command line prints; on a terminal, a tqdm bar. Both count with ``format_size``, so the bar and the
final summary print the same numbers ("512.5 MiB", never "513M" beside it).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from reshard.log import LOGGER
from reshard.sizes import format_size

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """``update(n)`` from any thread; ``close()`` when done (also on failure)."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, interval: float = 10.0,
                 stream: TextIO | None = None) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self.done = 0
        self._start = self._last = time.monotonic()
        self._lock = threading.Lock()
        self._bar = None
        if self.enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.stream, bar_format="{l_bar}{bar}| {postfix}",
                             dynamic_ncols=True, leave=False)

    def _status(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        left = format_duration(eta) if eta != float("inf") else "?"
        return f"{format_size(self.done)} of {format_size(self.total)}, {format_size(int(rate))}/s, {left} left"

    def update(self, n: int) -> None:
        if not self.enabled or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            if not self.done:  # the rate counts from the first byte, not from planning
                self._start = now
            self.done += n
            if self._bar is not None:
                self._bar.postfix = self._status(now)
                self._bar.update(n)
            elif now - self._last >= self.interval and now > self._start:  # a rate to report
                self._last = now
                pct = 100.0 * self.done / self.total
                LOGGER.info("reshard: %s: %.0f%% (%s)", self.desc, pct, self._status(now))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
