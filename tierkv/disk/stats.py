"""The disk medium's counters: hits, misses, bytes, latency histograms, corrupt pages, I/O mode."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

#: Upper bounds (seconds) of the latency buckets; the last bucket is +Inf.
LATENCY_BUCKETS = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
)


@dataclass(frozen=True, slots=True)
class Histogram:
    """A latency histogram in Prometheus' shape: cumulative counts per upper bound."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]  # len(bounds) + 1: the last is the count of all (+Inf)
    total_s: float

    @property
    def count(self) -> int:
        """How many observations."""
        return self.cumulative[-1]


@dataclass(frozen=True, slots=True)
class DiskStats:
    """A snapshot of the disk medium (``DiskPages.stats()``).

    ``hits``/``misses`` count keys asked of ``read``; ``corrupt_pages`` the reads that failed
    verification (each also a miss, its slot freed); ``damaged_at_open`` the slot headers the
    scan at open found damaged (those pages are not recovered); ``read_errors`` the reads the
    OS failed.
    ``write_failures`` count keys whose write failed (never reported stored), ``no_room`` keys
    refused for want of a free slot. ``io_mode`` is ``"direct"`` or ``"buffered"``,
    ``io_mode_reason`` says why buffered. ``last_error`` is the last OS error of an I/O.
    """

    hits: int
    misses: int
    corrupt_pages: int
    damaged_at_open: int
    read_errors: int
    pages_written: int
    write_failures: int
    no_room: int
    bytes_read: int
    bytes_written: int
    read_latency: Histogram
    write_latency: Histogram
    io_mode: str
    io_mode_reason: str
    capacity: int
    used: int
    reserved: int
    free: int
    recovered: int
    last_error: str


@dataclass(slots=True)
class Counters:
    """The mutable counters behind DiskStats (one lock: the I/O threads add to them)."""

    hits: int = 0
    misses: int = 0
    corrupt_pages: int = 0
    damaged_at_open: int = 0
    read_errors: int = 0
    pages_written: int = 0
    write_failures: int = 0
    no_room: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    last_error: str = ""
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    write_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    read_s: float = 0.0
    write_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self, **medium: Any) -> DiskStats:
        """The counters, with the medium's fields (I/O mode, slot accounting) added."""
        with self.lock:
            return DiskStats(
                hits=self.hits,
                misses=self.misses,
                corrupt_pages=self.corrupt_pages,
                damaged_at_open=self.damaged_at_open,
                read_errors=self.read_errors,
                pages_written=self.pages_written,
                write_failures=self.write_failures,
                no_room=self.no_room,
                bytes_read=self.bytes_read,
                bytes_written=self.bytes_written,
                read_latency=histogram(self.read_buckets, self.read_s),
                write_latency=histogram(self.write_buckets, self.write_s),
                last_error=self.last_error,
                **medium,
            )

    def observe(self, write: bool, seconds: float) -> None:
        """Record one batch's latency (the caller holds `lock`)."""
        i = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        if write:
            self.write_buckets[i] += 1
            self.write_s += seconds
        else:
            self.read_buckets[i] += 1
            self.read_s += seconds


def histogram(buckets: list[int], total_s: float) -> Histogram:
    """The cumulative histogram of per-bucket counts."""
    acc, out = 0, []
    for c in buckets:
        acc += c
        out.append(acc)
    return Histogram(LATENCY_BUCKETS, tuple(out), total_s)
