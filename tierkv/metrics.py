"""Prometheus metrics of a :class:`~tierkv.store.KVStore`, read from its counters at scrape time.

::

    from tierkv import metrics
    body = metrics.render(store)                               # exposition text (bytes)
    app.router.add_get("/metrics", metrics.aiohttp_handler(store))
    registry = metrics.registry(store)                         # one CollectorRegistry per store
    reg = metrics.registry(store, server)                      # ... plus a PageServer's figures
    app.router.add_get("/metrics", metrics.aiohttp_handler(reg))

Nothing is updated per operation: :class:`StoreCollector` reads ``store.stats()``,
``store.engine_stats()`` and the page table when Prometheus scrapes, and
:class:`PageServerCollector` reads ``PageServer.stats()``, so the hot path pays nothing. The
names and their meaning are listed in ``docs/metrics.md``.

Needs ``prometheus-client`` (and ``aiohttp`` for :func:`aiohttp_handler`); importing this module
without it raises ImportError.

This file stays whole (just over 400 lines): it is one flat list of metric families, each a few
lines of name, help text and value, read in one pass per scrape.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tierkv.errors import StoreClosedError
from tierkv.tiers import DEVICE

if TYPE_CHECKING:
    from tierkv.remote import PageServer
    from tierkv.store import KVStore

__all__ = [
    "CONTENT_TYPE_LATEST",
    "PageServerCollector",
    "StoreCollector",
    "aiohttp_handler",
    "registry",
    "render",
    "start_http_server",
]

PREFIX = "tierkv_"


class _Families:
    """Builds metric families with a collector's constant labels."""

    _labels: dict[str, str]

    def _family(
        self, cls: Any, name: str, doc: str, value: float | Mapping[str, float], label: str
    ) -> Metric:
        const = self._labels
        if not isinstance(value, Mapping):
            fam = cls(PREFIX + name, doc, labels=list(const))
            fam.add_metric(list(const.values()), float(value))
        else:
            fam = cls(PREFIX + name, doc, labels=[*const, label])
            for lv, v in value.items():
                fam.add_metric([*const.values(), lv], float(v))
        return fam

    def _counter(
        self, name: str, doc: str, value: float | Mapping[str, float], label: str = ""
    ) -> Metric:
        return self._family(CounterMetricFamily, name, doc, value, label)

    def _gauge(
        self, name: str, doc: str, value: float | Mapping[str, float], label: str = ""
    ) -> Metric:
        return self._family(GaugeMetricFamily, name, doc, value, label)


class StoreCollector(_Families):
    """A Prometheus collector of one store's figures (register it in any registry).

    Args:
        store: the store to read; a closed (or not yet opened) store exports only
            ``tierkv_store_open 0``.
        labels: constant labels added to every sample (e.g. ``{"store": "llama-8b"}``) when
            one process exports several stores into one registry.
    """

    def __init__(self, store: KVStore, labels: Mapping[str, str] | None = None) -> None:
        self._store = weakref.ref(store)
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        """The store's metric families, read now."""
        store = self._store()
        try:
            tiers = store.tiers if store is not None else None
        except StoreClosedError:
            tiers = None
        yield self._gauge("store_open", "1 while the store is open", 0.0 if tiers is None else 1.0)
        if store is None or tiers is None:
            return
        s = store.stats()
        e = store.engine_stats()
        ts = tiers.stats
        table = tiers.table

        yield self._counter(
            "pages_leased", "Pages pinned on the device by leases", s["pages_leased"]
        )
        yield self._counter(
            "hits",
            "Leased pages by the tier they came from: device = already resident, "
            "host/cold = loaded to the device from that tier (demand or prefetch)",
            dict(s["hits"]),
            label="tier",
        )
        yield self._counter(
            "page_loads", "Device misses: pages loaded from host or cold", s["page_loads"]
        )
        yield self._counter(
            "late_fetches",
            "Loaded pages compute waited on: a lease's at entry, a step layer's when their "
            "copies ended after it asked (not prefetched in time)",
            s["late_fetches"],
        )
        yield self._counter("prefetched_pages", "Pages loaded by prefetch", s["prefetched"])
        yield self._counter(
            "prefetch_used_pages", "Prefetched pages that a lease then used", s["prefetch_used"]
        )
        yield self._counter(
            "prefetch_skipped_pages",
            "Prefetch pages given up (no room, page gone)",
            store.counters.prefetch_skipped,
        )
        yield self._gauge(
            "prefetch_accuracy",
            "prefetch_used_pages / prefetched_pages (1 when none)",
            s["prefetch_accuracy"],
        )
        yield self._counter(
            "bytes_moved",
            "Page bytes moved between device and host, by direction",
            {"h2d": s["bytes_h2d"], "d2h": s["bytes_d2h"]},
            label="direction",
        )
        yield self._counter(
            "evictions",
            "Pages pushed down a tier: written_back (device -> host), compressed "
            "(host -> cold), dropped (gone from every tier)",
            {k: s[k] for k in ("written_back", "compressed", "dropped")},
            label="kind",
        )
        yield self._counter(
            "idle_compressed_pages",
            "Host pages compressed for being idle (part of compressed)",
            s["idle_compressed"],
        )
        yield self._counter(
            "codec_seconds",
            "Seconds spent encoding / decoding cold pages",
            {"encode": ts.encode_s, "decode": ts.decode_s},
            label="op",
        )
        yield self._counter(
            "prefix_tokens_reused",
            "Prompt tokens whose KV was reused from the cache",
            s["prefix_tokens_reused"],
        )
        yield self._counter(
            "prompt_tokens", "Prompt tokens of every sequence added", store.counters.prompt_tokens
        )
        yield self._counter(
            "background_errors",
            "Background prefetch / write-back / compression tasks that failed",
            s["background_errors"],
        )
        yield self._counter(
            "corrupt_pages",
            "Pages whose bytes failed their CRC-32C where they crossed a boundary, by where "
            "they were read from (cold, peer, redis): each a miss, the page dropped, never served",
            dict(s["corrupt_pages"]),
            label="tier",
        )

        # the transfer engine: every batch, whatever its priority
        yield self._counter(
            "transfer_batches",
            "Transfer batches finished, by state",
            {"completed": e.completed, "failed": e.failed, "cancelled": e.cancelled},
            label="state",
        )
        yield self._counter(
            "transfer_batches_by_priority",
            "Completed transfer batches by priority (demand, prefetch, writeback)",
            {p.lower(): n for p, n in sorted(e.by_priority.items())},
            label="priority",
        )
        yield self._counter("transfer_pages", "Pages copied by completed batches", e.pages)
        yield self._counter("transfer_bytes", "Bytes copied by completed batches", e.bytes)
        yield self._counter("transfer_copy_seconds", "Seconds spent copying", e.copy_s)
        yield self._counter(
            "transfer_queue_wait_seconds",
            "Seconds batches waited from submit to copy start",
            e.queue_wait_s,
        )
        yield self._gauge(
            "transfer_bandwidth_bytes_per_second",
            "transfer_bytes / transfer_copy_seconds since the store opened",
            e.bytes / e.copy_s if e.copy_s > 0 else 0.0,
        )
        yield self._gauge(
            "transfer_inflight_max", "Most batches in flight at once so far", e.max_inflight_seen
        )

        # occupancy, read from the page table now
        names = table.tier_names
        # the leased tier is labelled "host" in a host-first store (no device tier)
        shown = {t: tiers.leased if t == DEVICE else t for t in names}
        yield self._gauge(
            "tier_pages",
            "Pages held per tier (any state)",
            {shown[t]: table.used(t) for t in names},
            label="tier",
        )
        yield self._gauge(
            "tier_capacity_pages",
            "Capacity per tier in pages",
            {shown[t]: table.capacity(t) for t in names},
            label="tier",
        )
        yield self._gauge(
            "tier_unevictable_pages",
            "Pages per tier that cannot be evicted now (pinned, being written or moving)",
            {shown[t]: table.used(t) - table.evictable(t) for t in names},
            label="tier",
        )
        pinned = sum(1 for k in table.keys(DEVICE) if table.pins(k, DEVICE))
        yield self._gauge(
            "pinned_pages",
            "Leased-tier pages pinned now (by leases and loads in flight; host-first: by live "
            "sequences too)",
            {shown[DEVICE]: pinned},
            label="tier",
        )
        yield self._gauge(
            "peak_device_pages", "Most device pages held at once", s["peak_device_pages"]
        )
        yield self._gauge(
            "page_bytes", "Bytes of one page (all tiers but cold)", store.spec.page_bytes
        )
        remote = s.get("remote")
        if remote is not None:
            yield from self._remote(store, remote)
        disk = s.get("disk")
        if disk is not None:
            yield from self._disk(disk)
        tenants = s.get("tenants")
        if tenants is not None:
            yield from self._tenants(tenants)

    def _tenants(self, tenants: Mapping[str, Any]) -> Iterator[Metric]:
        """Per tenant (label ``tenant``; ``tier`` too where per tier): hits, refusals,
        evictions caused and suffered, bytes held, quotas (``stats()["tenants"]``)."""
        const = self._labels
        for key, doc in _TENANT_COUNTERS.items():
            fam = CounterMetricFamily(PREFIX + "tenant_" + key, doc, labels=[*const, "tenant"])
            for name, fig in tenants.items():
                fam.add_metric([*const.values(), name], float(fig[key]))
            yield fam
        for key, kind, doc in _TENANT_TIERS:
            per_tier = kind(PREFIX + "tenant_" + key, doc, labels=[*const, "tenant", "tier"])
            for name, fig in tenants.items():
                for tier, t in fig["tiers"].items():
                    per_tier.add_metric([*const.values(), name, tier], float(t[key]))
            yield per_tier

    def _disk(self, disk: Mapping[str, Any]) -> Iterator[Metric]:
        """The store's disk tier: hits, bytes, latency, corrupt pages, failed writes, I/O mode."""
        for key, doc in _DISK.items():
            yield self._counter("disk_" + key, doc, disk[key])
        for key, doc in _DISK_GAUGES.items():
            yield self._gauge("disk_" + key, doc, disk[key])
        const = self._labels
        mode = GaugeMetricFamily(
            f"{PREFIX}disk_io_mode",
            "1 for the disk tier's I/O mode in use (direct: O_DIRECT; buffered: the reason "
            "label says why, e.g. tmpfs)",
            labels=[*const, "mode", "reason"],
        )
        mode.add_metric([*const.values(), disk["io_mode"], disk["io_mode_reason"]], 1.0)
        yield mode
        for op in ("read", "write"):
            h = disk[op + "_latency"]
            fam = HistogramMetricFamily(
                f"{PREFIX}disk_{op}_seconds",
                f"Seconds of each disk tier {op} batch",
                labels=list(const),
            )
            bounds = [*(repr(b) for b in h.bounds), "+Inf"]
            fam.add_metric(
                list(const.values()), list(zip(bounds, map(float, h.cumulative))), h.total_s
            )
            yield fam

    def _remote(self, store: KVStore, remote: Mapping[str, Any]) -> Iterator[Metric]:
        """The store's remote tier: its reads and pushes, and each source's own figures."""
        for key, doc in _REMOTE.items():
            yield self._counter("remote_" + key, doc, remote[key])
        link = store.remote
        per: dict[str, dict[str, float]] = {}
        for i, src in enumerate(link.sources if link is not None else ()):
            stats = getattr(src, "stats", None)
            if stats is None or inspect.iscoroutinefunction(stats):
                continue  # RemoteTier.stats() asks its peer: not for a scrape
            name = f"{i}:{type(src).__name__}"
            for key, value in stats().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    per.setdefault(key, {})[name] = value
        for key, values in sorted(per.items()):
            doc = f"A remote source's stats()[{key!r}] (e.g. RedisTier: available 0/1)"
            if key in _SOURCE_GAUGES:
                yield self._gauge("remote_source_" + key, doc, values, label="source")
            else:
                yield self._counter("remote_source_" + key, doc, values, label="source")


_REMOTE = {
    "hits": "Pages imported from the remote tier",
    "misses": "Remote reads that found no page (or a bad one)",
    "lookups": "Remote lookups",
    "bytes_in": "Bytes imported from the remote tier",
    "errors": "Remote calls that failed (counted, not raised)",
    "pushes": "Pages pushed to the remote tier as they left the host tier",
    "push_dropped": "Pages leaving the host tier not pushed (no room in time, or failure)",
    "push_errors": "Push batches that failed",
    "bytes_out": "Bytes pushed to the remote tier",
}
_SOURCE_GAUGES = {"available", "sources"}

_DISK = {
    "hits": "Pages read from the disk tier, verified",
    "misses": "Disk tier reads that found no page or a damaged one",
    "corrupt_pages": "Disk pages that failed verification (CRC-32C, key, generation): each a "
    "miss, the slot freed, never served",
    "read_errors": "Disk tier reads the OS failed",
    "damaged_at_open": "Slot headers found damaged by the scan at open",
    "pages_written": "Pages written to the disk tier",
    "write_failures": "Disk tier writes the OS failed or cut short: never reported stored",
    "write_failed": "Pages leaving the host tier the disk did not store (failed, no room)",
    "no_room": "Pages refused by the disk tier for want of a free slot",
    "not_admitted": "Pages leaving the host tier the disk's admission filter declined",
    "bytes_read": "Bytes read from the disk tier, verified",
    "bytes_written": "Bytes written to the disk tier",
    "imported": "Pages brought back from the disk tier into the host tier",
}
_DISK_GAUGES = {
    "used": "Disk tier slots holding a page",
    "capacity": "Disk tier slots",
    "recovered": "Pages the disk tier recovered at open (a previous process's)",
}


# PageServer.stats() keys with a metric of their own; any other numeric key is exported too
_SERVER_KNOWN = {"pages", "host_used", "host_capacity", "leases", "expired"}


class PageServerCollector(_Families):
    """A Prometheus collector of a :class:`~tierkv.remote.PageServer`'s figures.

    Reads ``server.stats()`` at scrape time. A server not started (or closed, or whose store
    is closed) exports only ``tierkv_page_server_up 0``. Numeric keys of ``stats()`` beyond the
    known ones are exported as ``tierkv_page_server_<key>``: a counter when the key ends in
    ``_total``, else a gauge, so new server figures reach Prometheus without a change here.

    Args:
        server: the page server to read.
        labels: constant labels added to every sample.
    """

    def __init__(self, server: PageServer, labels: Mapping[str, str] | None = None) -> None:
        self._server = weakref.ref(server)
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        """The server's metric families, read now."""
        server = self._server()
        st: dict[str, Any] | None = None
        if server is not None and server.directory is not None and server.transports:
            try:
                st = server.stats()
            except StoreClosedError:
                st = None
        yield self._gauge("page_server_up", "1 while the page server serves", float(st is not None))
        if server is None or st is None:
            return
        page_bytes = server.store.spec.page_bytes
        yield self._gauge(
            "page_server_pages",
            "Content pages peers can read now (readable in the host tier)",
            st["pages"],
        )
        yield self._gauge(
            "page_server_bytes", "Bytes of the pages peers can read now", st["pages"] * page_bytes
        )
        yield self._gauge(
            "page_server_host_pages", "Host-tier pages held (any kind, any state)", st["host_used"]
        )
        yield self._gauge(
            "page_server_host_capacity_pages", "Host-tier capacity in pages", st["host_capacity"]
        )
        yield self._gauge(
            "page_server_leases", "Leases peers hold now (reads and writes)", st["leases"]
        )
        yield self._counter(
            "page_server_leases_expired",
            "Leases ended by their ttl or by the peer's connection closing",
            st["expired"],
        )
        yield self._gauge(
            "page_server_transport",
            "Data transports served (1 per transport)",
            {kind: 1.0 for kind in server.transports},
            label="transport",
        )
        for key, value in sorted(st.items()):
            if key in _SERVER_KNOWN or isinstance(value, bool):
                continue
            if not isinstance(value, int | float):
                continue
            doc = f"PageServer.stats()[{key!r}]"
            if key.endswith("_total"):
                yield self._counter("page_server_" + key.removesuffix("_total"), doc, value)
            else:
                yield self._gauge("page_server_" + key, doc, value)
        yield from self._tenants(st.get("tenants"))

    def _tenants(self, tenants: Any) -> Iterator[Metric]:
        """Per tenant, each numeric figure of ``PageServer.tenant_stats``:
        ``tierkv_page_server_tenant_<figure>{tenant=...}`` (a counter for ``*_total``)."""
        if not isinstance(tenants, dict) or not tenants:
            return
        first = next(iter(tenants.values()))
        for key in sorted(k for k, v in first.items() if type(v) is int):
            values = {t: figures[key] for t, figures in tenants.items()}
            doc = f"PageServer.tenant_stats(tenant)[{key!r}]"
            if key.endswith("_total"):
                name = "page_server_tenant_" + key.removesuffix("_total")
                yield self._counter(name, doc, values, label="tenant")
            else:
                yield self._gauge("page_server_tenant_" + key, doc, values, label="tenant")


_registries: weakref.WeakKeyDictionary[Any, CollectorRegistry] = weakref.WeakKeyDictionary()


_TENANT_COUNTERS = {
    "sequences": "Sequences a tenant added",
    "prompt_tokens": "Prompt tokens of a tenant's sequences",
    "prefix_tokens_reused": "Prompt tokens of a tenant's sequences whose KV was cached (hits)",
    "refusals": "Evictions for a tenant's pages that found too few pages within the quotas",
    "evictions_caused": "Pages evicted to make room for a tenant's pages",
}
_TENANT_TIERS = (
    ("bytes", GaugeMetricFamily, "Bytes of a tier's pages charged to a tenant"),
    ("evicted", CounterMetricFamily, "A tenant's pages evicted from a tier (suffered)"),
)


def registry(source: KVStore | PageServer) -> CollectorRegistry:
    """The registry of a store (a StoreCollector) or of a page server (a StoreCollector of its
    store and a PageServerCollector), made on first use, one per object."""
    reg = _registries.get(source)
    if reg is None:
        from tierkv.store import KVStore

        reg = CollectorRegistry()
        if isinstance(source, KVStore):
            reg.register(StoreCollector(source))
        else:
            reg.register(StoreCollector(source.store))
            reg.register(PageServerCollector(source))
        _registries[source] = reg
    return reg


def render(source: KVStore | PageServer | CollectorRegistry) -> bytes:
    """Metrics in Prometheus text exposition format (``CONTENT_TYPE_LATEST``): of a store, of a
    page server and its store (see :func:`registry`), or of any registry."""
    reg = source if isinstance(source, CollectorRegistry) else registry(source)
    return generate_latest(reg)


def aiohttp_handler(
    source: KVStore | PageServer | CollectorRegistry,
) -> Callable[[Any], Awaitable[Any]]:
    """An aiohttp request handler serving :func:`render` of ``source``
    (``app.router.add_get("/metrics", aiohttp_handler(store))``). Raises ImportError without
    aiohttp."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=render(source), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


async def start_http_server(
    source: KVStore | PageServer | CollectorRegistry, host: str = "127.0.0.1", port: int = 0
) -> tuple[Any, str]:
    """Serve ``GET /metrics`` (:func:`render` of ``source``) on ``host:port`` from the running
    event loop, so that scrapes read the store on its own thread. Returns ``(runner, url)``:
    ``await runner.cleanup()`` stops it; ``port=0`` picks a free port (see the url).

    Raises ImportError without aiohttp, OSError when the address cannot be bound.
    """
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/metrics", aiohttp_handler(source))
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}/metrics"
