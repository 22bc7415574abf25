"""`TierKVDiskTier`: vLLM's CPU-tier chunks kept in tierkv's disk medium (`tierkv.disk`).

One chunk is one page of `DiskPages` (segment files of self-checking slots, O_DIRECT where the
filesystem takes it, CRC-32C per page, the index recovered at open). Lookups read the in-memory
index: HIT or MISS at once, never RETRY. A store evicts the least recently used pages when the
disk is full (`DiskPages.victims`); a page that fails its check is a miss, never served.

One process per path: `DiskPages` holds an exclusive lock on its directory, so a second vLLM
instance on the same path gets `DiskInUseError` at startup. Pages outlive the process: the next
instance that opens the path finds them (content keys persist). To share chunks between live
instances, use `TierKVRedisTier`.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from tierkv.disk import DiskPages, StoreStatus
from tierkv.integrations.vllm._vllm import LookupResult, Medium
from tierkv.integrations.vllm.config import Field
from tierkv.integrations.vllm.keys import KEY_BYTES
from tierkv.integrations.vllm.tier import TierKVTierBase, result

__all__ = ["TierKVDiskTier"]


class TierKVDiskTier(TierKVTierBase):
    """A vLLM secondary tier on tierkv's disk medium.

    Config (``kv_connector_extra_config.secondary_tiers[i]``)::

        {"type": "TierKVDiskTier", "module_path": "tierkv.integrations.vllm",
         "path": "/nvme/kv", "disk_bytes": 68719476736}

    Fields: ``path`` (an existing directory, required), ``disk_bytes`` (required),
    ``io_threads`` (8: the queue depth; 1-2 MB chunks read at the device's rate from 8),
    ``segment_bytes`` (1 GiB), ``direct`` (True: O_DIRECT where the filesystem takes it),
    ``overwrite`` (False: a non-empty folder no disk tier made is refused,
    `DiskForeignDirError`), ``locality``, ``drain_timeout``. Unknown or wrong-typed fields
    raise `VllmTierConfigError`; the disk's own refusals (`DiskConfigError`,
    `DiskLayoutError`, `DiskInUseError`, `DiskSpaceError`) also come at construction.
    """

    medium: ClassVar[Any] = Medium.STORAGE if Medium is not None else None
    FIELDS: ClassVar[dict[str, Field]] = {
        "path": Field((str,)),
        "disk_bytes": Field((int,), minimum=1),
        "io_threads": Field((int,), 8, minimum=1),
        "segment_bytes": Field((int,), 1 << 30, minimum=1),
        "direct": Field((bool,), True),
        "overwrite": Field((bool,), False),
    }

    def _open(self, o: dict[str, Any]) -> None:
        self.disk = DiskPages.open(
            o["path"],
            page_bytes=self.block_size_bytes,
            disk_bytes=o["disk_bytes"],
            key_bytes=KEY_BYTES,
            segment_bytes=o["segment_bytes"],
            io_threads=o["io_threads"],
            direct=o["direct"],
            overwrite=o["overwrite"],
        )

    def lookup(self, key: Any, req_context: Any) -> Any:
        """HIT when the disk's index holds the chunk, MISS otherwise (or when the disk fails)."""
        self.counters["lookups"] += 1
        tkey = self.keys(key)  # a key that is not bytes: a typed error (misuse, not a miss)
        try:
            held = self.disk.lookup([tkey])[0] is not None
        except Exception:  # a closed or failing disk: a miss
            return LookupResult.MISS
        if held:
            self.counters["hits"] += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def _make_room(self, n: int) -> None:
        """Free the least recently used pages so that `n` more fit."""
        short = n - self.disk.stats().free
        if short > 0:
            self.disk.free(self.disk.victims(short))

    def submit_store(self, job_metadata: Any) -> None:
        """Write the job's primary chunks to disk (on the disk's I/O threads)."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        keys = list(job_metadata.keys)
        try:
            tkeys = self.keys.many(keys)
            rows = [self._rows[c] for c in self._chunk_rows(keys, job_metadata.chunk_ids)]
            missing = [k for k, slot in zip(tkeys, self.disk.lookup(tkeys)) if slot is None]
            self._make_room(len(missing))  # (after the checks: a refused job evicts nothing)
            future = self.disk.submit_write(tkeys, rows)
        except Exception as exc:
            self._fail_now(job_id, "store", exc)
            return
        size = self.block_size_bytes

        def finish(statuses: list[StoreStatus]) -> Any:
            ok = all(s.held or s is StoreStatus.BUSY for s in statuses)
            written = sum(s is StoreStatus.STORED for s in statuses)
            return result(job_id, ok, written * size, t0)

        self._track(job_id, future, finish)

    def submit_load(self, job_metadata: Any) -> None:
        """Read the job's chunks from disk into their primary slots (verified, or a miss)."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        keys = list(job_metadata.keys)
        try:
            rows = [self._rows[c] for c in self._chunk_rows(keys, job_metadata.chunk_ids)]
            future = self.disk.submit_read(self.keys.many(keys), rows)
        except Exception as exc:
            self._fail_now(job_id, "load", exc)
            return
        size = self.block_size_bytes

        def finish(hits: list[bool]) -> Any:
            got = [k for k, hit in zip(keys, hits) if hit]
            if len(got) == len(keys):
                return result(job_id, True, len(got) * size, t0)
            return result(job_id, False, len(got) * size, t0, tuple(got) or None)

        self._track(job_id, future, finish)

    def tierkv_stats(self) -> dict[str, Any]:
        """The tier's counters and the disk's (`DiskStats`)."""
        out: dict[str, Any] = dict(self.counters)
        try:
            st = self.disk.stats()
        except Exception:
            return out
        for name in ("hits", "misses", "corrupt_pages", "write_failures", "pages_written",
                     "used", "free", "capacity", "io_mode"):  # fmt: skip
            out[f"disk_{name}"] = getattr(st, name)
        return out

    def shutdown(self) -> None:
        """Wait for the copies, then close the disk (its lock is released). Idempotent."""
        if self.shut_down:
            return
        self.drain_jobs()
        try:
            self.disk.close()
        finally:
            self._release_rows()
