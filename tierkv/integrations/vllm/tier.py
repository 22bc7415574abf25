"""`TierKVTierBase`: what the tierkv tiers for vLLM share: config checks, keys, the job queue.

vLLM calls a secondary tier on its scheduler thread (under its manager's lock); every call here
returns at once. Copies run on tierkv's own threads (the disk medium's I/O threads, the Redis
tier's event loop) and end in a `concurrent.futures.Future`; its done-callback turns the outcome
into vLLM's `JobResult` and queues it, and `get_finished_jobs` hands the queue over. A medium
that fails (a closed disk, Redis gone, ENOSPC) gives failed jobs and misses, never an exception
into vLLM's scheduler loop: only a bad config raises, at construction.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from tierkv.errors import InvalidInputError, StoreClosedError
from tierkv.integrations.vllm._vllm import (
    JobResult,
    Locality,
    RequestOffloadingContext,
    SecondaryTierManager,
)
from tierkv.integrations.vllm.config import Field, VllmTierConfigError, check_options
from tierkv.integrations.vllm.keys import PageKeys, layout_digest, layout_fields

__all__ = ["COMMON_FIELDS", "MAX_WAIT_S", "TierKVTierBase"]

MAX_WAIT_S = 86_400.0
"""Longest timeout a config field takes, seconds (a thread's wait past the platform's time_t
raised OverflowError)."""

log = logging.getLogger("tierkv.integrations.vllm")

COMMON_FIELDS: dict[str, Field] = {
    "locality": Field((str, type(None)), None),
    "drain_timeout": Field((float,), 30.0, minimum=0.001, maximum=MAX_WAIT_S),
}
"""Fields every tierkv tier takes: ``locality`` (vLLM's LOCAL / REMOTE, read by its factory)
and ``drain_timeout`` (seconds between warnings while `drain_jobs` waits)."""

Rows = npt.NDArray[np.uint8]
Finish = Callable[[Any], Any]  # a future's result -> a JobResult


class TierKVTierBase(SecondaryTierManager):
    """A vLLM secondary tier whose copies are futures of a tierkv medium (see the module)."""

    FIELDS: ClassVar[dict[str, Field]] = {}

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = check_options(
            f"{type(self).__name__} tier {tier_type!r}", options, {**COMMON_FIELDS, **self.FIELDS}
        )
        if self.options["locality"] is not None:
            try:
                self.locality = Locality(self.options["locality"])
            except ValueError as exc:
                raise VllmTierConfigError(
                    f"locality must be one of {[m.value for m in Locality]}, got "
                    f"{self.options['locality']!r}"
                ) from exc
        self._rows: Rows = np.empty((0, self.block_size_bytes), dtype=np.uint8)
        self.shut_down = False
        """Set by `shutdown` (a job after it fails as the tier's, not as bad chunk ids)."""
        self.layout = layout_fields(offloading_spec, self.block_size_bytes)
        self.keys = PageKeys(layout_digest(self.layout))
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._in_flight: dict[int, concurrent.futures.Future[Any]] = {}
        self._flight_lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self.counters = dict.fromkeys(("lookups", "hits", "jobs_done", "jobs_failed"), 0)
        self._open(self.options)  # the medium, from the checked options
        self._see_rows()

    @abstractmethod
    def _open(self, options: dict[str, Any]) -> None:
        """Open the tier's medium from its checked ``options`` (each tier class has its own)."""

    def _see_rows(self) -> None:
        """View the primary tier's rows as uint8 (vLLM's view is signed bytes, a row per
        chunk). Called last in a subclass's constructor: a view still held when construction
        fails would keep vLLM from unmapping its region."""
        view = self._primary_kv_view
        self._rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)

    # -- jobs ---------------------------------------------------------------------------------
    def _chunk_rows(self, keys: list[Any], chunk_ids: Any) -> list[int]:
        """A job's primary rows, one per key. Raises InvalidInputError (a failed job, in the
        callers) for chunk ids that are not integers in ``[0, rows)`` or not one per key:
        a negative id indexed from the end (a load wrote another chunk's row), a float was
        truncated, and a key without a chunk id was dropped from a store reported done."""
        if self.shut_down:
            raise StoreClosedError(f"tierkv tier {self.tier_type}: shut down")
        ids = np.asarray(chunk_ids)
        if ids.ndim != 1 or len(ids) != len(keys):
            raise InvalidInputError(f"{ids.size} chunk ids for {len(keys)} keys")
        if ids.size and (
            ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= len(self._rows)
        ):
            raise InvalidInputError(
                f"chunk ids must be integers in [0, {len(self._rows)}), got {ids.dtype} "
                f"from {ids.min()} to {ids.max()}"
            )
        return [int(c) for c in ids.tolist()]

    def _track(self, job_id: int, future: concurrent.futures.Future[Any], finish: Finish) -> None:
        """Queue ``finish(result)`` (or a failed result) when `future` ends, on its thread."""
        with self._flight_lock:
            self._in_flight[job_id] = future
            self._idle.clear()

        def done(fut: concurrent.futures.Future[Any]) -> None:
            try:
                result = finish(fut.result())
            except BaseException as exc:  # a medium's failure is a failed job, never raised
                log.warning("tierkv tier %s: job %d failed: %r", self.tier_type, job_id, exc)
                result = JobResult(job_id=job_id, success=False)
            self._done.put(result)
            with self._flight_lock:
                self.counters["jobs_done"] += 1
                self.counters["jobs_failed"] += not result.success
                self._in_flight.pop(job_id, None)
                if not self._in_flight:
                    self._idle.set()

        future.add_done_callback(done)

    def _fail_now(self, job_id: int, what: str, exc: BaseException) -> None:
        log.warning("tierkv tier %s: %s %d not submitted: %r", self.tier_type, what, job_id, exc)
        self._done.put(JobResult(job_id=job_id, success=False))
        with self._flight_lock:
            self.counters["jobs_done"] += 1
            self.counters["jobs_failed"] += 1

    def get_finished_jobs(self) -> Iterable[Any]:
        """The jobs (stores and loads) ended since the last call."""
        out = []
        while True:
            try:
                result = self._done.get_nowait()
            except queue.Empty:
                break
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        """Whether copies are still running (vLLM keeps stepping until they end)."""
        return not self._idle.is_set() or not self._done.empty()

    def drain_jobs(self) -> None:
        """Wait until every submitted copy has ended (their results stay queued). Waits on an
        event set by the last copy to end, warning every ``drain_timeout`` seconds; a copy is
        never abandoned half-way (it would write into a primary slot vLLM reuses)."""
        started = time.monotonic()
        while not self._idle.wait(self.options["drain_timeout"]):
            log.warning(
                "tierkv tier %s: %d copies still running after %.0f s of drain_jobs",
                self.tier_type, len(self._in_flight), time.monotonic() - started,
            )  # fmt: skip

    def on_new_request(self, req_context: Any) -> Any:
        """Chunk-level offloading (vLLM's default policy)."""
        return RequestOffloadingContext()

    def _release_rows(self) -> None:
        """Drop the view of the primary rows, so that vLLM can unmap its region (the tier is
        shut down)."""
        self.shut_down = True
        self._rows = np.empty((0, self.block_size_bytes), dtype=np.uint8)

    def tierkv_stats(self) -> Mapping[str, Any]:
        """This tier's counters (and its medium's, in subclasses)."""
        return dict(self.counters)


def result(job_id: int, ok: bool, nbytes: int, t0: float, keys: Any = None) -> Any:
    """A vLLM JobResult with the transfer time and bytes vLLM's metrics collect."""
    return JobResult(
        job_id=job_id,
        success=ok,
        successful_keys=keys,
        transfer_time=time.monotonic() - t0,
        transfer_bytes=nbytes,
    )
