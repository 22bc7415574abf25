"""Progress of long commands, on stderr: a tqdm bar on a terminal, plain lines elsewhere.

tqdm comes with the ``hf`` extra (transformers and gguf need it); the core does not need it.
Without tqdm, or when the stream is not a terminal (logs, CI, a pipe), a plain line is printed
at every tenth of the work, so that long runs still show life without carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _tqdm_bar(total: int, label: str, stream: TextIO) -> Any:
    """A tqdm bar, or None without tqdm."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None

    class _Bar(tqdm):
        monitor_interval = 0  # no monitor thread: it would run inside the demos' timed passes

    return _Bar(total=total, desc=label, file=stream, mininterval=0.1, leave=True)


class Progress:
    """Progress of ``total`` units: ``with Progress(total, "replay lru") as p: p.update(n)``.

    On a terminal with tqdm installed, a tqdm bar (redrawn at most 10 times a second);
    otherwise a line at every tenth of the work. ``enabled=False`` silences it.
    """

    def __init__(
        self, total: int, label: str = "", *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._bar = _tqdm_bar(self.total, label, self._stream) if enabled and tty else None
        self._start = time.monotonic()
        self._last_tenth = 0

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        self.done += n
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        tenth = min(10, self.done * 10 // self.total)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            self._line()

    def _line(self) -> None:
        frac = min(1.0, self.done / self.total)
        elapsed = time.monotonic() - self._start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        self._stream.write(
            f"{self.label}: {frac * 100:5.1f}% {self.done}/{self.total} "
            f"{elapsed:5.1f}s eta {eta:5.1f}s\n"
        )
        self._stream.flush()

    def close(self) -> None:
        """Finish the bar (tqdm's last draw and newline). Idempotent."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            self._enabled = False  # no plain lines after the bar
            bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
