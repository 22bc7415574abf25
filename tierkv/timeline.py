"""A bounded timeline of compute and transfer spans, written in Chrome trace format (Perfetto).

::

    tl = Timeline(enabled=True, max_events=100_000)   # a ring: the newest 100,000 events
    tl.span("load", "stream host->device", t0, t1, pages=8)
    with tl.measure("replay lru", "benchmark"):      # a span around a block of code
        ...
    tl.counter("page server", time.perf_counter(), pages=12, leases=1)
    tl.write("trace.json")                             # open in https://ui.perfetto.dev

Every timeline of a process measures from the same origin (the import of this module), so the
events of several timelines (one per store, say) can be put in one file: :func:`merge`.

Each ``cat`` is a track of its own: a thread id per track, named by a ``thread_name`` metadata
event. Spans of a track nest or follow each other; those that overlap otherwise (concurrent
tasks waiting) are spread over extra lanes of the track (``"compute #2"``...), as Perfetto drops
improperly nested slices.

The timeline is a ring buffer of ``max_events`` events (:data:`DEFAULT_MAX_EVENTS` by default):
once full, each new event drops the oldest one, and :attr:`Timeline.dropped` counts the dropped
events (written into the file's ``otherData``). A long-running server's trace therefore holds
its last events, and its size stays bounded (about 200 bytes of JSON and 300 bytes of
memory per event: some 40 MB of JSON at the default size).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tierkv.errors import InvalidInputError

__all__ = ["DEFAULT_MAX_EVENTS", "Timeline", "merge", "write_json"]

DEFAULT_MAX_EVENTS = 200_000
_ORIGIN = time.perf_counter()  # shared by every timeline of the process

# an event as recorded: (phase, name, cat, start s, end s, args); "X" spans, "C" counters
_Event = tuple[str, str, str, float, float, dict[str, Any]]


class Timeline:
    """Collects spans and counter samples when enabled; costs one attribute check when not.

    Args:
        enabled: record from the start (else set :attr:`enabled` later).
        max_events: the ring's size; the oldest events are dropped beyond it.

    Raises:
        ValueError: ``max_events < 1``.
    """

    def __init__(self, enabled: bool = False, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise InvalidInputError(f"max_events must be >= 1, got {max_events}")
        self.enabled = enabled
        self.max_events = max_events
        self.dropped = 0
        self._events: collections.deque[_Event] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()  # spans may come from stream worker threads

    def span(self, name: str, cat: str, start: float, end: float, **args: Any) -> None:
        """Record ``[start, end)`` (``time.perf_counter()`` seconds) on the ``cat`` track."""
        if self.enabled:
            self._add(("X", name, cat, start, end, args))

    def counter(self, name: str, t: float, **values: float) -> None:
        """Record counter samples at ``t`` (perf_counter seconds): one Perfetto counter track
        per value, named ``name``'s ``key``."""
        if self.enabled:
            self._add(("C", name, name, t, t, values))

    @contextlib.contextmanager
    def measure(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """A span around the ``with`` block (recorded even when the block raises)."""
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.span(name, cat, t0, time.perf_counter(), **args)

    def _add(self, ev: _Event) -> None:
        with self._lock:
            if len(self._events) == self.max_events:
                self.dropped += 1
            self._events.append(ev)

    def clear(self) -> None:
        """Forget every event (and the dropped count)."""
        with self._lock:
            self._events.clear()
            self.dropped = 0

    def to_chrome(self, pid: int | None = None) -> dict[str, Any]:
        """The trace as a Chrome trace-event document (``pid``: default this process's id).

        Spans of one track that overlap without nesting (waits of concurrent tasks, say) go to
        extra lanes named ``"<track> #2"``, ``"#3"``...: Perfetto would drop them otherwise.
        """
        with self._lock:
            events = list(self._events)
            dropped = self.dropped
        pid = os.getpid() if pid is None else pid
        events.sort(key=lambda e: (e[3], -e[4]))  # by start; an enclosing span first
        lanes = _Lanes()
        out: list[dict[str, Any]] = []
        for ph, name, cat, start, end, args in events:
            ev: dict[str, Any] = {
                "name": name,
                "cat": cat,
                "ph": ph,
                "ts": (start - _ORIGIN) * 1e6,
                "pid": pid,
                "tid": 0,  # counters belong to the process
                "args": args,
            }
            if ph == "X":
                end = max(start, end)
                ev["tid"] = lanes.place(cat, start, end)
                ev["dur"] = (end - start) * 1e6
            out.append(ev)
        meta = [_meta("thread_name", pid, tid, lane) for lane, tid in lanes.tids.items()]
        return {
            "traceEvents": meta + out,
            "displayTimeUnit": "ms",
            "otherData": {"dropped_events": dropped, "max_events": self.max_events},
        }

    def write(self, path: str) -> None:
        """Write the trace to ``path`` (JSON, replaced atomically). Raises OSError."""
        write_json(path, self.to_chrome())

    def __len__(self) -> int:
        return len(self._events)


class _Lanes:
    """Thread ids of tracks: the first lane of a track whose open spans the new one nests in
    (or that has none open), else a new lane."""

    def __init__(self) -> None:
        self.tids: dict[str, int] = {}  # lane name -> tid, in order of first use
        self._open: dict[str, list[list[float]]] = {}  # track -> per lane, ends of open spans

    def place(self, cat: str, start: float, end: float) -> int:
        stacks = self._open.setdefault(cat, [])
        for i, ends in enumerate(stacks):
            while ends and ends[-1] <= start:
                ends.pop()
            if not ends or end <= ends[-1]:
                ends.append(end)
                return self._tid(cat, i)
        stacks.append([end])
        return self._tid(cat, len(stacks) - 1)

    def _tid(self, cat: str, lane: int) -> int:
        name = cat if lane == 0 else f"{cat} #{lane + 1}"
        return self.tids.setdefault(name, len(self.tids) + 1)


def merge(parts: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One trace of several ``(label, to_chrome() document)`` parts: each part becomes a
    process of its own, named ``label``, so that their tracks stay apart."""
    events: list[dict[str, Any]] = []
    dropped = 0
    for pid, (label, doc) in enumerate(parts, start=1):
        events.append(_meta("process_name", pid, 0, label))
        events.extend({**ev, "pid": pid} for ev in doc.get("traceEvents", []))
        dropped += int(doc.get("otherData", {}).get("dropped_events", 0))
    other = {"dropped_events": dropped}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    """A metadata event naming a thread or process (category as Chrome writes it)."""
    return {
        "name": kind,
        "cat": "__metadata",
        "ph": "M",
        "pid": pid,
        "tid": tid,
        "args": {"name": name},
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write a trace document to ``path`` through a temporary file renamed over it, so that a
    reader never sees half a file. Raises OSError."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
