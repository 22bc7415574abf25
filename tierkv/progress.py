"""A dependency-free progress bar for long commands (written to stderr)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A progress bar: ``with Progress(total, "replay lru") as p: p.update(n)``.

    On a terminal it redraws one line at most 10 times a second; elsewhere (logs, CI) it prints
    a line at every 10% so that long runs still show life. ``enabled=False`` silences it.
    """

    def __init__(
        self, total: int, label: str = "", *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        self.done += n
        if not self._enabled:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 0.1 or self.done >= self.total:
                self._last_draw = now
                self._draw(now, end="\r")
        else:
            decile = min(10, self.done * 10 // self.total)
            if decile != self._last_decile:
                self._last_decile = decile
                self._draw(now, end="\n")

    def _draw(self, now: float, end: str) -> None:
        frac = min(1.0, self.done / self.total)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = now - self._start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self._stream.write(
            f"{self.label} [{bar}] {frac * 100:5.1f}% {self.done}/{self.total} "
            f"{elapsed:5.1f}s eta {eta:5.1f}s{end}"
        )
        self._stream.flush()

    def close(self) -> None:
        """Finish the bar (a newline on a terminal)."""
        if self._enabled and self._tty:
            self._draw(time.monotonic(), end="\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
