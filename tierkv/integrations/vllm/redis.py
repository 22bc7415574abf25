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
from typing import Any, ClassVar

from tierkv.integrations.vllm._vllm import Medium
from tierkv.integrations.vllm.config import Field
from tierkv.integrations.vllm.source import TierKVSourceTier
from tierkv.integrations.vllm.tier import MAX_WAIT_S
from tierkv.remote.sources.redis_tier import BATCH_PAGES, RedisTier
from tierkv.spec import KVSpec, parse_dtype

__all__ = ["TierKVRedisTier"]

_FAILURES = ("errors", "timeouts", "full")
MAX_TTL_S = 1e9
"""Longest ``ttl`` taken, seconds (~31 years; past Redis's expire range every store failed)."""


class TierKVRedisTier(TierKVSourceTier):
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
        "ttl": Field((float, type(None)), None, minimum=0.001, maximum=MAX_TTL_S),
        "timeout": Field((float,), 1.0, minimum=0.001, maximum=MAX_WAIT_S),
        "batch_pages": Field((int,), BATCH_PAGES, minimum=1),
        "namespace": Field((str,), "vllm"),
        "tenant": Field((str, type(None)), None),
    }

    async def _start(self, o: dict[str, Any]) -> None:
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
        self.lookup_batch = o["batch_pages"]  # (the deadline of `present` counts batches)
        self._lock = asyncio.Lock()  # one RedisTier call at a time: its counters tell outcomes
        async with self._lock:  # never raises for an unreachable server (it keeps trying)
            await self.redis.connect()

    async def _leading(self, tkeys: list[bytes]) -> int:
        async with self._lock:
            return await self.redis.lookup(tkeys)  # (a failed server: 0)

    def _failures(self) -> tuple[int, ...]:
        st = self.redis.stats()
        return tuple(int(st[name]) for name in _FAILURES)

    async def _publish(self, tkeys: list[bytes], slots: list[int]) -> bool:
        """SET NX: chunks already there are kept."""
        async with self._lock:
            before = self._failures()
            await self.redis.publish(tkeys, self._rows, slots)
            return self._failures() == before and self.redis.available

    async def _load(self, tkeys: list[bytes], slots: list[int]) -> int:
        async with self._lock:
            return await self.redis.load(tkeys, self._rows, slots)

    async def _aclose(self) -> None:
        await self.redis.aclose()

    def tierkv_stats(self) -> dict[str, Any]:
        """The tier's counters and RedisTier's."""
        out: dict[str, Any] = dict(self.counters)
        out.update({f"redis_{k}": v for k, v in self.redis.stats().items()})
        return out
