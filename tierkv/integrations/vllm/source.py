"""`TierKVSourceTier`: a vLLM secondary tier over an asyncio page source (Redis, page servers).

What `TierKVRedisTier` and `TierKVPeerTier` share: the source runs on an event loop of the
tier's own thread; lookups go through vLLM's `AsyncLookupManager` (as vLLM's ``fs`` tier does:
the first lookup of a chunk answers RETRY, the step's keys are asked of the source in one batch
on vLLM's lookup thread, the next lookup answers HIT or MISS); stores and loads are coroutines
on the loop whose futures end in vLLM's `JobResult`. A source that is down, slow or gone gives
misses and failed jobs; nothing raises into vLLM's scheduler. A load that fails marks its
failed keys a miss for the request (no retry livelock).

A subclass opens its source in `_start` (on the loop; a config the source refuses raises
there, the subclass closing what it opened) and implements `_leading`, `_publish`, `_load`
and `_aclose`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any

from tierkv.errors import InvalidInputError
from tierkv.integrations.vllm._vllm import AsyncLookupManager, LookupResult
from tierkv.integrations.vllm.config import VllmTierConfigError
from tierkv.integrations.vllm.keys import check_key
from tierkv.integrations.vllm.tier import TierKVTierBase, result

__all__ = ["TierKVSourceTier"]


class _LoopThread:
    """An asyncio loop on a daemon thread; `submit` returns a concurrent Future."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, timeout: float) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup state; the batch is asked of the source on vLLM's lookup thread."""

    def __init__(self, tier: TierKVSourceTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[Any], req_context: Any) -> Iterable[bool]:
        return self._tier.present(keys)


class TierKVSourceTier(TierKVTierBase):
    """A vLLM secondary tier whose medium is an asyncio page source (see the module)."""

    #: most keys asked of the source in one lookup call
    lookup_batch = 1024

    def _open(self, o: dict[str, Any]) -> None:
        self._load_keys: dict[int, list[Any]] = {}  # in-flight loads (scheduler thread)
        self._loop = _LoopThread(f"tierkv_vllm_{self.tier_type}")
        try:
            self._loop.submit(self._start(o)).result(self.start_deadline(o))
        except VllmTierConfigError:
            self._loop.close(5.0)
            raise
        except InvalidInputError as exc:  # the source's own refusal (a SpecError...): name the tier
            self._loop.close(5.0)
            raise VllmTierConfigError(
                f"{type(self).__name__} tier {self.tier_type!r}: {exc}"
            ) from exc
        except BaseException:
            self._loop.close(5.0)
            raise
        self._lookups = _Lookups(self)

    def start_deadline(self, o: dict[str, Any]) -> float:
        """Seconds `_start` may take (its own calls are bounded by the ``timeout`` field)."""
        return 4 * float(o["timeout"]) + 1

    @abstractmethod
    async def _start(self, o: dict[str, Any]) -> None:
        """Open the source from the checked options, on the loop. An unreachable source is no
        error here (it gives misses until it answers); a refused config raises, with nothing
        left open."""

    @abstractmethod
    async def _leading(self, tkeys: list[bytes]) -> int:
        """How many leading pages of ``tkeys`` the source holds (raises when it fails)."""

    @abstractmethod
    async def _publish(self, tkeys: list[bytes], slots: list[int]) -> bool:
        """Store the primary rows ``slots`` under ``tkeys``; whether every page is held now
        (False or an exception: a failed store)."""

    @abstractmethod
    async def _load(self, tkeys: list[bytes], slots: list[int]) -> int:
        """Read the leading pages of ``tkeys`` into the primary rows ``slots``; how many
        arrived intact (verified)."""

    @abstractmethod
    async def _aclose(self) -> None:
        """Close the source."""

    # -- lookups (vLLM's lookup thread) ---------------------------------------------------------
    async def _present(self, tkeys: list[bytes]) -> list[bool]:
        found = [False] * len(tkeys)
        i = 0
        while i < len(tkeys):
            part = tkeys[i : i + self.lookup_batch]
            n = await self._leading(part)  # leading pages present
            found[i : i + n] = [True] * n
            i += n if n == len(part) else n + 1  # tkeys[i + n] is absent
        return found

    def present(self, keys: list[Any]) -> list[bool]:
        """Which of `keys` the source holds (a hint: loads verify); all False on any failure."""
        deadline = 2 * self.options["timeout"] * (2 + len(keys) // self.lookup_batch)
        try:
            return self._loop.submit(self._present(self.keys.many(keys))).result(deadline)
        except Exception:
            return [False] * len(keys)

    def lookup(self, key: Any, req_context: Any) -> Any:
        """HIT / MISS once the source has answered for this key, RETRY until then."""
        check_key(key)  # a key that is not bytes: a typed error (misuse, not a miss)
        self.counters["lookups"] += 1
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        if found:
            self.counters["hits"] += 1
            return LookupResult.HIT
        return LookupResult.MISS

    def on_schedule_end(self, context: Any) -> None:
        """Send this step's lookups to the lookup thread."""
        self._lookups.flush()

    def on_request_finished(self, req_context: Any) -> None:
        """Drop the request's lookup state."""
        self._lookups.cleanup(req_context.req_id)

    # -- copies (the loop thread) ---------------------------------------------------------------
    def submit_store(self, job_metadata: Any) -> None:
        """Store the job's primary chunks in the source."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        try:
            keys = list(job_metadata.keys)
            slots = self._chunk_rows(keys, job_metadata.chunk_ids)
            future = self._loop.submit(self._publish(self.keys.many(keys), slots))
        except Exception as exc:
            self._fail_now(job_id, "store", exc)
            return
        nbytes = len(slots) * self.block_size_bytes
        self._track(job_id, future, lambda ok: result(job_id, ok, nbytes, t0))

    def submit_load(self, job_metadata: Any) -> None:
        """Load the job's chunks into their primary slots; the leading intact ones count."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        keys = list(job_metadata.keys)
        try:
            slots = self._chunk_rows(keys, job_metadata.chunk_ids)
            future = self._loop.submit(self._load(self.keys.many(keys), slots))
        except Exception as exc:
            self._fail_now(job_id, "load", exc)
            return
        size = self.block_size_bytes
        self._load_keys[job_id] = keys

        def finish(n: int) -> Any:
            if n == len(keys):
                return result(job_id, True, n * size, t0)
            return result(job_id, False, n * size, t0, tuple(keys[:n]) or None)

        self._track(job_id, future, finish)

    def get_finished_jobs(self) -> Iterable[Any]:
        """Finished jobs; a failed load marks its failed keys a miss (no retry livelock)."""
        out = list(super().get_finished_jobs())
        for res in out:
            keys = self._load_keys.pop(res.job_id, None)
            if keys is not None and not res.success:
                kept = set(res.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in kept])
        return out

    def shutdown(self) -> None:
        """Wait for the copies, close the source, stop the loop and the lookup thread.
        Idempotent (a second call was a RuntimeError, its coroutine never awaited)."""
        if self.shut_down:
            return
        self.drain_jobs()
        self._lookups.shutdown()
        try:
            self._loop.submit(self._aclose()).result(4 * self.options["timeout"] + 1)
        finally:
            self._loop.close(5.0)
            self._release_rows()
