"""Prometheus metrics of a store: the exposition parses and matches the store's own figures."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import tierkv
from tierkv import KVSpec, KVStore, metrics

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: bytes) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def fill(store: KVStore, sid: str, toks: list[int]) -> None:
    await store.add_sequence(sid, toks)
    async with store.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            g = torch.Generator().manual_seed(sum(map(ord, sid)) * 10 + layer)
            k = torch.randn((2, len(toks), 16), generator=g)
            await lease.append(sid, layer, k, -k)


async def busy_store(store: KVStore) -> None:
    """Three sequences on a device of six pages: write-backs, loads from host, a reused prefix."""
    for i, sid in enumerate("abc"):
        await fill(store, sid, [100 * i + t for t in range(10)])
    async with store.lease(["a"]):
        pass  # a's pages come back from the host
    await store.release("a")
    assert await store.add_sequence("a2", list(range(10))) == 8  # two full blocks reused
    await store.drain()


async def test_exposition_matches_store_figures() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await busy_store(store)
        m = parse(metrics.render(store))
        s = store.stats()
        e = store.engine_stats()
        assert get(m, "tierkv_store_open") == 1
        assert get(m, "tierkv_pages_leased_total") == s["pages_leased"]
        for tier in ("device", "host", "cold"):
            assert get(m, "tierkv_hits_total", tier=tier) == s["hits"][tier]
        assert get(m, "tierkv_hits_total", tier="host") > 0
        assert get(m, "tierkv_page_loads_total") == s["page_loads"] > 0
        assert get(m, "tierkv_late_fetches_total") == s["late_fetches"]
        assert get(m, "tierkv_prefetch_accuracy") == s["prefetch_accuracy"]
        assert get(m, "tierkv_bytes_moved_total", direction="h2d") == s["bytes_h2d"] > 0
        assert get(m, "tierkv_bytes_moved_total", direction="d2h") == s["bytes_d2h"] > 0
        assert get(m, "tierkv_evictions_total", kind="written_back") == s["written_back"] > 0
        assert get(m, "tierkv_evictions_total", kind="dropped") == 0
        assert get(m, "tierkv_prefix_tokens_reused_total") == 8
        assert get(m, "tierkv_prompt_tokens_total") == 40
        assert get(m, "tierkv_transfer_bytes_total") == e.bytes > 0
        assert get(m, "tierkv_transfer_batches_total", state="completed") == e.completed > 0
        assert get(m, "tierkv_transfer_copy_seconds_total") == pytest.approx(e.copy_s)
        assert get(m, "tierkv_transfer_queue_wait_seconds_total") == pytest.approx(e.queue_wait_s)
        assert get(m, "tierkv_transfer_bandwidth_bytes_per_second") == pytest.approx(
            e.bytes / e.copy_s
        )
        by_prio = sum(
            v for (name, _), v in m.items() if name == "tierkv_transfer_batches_by_priority_total"
        )
        assert by_prio == e.completed
        assert get(m, "tierkv_tier_capacity_pages", tier="device") == 6
        assert get(m, "tierkv_tier_pages", tier="device") == s["tiers"]["device"]["used"]
        assert get(m, "tierkv_pinned_pages", tier="device") == 0
        assert get(m, "tierkv_page_bytes") == PAGE


async def test_pinned_pages_counts_a_live_lease() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await fill(store, "a", list(range(10)))  # 3 blocks x 2 layers
        async with store.lease(["a"]):
            m = parse(metrics.render(store))
            assert get(m, "tierkv_pinned_pages", tier="device") == 6
            assert get(m, "tierkv_tier_unevictable_pages", tier="device") >= 6
        await store.drain()
        assert get(parse(metrics.render(store)), "tierkv_pinned_pages", tier="device") == 0


async def test_a_host_first_store_labels_its_leased_tier_host() -> None:
    """No device tier: the leased tier is the host's, its live pages pinned by their owners."""
    async with KVStore(SPEC, tiers=[tierkv.Host(bytes=8 * PAGE)]) as store:
        await fill(store, "a", list(range(10)))  # 3 blocks x 2 layers, owned
        m = parse(metrics.render(store))
        assert get(m, "tierkv_tier_capacity_pages", tier="host") == 8
        assert get(m, "tierkv_tier_pages", tier="host") == 6
        assert get(m, "tierkv_pinned_pages", tier="host") == 6
        assert not any(labels == frozenset({("tier", "device")}) for _, labels in m)
        await store.release("a")
        assert get(parse(metrics.render(store)), "tierkv_pinned_pages", tier="host") == 0


async def test_scrape_changes_nothing_and_registry_is_per_store() -> None:
    async with (
        KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE) as one,
        KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE) as two,
    ):
        await busy_store(one)
        before = one.stats()
        assert metrics.render(one) == metrics.render(one)
        assert one.stats() == before
        assert metrics.registry(one) is metrics.registry(one)
        assert metrics.registry(one) is not metrics.registry(two)
        assert get(parse(metrics.render(two)), "tierkv_tier_capacity_pages", tier="device") == 8


async def test_closed_store_exports_only_store_open() -> None:
    store = KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE)
    assert parse(metrics.render(store)) == {("tierkv_store_open", frozenset()): 0.0}
    async with store:
        assert len(parse(metrics.render(store))) > 20
    assert parse(metrics.render(store)) == {("tierkv_store_open", frozenset()): 0.0}


async def test_constant_labels_tell_stores_apart_in_one_registry() -> None:
    async with (
        KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE) as one,
        KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=40 * PAGE) as two,
    ):
        reg = CollectorRegistry()
        reg.register(metrics.StoreCollector(one, labels={"store": "one"}))
        reg.register(metrics.StoreCollector(two, labels={"store": "two"}))
        m = parse(generate_latest(reg))
        assert get(m, "tierkv_tier_capacity_pages", store="one", tier="device") == 6
        assert get(m, "tierkv_tier_capacity_pages", store="two", tier="device") == 8


async def test_aiohttp_handler_serves_the_exposition() -> None:
    pytest.importorskip("aiohttp")
    from aiohttp.test_utils import make_mocked_request

    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE) as store:
        await busy_store(store)
        resp = await metrics.aiohttp_handler(store)(make_mocked_request("GET", "/metrics"))
        assert resp.status == 200
        assert resp.headers["Content-Type"] == metrics.CONTENT_TYPE_LATEST
        assert isinstance(resp.body, bytes)
        assert get(parse(resp.body), "tierkv_prefix_tokens_reused_total") == 8


class DictSource:
    """A page source in a dict (a test double), with RedisTier-like synchronous stats()."""

    def __init__(self) -> None:
        self.pages: dict[bytes, bytes] = {}
        self.calls = 0

    async def lookup(self, keys: list[bytes]) -> int:
        self.calls += 1
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    async def load(self, keys: list[bytes], array: object, slots: list[int]) -> int:
        return 0

    async def publish(self, keys: list[bytes], array: object, slots: list[int]) -> int:
        return 0

    def stats(self) -> dict[str, object]:
        return {"available": 1, "calls": self.calls, "note": "not a number"}


async def test_remote_tier_and_its_sources_are_exported() -> None:
    src = DictSource()
    async with KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None, remote=src
    ) as store:
        await busy_store(store)
        m = parse(metrics.render(store))
        remote = store.stats()["remote"]
        assert remote["lookups"] > 0
        for key in ("hits", "misses", "lookups", "bytes_in", "errors", "pushes", "bytes_out"):
            assert get(m, f"tierkv_remote_{key}_total") == remote[key]
        assert get(m, "tierkv_remote_source_available", source="0:DictSource") == 1
        assert get(m, "tierkv_remote_source_calls_total", source="0:DictSource") == src.calls
        assert not any(name.startswith("tierkv_remote_source_note") for name, _ in m)


async def test_a_store_without_remote_exports_no_remote_families() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await busy_store(store)
        assert not any(name.startswith("tierkv_remote") for name, _ in parse(metrics.render(store)))
