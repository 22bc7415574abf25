"""A timeline of compute and transfer spans, written in Chrome trace format (opens in Perfetto)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class Timeline:
    """Collects spans when enabled; costs one attribute check when not."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._events: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()

    def span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """Record ``[start, end)`` (``time.perf_counter()`` seconds) on the ``cat`` track."""
        if not self.enabled:
            return
        ev = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": (start - self._t0) * 1e6,
            "dur": max(0.0, (end - start) * 1e6),
            "pid": os.getpid(),
            "tid": cat,
            "args": args,
        }
        with self._lock:
            self._events.append(ev)

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace-event document."""
        with self._lock:
            return {"traceEvents": list(self._events), "displayTimeUnit": "ms"}

    def write(self, path: str) -> None:
        """Write the trace to ``path`` (JSON)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome(), f)

    def __len__(self) -> int:
        return len(self._events)
