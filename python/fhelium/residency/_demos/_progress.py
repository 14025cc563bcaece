"""A one-line progress bar for the command line's long work: drawn on a terminal,
silent otherwise (a pipe, a file, a test's captured stream)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 28
# At most this many redraws a second (a fast loop must not spend its time drawing).
_RATE_S = 0.1


class Progress:
    """Counts ``total`` steps of work under ``label``; `advance` moves it, `close` ends the
    line. Writes to ``stream`` (standard error by default) only when ``enabled`` and the
    stream is a terminal."""

    def __init__(
        self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.shown = bool(enabled and isatty is not None and isatty())
        self.started = time.perf_counter()
        self.drawn = 0.0
        self.width = 0

    def advance(self, steps: int = 1, label: str | None = None) -> None:
        """Counts ``steps`` more done (and, when given, a new label for what follows)."""
        self.done = min(self.total, self.done + steps)
        if label is not None:
            self.label = label
        now = time.perf_counter()
        if self.shown and (now - self.drawn >= _RATE_S or self.done == self.total):
            self.drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        filled = _WIDTH * self.done // self.total
        elapsed = now - self.started
        line = (
            f"{self.label} [{'#' * filled}{'.' * (_WIDTH - filled)}] "
            f"{self.done}/{self.total} {elapsed:.1f}s"
        )
        # Pads over a longer previous line.
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()
        self.width = len(line)

    def close(self) -> None:
        """Ends the bar's line (nothing when it was never shown)."""
        if self.shown and self.width:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
