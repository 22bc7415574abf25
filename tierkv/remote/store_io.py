"""Move a prompt's cached prefix between a local store and a page source, as whole blocks.

The peer is any `PageSource`: a page server (`RemoteTier`) or Redis (`RedisTier`).

A block's pages go block-major (``[b0 l0, b0 l1, ..., b1 l0, ...]``), so a page prefix the peer
holds maps to a block prefix. Imported pages land in the local host tier as unowned cached
pages (two-phase: reserved WRITING, committed once the peer confirmed them), exactly as if this
store had computed and released them; `KVStore.add_sequence` then reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tierkv.errors import TierFullError
from tierkv.keys import prefix_keys
from tierkv.remote.source import PageSource
from tierkv.sequence import page_key
from tierkv.store import KVStore
from tierkv.tiers import HOST

__all__ = ["import_prefix", "prefix_pages", "publish_prefix", "stage_prefix"]


def prefix_pages(store: KVStore, tokens: Sequence[int]) -> list[bytes]:
    """Page keys (block-major) of the blocks `add_sequence` would reuse for ``tokens``."""
    t = store.spec.page_tokens
    toks = [int(x) for x in tokens]
    blocks = prefix_keys(toks[: max(0, len(toks) - 1) // t * t], t, store.namespace)
    return [page_key(b, layer) for b in blocks for layer in range(store.spec.num_layers)]


async def stage_prefix(store: KVStore, tokens: Sequence[int]) -> int:
    """Copy the cached blocks of ``tokens``' prefix that are only (or newer) on the device down
    to the host tier, where a page server can serve them; returns the pages this call copied.

    It waits for the store's background work first (`KVStore.drain`), so the pages a lease's
    write-behind already copied are not copied again (and not counted). Use it to have a
    prefix servable now: after a prefill with ``write_behind=False``, or to be sure the
    write-behind has finished.
    """
    await store.drain()
    return await store.tiers.write_behind(prefix_pages(store, tokens))


async def import_prefix(store: KVStore, peer: PageSource, tokens: Sequence[int]) -> int:
    """Load from ``peer`` the blocks of ``tokens``' prefix this store lacks; returns the prompt
    tokens now cached locally (what `add_sequence` will reuse).

    Raises TierFullError (no room in the local host tier), PeerGoneError, RemoteTimeoutError,
    RemoteError. On any error (or cancellation) no local page has changed.
    """
    table = store.tiers.table
    pages = prefix_pages(store, tokens)
    layers = store.spec.num_layers
    have = table.lookup(pages) // layers * layers  # any tier
    held = have + (await peer.lookup(pages[have:])) // layers * layers
    want = [k for k in pages[have:held] if not table.tiers_of(k)]
    if want:
        alloc = table.prepare_store(want, HOST)
        if alloc is None:
            raise TierFullError(f"host tier: no room to import {len(want)} pages")
        store.tiers.host_left(alloc.evicted)
        keys, slots = cast(list[bytes], alloc.keys), list(alloc.slots)
        ok = 0
        try:
            ok = await peer.load(keys, store.tiers.arenas[HOST].array, slots)
        finally:
            if ok:
                table.complete_store(keys[:ok], HOST)
            if ok < len(keys):
                table.complete_store(keys[ok:], HOST, ok=False)
    return store.lookup(tokens)


async def publish_prefix(store: KVStore, peer: PageSource, tokens: Sequence[int]) -> int:
    """Write the cached blocks of ``tokens``' prefix that sit in the local host tier to
    ``peer``; returns the pages the peer newly stored. Call `stage_prefix` first so that
    pages computed on the device are in the host tier.

    Raises RemoteFullError, PeerGoneError, RemoteTimeoutError, RemoteError.
    """
    table = store.tiers.table
    pages = prefix_pages(store, tokens)
    layers = store.spec.num_layers
    n = table.lookup(pages, HOST) // layers * layers
    if not n:
        return 0
    keys = pages[:n]
    slots = table.prepare_load(keys, HOST)  # no eviction while the peer copies them
    try:
        return await peer.publish(keys, store.tiers.arenas[HOST].array, slots)
    finally:
        table.complete_load(keys, HOST)
