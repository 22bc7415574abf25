"""Statistics of the transfer engine: per batch (TransferStats) and per engine (EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .priority import Priority

__all__ = ["EngineStats", "TransferStats"]


@dataclass(slots=True)
class TransferStats:
    """Timings of one batch (time.perf_counter seconds; 0.0 until reached)."""

    priority: Priority
    pages: int
    bytes: int
    submitted_at: float
    dispatched_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    runs: int = 0
    kernel: str = ""
    kind: str = "copy"  # "copy" (backend kernel), "call" (a host function), "async" (on the loop)

    @property
    def queue_wait_s(self) -> float:
        """Seconds from submit to the start of the copy (engine queue, stream queue, `after`)."""
        return max(0.0, self.started_at - self.submitted_at) if self.started_at else 0.0

    @property
    def copy_s(self) -> float:
        """Seconds the copy itself took."""
        return max(0.0, self.finished_at - self.started_at) if self.finished_at else 0.0

    @property
    def total_s(self) -> float:
        """Seconds from submit to completion."""
        return max(0.0, self.finished_at - self.submitted_at) if self.finished_at else 0.0

    @property
    def bandwidth_gbps(self) -> float:
        """Copy bandwidth in GB/s (1e9 bytes), 0.0 when unknown."""
        return self.bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0


@dataclass(slots=True)
class EngineStats:
    """Totals over every batch the engine has finished."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    pages: int = 0
    bytes: int = 0
    copy_s: float = 0.0
    queue_wait_s: float = 0.0
    max_inflight_seen: int = 0
    by_priority: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)  # completed batches per job kind

    def record(self, t: TransferStats, state: str) -> None:
        """Account one finished batch (`state`: "done", "failed" or "cancelled")."""
        if state == "cancelled":
            self.cancelled += 1
            return
        if state == "failed":
            self.failed += 1
            return
        self.completed += 1
        self.pages += t.pages
        self.bytes += t.bytes
        self.copy_s += t.copy_s
        self.queue_wait_s += t.queue_wait_s
        name = t.priority.name
        self.by_priority[name] = self.by_priority.get(name, 0) + 1
        self.by_kind[t.kind] = self.by_kind.get(t.kind, 0) + 1

    @property
    def bandwidth_gbps(self) -> float:
        """Bytes moved per second of copy time, in GB/s."""
        return self.bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    def snapshot(self) -> EngineStats:
        """An independent copy."""
        return replace(self, by_priority=dict(self.by_priority), by_kind=dict(self.by_kind))
