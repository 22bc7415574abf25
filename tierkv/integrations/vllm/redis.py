"""`TierKVRedisTier`: vLLM's CPU-tier chunks in Redis / Valkey through tierkv's `RedisTier`.

One chunk is one Redis value (tierkv's self-checking layout: a value that fails a check is a
miss, deleted, never served). The tier runs `RedisTier` on an event loop of its own thread.
Lookups go through vLLM's `AsyncLookupManager` (as vLLM's ``fs`` tier does): the first lookup of
a chunk answers RETRY, the step's keys are asked of Redis in one batch on the lookup thread,
and the next lookup answers HIT or MISS. A server that is down, slow or restarting gives
misses and failed stores (RedisTier backs off and reconnects by itself); nothing raises into
vLLM's scheduler.

Several vLLM instances (processes, machines) share chunks through one server: the keys name
the model and the KV layout (`tierkv.integrations.vllm.keys`), so two models or layouts never
share a value.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from tierkv.integrations.vllm._vllm import AsyncLookupManager, LookupResult, Medium
from tierkv.integrations.vllm.config import Field
from tierkv.integrations.vllm.tier import TierKVTierBase, result
from tierkv.remote.sources.redis_tier import BATCH_PAGES, RedisTier
from tierkv.spec import KVSpec, parse_dtype

__all__ = ["TierKVRedisTier"]

_FAILURES = ("errors", "timeouts", "full")


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
    """vLLM's async lookup state; the batch is asked of Redis on vLLM's lookup thread."""

    def __init__(self, tier: TierKVRedisTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[Any], req_context: Any) -> Iterable[bool]:
        return self._tier.present(keys)


class TierKVRedisTier(TierKVTierBase):
    """A vLLM secondary tier on Redis / Valkey (one server or a cluster).

    Config::

        {"type": "TierKVRedisTier", "module_path": "tierkv.integrations.vllm",
         "url": "redis://cache:6379/0"}

    Fields: ``url`` (required), ``cluster`` (False), ``ttl`` (seconds or None), ``timeout``
    (1.0 s: the bound of every Redis call), ``batch_pages`` (64), ``namespace`` (what shares
    values, default ``"vllm"``; the model and layout are in every key anyway), ``tenant``
    (None: whose chunks these are, in every key: docs/security.md, *Tenants*), ``locality``,
    ``drain_timeout``.
    """

    medium: ClassVar[Any] = Medium.STORAGE if Medium is not None else None
    FIELDS: ClassVar[dict[str, Field]] = {
        "url": Field((str,)),
        "cluster": Field((bool,), False),
        "ttl": Field((float, type(None)), None, minimum=0.001),
        "timeout": Field((float,), 1.0, minimum=0.001),
        "batch_pages": Field((int,), BATCH_PAGES, minimum=1),
        "namespace": Field((str,), "vllm"),
        "tenant": Field((str, type(None)), None),
    }

    def _open(self, o: dict[str, Any]) -> None:
        # a KVSpec whose page is one vLLM chunk (1-byte elements): RedisTier checks lengths
        # against it and binds every value to it
        spec = KVSpec(1, 1, self.block_size_bytes // 2, dtype=parse_dtype("fp8"), page_tokens=1)
        self.redis = RedisTier(
            o["url"],
            spec=spec,
            namespace=o["namespace"],
            cluster=o["cluster"],
            ttl=o["ttl"],
            timeout=o["timeout"],
            batch_pages=o["batch_pages"],
            tenant=o["tenant"],
        )
        self._load_keys: dict[int, list[Any]] = {}  # in-flight loads (scheduler thread)
        self._loop = _LoopThread(f"tierkv_vllm_redis_{self.tier_type}")
        self._lock = asyncio.Lock()  # one RedisTier call at a time: its counters tell outcomes
        try:
            # never raises for an unreachable server (it starts unavailable and keeps trying)
            self._loop.submit(self._connect()).result(4 * o["timeout"] + 1)
        except BaseException:
            self._loop.close(5.0)
            raise
        self._lookups = _Lookups(self)

    async def _connect(self) -> None:
        async with self._lock:
            await self.redis.connect()

    # -- lookups (vLLM's lookup thread) ---------------------------------------------------------
    async def _present(self, tkeys: list[bytes]) -> list[bool]:
        found = [False] * len(tkeys)
        i = 0
        async with self._lock:
            while i < len(tkeys):
                n = await self.redis.lookup(tkeys[i:])  # leading pages present
                found[i : i + n] = [True] * n
                i += n + 1  # tkeys[i + n] is absent (or the server failed: all misses)
        return found

    def present(self, keys: list[Any]) -> list[bool]:
        """Which of `keys` Redis holds (a hint: loads verify); all False on any failure."""
        deadline = 2 * self.options["timeout"] * (1 + len(keys) // self.options["batch_pages"])
        try:
            return self._loop.submit(self._present(self.keys.many(keys))).result(deadline)
        except Exception:
            return [False] * len(keys)

    def lookup(self, key: Any, req_context: Any) -> Any:
        """HIT / MISS once Redis has answered for this key, RETRY until then."""
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
    def _failures(self) -> tuple[int, ...]:
        st = self.redis.stats()
        return tuple(int(st[name]) for name in _FAILURES)

    async def _publish(self, tkeys: list[bytes], slots: list[int]) -> bool:
        async with self._lock:
            before = self._failures()
            await self.redis.publish(tkeys, self._rows, slots)
            return self._failures() == before and self.redis.available

    async def _load(self, tkeys: list[bytes], slots: list[int]) -> int:
        async with self._lock:
            return await self.redis.load(tkeys, self._rows, slots)

    def submit_store(self, job_metadata: Any) -> None:
        """Publish the job's primary chunks (SET NX: chunks already there are kept)."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        try:
            slots = [int(c) for c in job_metadata.chunk_ids]
            future = self._loop.submit(self._publish(self.keys.many(job_metadata.keys), slots))
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
            slots = [int(c) for c in job_metadata.chunk_ids]
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

    def tierkv_stats(self) -> dict[str, Any]:
        """The tier's counters and RedisTier's."""
        out: dict[str, Any] = dict(self.counters)
        out.update({f"redis_{k}": v for k, v in self.redis.stats().items()})
        return out

    def shutdown(self) -> None:
        """Wait for the copies, close the client, stop the loop and the lookup thread."""
        self.drain_jobs()
        self._lookups.shutdown()
        try:
            self._loop.submit(self.redis.aclose()).result(4 * self.options["timeout"] + 1)
        finally:
            self._loop.close(5.0)
            self._release_rows()
